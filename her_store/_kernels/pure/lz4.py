"""LZ4 rows in Python: each row a size header and one LZ4 block (numcodecs' LZ4, which runs without the GIL),
decoded from one buffer (:func:`decode_lz4`), from files by pread (:func:`pread_lz4`) or from mapped files
(:func:`map_lz4`), and encoded (:func:`encode_lz4`). The work of a call that can run on threads of its own
(:class:`MapJob`, :class:`EncodeJob`) is shared by every run of it, a few rows at a time
(:mod:`her_store._kernels.pure.tasks` starts them).
"""

from __future__ import annotations

import errno
import itertools
import os
import struct
from typing import Any

import numpy as np
from numcodecs.lz4 import compress as _compress
from numcodecs.lz4 import decompress as _decompress

from her_store._kernels.pure.arguments import (
    INT32_MAX,
    as_bytes,
    blocks_read,
    c_int,
    check_rows,
    ints,
    ssize,
    writable,
)
from her_store._kernels.pure.mapped import past_end

__all__ = ["EncodeJob", "MapJob", "decode_lz4", "encode_lz4", "map_lz4", "pread_lz4", "row_error"]

LZ4_MAX_INPUT_SIZE = 0x7E000000
RUN_BYTES = 1 << 20  # pread_lz4 reads adjacent rows of one file in one pread, up to this many bytes
TAKE = 8  # map_lz4's threads and caller take this many rows at a time
TAKE_ENCODE = 2  # encode_lz4's, as many


def row_error(
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


def decode_lz4(src: Any, offsets: Any, nbytes: Any, out: Any, row_nbytes: int, /) -> tuple[int, int]:
    """Row i from src[offsets[i] : offsets[i] + nbytes[i]] decoded into out[i]; (-1, 0) or (first failing row, 0)."""
    src_b, off_b, nb_b = as_bytes(src), as_bytes(offsets), as_bytes(nbytes)
    out_b = writable(out, 4)
    rn = ssize(row_nbytes)
    n = check_rows(off_b, nb_b, out_b, rn)
    off_v, nb_v = ints(off_b, "q"), ints(nb_b, "q")
    src_m, out_m, length = memoryview(src_b), memoryview(out_b), len(src_b)
    for i in range(n):
        size, at = nb_v[i], off_v[i]
        if size < 0 or at < 0 or at > length or size > length - at:
            return i, 0
        if row_error(src_m, at, size, out_m, i, rn, None) is not None:
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
    fd_b, off_b, nb_b, dst_b = as_bytes(fds), as_bytes(offsets), as_bytes(nbytes), as_bytes(dst)
    out_b = writable(out, 5)
    rn = ssize(row_nbytes)
    n = check_rows(off_b, nb_b, out_b, rn, fd_b)
    if len(dst_b) != n * 8:
        raise ValueError("dst (int64) must hold one entry per row")
    out_rows = len(out_b) // rn
    wanted = dst_b.view(np.int64)
    if n and ((wanted < 0) | (wanted >= out_rows)).any():
        raise ValueError("dst names a row outside out")
    fd_v, off_v, nb_v, dst_v = ints(fd_b, "i"), ints(off_b, "q"), ints(nb_b, "q"), ints(dst_b, "q")
    out_m = memoryview(out_b)
    row_bound = rn + rn // 4 + 1024  # above LZ4's bound for one row
    failed, err = -1, 0
    before = blocks_read()
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
            if bad or row_error(src, at, size, out_m, row, rn, None) is not None:
                failed = k
                if size >= 0 and at + size <= done:
                    err = 0
                break
            at += size
        i = j
    return failed, (err if failed >= 0 else 0), blocks_read() - before


class MapJob:
    """map_lz4's work: its arguments, held (buffer exports) until released, and its answer. Runs (threads and the
    caller) share the rows, each taking the next TAKE rows not taken yet until none are left or a row failed."""

    def __init__(self, maps: Any, slots: Any, offsets: Any, nbytes: Any, dst: Any, out: Any, row_nbytes: Any) -> None:
        if not isinstance(maps, tuple):
            raise TypeError(f"argument 1 must be tuple, not {type(maps).__name__}")
        slots_b, off_b, nb_b, dst_b = as_bytes(slots), as_bytes(offsets), as_bytes(nbytes), as_bytes(dst)
        out_b = writable(out, 6)
        rn = ssize(row_nbytes)
        n = check_rows(off_b, nb_b, out_b, rn)
        if len(slots_b) != n * 4 or len(dst_b) != n * 8:
            raise ValueError("slots (int32) and dst (int64) must hold one entry per row")
        views = [as_bytes(m) for m in maps]  # each map held until every row is decoded
        out_rows = len(out_b) // rn
        s, d = slots_b.view(np.int32), dst_b.view(np.int64)
        if n and ((s < 0) | (s >= len(views)) | (d < 0) | (d >= out_rows)).any():
            raise ValueError("a slot names no map, or dst a row outside out")
        self.n, self.rn, self.out_rows = n, rn, out_rows
        self.slots, self.dst = ints(slots_b, "i"), ints(dst_b, "q")
        self.offsets, self.nbytes = ints(off_b, "q"), ints(nb_b, "q")
        self.out = memoryview(out_b)
        self.maps = [memoryview(v) for v in views]
        self.past = [past_end(m) for m in maps]  # each mapped file's end, as the call starts
        self.next = itertools.count()  # batches of TAKE rows, taken in order (next() holds the GIL: atomic)
        self.stop = False
        self.failures: list[tuple[int, int]] = []
        self.errors: list[BaseException] = []  # what a run raised (wait() raises it, as map_lz4 would)
        self.inblock: list[int] = []

    def run(self) -> None:
        """Decode rows no other run has taken."""
        before = blocks_read()
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
                    err = row_error(view, at, size, self.out, row, rn, self.past[slot])
                    if err is not None:
                        self.fail(i, err)
                        break
        except BaseException as e:  # noqa: BLE001 - raised again by result(): by the call, or by wait()
            self.errors.append(e)
            self.stop = True
        finally:
            self.inblock.append(blocks_read() - before)

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
    job = MapJob(maps, slots, offsets, nbytes, dst, out, row_nbytes)
    job.run()
    job.release()
    return job.result()


class EncodeJob:
    """encode_lz4's work: the rows held (a buffer export) until released; runs share them as a MapJob's rows."""

    def __init__(self, rows: Any, row_nbytes: Any, acceleration: Any) -> None:
        rn, self.acceleration = ssize(row_nbytes), c_int(acceleration)
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
    job = EncodeJob(rows, row_nbytes, acceleration)
    job.run()
    job.release()
    return job.result()
