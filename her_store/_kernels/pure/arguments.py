"""The arguments of the pure kernels, converted and checked as the C functions' PyArg_ParseTuple formats and their
own checks convert and check them (the same TypeErrors, OverflowErrors and ValueErrors), and the per-thread count of
blocks read that the gathers report.
"""

from __future__ import annotations

import operator
import resource
from typing import Any

import numpy as np

__all__ = [
    "INT32_MAX",
    "MAX_THREADS",
    "as_bytes",
    "blocks_read",
    "c_int",
    "c_integer",
    "c_uint",
    "check_rows",
    "ints",
    "items",
    "ssize",
    "thread_count",
    "writable",
]

INT32_MAX = 2**31 - 1
MAX_THREADS = 64


def c_integer(x: Any, low: int, high: int, what: str) -> int:
    """An integer argument of a C type holding ``low`` .. ``high`` (TypeError when not an integer)."""
    v = operator.index(x)
    if not low <= v <= high:
        raise OverflowError(f"Python int too large to convert to C {what}")
    return v


def ssize(x: Any) -> int:  # "n"
    return c_integer(x, -(2**63), 2**63 - 1, "ssize_t")


def c_int(x: Any) -> int:  # "i"
    return c_integer(x, -(2**31), 2**31 - 1, "int")


def c_uint(x: Any) -> int:  # "I": masked to 32 bits, as zlib.crc32 takes its value
    return operator.index(x) & 0xFFFFFFFF


def as_bytes(obj: Any) -> np.ndarray:
    """A C-contiguous buffer's bytes ("y*"), uint8, read in place (the exporter's own error when it cannot be)."""
    return np.frombuffer(obj, np.uint8)


def writable(obj: Any, position: int) -> np.ndarray:
    """A writable C-contiguous buffer's bytes ("w*"), uint8, written in place."""
    try:
        view = memoryview(obj)
    except TypeError:
        view = None
    if view is None or view.readonly or not view.c_contiguous:
        raise TypeError(f"argument {position} must be read-write bytes-like object, not {type(obj).__name__}")
    return np.frombuffer(obj, np.uint8)


def ints(b: np.ndarray, code: str) -> memoryview:
    """A live view of b's bytes as C integers ('i' int32, 'q' int64): read entry by entry as C reads them, so a
    write into ``out`` that overlaps them is seen by the entries after it."""
    return memoryview(b).cast(code)


def items(items: Any, allow_none: bool, name: str) -> list[np.ndarray | None]:
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


def check_rows(
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


def thread_count(threads: Any) -> int:
    asked = c_integer(threads, -(2**63), 2**63 - 1, "long")
    if not 1 <= asked <= MAX_THREADS:
        raise ValueError("threads must be 1 .. 64")
    return asked


def blocks_read() -> int:
    """512-byte blocks the calling thread has read from disks so far (0 where the system does not count them per
    thread)."""
    who = getattr(resource, "RUSAGE_THREAD", None)
    return resource.getrusage(who).ru_inblock if who is not None else 0
