"""The kernels of her_store._kernels._frames in Python: numpy, numcodecs' LZ4 and zlib's crc32 (isal's where installed: the
same values, faster), for an install without a C compiler (or HER_STORE_PURE=1; her_store._kernels chooses).

Each function takes the arguments of its C twin (her_store/_kernels/_frames.c describes them) and returns or raises what that
one does: the same rows decoded and encoded byte for byte, the same (index, errno[, inblock]) answers, the same
ValueErrors for arguments that do not fit together, and every offset and size checked against its source. An
uncompressed gather (take_rows) is numpy's fancy indexing; LZ4 rows are a loop of numcodecs calls (it has no batch
call): LZ4 itself runs without the GIL, each row's bookkeeping with it, which is this path's cost.

What only the compiled path does:
- A file cut short in place *during* a gather from its mapping (take_rows, map_lz4) fails its rows with EIO there;
  here the process ends with SIGBUS (Python cannot survive the fault). The size of each mapped file is looked up as
  a call starts, so rows on pages past the end of a file cut short before the call fail with EIO, as in C (a
  damaged LZ4 block reaching past the end fails with EIO here; in C with EIO or errno 0, as its decoder stops
  before that page or not).
- A Mapping (map_file) here holds a duplicate of its file's descriptor (Python's mmap keeps one), through which the
  file's size is seen; the compiled one holds none.
- Of a row that fails part way (a block that is not one row, a page past the end of its file), C may have written
  part into ``out``; here a row past the end of its file is left as it was.
"""

from __future__ import annotations

import errno
import itertools
import mmap
import operator
import os
import re
import resource
import struct
import sys
import threading
from typing import Any

import numpy as np
from numcodecs.lz4 import compress as _compress
from numcodecs.lz4 import decompress as _decompress

try:
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # isal is optional (her_store[fast]); zlib's crc32 gives the same values
    from zlib import crc32 as _crc32

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
]

INT32_MAX = 2**31 - 1
LZ4_MAX_INPUT_SIZE = 0x7E000000
RUN_BYTES = 1 << 20  # pread_lz4 reads adjacent rows of one file in one pread, up to this many bytes
TAKE = 8  # map_lz4's threads and caller take this many rows at a time
TAKE_ENCODE = 2  # encode_lz4's, as many
MAX_THREADS = 64
_MMAP_OFFSET = re.compile(r"\boffset=(\d+)")
_NO_AT = object()  # take_rows called without ``at`` (None is refused, as by C)

crc32 = _crc32  # crc32(data, value=0) -> int: zlib.crc32(data, value), for any C-contiguous bytes-like data


# -- arguments, converted as the C functions' PyArg_ParseTuple formats convert them ---------------------------------


def _index(x: Any, low: int, high: int, what: str) -> int:
    """An integer argument of a C type holding ``low`` .. ``high`` (TypeError when not an integer)."""
    v = operator.index(x)
    if not low <= v <= high:
        raise OverflowError(f"Python int too large to convert to C {what}")
    return v


def _ssize(x: Any) -> int:  # "n"
    return _index(x, -(2**63), 2**63 - 1, "ssize_t")


def _c_int(x: Any) -> int:  # "i"
    return _index(x, -(2**31), 2**31 - 1, "int")


def _c_uint(x: Any) -> int:  # "I": masked to 32 bits, as zlib.crc32 takes its value
    return operator.index(x) & 0xFFFFFFFF


def _bytes(obj: Any) -> np.ndarray:
    """A C-contiguous buffer's bytes ("y*"), uint8, read in place (the exporter's own error when it cannot be)."""
    return np.frombuffer(obj, np.uint8)


def _writable(obj: Any, position: int) -> np.ndarray:
    """A writable C-contiguous buffer's bytes ("w*"), uint8, written in place."""
    try:
        view = memoryview(obj)
    except TypeError:
        view = None
    if view is None or view.readonly or not view.c_contiguous:
        raise TypeError(f"argument {position} must be read-write bytes-like object, not {type(obj).__name__}")
    return np.frombuffer(obj, np.uint8)


def _ints(b: np.ndarray, code: str) -> memoryview:
    """A live view of b's bytes as C integers ('i' int32, 'q' int64): read entry by entry as C reads them, so a
    write into ``out`` that overlaps them is seen by the entries after it."""
    return memoryview(b).cast(code)


def _items(items: Any, allow_none: bool, name: str) -> list[np.ndarray | None]:
    """The C-contiguous bytes-like items of a list or tuple (None items only when allow_none)."""
    if not isinstance(items, (list, tuple)):
        raise TypeError(f"{name} must be a list or tuple of bytes-like objects, got {type(items).__name__}")
    views: list[np.ndarray | None] = []
    for i, item in enumerate(list(items)):
        if item is None and allow_none:
            views.append(None)
            continue
        try:
            view = memoryview(item)
        except TypeError:
            view = None
        if view is None or not view.c_contiguous:
            tail = " or None" if allow_none else ""
            raise TypeError(f"{name}[{i}] is {type(item).__name__}, not a C-contiguous bytes-like object{tail}")
        views.append(np.frombuffer(item, np.uint8))
    return views


def _check(
    offsets: np.ndarray, nbytes: np.ndarray, out: np.ndarray, row_nbytes: int, fds: np.ndarray | None = None
) -> int:
    """Rows in a batch, after checking every buffer's size against it (the C decoders' check)."""
    n = len(offsets) // 8
    if row_nbytes <= 0 or row_nbytes > INT32_MAX - 16:
        raise ValueError("row_nbytes must be positive and below 2 GiB")
    if len(offsets) != n * 8 or len(nbytes) != n * 8 or (fds is not None and len(fds) != n * 4):
        raise ValueError("fds (int32), offsets and nbytes (int64) must hold one entry per row")
    if len(out) < n * row_nbytes:
        raise ValueError("out is smaller than rows * row_nbytes")
    return n


def _thread_count(threads: Any) -> int:
    asked = _index(threads, -(2**63), 2**63 - 1, "long")
    if not 1 <= asked <= MAX_THREADS:
        raise ValueError("threads must be 1 .. 64")
    return asked


def _blocks_read() -> int:
    """512-byte blocks the calling thread has read from disks so far (0 where the system does not count them per
    thread)."""
    who = getattr(resource, "RUSAGE_THREAD", None)
    return resource.getrusage(who).ru_inblock if who is not None else 0


# -- mapped files ----------------------------------------------------------------------------------------------------


class Mapping(np.ndarray):
    """Bytes of a file mapped read-only (:func:`map_file`), unmapped when the last reference goes.

    A read-only uint8 array over exactly the bytes asked for (in Python before 3.12 only an extension type can export
    a buffer of its own; numpy's is one). As the compiled Mapping it compares and hashes by identity and is true when
    it holds bytes, never element by element; its repr reads none of them.
    """

    _map: mmap.mmap | None = None  # the mapping, from a page boundary (Python's mmap: it holds the file's descriptor)
    _map_offset = 0  # where the mapping starts in its file
    _map_address = 0  # and in memory

    def __array_finalize__(self, obj: Any) -> None:
        self._map = getattr(obj, "_map", None)
        self._map_offset = getattr(obj, "_map_offset", 0)
        self._map_address = getattr(obj, "_map_address", 0)

    def drop_pages(self) -> None:
        """Unmap its pages from this process (MADV_DONTNEED), so that the page cache can let them go (a cold start)."""
        if self._map is not None:
            self._map.madvise(mmap.MADV_DONTNEED)

    __eq__ = object.__eq__  # type: ignore[assignment]
    __ne__ = object.__ne__  # type: ignore[assignment]
    __hash__ = object.__hash__  # type: ignore[assignment]

    def __bool__(self) -> bool:
        return len(self) > 0

    def __repr__(self) -> str:
        return f"<her_store._kernels.pure.Mapping of {len(self)} bytes>"


def map_file(fd: int, offset: int, length: int, /) -> Mapping:
    """Bytes ``offset .. offset + length`` of an open file, mapped read-only (MADV_RANDOM: a page fault reads its page
    alone); see her_store/_kernels/_frames.c."""
    fd = _c_int(fd)
    offset = _index(offset, -(2**63), 2**63 - 1, "long long")
    length = _index(length, -(2**63), 2**63 - 1, "long long")
    if offset < 0 or length <= 0 or length > sys.maxsize - 65536:
        raise ValueError("map_file needs offset >= 0 and a length of at least one byte")
    size = os.fstat(fd).st_size
    if offset > size or length > size - offset:
        raise ValueError("map_file: offset + length is past the end of the file")
    skip = offset % mmap.ALLOCATIONGRANULARITY
    mapped = mmap.mmap(fd, skip + length, access=mmap.ACCESS_READ, offset=offset - skip)
    if hasattr(mmap, "MADV_RANDOM"):
        mapped.madvise(mmap.MADV_RANDOM)  # advice only: its absence changes nothing read
    view = np.frombuffer(mapped, np.uint8, length, skip).view(Mapping)
    view._map, view._map_offset = mapped, offset - skip
    view._map_address = view.__array_interface__["data"][0] - skip
    return view


def _past_end(buf: Any) -> int | None:
    """Where, in a mapped file's buffer (a Mapping, or a Python mmap), the pages past the file's current end begin
    (reading there is SIGBUS); None for a buffer that maps no file."""
    if isinstance(buf, Mapping) and buf._map is not None:
        mapped = buf._map
        start = buf._map_offset + buf.__array_interface__["data"][0] - buf._map_address
    elif isinstance(buf, mmap.mmap):
        found = _MMAP_OFFSET.search(repr(buf))  # where Python's mmap starts in its file: said by its repr alone
        if found is None:
            return None
        mapped, start = buf, int(found[1])
    else:
        return None
    size = mapped.size()  # the file's size now (fstat of the mapping's descriptor)
    return -(-size // mmap.PAGESIZE) * mmap.PAGESIZE - start


# -- gathers ---------------------------------------------------------------------------------------------------------


def _row_error(
    src: memoryview, at: int, size: int, out: memoryview, row: int, row_nbytes: int, past: int | None
) -> int | None:
    """Decode one row's bytes (size header + LZ4 block) at src[at : at + size] into row ``row`` of out: None when
    they are exactly one row, else the errno of its failure (0: they are not one row's block; EIO: they lie on a page
    past the end of their file, which C meets as SIGBUS: the header first, the block only when the header names a
    row)."""
    if size < 4:
        return 0
    if past is not None and at + 4 > past:
        return errno.EIO
    if struct.unpack_from("<I", src, at)[0] != row_nbytes or size - 4 > INT32_MAX:
        return 0
    if past is not None and at + size > past:
        return errno.EIO
    try:
        _decompress(src[at : at + size], out[row * row_nbytes : (row + 1) * row_nbytes])
    except (RuntimeError, ValueError):  # not one LZ4 block, or one of another size
        return 0
    return None


def _wrap64(v: int) -> int:
    """v as C's int64 arithmetic leaves it."""
    return (v + 2**63) % 2**64 - 2**63


def take_rows(
    src: Any, rows: Any, first: int, skip: int, out: Any, row_nbytes: int, at: Any = _NO_AT, /
) -> tuple[int, int]:
    """out[i] (out[at[i]]) = row rows[i] - first of src, whose row k is bytes skip + k * row_nbytes ..; returns
    (-1, 0), or the first failing row and its errno (0: outside src or out; EIO: past the end of a mapped file)."""
    src_b, rows_b = _bytes(src), _bytes(rows)
    first, skip = _ssize(first), _ssize(skip)
    out_b = _writable(out, 5)
    rn = _ssize(row_nbytes)
    at_b = None if at is _NO_AT else _bytes(at)
    n = len(rows_b) // 8
    out_rows = len(out_b) // rn if rn > 0 else 0
    bad = rn <= 0 or len(rows_b) != n * 8 or skip < 0 or skip > len(src_b)
    if bad or (len(at_b) != n * 8 if at_b is not None else out_rows < n):
        raise ValueError(
            "rows (and at) must be int64 (8 bytes an entry), out must hold them, row_nbytes > 0, skip within src"
        )
    have = (len(src_b) - skip) // rn
    past = _past_end(src)
    if any(np.may_share_memory(out_b, b) for b in (src_b, rows_b, at_b) if b is not None):
        return _take_in_order(src_b, rows_b, first, skip, out_b, rn, at_b, n, have, out_rows, past)
    r = rows_b.view(np.int64) - np.int64(first)  # wraps as C's int64 arithmetic does
    to = at_b.view(np.int64) if at_b is not None else None
    k = to if to is not None else np.arange(n)
    failing = (r < 0) | (r >= have) | (k < 0) | (k >= out_rows)
    stop, err = n, 0
    if n and failing.any():
        stop = int(failing.argmax())
    if past is not None and stop:
        cut = ~failing[:stop] & (skip + (r[:stop] + 1) * rn > past)  # a row reaching a page past the file's end
        if cut.any():
            stop, err = int(cut.argmax()), errno.EIO
    table = src_b[skip : skip + have * rn].reshape(have, rn)
    dst = out_b[: out_rows * rn].reshape(out_rows, rn)
    if to is None:
        np.take(table, r[:stop], axis=0, out=dst[:stop], mode="clip")  # indices checked: no buffering
    else:
        dst[to[:stop]] = table[r[:stop]]
    return (stop if stop < n else -1), err


def _take_in_order(
    src: np.ndarray, rows: np.ndarray, first: int, skip: int, out: np.ndarray, rn: int, at: np.ndarray | None,
    n: int, have: int, out_rows: int, past: int | None,
) -> tuple[int, int]:
    """take_rows row after row, each entry read as it is used: rows or at sharing memory with out (a row copied
    changes the entries after it, as in C)."""
    want, to = _ints(rows, "q"), _ints(at, "q") if at is not None else None
    src_m, out_m = memoryview(src), memoryview(out)
    for i in range(n):
        r, k = _wrap64(want[i] - first), to[i] if to is not None else i
        if r < 0 or r >= have or k < 0 or k >= out_rows:
            return i, 0
        if past is not None and skip + (r + 1) * rn > past:
            return i, errno.EIO
        out_m[k * rn : (k + 1) * rn] = src_m[skip + r * rn : skip + (r + 1) * rn]
    return -1, 0


def decode_lz4(src: Any, offsets: Any, nbytes: Any, out: Any, row_nbytes: int, /) -> tuple[int, int]:
    """Row i from src[offsets[i] : offsets[i] + nbytes[i]] decoded into out[i]; (-1, 0) or (first failing row, 0)."""
    src_b, off_b, nb_b = _bytes(src), _bytes(offsets), _bytes(nbytes)
    out_b = _writable(out, 4)
    rn = _ssize(row_nbytes)
    n = _check(off_b, nb_b, out_b, rn)
    off_v, nb_v = _ints(off_b, "q"), _ints(nb_b, "q")
    src_m, out_m, length = memoryview(src_b), memoryview(out_b), len(src_b)
    for i in range(n):
        size, at = nb_v[i], off_v[i]
        if size < 0 or at < 0 or at > length or size > length - at:
            return i, 0
        if _row_error(src_m, at, size, out_m, i, rn, None) is not None:
            return i, 0
    return -1, 0


def _pread_run(fd: int, offset: int, total: int) -> tuple[bytes, int]:
    """Up to ``total`` bytes of fd from ``offset``, and the errno that stopped it short (EIO: the file ended)."""
    parts, done, err = [], 0, 0
    while done < total:
        try:
            got = os.pread(fd, total - done, offset + done)
        except OSError as e:
            err = e.errno or errno.EIO
            break
        if not got:
            err = errno.EIO  # a file shorter than its index says
            break
        parts.append(got)
        done += len(got)
    return b"".join(parts), err


def pread_lz4(fds: Any, offsets: Any, nbytes: Any, dst: Any, out: Any, row_nbytes: int, /) -> tuple[int, int, int]:
    """Row i: nbytes[i] bytes at offsets[i] of fds[i] decoded into out[dst[i]], rows that follow each other in one
    file read with one pread; (-1, 0, inblock) or (first failing row, errno, inblock)."""
    fd_b, off_b, nb_b, dst_b = _bytes(fds), _bytes(offsets), _bytes(nbytes), _bytes(dst)
    out_b = _writable(out, 5)
    rn = _ssize(row_nbytes)
    n = _check(off_b, nb_b, out_b, rn, fd_b)
    if len(dst_b) != n * 8:
        raise ValueError("dst (int64) must hold one entry per row")
    out_rows = len(out_b) // rn
    wanted = dst_b.view(np.int64)
    if n and ((wanted < 0) | (wanted >= out_rows)).any():
        raise ValueError("dst names a row outside out")
    fd_v, off_v, nb_v, dst_v = _ints(fd_b, "i"), _ints(off_b, "q"), _ints(nb_b, "q"), _ints(dst_b, "q")
    out_m = memoryview(out_b)
    row_bound = rn + rn // 4 + 1024  # above LZ4's bound for one row
    failed, err = -1, 0
    before = _blocks_read()
    i = 0
    while i < n and failed < 0:
        j, total = i, 0  # a run: rows i .. j - 1 of one file, each starting where the previous ended
        while j < n:
            size, at = nb_v[j], off_v[j]
            if size < 0 or at < 0 or size > row_bound:
                break
            if j > i and (fd_v[j] != fd_v[i] or at != off_v[i] + total or total + size > RUN_BYTES):
                break
            total += size
            j += 1
        if j == i:  # row i itself is not a row to read
            failed = i
            break
        data, err = _pread_run(fd_v[i], off_v[i], total)
        src, done, at = memoryview(data), len(data), 0
        for k in range(i, j):  # with a short read, the rows it did not reach fail, the ones before are decoded
            size, row = nb_v[k], dst_v[k]
            bad = size < 0 or at + size > done or row < 0 or row >= out_rows
            if bad or _row_error(src, at, size, out_m, row, rn, None) is not None:
                failed = k
                if size >= 0 and at + size <= done:
                    err = 0
                break
            at += size
        i = j
    return failed, (err if failed >= 0 else 0), _blocks_read() - before


class _MapJob:
    """map_lz4's work: its arguments, held (buffer exports) until released, and its answer. Runs (threads and the
    caller) share the rows, each taking the next TAKE rows not taken yet until none are left or a row failed."""

    def __init__(self, maps: Any, slots: Any, offsets: Any, nbytes: Any, dst: Any, out: Any, row_nbytes: Any) -> None:
        if not isinstance(maps, tuple):
            raise TypeError(f"argument 1 must be tuple, not {type(maps).__name__}")
        slots_b, off_b, nb_b, dst_b = _bytes(slots), _bytes(offsets), _bytes(nbytes), _bytes(dst)
        out_b = _writable(out, 6)
        rn = _ssize(row_nbytes)
        n = _check(off_b, nb_b, out_b, rn)
        if len(slots_b) != n * 4 or len(dst_b) != n * 8:
            raise ValueError("slots (int32) and dst (int64) must hold one entry per row")
        views = [_bytes(m) for m in maps]  # each map held until every row is decoded
        out_rows = len(out_b) // rn
        s, d = slots_b.view(np.int32), dst_b.view(np.int64)
        if n and ((s < 0) | (s >= len(views)) | (d < 0) | (d >= out_rows)).any():
            raise ValueError("a slot names no map, or dst a row outside out")
        self.n, self.rn, self.out_rows = n, rn, out_rows
        self.slots, self.dst = _ints(slots_b, "i"), _ints(dst_b, "q")
        self.offsets, self.nbytes = _ints(off_b, "q"), _ints(nb_b, "q")
        self.out = memoryview(out_b)
        self.maps = [memoryview(v) for v in views]
        self.past = [_past_end(m) for m in maps]  # each mapped file's end, as the call starts
        self.next = itertools.count()  # batches of TAKE rows, taken in order (next() holds the GIL: atomic)
        self.stop = False
        self.failures: list[tuple[int, int]] = []
        self.errors: list[BaseException] = []  # what a run raised (wait() raises it, as map_lz4 would)
        self.inblock: list[int] = []

    def run(self) -> None:
        """Decode rows no other run has taken."""
        before = _blocks_read()
        try:
            n, rn, out_rows, maps = self.n, self.rn, self.out_rows, self.maps
            while not self.stop:
                first = next(self.next) * TAKE
                if first >= n:
                    break
                for i in range(first, min(first + TAKE, n)):
                    # each entry read once and checked as it is used: the arrays may share memory with out
                    slot, size, at, row = self.slots[i], self.nbytes[i], self.offsets[i], self.dst[i]
                    view = maps[slot] if 0 <= slot < len(maps) else None
                    bad = view is None or row < 0 or row >= out_rows or size < 0 or at < 0
                    if bad or at > len(view) or size > len(view) - at:
                        self.fail(i, 0)
                        break
                    err = _row_error(view, at, size, self.out, row, rn, self.past[slot])
                    if err is not None:
                        self.fail(i, err)
                        break
        except BaseException as e:  # noqa: BLE001 - raised again by result(): by the call, or by wait()
            self.errors.append(e)
            self.stop = True
        finally:
            self.inblock.append(_blocks_read() - before)

    def fail(self, i: int, err: int) -> None:
        self.failures.append((i, err))
        self.stop = True

    def lost(self) -> None:
        """Its threads are gone (a forked child): rows may be undone."""
        if not self.failures:
            self.failures.append((0, errno.ESRCH))

    def result(self) -> tuple[int, int, int]:
        if self.errors:
            raise self.errors[0]
        failed, err = min(self.failures) if self.failures else (-1, 0)
        return failed, err, sum(self.inblock)

    def release(self) -> None:
        self.slots = self.offsets = self.nbytes = self.dst = self.out = None  # type: ignore[assignment]
        self.maps = []


def map_lz4(
    maps: tuple, slots: Any, offsets: Any, nbytes: Any, dst: Any, out: Any, row_nbytes: int, /
) -> tuple[int, int, int]:
    """Row i at maps[slots[i]][offsets[i] : offsets[i] + nbytes[i]] decoded into out[dst[i]]; (-1, 0, inblock) or
    (first failing row, errno, inblock)."""
    job = _MapJob(maps, slots, offsets, nbytes, dst, out, row_nbytes)
    job.run()
    job.release()
    return job.result()


# -- encoding --------------------------------------------------------------------------------------------------------


class _EncodeJob:
    """encode_lz4's work: the rows held (a buffer export) until released; runs share them as a _MapJob's rows."""

    def __init__(self, rows: Any, row_nbytes: Any, acceleration: Any) -> None:
        rn, self.acceleration = _ssize(row_nbytes), _c_int(acceleration)
        view = memoryview(rows)
        if rn <= 0 or rn > LZ4_MAX_INPUT_SIZE:
            raise ValueError("row_nbytes must be 1 .. LZ4_MAX_INPUT_SIZE")
        self.rn, self.view = rn, view
        self.flat: memoryview | None = None  # flat bytes (rows one after the other), else rows taken at a stride
        if view.ndim <= 1 and (view.ndim == 0 or view.strides[0] == view.itemsize):
            if view.nbytes % rn:
                raise _not_rows()
            self.n, self.flat = view.nbytes // rn, np.frombuffer(view, np.uint8).data
        else:
            inner = view.itemsize  # the bytes of one row, checked C-contiguous from the last axis up
            for k in range(view.ndim - 1, 0, -1):
                if view.shape[k] > 1 and view.strides[k] != inner:
                    raise _not_rows()
                inner *= view.shape[k]
            if view.suboffsets or inner != rn:
                raise _not_rows()
            self.n = view.shape[0]
        self.frames: list[bytes | None] = [None] * self.n
        self.next = itertools.count()
        self.stop = False
        self.errors: list[BaseException] = []
        self.lost_rows = False

    def row(self, i: int) -> memoryview:
        if self.flat is not None:
            return self.flat[i * self.rn : (i + 1) * self.rn]
        return self.view[i : i + 1]  # one row, C-contiguous

    def run(self) -> None:
        try:
            while not self.stop:
                first = next(self.next) * TAKE_ENCODE
                if first >= self.n:
                    break
                for i in range(first, min(first + TAKE_ENCODE, self.n)):
                    try:
                        self.frames[i] = _compress(self.row(i), self.acceleration)
                    except RuntimeError:
                        raise RuntimeError("LZ4 compression failed") from None
        except BaseException as e:  # noqa: BLE001 - raised again by result(): by the call, or by wait()
            self.errors.append(e)
            self.stop = True

    def lost(self) -> None:
        self.lost_rows = True

    def result(self) -> list[bytes]:
        if self.errors:
            raise self.errors[0]
        if self.lost_rows:
            raise RuntimeError("rows were left unencoded: the task's threads are gone (a fork)")
        if any(f is None for f in self.frames):
            raise RuntimeError("rows were left unencoded")
        return self.frames  # type: ignore[return-value]

    def release(self) -> None:
        self.flat = None
        self.view = None  # type: ignore[assignment]


def _not_rows() -> ValueError:
    return ValueError("rows must hold whole rows of row_nbytes (1 .. LZ4_MAX_INPUT_SIZE) bytes, each C-contiguous")


def encode_lz4(rows: Any, row_nbytes: int, acceleration: int, /) -> list[bytes]:
    """Each row of rows (a buffer of whole rows, each C-contiguous, at any stride) encoded: size header + block."""
    job = _EncodeJob(rows, row_nbytes, acceleration)
    job.run()
    job.release()
    return job.result()


# -- tasks -----------------------------------------------------------------------------------------------------------


def _run_then_leave(job: _MapJob | _EncodeJob, active: list[None]) -> None:
    try:
        job.run()
    finally:
        active.pop()


class Task:
    """map_lz4 or encode_lz4 under way on threads of their own (map_lz4_start, encode_lz4_start).

    wait() takes the rows the threads have not taken yet, joins them and returns what the call would have (every
    wait(); the first one raises what the call would have raised, the later ones a RuntimeError). The buffers are
    held until then, or until the task is dropped (its threads end first). In a forked child, which has none of the
    threads: if one was under way at the fork its rows may be lost, and the answer says so (a row failing with ESRCH,
    a RuntimeError); else wait() does the rows not taken yet.
    """

    def __init__(self, job: _MapJob | _EncodeJob, threads: int) -> None:
        self._job: Any = job
        self._pid = os.getpid()
        self._joining = threading.Lock()  # one wait() helps, joins and takes the result; the others wait for it
        self._active: list[None] = []  # one entry per run under way (list appends and pops hold the GIL: atomic)
        self._helped = False
        self._result: Any = None
        self._threads: list[threading.Thread] = []
        for _ in range(threads):  # threads that cannot be had leave their rows to the others and wait()
            self._active.append(None)
            thread = threading.Thread(target=_run_then_leave, args=(job, self._active), daemon=True)
            try:
                thread.start()
            except RuntimeError:
                self._active.pop()
                continue
            self._threads.append(thread)

    def _help(self) -> None:
        self._active.append(None)  # a run under way, as a thread's (a fork must tell)
        _run_then_leave(self._job, self._active)

    def _join(self, help: bool) -> Any:
        if self._pid != os.getpid():  # a forked child: none of the threads (nor a waiting one) is here
            self._threads = []
            if self._job is not None and self._active:
                self._job.lost()
            elif help and self._job is not None and not self._helped:
                self._help()
            self._helped = True
            self._active.clear()
            return self._take(help)
        with self._joining:
            if help and not self._helped:
                self._help()
            self._helped = True
            for thread in self._threads:
                thread.join()
            self._threads = []
            return self._take(help)

    def _take(self, help: bool) -> Any:
        job, self._job = self._job, None
        if job is not None:
            job.release()
            if help:
                self._result = job.result()  # raises what the call would have: this wait() raises it
        elif help and self._result is None:
            raise RuntimeError("the task failed, and its first wait() raised why")
        return self._result

    def wait(self) -> Any:
        """Do the rows its threads have not taken, wait for theirs, and return what the call would have."""
        return self._join(True)

    def done(self) -> bool:
        """Whether its threads are done (without waiting)."""
        return not self._active

    def __del__(self) -> None:
        if getattr(self, "_job", None) is not None:
            self._join(False)  # its threads use buffers it holds: never let them go before they end


def map_lz4_start(
    maps: tuple, slots: Any, offsets: Any, nbytes: Any, dst: Any, out: Any, row_nbytes: int, threads: int = 1, /
) -> Task:
    """map_lz4 on ``threads`` threads of its own, started before this returns."""
    count = _thread_count(threads)
    return Task(_MapJob(maps, slots, offsets, nbytes, dst, out, row_nbytes), count)


def encode_lz4_start(rows: Any, row_nbytes: int, acceleration: int, threads: int = 1, /) -> Task:
    """encode_lz4 on ``threads`` threads of its own, started before this returns; the rows must not change until
    the task is waited for."""
    count = _thread_count(threads)
    return Task(_EncodeJob(rows, row_nbytes, acceleration), count)


# -- shards and checksums --------------------------------------------------------------------------------------------


def shard_body(rows: Any, /) -> bytearray:
    """A shard's bytes but the index's crc32c: the rows' bytes (None: never written), then per row (offset, nbytes)
    as little-endian uint64 (both 2**64 - 1 for a None row), then 4 zero bytes."""
    views = _items(rows, True, "rows")
    sizes = np.array([-1 if v is None else v.nbytes for v in views], np.int64)
    written = sizes >= 0
    index = np.full((len(views), 2), np.iinfo(np.uint64).max, np.dtype("<u8"))
    kept = np.where(written, sizes, 0)
    index[written, 0] = (np.cumsum(kept) - kept)[written]
    index[written, 1] = sizes[written]
    out = bytearray(b"".join(v for v in views if v is not None))
    out += index.tobytes()
    out += bytes(4)
    return out


def crc32_all(buffers: Any, value: int = 0, /) -> int:
    """zlib.crc32 over the buffers one after the other, without joining them."""
    crc = _c_uint(value)
    for view in _items(buffers, False, "buffers"):
        crc = _crc32(view, crc)  # type: ignore[arg-type]
    return crc


def _int_buffer(obj: Any, itemsize: int, signed: bool, writable: bool, name: str) -> memoryview:
    """A C-contiguous buffer of integers of itemsize bytes (crc32_runs' starts, ends, crcs), refused as its exporter
    refuses such a request (numpy: ValueError; other buffers: BufferError) or for another type."""
    view = memoryview(obj)
    numpy_array = isinstance(obj, np.ndarray)
    if not view.c_contiguous:
        raise ValueError("ndarray is not C-contiguous") if numpy_array else BufferError(
            "memoryview: underlying buffer is not C-contiguous"
        )
    if writable and view.readonly:
        raise ValueError("buffer source array is read-only") if numpy_array else BufferError("Object is not writable.")
    f = view.format[1:] if view.format[:1] in ("<", "=", "@") else view.format
    if view.itemsize != itemsize or len(f) != 1 or f not in ("bhilq" if signed else "BHILQ"):
        kind = "int" if signed else "uint"
        got = f"got format {view.format}, itemsize {view.itemsize}"
        raise ValueError(f"{name} must be {kind}{8 * itemsize} integers ({got})")
    return view


def crc32_runs(data: Any, starts: Any, ends: Any, crcs: Any, /) -> None:
    """crcs[i] = zlib.crc32(data[starts[i] : ends[i]], crcs[i]) for every i (uint32 crcs, updated in place)."""
    d = memoryview(_bytes(data))
    s_view = _int_buffer(starts, 8, True, False, "starts")
    e_view = _int_buffer(ends, 8, True, False, "ends")
    c_view = _int_buffer(crcs, 4, False, True, "crcs")
    n = c_view.nbytes // 4
    if s_view.nbytes != n * 8 or e_view.nbytes != n * 8:
        raise ValueError("starts, ends and crcs must hold one entry per run")
    # copied, then checked and used from the copy: crcs sharing memory with the runs cannot move one after its check
    s = np.frombuffer(s_view, np.int64).copy()
    e = np.frombuffer(e_view, np.int64).copy()
    crc = np.frombuffer(c_view, np.uint32).copy()
    if n and ((s < 0) | (s > e) | (e > len(d))).any():
        raise ValueError("a run lies outside data")
    got = [_crc32(d[a:b], c) for a, b, c in zip(s.tolist(), e.tolist(), crc.tolist())]
    np.frombuffer(c_view, np.uint32)[:] = got


def same_bytes(a: Any, b: Any, /) -> bool:
    """Whether two C-contiguous buffers hold the same bytes."""
    x, y = _bytes(a), _bytes(b)
    return len(x) == len(y) and x.tobytes() == y.tobytes()
