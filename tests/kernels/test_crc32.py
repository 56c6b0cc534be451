"""The kernels' crc32 (her_store/_kernels/crc32.c in the compiled ones, isal's or zlib's in the pure ones; through
_kernels.crc32 and crc32_runs) is zlib.crc32 at every length, alignment and starting value: a wrong fold constant or
a mishandled tail shows up as a mismatch."""

from __future__ import annotations

import mmap
import zlib

import numpy as np
import pytest

from her_store import _kernels

BOUNDARIES = sorted({n + d for n in (64, 128, 256, 512, 4096) for d in range(-3, 4)})
STARTS = (0, 1, 0xFFFFFFFF, 0xEDB88320, 0x12345678)


def _bytes(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def _runs(data: bytes, pieces: list[tuple[int, int]], start: int) -> list[int]:
    """crc32_runs over (a, b) pieces of data, each chained from start."""
    crcs = np.full(len(pieces), start, np.uint32)
    a = np.array([p[0] for p in pieces], np.int64)
    b = np.array([p[1] for p in pieces], np.int64)
    _kernels.crc32_runs(data, a, b, crcs)
    return crcs.tolist()


def test_every_short_length_and_the_fold_boundaries():
    data = _bytes(5000, seed=1)
    for n in [*range(301), *BOUNDARIES]:
        for start in STARTS:
            assert _kernels.crc32(data[:n], start) == zlib.crc32(data[:n], start), (n, start)
    pieces = [(0, n) for n in [*range(301), *BOUNDARIES]]
    for start in STARTS:
        assert _runs(data, pieces, start) == [zlib.crc32(data[a:b], start) for a, b in pieces]


def test_default_value_and_empty_input():
    data = _bytes(1000, seed=2)
    assert _kernels.crc32(data) == zlib.crc32(data)
    assert _kernels.crc32(b"") == 0
    assert _kernels.crc32(b"", 0xDEADBEEF) == 0xDEADBEEF
    # values are masked to 32 bits, as zlib masks them
    assert _kernels.crc32(data, -1) == zlib.crc32(data, -1)
    assert _kernels.crc32(data, 2**32 + 5) == zlib.crc32(data, 2**32 + 5)
    assert _kernels.crc32(data, np.uint32(7)) == zlib.crc32(data, 7)


@pytest.mark.parametrize("seed", [3, 4])
def test_large_random_buffers(seed: int):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(3 << 20, 5 << 20))  # a few MB, of no round length
    data = rng.integers(0, 256, n, dtype=np.uint8)
    start = int(rng.integers(0, 2**32))
    assert _kernels.crc32(data) == zlib.crc32(data)
    assert _kernels.crc32(data, start) == zlib.crc32(data, start)
    assert _runs(data.tobytes(), [(0, n), (17, n - 5)], start) == [
        zlib.crc32(data, start),
        zlib.crc32(data[17 : n - 5], start),
    ]


def test_every_alignment_of_a_memoryview_slice():
    data = _bytes(8192, seed=5)
    view = memoryview(data)
    for offset in range(16):
        for n in (63, 64, 65, 100, 1000, 4096 + 7, 8000):
            piece = view[offset : offset + n]
            assert _kernels.crc32(piece, 0x89ABCDEF) == zlib.crc32(piece, 0x89ABCDEF), (offset, n)
        pieces = [(offset, offset + n) for n in (64, 129, 2000, 8192 - 16)]
        assert _runs(data, pieces, 0) == [zlib.crc32(data[a:b]) for a, b in pieces], offset


def test_chaining_equals_one_pass():
    data = _bytes(100_000, seed=6)
    rng = np.random.default_rng(7)
    cuts = np.sort(rng.integers(0, len(data), 40)).tolist()
    for start in STARTS:
        crc, at = start, 0
        for cut in [*cuts, len(data)]:
            crc = _kernels.crc32(data[at:cut], crc)
            at = cut
        assert crc == zlib.crc32(data, start)


def test_mmap_and_numpy_buffers():
    data = _bytes(70_000, seed=8)
    with mmap.mmap(-1, len(data)) as m:
        m[:] = data
        view = memoryview(m)
        try:
            assert _kernels.crc32(view[3:], 5) == zlib.crc32(data[3:], 5)
        finally:
            view.release()
    rows = np.frombuffer(data, np.uint8)[:69_999].reshape(-1, 3).astype(np.float32)  # multi-byte items, 2-d
    assert _kernels.crc32(rows) == zlib.crc32(rows.tobytes())


def test_non_contiguous_input_is_refused_as_zlib_refuses_it():
    strided = memoryview(_bytes(1000, seed=9))[::2]
    with pytest.raises(BufferError, match="not C-contiguous"):
        zlib.crc32(strided)
    with pytest.raises(BufferError, match="not C-contiguous"):
        _kernels.crc32(strided)
    with pytest.raises(TypeError):
        _kernels.crc32("text")
