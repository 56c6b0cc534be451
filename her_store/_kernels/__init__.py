"""The kernels of her_store's hot paths (batch LZ4 decoding and encoding of image rows, gathers from mapped files,
crc32 runs, shard bodies, the priority tree of prioritized replay), from the one place that chooses them.

They are the C extension's (her_store._kernels._frames, built from her_store/_kernels/_frames.c where a C compiler
was found at install) when it imports and the environment variable HER_STORE_PURE is not ``1``; else their
pure-Python twins (her_store._kernels.pure: numpy, numcodecs' LZ4, zlib's crc32), which take the same arguments and
give the same answers, slower; a file cut short in place during a gather from its mapping is survived by the compiled
path only. ``COMPILED`` tells which are live. Modules call them through this module (``_kernels.map_lz4(...)``), so
that a test can put another in its place.
"""

from __future__ import annotations

import os

__all__ = [
    "COMPILED",
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

COMPILED: bool = False
if os.environ.get("HER_STORE_PURE") != "1":
    try:
        from her_store._kernels import _frames  # noqa: F401
    except ImportError:  # not built (no C compiler at install): the pure twins
        pass
    else:
        COMPILED = True

if COMPILED:
    from her_store._kernels import _frames as _live  # type: ignore[attr-defined]
else:
    from her_store._kernels import pure as _live

crc32 = _live.crc32
crc32_all = _live.crc32_all
crc32_runs = _live.crc32_runs
decode_lz4 = _live.decode_lz4
encode_lz4 = _live.encode_lz4
encode_lz4_start = _live.encode_lz4_start
map_file = _live.map_file
map_lz4 = _live.map_lz4
map_lz4_start = _live.map_lz4_start
pread_lz4 = _live.pread_lz4
same_bytes = _live.same_bytes
shard_body = _live.shard_body
take_rows = _live.take_rows
tree_find = _live.tree_find
tree_set = _live.tree_set
