"""crc32 checksums (zlib's values; isal's crc32 where installed: the same values, faster) of one buffer, of many
buffers one after the other and of many runs of one buffer, and the byte-for-byte comparison of two buffers: how the
bytes written and read are checked.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from her_store._kernels.pure.arguments import as_bytes, c_uint, items

try:
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # isal is optional (her_store[fast]); zlib's crc32 gives the same values
    from zlib import crc32 as _crc32

__all__ = ["crc32", "crc32_all", "crc32_runs", "same_bytes"]

crc32 = _crc32  # crc32(data, value=0) -> int: zlib.crc32(data, value), for any C-contiguous bytes-like data


def crc32_all(buffers: Any, value: int = 0, /) -> int:
    """zlib.crc32 over the buffers one after the other, without joining them."""
    crc = c_uint(value)
    for view in items(buffers, False, "buffers"):
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
    d = memoryview(as_bytes(data))
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
    x, y = as_bytes(a), as_bytes(b)
    return len(x) == len(y) and x.tobytes() == y.tobytes()
