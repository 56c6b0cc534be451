"""The kernels of her_store._kernels._frames in Python: numpy, numcodecs' LZ4 and zlib's crc32 (isal's where installed:
the same values, faster), for an install without a C compiler (or HER_STORE_PURE=1; her_store._kernels chooses).

Each function takes the arguments of its C twin (her_store/_kernels/_frames.c describes them) and returns or raises what
that one does: the same rows decoded and encoded byte for byte, the same (index, errno[, inblock]) answers, the same
ValueErrors for arguments that do not fit together, and every offset and size checked against its source. An
uncompressed gather (take_rows) is numpy's fancy indexing; LZ4 rows are a loop of numcodecs calls (it has no batch
call): LZ4 itself runs without the GIL, each row's bookkeeping with it, which is this path's cost.

The twins by concept: mapped files and the rows gathered from them (:mod:`~her_store._kernels.pure.mapped`), LZ4 rows
(:mod:`~her_store._kernels.pure.lz4`) and their calls on threads of their own (:mod:`~her_store._kernels.pure.tasks`),
a shard's body (:mod:`~her_store._kernels.pure.shard`), checksums (:mod:`~her_store._kernels.pure.checksums`), and the
arguments all of them convert as C does (:mod:`~her_store._kernels.pure.arguments`).

What only the compiled path does:
- A file cut short in place *during* a gather from its mapping (take_rows, map_lz4) fails its rows with EIO there;
  here the process ends with SIGBUS (Python cannot survive the fault). The size of each file mapped by map_file is
  looked up as a call starts, so rows on pages past the end of a file cut short before the call fail with EIO, as in
  C (a damaged LZ4 block reaching past the end fails with EIO here; in C with EIO or errno 0, as its decoder stops
  before that page or not). Any other buffer (a Python mmap among them) is read here as bytes that map no file: the
  compiled kernels survive reading one whose file was cut short, these do not.
- A Mapping (map_file) here holds a duplicate of its file's descriptor (Python's mmap keeps one), through which the
  file's size is seen; the compiled one holds none.
- Of a row that fails part way (a block that is not one row, a page past the end of its file), C may have written
  part into ``out``; here a row past the end of its file is left as it was.
"""

from __future__ import annotations

from her_store._kernels.pure.checksums import crc32, crc32_all, crc32_runs, same_bytes
from her_store._kernels.pure.lz4 import decode_lz4, encode_lz4, map_lz4, pread_lz4
from her_store._kernels.pure.mapped import Mapping, map_file, take_rows
from her_store._kernels.pure.shard import shard_body
from her_store._kernels.pure.tasks import Task, encode_lz4_start, map_lz4_start
from her_store._kernels.pure.tree import tree_find, tree_set

__all__ = [
    "Mapping",
    "Task",
    "crc32",
    "crc32_all",
    "crc32_runs",
    "decode_lz4",
    "encode_lz4",
    "encode_lz4_start",
    "map_file",
    "map_lz4",
    "map_lz4_start",
    "pread_lz4",
    "same_bytes",
    "shard_body",
    "take_rows",
    "tree_find",
    "tree_set",
]
