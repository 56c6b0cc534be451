"""Mapped files and the rows gathered from them: :func:`map_file` (a read-only :class:`Mapping` of bytes of a file)
and :func:`take_rows` (rows of an uncompressed chunk copied out of a buffer, numpy's fancy indexing).

A Mapping holds a duplicate of its file's descriptor (Python's mmap keeps one), through which the file's size is
seen as each call starts (:func:`past_end`): rows on pages past the end of a file cut short before a call fail with
EIO, as in C. Any other buffer is read as bytes that map no file: only the compiled take_rows survives reading one
whose file was cut short under it.
"""

from __future__ import annotations

import errno
import mmap
import os
import sys
from typing import Any

import numpy as np

from her_store._kernels.pure.arguments import as_bytes, c_int, c_integer, ints, ssize, writable

__all__ = ["Mapping", "map_file", "past_end", "take_rows"]

_NO_AT = object()  # take_rows called without ``at`` (None is refused, as by C)


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


def map_file(fd: int, offset: int, length: int, random: bool = True, /) -> Mapping:
    """Bytes ``offset .. offset + length`` of an open file, mapped read-only; with ``random`` (MADV_RANDOM) a page
    fault reads its page alone, else the kernel reads ahead as it sees fit (rows read in order); see
    her_store/_kernels/_frames.c."""
    fd = c_int(fd)
    offset = c_integer(offset, -(2**63), 2**63 - 1, "long long")
    length = c_integer(length, -(2**63), 2**63 - 1, "long long")
    random = bool(random)
    if offset < 0 or length <= 0 or length > sys.maxsize - 65536:
        raise ValueError("map_file needs offset >= 0 and a length of at least one byte")
    size = os.fstat(fd).st_size
    if offset > size or length > size - offset:
        raise ValueError("map_file: offset + length is past the end of the file")
    skip = offset % mmap.ALLOCATIONGRANULARITY
    mapped = mmap.mmap(fd, skip + length, access=mmap.ACCESS_READ, offset=offset - skip)
    if random and hasattr(mmap, "MADV_RANDOM"):
        mapped.madvise(mmap.MADV_RANDOM)  # advice only: its absence changes nothing read
    view = np.frombuffer(mapped, np.uint8, length, skip).view(Mapping)
    view._map, view._map_offset = mapped, offset - skip
    view._map_address = view.__array_interface__["data"][0] - skip
    return view


def past_end(buf: Any) -> int | None:
    """Where, in a Mapping's bytes, the pages past its file's current end begin (reading there is SIGBUS); None for
    any other buffer, whose file (if it maps one) is not known here."""
    if not isinstance(buf, Mapping) or buf._map is None:
        return None
    start = buf._map_offset + buf.__array_interface__["data"][0] - buf._map_address  # where buf starts in its file
    size = buf._map.size()  # the file's size now (fstat of the mapping's descriptor)
    return -(-size // mmap.PAGESIZE) * mmap.PAGESIZE - start


def _wrap64(v: int) -> int:
    """v as C's int64 arithmetic leaves it."""
    return (v + 2**63) % 2**64 - 2**63


def take_rows(
    src: Any, rows: Any, first: int, skip: int, out: Any, row_nbytes: int, at: Any = _NO_AT, /
) -> tuple[int, int]:
    """out[i] (out[at[i]]) = row rows[i] - first of src, whose row k is bytes skip + k * row_nbytes ..; returns
    (-1, 0), or the first failing row and its errno (0: outside src or out; EIO: past the end of a mapped file)."""
    src_b, rows_b = as_bytes(src), as_bytes(rows)
    first, skip = ssize(first), ssize(skip)
    out_b = writable(out, 5)
    rn = ssize(row_nbytes)
    at_b = None if at is _NO_AT else as_bytes(at)
    n = len(rows_b) // 8
    out_rows = len(out_b) // rn if rn > 0 else 0
    bad = rn <= 0 or len(rows_b) != n * 8 or skip < 0 or skip > len(src_b)
    if bad or (len(at_b) != n * 8 if at_b is not None else out_rows < n):
        raise ValueError(
            "rows (and at) must be int64 (8 bytes an entry), out must hold them, row_nbytes > 0, skip within src"
        )
    have = (len(src_b) - skip) // rn
    past = past_end(src)
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
    want, to = ints(rows, "q"), ints(at, "q") if at is not None else None
    src_m, out_m = memoryview(src), memoryview(out)
    for i in range(n):
        r, k = _wrap64(want[i] - first), to[i] if to is not None else i
        if r < 0 or r >= have or k < 0 or k >= out_rows:
            return i, 0
        if past is not None and skip + (r + 1) * rn > past:
            return i, errno.EIO
        out_m[k * rn : (k + 1) * rn] = src_m[skip + r * rn : skip + (r + 1) * rn]
    return -1, 0
