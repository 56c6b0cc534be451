"""Sharded arrays: one row's encoding, a shard's bytes and index, the writer's whole-shard commits, the C decoders."""

from __future__ import annotations

import errno
import os
import signal
import struct
import threading
import zlib
from pathlib import Path

import google_crc32c
import numcodecs
import numcodecs.lz4
import numpy as np
import pytest
import zarr
import zarr.codecs as zc

from her_store import _kernels
from her_store.errors import CorruptStoreError
from her_store.format.frames import EMPTY, FrameCodec, build_shard, index_nbytes, lz4_codec, parse_index
from her_store.format.jpeg import jpeg_codec
from her_store.format.keys import chunk_key
from her_store.storage import open_backend
from her_store.store import frame_writer as shard_module
from her_store.store.frame_writer import FrameWriter as ShardWriter
from her_store.store.split import STEP
from tests.conftest import FailingTask, requires_compiled

ROW = (3, 8, 8)
ROW_NBYTES = 192
SHARD_ROWS = 8
PATH = "steps/pixels"
CODECS = {
    "lz4": lz4_codec,
    "blosc": lambda: zc.BloscCodec(cname="lz4", clevel=5, shuffle="bitshuffle"),
    "zstd": lambda: zc.ZstdCodec(level=3),
    "gzip": lambda: zc.GzipCodec(level=5),
    "raw": lambda: None,
}


def _array(root, codec, rows: int = 4 * SHARD_ROWS) -> zarr.Array:
    """A sharded uint8 array of 3x8x8 rows as the store makes it, at ``steps/pixels`` of a group at ``root``."""
    group = zarr.open_group(str(root), mode="a")
    return group.create_array(
        PATH, shape=(rows, *ROW), chunks=(1, *ROW), shards=(SHARD_ROWS, *ROW), dtype="u1", compressors=codec,
        fill_value=0, chunk_key_encoding={"name": "default", "separator": "."},
    )


def _frames_of(n: int, seed: int = 0) -> np.ndarray:
    """Rows that compress (few distinct values), each different."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 4, (n, *ROW)).astype(np.uint8) + np.arange(n, dtype=np.uint8)[:, None, None, None]


def _shard_file(root, shard: int) -> str:
    return os.path.join(str(root), chunk_key(PATH, shard, 1 + len(ROW), "."))


# -- FrameCodec --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(CODECS))
def test_each_inner_codec_round_trips_a_row_and_zarr_reads_the_shard_it_makes(tmp_path, name):
    array = _array(tmp_path, CODECS[name]())
    codec = FrameCodec(array, "a")
    rows = _frames_of(SHARD_ROWS)
    encoded = [codec.encode(r) for r in rows]
    for r, raw in zip(rows, encoded):
        out = np.full(ROW, 255, np.uint8)
        codec.decode(raw, out)
        np.testing.assert_array_equal(out, r)
    assert codec.is_lz4 == (name == "lz4")
    assert (name == "raw") == all(len(raw) == ROW_NBYTES for raw in encoded)
    os.makedirs(os.path.dirname(_shard_file(tmp_path, 1)), exist_ok=True)
    with open(_shard_file(tmp_path, 1), "wb") as f:
        f.write(build_shard([*encoded[:5], None, *encoded[6:]]))
    got = zarr.open_array(str(tmp_path / PATH), mode="r")[SHARD_ROWS : 2 * SHARD_ROWS]
    np.testing.assert_array_equal(got[[0, 1, 2, 3, 4, 6, 7]], rows[[0, 1, 2, 3, 4, 6, 7]])
    assert not got[5].any()  # a row never written is the fill value


def test_the_lossy_codec_round_trips_within_its_error(tmp_path):
    pytest.importorskip("imagecodecs", reason='pip install "her_store[lossy]"')
    codec = FrameCodec(_array(tmp_path, jpeg_codec()), "a")
    row = (np.add.outer(np.arange(8), np.arange(8)) * 8).astype(np.uint8)[None].repeat(3, 0)
    out = np.empty(ROW, np.uint8)
    codec.decode(codec.encode(row), out)
    assert np.abs(out.astype(int) - row).max() <= 4


def _other_size(name: str, n: int) -> bytes:
    """A well-formed frame of ``n`` bytes (not one row) in the codec's format."""
    data = np.arange(n, dtype=np.uint8)
    return bytes({
        "lz4": numcodecs.LZ4(), "blosc": numcodecs.Blosc("lz4"), "zstd": numcodecs.Zstd(), "gzip": numcodecs.GZip()
    }[name].encode(data)) if name != "raw" else data.tobytes()


def _lz4_block_claiming_a_row(n: int) -> bytes:
    """An LZ4 block of ``n`` bytes behind a header that says one row (192 bytes)."""
    return struct.pack("<i", ROW_NBYTES) + _other_size("lz4", n)[4:]


@pytest.mark.parametrize("name", sorted(CODECS))
@pytest.mark.parametrize("damage", ["empty", "truncated", "garbage", "one more byte", "fewer bytes", "more bytes"])
def test_bytes_that_are_not_one_row_are_a_value_error(tmp_path, name, damage):
    codec = FrameCodec(_array(tmp_path, CODECS[name]()), "a")
    row = _frames_of(1)[0]
    good = codec.encode(row)
    raw = {
        "empty": b"",
        "truncated": good[: len(good) // 2],
        "garbage": bytes(np.random.default_rng(1).integers(0, 256, len(good) + 7, np.uint8)),
        "one more byte": good + b"\0",
        "fewer bytes": _other_size(name, ROW_NBYTES - 92),
        "more bytes": _other_size(name, ROW_NBYTES + 100),
    }[damage]
    out = row.copy()
    with pytest.raises(ValueError):
        codec.decode(raw, out)


@pytest.mark.parametrize("n", [ROW_NBYTES - 92, ROW_NBYTES + 100])
def test_an_lz4_block_decoding_to_another_size_than_its_header_says_is_a_value_error(tmp_path, n):
    codec = FrameCodec(_array(tmp_path, lz4_codec()), "a")
    with pytest.raises(ValueError):
        codec.decode(_lz4_block_claiming_a_row(n), np.empty(ROW, np.uint8))


def test_a_blosc_frame_claiming_another_size_is_refused_before_decoding(tmp_path):
    codec = FrameCodec(_array(tmp_path, CODECS["blosc"]()), "a")
    raw = bytearray(codec.encode(_frames_of(1)[0]))
    for at, value in ((4, 1 << 31), (4, ROW_NBYTES - 1), (12, len(raw) + 1)):  # decoded size, then frame size
        bad = bytearray(raw)
        bad[at : at + 4] = struct.pack("<I", value)
        with pytest.raises(ValueError, match="a blosc frame of"):
            codec.decode(bytes(bad), np.empty(ROW, np.uint8))


def test_a_zstd_frame_must_declare_one_row(tmp_path):
    codec = FrameCodec(_array(tmp_path, CODECS["zstd"]()), "a")
    row = _frames_of(1)[0]
    raw = bytearray(codec.encode(row))
    fhd = raw[4]
    assert fhd >> 6 or fhd & 0x20, "numcodecs writes the frame's content size"
    no_size = bytes(raw[:4]) + bytes([fhd & 0x3F & ~0x20]) + bytes(raw[5:])  # no content size, no single segment
    with pytest.raises(ValueError, match="declaring -1 bytes"):
        codec.decode(no_size, np.empty(ROW, np.uint8))


# -- build_shard / parse_index -----------------------------------------------------------------------------------------
def test_a_shard_of_empty_rows_is_its_index_alone():
    raw = build_shard([None] * 4)
    assert len(raw) == index_nbytes(4) == 68
    offsets, nbytes = parse_index(raw, 4, "s")
    assert offsets.tolist() == [-1] * 4 and nbytes.tolist() == [0] * 4


def test_index_gives_each_row_its_byte_range():
    frames = [b"abc", None, b"", b"defgh"]
    raw = build_shard(frames)
    offsets, nbytes = parse_index(raw, 4, "s")
    assert offsets.tolist() == [0, -1, 3, 3] and nbytes.tolist() == [3, 0, 0, 5]
    assert raw[:8] == b"abcdefgh" and parse_index(memoryview(raw), 4, "s")[0].tolist() == offsets.tolist()


def test_build_shard_refuses_rows_that_are_not_bytes():
    with pytest.raises(TypeError, match=r"rows\[1\] is int, not a C-contiguous bytes-like object or None"):
        build_shard([b"abc", 7])
    with pytest.raises(TypeError, match="list or tuple"):
        build_shard(5)  # type: ignore[arg-type]


def test_crc32_all_is_zlibs_crc32_of_the_buffers_joined():
    parts = [b"", b"abc", bytearray(b"d" * 20000), memoryview(np.arange(999, dtype=np.uint8))]
    assert _kernels.crc32_all(parts, 7) == zlib.crc32(b"".join(bytes(p) for p in parts), 7)
    assert _kernels.crc32_all((), 5) == 5
    with pytest.raises(TypeError, match=r"buffers\[0\] is NoneType"):
        _kernels.crc32_all([None])


def _with_index(data: bytes, index: np.ndarray) -> bytes:
    """Data then the given (offset, nbytes) entries and their valid crc32c: what a crafted shard holds."""
    raw_index = np.asarray(index, "<u8").tobytes()
    return data + raw_index + struct.pack("<I", google_crc32c.value(raw_index))


@pytest.mark.parametrize(
    "entries, msg",
    [
        ([[0, EMPTY], [EMPTY, EMPTY]], "only one of offset and nbytes empty"),
        ([[EMPTY, 4], [EMPTY, EMPTY]], "only one of offset and nbytes empty"),
        ([[0, 9], [EMPTY, EMPTY]], "points past the shard's 8 bytes of data"),
        ([[9, 0], [EMPTY, EMPTY]], "points past"),
        ([[4, 5], [EMPTY, EMPTY]], "points past"),
        ([[EMPTY - 1, 2], [EMPTY, EMPTY]], "points past"),
        ([[2, EMPTY - 1], [EMPTY, EMPTY]], "points past"),  # an offset + nbytes that wraps around 2**64
        ([[1 << 63, 1 << 63], [EMPTY, EMPTY]], "points past"),
    ],
)
def test_crafted_index_entries_are_refused(entries, msg):
    assert parse_index(_with_index(b"x" * 8, [[0, 8], [EMPTY, EMPTY]]), 2, "s")[1].tolist() == [8, 0]
    with pytest.raises(CorruptStoreError, match=msg):
        parse_index(_with_index(b"x" * 8, entries), 2, "s/c/0/0/0/0")


def test_a_damaged_index_fails_its_crc32c_and_a_short_file_is_named():
    raw = bytearray(build_shard([b"abc", b"de"]))
    raw[-10] ^= 1
    with pytest.raises(CorruptStoreError, match=r"s/c/0: the shard index fails its crc32c"):
        parse_index(bytes(raw), 2, "s/c/0")
    raw = build_shard([b"abc", b"de"])
    with pytest.raises(CorruptStoreError, match=r"s/c/0: 41 bytes, shorter than the index of 3 rows \(52 bytes\)"):
        parse_index(raw, 3, "s/c/0")  # a shard of another shard's row count
    for cut in (1, len(raw) - 5, len(raw) - 1):
        with pytest.raises(CorruptStoreError):
            parse_index(raw[cut:], 2, "s") if cut > 1 else parse_index(raw[:-cut], 2, "s")


# -- ShardWriter -------------------------------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def _split_small_rows(monkeypatch):
    """LZ4 rows of these small frames are encoded on C threads, as an episode of real frames is."""
    monkeypatch.setattr(shard_module, "SPLIT_BYTES", 1)


def _writer(root, codec=None, rows: int = 4 * SHARD_ROWS) -> ShardWriter:
    array = _array(root, lz4_codec() if codec is None else codec, rows)
    return ShardWriter(array, open_backend(str(root)))


def _reopen(root) -> ShardWriter:
    """A new writer over the array as on disk (nothing held in memory)."""
    return ShardWriter(zarr.open_group(str(root), mode="r+")[PATH], open_backend(str(root)))


def _zarr_rows(root) -> np.ndarray:
    return zarr.open_array(str(root / PATH), mode="r")[:]


def test_rows_written_across_shard_boundaries_are_read_back_by_the_writer_and_by_zarr(tmp_path):
    w = _writer(tmp_path)
    rows = _frames_of(13)
    w.put(5, w.encode(rows).frames())  # rows 5..17: the tail of shard 0, all of shard 1, the head of shard 2
    np.testing.assert_array_equal(w.read(5, 18), rows)  # before flush: the rows being written
    assert not os.path.exists(_shard_file(tmp_path, 0))
    w.flush(fsync=True)
    assert sorted(os.listdir(tmp_path / PATH)) == ["c.0.0.0.0", "c.1.0.0.0", "c.2.0.0.0", "zarr.json"]  # no shard 3
    want = np.zeros((4 * SHARD_ROWS, *ROW), np.uint8)
    want[5:18] = rows
    np.testing.assert_array_equal(w.read(0, 4 * SHARD_ROWS), want)
    np.testing.assert_array_equal(_zarr_rows(tmp_path), want)
    with pytest.raises(IndexError, match="past its 32 rows"):
        w.read(30, 33)
    w.close()


def test_rows_written_into_a_shard_on_disk_keep_its_other_rows(tmp_path):
    w = _writer(tmp_path)
    first, second = _frames_of(3, seed=1), _frames_of(4, seed=2)
    w.put(0, w.encode(first).frames())
    w.flush(fsync=False)
    w.close()
    w = _reopen(tmp_path)
    w.put(3, w.encode(second).frames())  # a new handle: shard 0 is read from disk, then rewritten whole
    w.flush(fsync=False)
    np.testing.assert_array_equal(_zarr_rows(tmp_path)[:7], np.concatenate([first, second]))
    w.close()


@pytest.mark.parametrize("name", ["lz4", "zstd"])
def test_a_ring_overwrite_replaces_only_the_rows_written(tmp_path, name):
    w = _writer(tmp_path, CODECS[name]())
    old, new = _frames_of(4 * SHARD_ROWS, seed=3), _frames_of(11, seed=4)
    w.put(0, w.encode(old).frames())  # 32 rows: enough to be encoded across threads
    w.flush(fsync=False)
    w.put(6, w.encode(new).frames())  # rows 6..16 again, over shards 0, 1 and 2
    w.flush(fsync=False)
    want = old.copy()
    want[6:17] = new
    np.testing.assert_array_equal(_zarr_rows(tmp_path), want)
    np.testing.assert_array_equal(w.read(0, 4 * SHARD_ROWS), want)
    w.close()


def _held_threads(monkeypatch) -> threading.Event:
    """Make ShardWriter's encoder threads wait until the returned event is set (the calling thread does not; a test
    that fails before it sets the event lets them go after 300 s)."""
    real, go = ShardWriter._encode_part, threading.Event()

    def encode_part(self, rows):
        if threading.current_thread() is not threading.main_thread():
            go.wait(300)
        return real(self, rows)

    monkeypatch.setattr(ShardWriter, "_encode_part", encode_part)
    return go


def test_the_threads_share_of_the_rows_follows_who_finishes_first(tmp_path, monkeypatch):
    """The encoder pool's threads take a share of the rows (codecs but LZ4), read in place; it grows while they finish
    before their frames are asked for and shrinks while the calling thread waits for them, so that both finish
    together."""
    w = _writer(tmp_path, CODECS["zstd"](), rows=64 * SHARD_ROWS)
    if not w._threads:
        pytest.skip("one core: no encoder thread")
    rows = _frames_of(40, seed=7)
    start = w._threads / (w._threads + 1)  # an even split to start with
    pending = w.encode(rows)
    assert [(a, b) for _, a, b in pending._background][-1][1] == int(40 * start)
    assert len(pending._done) == 40 - int(40 * start)
    future = pending._background[0][0]
    future.result()  # the thread finished first: it takes more of the next rows
    np.testing.assert_array_equal(w.decode(pending.frames()), rows)
    assert w._balance.share == pytest.approx(start + STEP)
    go = _held_threads(monkeypatch)
    observe = w._balance.observe

    def observe_then_go(threads_first: bool) -> None:  # the thread runs on once frames() found its share not done
        observe(threads_first)
        go.set()

    monkeypatch.setattr(w._balance, "observe", observe_then_go)
    pending = w.encode(rows)
    np.testing.assert_array_equal(w.decode(pending.frames()), rows)  # waited for: it takes less
    assert w._balance.share == pytest.approx(start)
    w.close()


def test_a_share_no_thread_has_started_is_encoded_by_the_calling_thread(tmp_path, monkeypatch):
    w = _writer(tmp_path, CODECS["zstd"](), rows=64 * SHARD_ROWS)
    if not w._threads:
        pytest.skip("one core: no encoder thread")
    go = _held_threads(monkeypatch)
    rows = _frames_of(40, seed=9)
    first, second = w.encode(rows), w.encode(rows[::-1])  # the second's share queues behind the held first
    np.testing.assert_array_equal(w.decode(second.frames()), rows[::-1])  # not waited for
    assert second._frames is not None and not first._background[0][0].done()
    go.set()
    np.testing.assert_array_equal(w.decode(first.frames()), rows)
    w.close()


def test_a_share_whose_thread_fails_is_encoded_again_and_wait_lets_go_of_the_rows(tmp_path, monkeypatch):
    w = _writer(tmp_path, CODECS["zstd"]())
    if not w._threads:
        pytest.skip("one core: no encoder thread")
    real, failures = ShardWriter._encode_part, {"left": 0}

    def encode_part(self, rows):
        if failures["left"] > 0 and threading.current_thread() is not threading.main_thread():
            failures["left"] -= 1
            raise MemoryError("no memory for the encoded rows")
        return real(self, rows)

    monkeypatch.setattr(ShardWriter, "_encode_part", encode_part)
    rows = _frames_of(2 * SHARD_ROWS, seed=8)
    failures["left"] = 1  # the thread's share fails: the calling thread encodes it again
    pending = w.encode(rows)
    assert pending._background
    np.testing.assert_array_equal(w.decode(pending.frames()), rows)
    pending = w.encode(rows)
    pending.wait()  # an append that failed: the thread is done with the rows, and nothing holds them
    assert pending._rows is None and all(f.done() for f, _, _ in pending._background)
    w.close()


def test_lz4_rows_are_encoded_on_c_threads_the_caller_joins(tmp_path, monkeypatch):
    """LZ4 rows go to C threads that start before encode() returns (the rows read in place, held until frames()); a
    task that fails is done again by the calling thread; wait() leaves no thread reading the rows."""
    w = _writer(tmp_path, rows=64 * SHARD_ROWS)
    if not w._threads:
        pytest.skip("one core: no encoder thread")
    rows = _frames_of(40, seed=7)
    pending = w.encode(rows)
    assert pending._task is not None and pending._rows is rows  # in place, no copy
    np.testing.assert_array_equal(w.decode(pending.frames()), rows)
    assert pending._task is None and pending._rows is None
    real, tasks = _kernels.encode_lz4_start, []

    def failing_start(*args):
        tasks.append(real(*args))
        return FailingTask(tasks[-1])

    monkeypatch.setattr(_kernels, "encode_lz4_start", failing_start)
    pending = w.encode(rows[::-1])
    np.testing.assert_array_equal(w.decode(pending.frames()), rows[::-1])  # encoded again by the caller
    pending = w.encode(rows)
    pending.wait()  # an append that failed: its threads are done with the rows, and nothing holds them
    assert pending._rows is None and pending._task is None and all(t.done() for t in tasks) and len(tasks) == 2


def test_flush_replaces_a_shard_whole_and_a_reader_holding_the_old_file_reads_the_old_rows(tmp_path):
    w = _writer(tmp_path)
    old, new = _frames_of(SHARD_ROWS, seed=5), _frames_of(2, seed=6)
    w.put(0, w.encode(old[:6]).frames())
    w.flush(fsync=False)
    path = _shard_file(tmp_path, 0)
    inode = os.stat(path).st_ino
    with open(path, "rb") as held:
        w.put(2, w.encode(new).frames())  # rows 2, 3 again
        w.put(6, w.encode(old[6:]).frames())
        w.flush(fsync=False)
        assert os.stat(path).st_ino != inode  # renamed into place, never written in place
        raw = held.read()
    offsets, nbytes = parse_index(raw, SHARD_ROWS, path)
    assert (offsets[6:] == -1).all()  # the old file: only its six rows
    codec = w.codec
    for r in range(6):
        out = np.empty(ROW, np.uint8)
        codec.decode(raw[offsets[r] : offsets[r] + nbytes[r]], out)
        np.testing.assert_array_equal(out, old[r])
    want = old.copy()
    want[2:4] = new
    np.testing.assert_array_equal(_zarr_rows(tmp_path)[:SHARD_ROWS], want)
    assert sorted(os.listdir(os.path.dirname(path))) == ["c.0.0.0.0", "zarr.json"]  # no temp file left
    w.close()


def test_a_damaged_shard_on_disk_is_a_corrupt_store_for_the_writer(tmp_path):
    w = _writer(tmp_path)
    w.put(0, w.encode(_frames_of(4)).frames())
    w.flush(fsync=False)
    w.close()
    path = Path(_shard_file(tmp_path, 0))
    raw = bytearray(path.read_bytes())
    raw[0] ^= 0xFF  # the first row's LZ4 header: the index still checks
    path.write_bytes(bytes(raw))
    w = _reopen(tmp_path)
    with pytest.raises(CorruptStoreError, match=r"c\.0\.0\.0\.0: row 0 cannot be decoded"):
        w.read(0, 4)
    path.write_bytes(bytes(raw[:-3]))
    with pytest.raises(CorruptStoreError, match="crc32c"):
        w.put(4, w.encode(_frames_of(1)).frames())  # appending into it reads its index first
    w.close()


# -- her_store._kernels ------------------------------------------------------------------------------------------------
DST3, DST5 = np.arange(3, dtype=np.int64), np.arange(5, dtype=np.int64)  # pread_lz4 decodes row i into out[i]


def _lz4_rows(n: int) -> tuple[bytes, np.ndarray, np.ndarray, np.ndarray]:
    rows = _frames_of(n)
    encoded = _kernels.encode_lz4(rows, ROW_NBYTES, 1)
    assert isinstance(encoded, list) and all(type(f) is bytes for f in encoded)
    nbytes = np.array([len(f) for f in encoded], np.int64)
    return b"".join(encoded), np.cumsum(nbytes) - nbytes, nbytes, rows


def test_encode_lz4_writes_numcodecs_lz4_and_the_decoders_read_it(tmp_path):
    blob, offsets, nbytes, rows = _lz4_rows(5)
    for i in range(5):  # each row: what numcodecs.lz4 itself writes and reads
        np.testing.assert_array_equal(
            np.frombuffer(numcodecs.lz4.decompress(blob[offsets[i] : offsets[i] + nbytes[i]]), np.uint8),
            rows[i].ravel(),
        )
    out = np.full((5, *ROW), 7, np.uint8)
    assert _kernels.decode_lz4(blob, offsets, nbytes, out, ROW_NBYTES) == (-1, 0)
    np.testing.assert_array_equal(out, rows)
    (tmp_path / "f").write_bytes(b"pad" + blob)
    with open(tmp_path / "f", "rb") as f:
        out[:] = 7
        fds = np.full(5, f.fileno(), np.int32)
        assert _kernels.pread_lz4(fds, offsets + 3, nbytes, DST5, out, ROW_NBYTES)[:2] == (-1, 0)
        np.testing.assert_array_equal(out, rows)
        mapping = _kernels.map_file(f.fileno(), 3, len(blob))
        out[:] = 7
        slots = np.zeros(5, np.int32)
        assert _kernels.map_lz4((mapping,), slots, offsets, nbytes, DST5, out, ROW_NBYTES)[:2] == (-1, 0)
        np.testing.assert_array_equal(out, rows)
        nbytes[2] = -1  # a row never written is not a row to decode: the gathers ask only for committed rows
        assert _kernels.pread_lz4(fds, offsets + 3, nbytes, DST5, out, ROW_NBYTES)[:2] == (2, 0)
        assert _kernels.map_lz4((mapping,), slots, offsets, nbytes, DST5, out, ROW_NBYTES)[:2] == (2, 0)
    assert _kernels.decode_lz4(blob, offsets, nbytes, out, ROW_NBYTES) == (2, 0)


def test_encode_lz4_refuses_buffers_that_are_not_whole_rows():
    for rows, row_nbytes, why in (
        (b"x" * 10, 3, "whole rows"),
        (b"x" * 10, 0, "row_nbytes must be"),
        (b"x" * 10, -1, "row_nbytes must be"),
        (b"x" * 10, 1 << 31, "row_nbytes must be"),
        (np.zeros((4, 3, 5), np.uint8)[:, :, :4], 12, "each C-contiguous"),  # rows that are not contiguous
        (np.zeros((4, 3, 5), np.uint8), 12, "whole rows"),  # contiguous rows of another size
    ):
        with pytest.raises(ValueError, match=why):
            _kernels.encode_lz4(rows, row_nbytes, 1)
    with pytest.raises(TypeError):
        _kernels.encode_lz4([1, 2, 3], 3, 1)
    assert _kernels.encode_lz4(b"", 3, 1) == []


@pytest.mark.parametrize(
    "take",
    [lambda a: a[1:7, 2], lambda a: a[::-2, 0], lambda a: a[3:4, 1], lambda a: np.broadcast_to(a[0, 0], (5, *ROW))],
)
def test_encode_lz4_reads_rows_taken_at_a_stride_in_place(take):
    """An env's frames in a StepWriter's (step, env, ...) buffer: each row contiguous, the rows a stride apart."""
    rows = take(np.random.default_rng(0).integers(0, 9, (8, 3, *ROW), np.uint8))
    assert not rows.flags.c_contiguous or len(rows) == 1  # (a broadcast: one row, repeated at stride 0)
    encoded = _kernels.encode_lz4(rows, ROW_NBYTES, 1)
    decoded = [np.frombuffer(numcodecs.lz4.decompress(f), np.uint8).reshape(ROW).tolist() for f in encoded]
    assert decoded == rows.tolist()


def test_encode_lz4_packs_rows_of_any_compressibility_in_threads_at_once():
    """Rows are packed one after the other into a buffer each thread keeps between calls (grown past what it keeps for
    a large call): threads encoding at once, incompressible rows past that size, and a kept buffer reused all give
    each row's own bytes."""
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(0)
    calls = [
        rng.integers(0, 256, (150, 64, 1024), np.uint8),  # 9.6 MB that LZ4 cannot shrink: past the 8 MiB kept
        rng.integers(0, 3, (40, 64, 1024), np.uint8),  # rows that shrink, into a buffer a larger call grew
        np.zeros((1, 64, 1024), np.uint8),
        rng.integers(0, 256, (3, 64, 1024), np.uint8)[::-1],
    ]

    def encode(rows: np.ndarray) -> list[bytes]:
        return _kernels.encode_lz4(rows, rows[0].nbytes, 1)

    want = [encode(rows) for rows in calls]  # one thread, one call after another
    for rows, frames in zip(calls, want):
        assert [numcodecs.lz4.decompress(f) for f in frames] == [r.tobytes() for r in rows]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(3):
            assert list(pool.map(encode, calls * 4)) == want * 4


def test_encode_lz4_start_encodes_on_threads_of_its_own_and_holds_the_rows_until_then():
    """The task encodes while the caller goes on; wait() gives what encode_lz4 gives (again when asked again), whatever
    the threads, the rows' stride or compressibility (rows that grow a thread's buffer); the rows cannot change size
    until the task is waited for or dropped (its threads end first)."""
    rng = np.random.default_rng(3)
    calls = [
        _frames_of(2_000, seed=3),
        _frames_of(600, seed=4)[::-3],  # taken at a stride, read in place
        rng.integers(0, 256, (300, 64, 1024), np.uint8),  # 19.7 MB that LZ4 cannot shrink
        np.zeros((0, *ROW), np.uint8),
    ]
    for rows in calls:
        want = _kernels.encode_lz4(rows, rows[0].nbytes if len(rows) else ROW_NBYTES, 1)
        for threads in (1, 3, 64):
            task = _kernels.encode_lz4_start(rows, rows[0].nbytes if len(rows) else ROW_NBYTES, 1, threads)
            assert task.wait() == want and task.done() and task.wait() == want
    blob = bytearray(_frames_of(2_000, seed=5).tobytes())
    want = _kernels.encode_lz4(blob, ROW_NBYTES, 1)
    task = _kernels.encode_lz4_start(blob, ROW_NBYTES, 1)
    with pytest.raises(BufferError):  # the task holds the rows: they cannot change size under its threads
        blob += b"x" * ROW_NBYTES
    assert task.wait() == want
    blob += b"x" * ROW_NBYTES  # waited for: the rows are let go
    task = _kernels.encode_lz4_start(blob, ROW_NBYTES, 1, 2)
    del task  # dropped unwaited: its threads end before the rows go
    blob += b"x" * ROW_NBYTES
    for args, error, words in (
        ((blob, ROW_NBYTES, 1, 0), ValueError, "threads must be"),
        ((blob, ROW_NBYTES, 1, 65), ValueError, "threads must be"),
        ((blob, ROW_NBYTES, 1, 2**32 + 3), ValueError, "threads must be"),  # not taken as 3
        ((blob, ROW_NBYTES, 1, -(2**32) + 2), ValueError, "threads must be"),
        ((blob, ROW_NBYTES, 1, "2"), TypeError, "integer"),
        ((blob, 5, 1), ValueError, "whole rows"),
        ((np.zeros((4, 3, 5), np.uint8)[:, :, :4], 12, 1), ValueError, "each C-contiguous"),
    ):
        with pytest.raises(error, match=words):
            _kernels.encode_lz4_start(*args)


def test_an_encode_task_waited_for_from_many_threads_and_in_a_forked_child():
    """wait() from two threads: one joins, both get the rows. A forked child has none of the task's threads: its
    wait() gives every row or raises, never a list with rows missing."""
    rows = _frames_of(30_000, seed=6)
    want = _kernels.encode_lz4(rows, ROW_NBYTES, 1)
    task = _kernels.encode_lz4_start(rows, ROW_NBYTES, 1)
    answers: list[list[bytes]] = []
    threads = [threading.Thread(target=lambda: answers.append(task.wait())) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and answers == [want, want]
    for waiting in (False, True):  # another thread of the parent inside wait() when it forks (its lock held)
        task = _kernels.encode_lz4_start(rows, ROW_NBYTES, 1)
        waiter = threading.Thread(target=task.wait)
        if waiting:
            waiter.start()
        pid = os.fork()
        if pid == 0:  # the child: exit 0 when the answer is every row or an error, 1 otherwise; a hang is killed
            signal.alarm(120)
            try:
                ok = task.wait() == want
            except RuntimeError as e:
                ok = "threads are gone" in str(e)
            os._exit(0 if ok and task.done() else 1)  # no thread of it runs here
        assert os.waitpid(pid, 0)[1] == 0, f"waiting: {waiting}"
        assert task.wait() == want
        if waiting:
            waiter.join()


def test_take_rows_copies_rows_of_a_mapping_and_fails_one_the_file_no_longer_has(tmp_path):
    """An uncompressed chunk's gather: out[i] = row rows[i] - first of the mapping (rows from ``skip`` on), as numpy's
    take; a row outside it fails (errno 0), and one past the end of a file cut short in place under its mapping fails
    with EIO, the rows before it copied (numpy's copy raised SIGBUS, which ended the process)."""
    import mmap

    row_nbytes, skip = 1000, 24
    data = np.random.default_rng(2).integers(0, 256, 40 * row_nbytes, np.uint8)
    (tmp_path / "f").write_bytes(bytes(skip) + data.tobytes())
    table = data.reshape(40, row_nbytes)
    rows = np.array([7, 3, 3, 39, 0], np.int64) + 100  # rows of a chunk starting at row 100
    out = np.zeros((5, row_nbytes), np.uint8)
    with open(tmp_path / "f", "r+b") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        assert _kernels.take_rows(m, rows, 100, skip, out, row_nbytes) == (-1, 0)
        np.testing.assert_array_equal(out, table[rows - 100])
        assert _kernels.take_rows(m, np.array([101, 140], np.int64), 100, skip, out, row_nbytes) == (1, 0)  # outside
        assert _kernels.take_rows(m, np.array([101, 99], np.int64), 100, skip, out, row_nbytes) == (1, 0)
        for args in (
            (m, rows.astype(np.int32)[:3], 100, skip, out, row_nbytes),  # not int64 rows
            (m, rows, 100, skip, out[:4], row_nbytes),  # out too small
            (m, rows, 100, len(m) + 1, out, row_nbytes),  # skip past the mapping
            (m, rows, 100, skip, out, 0),
            (m, rows, 100, skip, out, row_nbytes, np.array([0, 1], np.int64)),  # at: not one per row
        ):
            with pytest.raises(ValueError, match=r"rows \(and at\) must be int64"):
                _kernels.take_rows(*args)
        out[:] = 0
        assert _kernels.take_rows(m, rows, 100, skip, out, row_nbytes, np.array([4, 3, 2, 1, 0])) == (-1, 0)
        np.testing.assert_array_equal(out[::-1], table[rows - 100])  # row i into out[at[i]]
        assert _kernels.take_rows(m, rows, 100, skip, out, row_nbytes, np.array([0, 1, 2, 3, 5])) == (4, 0)  # outside
        # at sharing memory with out, each entry checked as it is used: a row copied over the next entry (a huge
        # value) fails that row, rather than writing far outside out (a segmentation fault)
        huge = np.full(8, 2**44, np.int64).view(np.uint8)
        (tmp_path / "g").write_bytes(huge.tobytes() * 2)
        with open(tmp_path / "g", "rb") as g:
            rows8 = mmap.mmap(g.fileno(), 0, access=mmap.ACCESS_READ)
            into = np.zeros(16, np.int64)
            into[:2] = [1, 0]  # at = into[:2]: row 0 goes to into[1], which is at[1]
            got = _kernels.take_rows(rows8, np.array([0, 1], np.int64), 0, 0, into.view(np.uint8), 8, into[:2])
            assert got == (1, 0)
            del rows8
        m.madvise(mmap.MADV_DONTNEED)
        os.ftruncate(f.fileno(), skip + 20 * row_nbytes)  # rows 20.. gone; row 19 ends on the last page kept
        big = np.arange(40, dtype=np.int64) + 100
        out = np.zeros((40, row_nbytes), np.uint8)
        failed, err = _kernels.take_rows(m, big, 100, skip, out, row_nbytes)
        assert err == errno.EIO and 20 <= failed <= 24  # the first row on a page past the end
        np.testing.assert_array_equal(out[:failed], table[:failed])
        assert _kernels.take_rows(m, big[:3], 100, skip, out, row_nbytes) == (-1, 0)
        assert _kernels.take_rows(m, big[30:33], 100, skip, out, row_nbytes) == (0, errno.EIO)
        del m


def test_decode_lz4_refuses_bad_arguments():
    blob, offsets, nbytes, _ = _lz4_rows(3)
    out = np.empty((3, *ROW), np.uint8)
    bad = [
        ((blob, offsets, nbytes, out[:2], ROW_NBYTES), ValueError, "out is smaller"),
        ((blob, offsets[:2], nbytes, out, ROW_NBYTES), ValueError, "one entry per row"),
        ((blob, offsets.astype(np.int32), nbytes, out, ROW_NBYTES), ValueError, "one entry per row"),
        ((blob, offsets.tobytes()[:-1], nbytes, out, ROW_NBYTES), ValueError, "one entry per row"),
        ((blob, offsets, nbytes, out, 0), ValueError, "row_nbytes must be positive"),
        ((blob, offsets, nbytes, out, -ROW_NBYTES), ValueError, "row_nbytes must be positive"),
        ((blob, offsets, nbytes, out, 1 << 40), ValueError, "row_nbytes must be positive"),
        ((blob, offsets, nbytes, bytes(out), ROW_NBYTES), TypeError, ""),  # out read-only
        (
            (blob, offsets, nbytes, np.empty((3, 3, 8, 16), np.uint8)[..., ::2], ROW_NBYTES),
            (TypeError, BufferError),
            "",
        ),
        ((None, offsets, nbytes, out, ROW_NBYTES), TypeError, ""),
    ]
    for args, error, msg in bad:
        with pytest.raises(error, match=msg):
            _kernels.decode_lz4(*args)


@pytest.mark.parametrize(
    "change",
    ["negative offset", "offset past the source", "range past the source", "huge nbytes", "header", "short block",
     "long block", "garbage"],
)
def test_decode_lz4_and_pread_lz4_report_the_first_bad_row(tmp_path, change):
    blob, offsets, nbytes, rows = _lz4_rows(3)
    src = bytearray(blob)
    i = 1
    if change == "negative offset":
        offsets[i] = -5
    elif change == "offset past the source":
        offsets[i] = len(blob) + 10
    elif change == "range past the source":
        nbytes[i] = len(blob) - offsets[i] + 1
    elif change == "huge nbytes":
        nbytes[i] = 1 << 62
    elif change == "header":
        src[offsets[i]] ^= 1
    elif change in ("short block", "long block"):
        n = ROW_NBYTES - 92 if change == "short block" else ROW_NBYTES + 100
        extra = _lz4_block_claiming_a_row(n)
        offsets[i], nbytes[i] = len(src), len(extra)
        src += extra
    else:
        src[offsets[i] + 4 : offsets[i] + nbytes[i]] = b"\xff" * (int(nbytes[i]) - 4)
    out = np.zeros((3, *ROW), np.uint8)
    failed, err = _kernels.decode_lz4(bytes(src), offsets, nbytes, out, ROW_NBYTES)
    assert (failed, err) == (i, 0)
    np.testing.assert_array_equal(out[0], rows[0])
    (tmp_path / "f").write_bytes(bytes(src))
    with open(tmp_path / "f", "rb") as f:
        mapping = _kernels.map_file(f.fileno(), 0, len(src))
        failed, err, _ = _kernels.pread_lz4(np.full(3, f.fileno(), np.int32), offsets, nbytes, DST3, out, ROW_NBYTES)
    slots = np.zeros(3, np.int32)
    for decoded in (  # from the mapped file: checked against the mapping's length, as decode_lz4 against its source
        _kernels.map_lz4((mapping,), slots, offsets, nbytes, DST3, out, ROW_NBYTES),
        _kernels.map_lz4_start((mapping,), slots, offsets, nbytes, DST3, out, ROW_NBYTES).wait(),
    ):
        assert decoded[:2] == (i, 0)
    assert failed == i
    # past the end of the file pread reads nothing: an I/O error; anything else is not one row's block
    assert err == (errno.EIO if change in ("offset past the source", "range past the source") else 0)


def test_pread_lz4_reports_a_closed_fd_a_short_file_and_bad_arguments(tmp_path):
    blob, offsets, nbytes, rows = _lz4_rows(3)
    (tmp_path / "f").write_bytes(blob)
    out = np.zeros((3, *ROW), np.uint8)
    with open(tmp_path / "f", "rb") as f:
        fds = np.full(3, f.fileno(), np.int32)
        with pytest.raises(ValueError, match="one entry per row"):
            _kernels.pread_lz4(fds[:2], offsets, nbytes, DST3, out, ROW_NBYTES)
        with pytest.raises(ValueError, match="out is smaller"):
            _kernels.pread_lz4(fds, offsets, nbytes, DST3, out[:1], ROW_NBYTES)
    assert _kernels.pread_lz4(fds, offsets, nbytes, DST3, out, ROW_NBYTES)[:2] == (0, errno.EBADF)
    fds[:] = -1
    nbytes[:] = -1  # a row never written fails before its (absent) file is read
    assert _kernels.pread_lz4(fds, offsets, nbytes, DST3, out, ROW_NBYTES)[:2] == (0, 0)
    _, offsets, nbytes, _ = _lz4_rows(3)
    (tmp_path / "f").write_bytes(blob[: offsets[2] + 3])  # the file cut inside the last row
    with open(tmp_path / "f", "rb") as f:
        fds[:] = f.fileno()
        assert _kernels.pread_lz4(fds, offsets, nbytes, DST3, out, ROW_NBYTES)[:2] == (2, errno.EIO)
    np.testing.assert_array_equal(out[:2], rows[:2])


def test_pread_lz4_reads_adjacent_rows_together_into_the_rows_dst_names(tmp_path):
    """Rows that follow each other in a file are one read (one run); each lands in the row of ``out`` its dst names."""
    blob, offsets, nbytes, rows = _lz4_rows(5)
    (tmp_path / "f").write_bytes(blob)
    dst = np.array([4, 2, 0, 1, 3], np.int64)
    out = np.zeros((5, *ROW), np.uint8)
    with open(tmp_path / "f", "rb") as f:
        fds = np.full(5, f.fileno(), np.int32)
        assert _kernels.pread_lz4(fds, offsets, nbytes, dst, out, ROW_NBYTES)[:2] == (-1, 0)
        np.testing.assert_array_equal(out[dst], rows)
        for bad in (np.array([0, 1, 2, 3, 5]), np.array([0, 1, -1, 3, 4]), np.arange(4)):
            with pytest.raises(ValueError, match="dst"):
                _kernels.pread_lz4(fds, offsets, nbytes, bad.astype(np.int64), out, ROW_NBYTES)
        nbytes[3] += 1  # a row whose range runs into the next: the run reads on, the row fails to decode
        failed, err, _ = _kernels.pread_lz4(fds, offsets, nbytes, dst, out, ROW_NBYTES)
        assert (failed, err) == (3, 0)


def test_map_file_maps_bytes_of_a_file_without_keeping_a_descriptor(tmp_path):
    """A mapping holds the bytes it was given (from any offset: mappings start on a page), not the file: it stays
    readable once the file is closed and replaced by a rename, as a commit replaces a shard. The compiled mapping
    holds no descriptor; the pure one holds the duplicate Python's mmap keeps (by which it sees the file's size)."""
    data = np.random.default_rng(0).integers(0, 256, 3 * 4096 + 100, np.uint8).tobytes()
    (tmp_path / "f").write_bytes(data)
    before = len(os.listdir("/proc/self/fd"))
    with open(tmp_path / "f", "rb") as f:
        mappings = [(a, n, _kernels.map_file(f.fileno(), a, n)) for a, n in ((0, len(data)), (4097, 5000), (8191, 1))]
    assert len(os.listdir("/proc/self/fd")) == before + (0 if _kernels.COMPILED else len(mappings))
    (tmp_path / "g").write_bytes(b"another file")
    os.replace(tmp_path / "g", tmp_path / "f")
    for a, n, m in mappings:
        assert len(m) == n and bytes(memoryview(m)) == data[a : a + n]
        assert memoryview(m).readonly
    mappings[0][2].drop_pages()  # its pages go from this process; reading them again reads the file's
    assert bytes(memoryview(mappings[0][2])[-5:]) == data[-5:]
    with open(tmp_path / "f", "rb") as f:
        size = len(b"another file")
        for a, n, why in ((-1, 10, "offset >= 0"), (0, 0, "at least one byte"), (0, -5, "at least one byte"),
                          (0, size + 1, "past the end"), (size, 1, "past the end"), (1 << 62, 1, "past the end")):
            with pytest.raises(ValueError, match=why):
                _kernels.map_file(f.fileno(), a, n)
    with pytest.raises(OSError) as e:
        _kernels.map_file(-1, 0, 10)
    assert e.value.errno == errno.EBADF


@pytest.mark.slow
def test_map_lz4_fails_the_row_of_a_file_cut_short_under_its_mapping(tmp_path):
    """A mapped file cut short in place (by another process): reading a page past its new end raised SIGBUS, which
    killed the process; the row now fails with EIO, as pread's short read does, and SIGBUS elsewhere is untouched."""
    import subprocess
    import sys

    rows = np.random.default_rng(0).integers(0, 256, (40, 3, 64, 64), np.uint8)  # 12 KiB rows LZ4 cannot shrink
    row_nbytes = rows[0].nbytes
    encoded = _kernels.encode_lz4(rows, row_nbytes, 1)
    nbytes = np.array([len(f) for f in encoded], np.int64)
    offsets = np.cumsum(nbytes) - nbytes
    (tmp_path / "f").write_bytes(b"".join(encoded))
    cut = 20 * 4096
    first_past = int(np.searchsorted(offsets + nbytes, cut + 1))  # the first row with a byte past the cut
    out = np.zeros_like(rows)
    args = (np.zeros(40, np.int32), offsets, nbytes, np.arange(40), out, row_nbytes)
    with open(tmp_path / "f", "r+b") as f:
        mapping = _kernels.map_file(f.fileno(), 0, int(nbytes.sum()))
        assert _kernels.map_lz4((mapping,), *args) == (-1, 0, 0)
        mapping.drop_pages()
        os.ftruncate(f.fileno(), cut)
        for start in (False, True):
            got = _kernels.map_lz4_start((mapping,), *args).wait() if start else _kernels.map_lz4((mapping,), *args)
            assert got[:2] == (first_past, errno.EIO)
            np.testing.assert_array_equal(out[:first_past], rows[:first_past])
    # outside a decode, SIGBUS does what it did before: end the process, be ignored, or run Python's handler
    decode = "from her_store import _kernels; _kernels.map_lz4((b'',), b'', b'', b'', b'', bytearray(1), 1)"
    for before, returncode, said in (
        ("pass", -signal.SIGBUS, b""),
        ("signal.signal(signal.SIGBUS, signal.SIG_IGN)", 0, b"on"),
        ("signal.signal(signal.SIGBUS, lambda *_: print('handled'))", 0, b"handled\non"),
    ):
        code = f"import os, signal; {before}; {decode}; os.kill(os.getpid(), signal.SIGBUS); print('on')"
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, check=False)
        assert (done.returncode, done.stdout.strip()) == (returncode, said), done.stderr
    # a real fault outside a decode, faulthandler enabled before or after one (its handler and ours had called each
    # other forever): one report, and the process ends
    fault = (
        "import mmap, os; f = open({path!r}, 'r+b'); m = mmap.mmap(f.fileno(), 0); os.ftruncate(f.fileno(), 0); m[0]"
    ).format(path=str(tmp_path / "g"))
    for order in ("faulthandler.enable(); " + decode, decode + "; faulthandler.enable(); " + decode):
        (tmp_path / "g").write_bytes(bytes(8192))
        code = f"import faulthandler; {order}; {fault}"
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, check=False, timeout=120)
        assert done.returncode == -signal.SIGBUS, done.stderr[-2000:]
        assert done.stderr.count(b"Fatal Python error: Bus error") == 1, done.stderr[-2000:]


_SIGBUS_DURING_DECODES = """
import os, signal, sys, threading, time
import numpy as np
from her_store import _kernels

path, mode = sys.argv[1], sys.argv[2]
row = 64 << 10
rows = np.random.default_rng(0).integers(0, 256, (256, row), np.uint8)  # rows LZ4 cannot shrink: 16 MiB
encoded = _kernels.encode_lz4(rows, row, 1)
nbytes = np.array([len(f) for f in encoded], np.int64)
with open(path, "wb") as f:
    f.write(b"".join(encoded))
f = open(path, "r+b")
mapping = _kernels.map_file(f.fileno(), 0, int(nbytes.sum()))
args = (np.zeros(256, np.int32), np.cumsum(nbytes) - nbytes, nbytes, np.arange(256), np.zeros_like(rows), row)
seen = []
signal.signal(signal.SIGBUS, lambda *_: seen.append(1))
answers, stop = [], threading.Event()

def decode():
    while not stop.is_set():
        answers.append(_kernels.map_lz4((mapping,), *args)[:2])

def decoded(n):  # until the thread has answered n decodes
    while len(answers) < n:
        time.sleep(0.01)

thread = threading.Thread(target=decode)
thread.start()
decoded(1)  # decoding, one call after the other, until stopped
if mode == "sent":  # signals sent to the decoding thread: not a fault of its maps
    for _ in range(5):
        signal.pthread_kill(thread.ident, signal.SIGBUS)
        time.sleep(0.05)
    stop.set()
    thread.join()
    time.sleep(0.1)
    print(set(answers) == {(-1, 0)}, len(seen) > 0)
else:  # a signal to the process, then the file cut short under the decodes: they still fail a row with EIO
    os.kill(os.getpid(), signal.SIGBUS)
    os.ftruncate(f.fileno(), 4096)
    decoded(len(answers) + 2)  # the last one began after the cut
    stop.set()
    thread.join()
    time.sleep(0.1)
    print(answers[-1][1] == 5, len(seen) > 0)
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sent", pytest.param("stray then cut", marks=requires_compiled)])
def test_a_sigbus_a_process_sends_during_decodes_reaches_its_handler_and_leaves_the_guard(tmp_path, mode):
    """A SIGBUS sent (not a fault) to a decoding thread failed a good row with EIO and was lost; one sent to the
    process put the old disposition back under decodes still running, so a map cut short then killed the process
    (or faulted forever). Now only a fault inside a decode's maps fails a row: signals reach their handler."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _SIGBUS_DURING_DECODES, str(tmp_path / "f"), mode.split()[0]],
        capture_output=True, check=False, timeout=120,
    )
    assert (done.returncode, done.stdout.split()) == (0, [b"True", b"True"]), done.stderr[-2000:]


def test_map_lz4_decodes_rows_of_many_maps_and_refuses_bad_arguments(tmp_path):
    blob_a, offsets_a, nbytes_a, rows_a = _lz4_rows(3)
    rows_b = _frames_of(2, seed=1)
    encoded_b = _kernels.encode_lz4(rows_b, ROW_NBYTES, 1)
    blob_b = b"".join(encoded_b)
    nbytes_b = np.array([len(f) for f in encoded_b], np.int64)
    offsets_b = np.cumsum(nbytes_b) - nbytes_b
    maps = (blob_a, blob_b)  # any buffers: mappings in the reader
    slots = np.array([1, 0, 0, 1, 0], np.int32)
    offsets = np.array([offsets_b[1], offsets_a[0], offsets_a[2], offsets_b[0], offsets_a[1]], np.int64)
    nbytes = np.array([nbytes_b[1], nbytes_a[0], nbytes_a[2], nbytes_b[0], nbytes_a[1]], np.int64)
    dst = np.array([0, 4, 1, 3, 2], np.int64)
    want = np.stack([rows_b[1], rows_a[2], rows_a[1], rows_b[0], rows_a[0]])
    out = np.zeros((5, *ROW), np.uint8)
    assert _kernels.map_lz4(maps, slots, offsets, nbytes, dst, out, ROW_NBYTES) == (-1, 0, 0)
    np.testing.assert_array_equal(out, want)
    bad = [
        ((list(maps), slots, offsets, nbytes, dst, out, ROW_NBYTES), TypeError, ""),  # maps: a tuple
        ((maps + (3,), slots, offsets, nbytes, dst, out, ROW_NBYTES), TypeError, ""),  # of buffers
        ((maps, np.array([1, 0, 0, 2, 0], np.int32), offsets, nbytes, dst, out, ROW_NBYTES), ValueError, "slot"),
        ((maps, np.array([1, 0, -1, 1, 0], np.int32), offsets, nbytes, dst, out, ROW_NBYTES), ValueError, "slot"),
        ((maps, slots.astype(np.int64), offsets, nbytes, dst, out, ROW_NBYTES), ValueError, "one entry per row"),
        ((maps, slots, offsets, nbytes, dst + 1, out, ROW_NBYTES), ValueError, "dst"),
        ((maps, slots, offsets, nbytes, dst[:4], out, ROW_NBYTES), ValueError, "one entry per row"),
        ((maps, slots, offsets, nbytes, dst, out[:4], ROW_NBYTES), ValueError, "out is smaller"),
        ((maps, slots, offsets, nbytes, dst, bytes(out), ROW_NBYTES), TypeError, ""),  # out read-only
        ((maps, slots, offsets, nbytes, dst, out, 0), ValueError, "row_nbytes"),
    ]
    for args, error, msg in bad:
        for call in (_kernels.map_lz4, _kernels.map_lz4_start):
            with pytest.raises(error, match=msg):
                call(*args)


def test_map_lz4_start_decodes_on_a_thread_of_its_own_and_holds_its_buffers_until_then():
    """The task decodes while the caller goes on; wait() gives what map_lz4 gives (again when asked again), and a task
    dropped unwaited still ends before its buffers go (its out is complete). With several threads, they and the
    waiting caller share the rows."""
    rows = _frames_of(2_000, seed=3)
    encoded = _kernels.encode_lz4(rows, ROW_NBYTES, 1)
    nbytes = np.array([len(f) for f in encoded], np.int64)
    offsets = np.cumsum(nbytes) - nbytes
    blob = bytearray(b"".join(encoded))
    slots, dst = np.zeros(len(rows), np.int32), np.arange(len(rows), dtype=np.int64)
    out = np.zeros_like(rows)
    task = _kernels.map_lz4_start((blob,), slots, offsets, nbytes, dst, out, ROW_NBYTES)
    with pytest.raises(BufferError):  # the task holds the source: it cannot change size under the decoding thread
        blob += b"x"
    assert task.wait() == (-1, 0, 0) and task.done() and task.wait() == (-1, 0, 0)
    np.testing.assert_array_equal(out, rows)
    blob += b"x"  # waited for: the source is let go
    out = np.zeros_like(rows)
    task = _kernels.map_lz4_start((blob,), slots, offsets, nbytes, dst, out, ROW_NBYTES)
    del task
    np.testing.assert_array_equal(out, rows)
    for threads in (1, 3, 64):  # threads and the waiting caller share the rows, each taking those not taken yet
        out = np.zeros_like(rows)
        got = _kernels.map_lz4_start((blob,), slots, offsets, nbytes, dst, out, ROW_NBYTES, threads).wait()
        assert got == (-1, 0, 0)
        np.testing.assert_array_equal(out, rows)
    nbytes[[1500, 700]] += 1  # two rows that do not decode: the first is named, whichever thread met it
    for threads in (1, 3):
        got = _kernels.map_lz4_start((blob,), slots, offsets, nbytes, dst, out, ROW_NBYTES, threads).wait()
        assert got[:2] == (700, 0)
    for threads, error in ((0, ValueError), (65, ValueError), ("2", TypeError)):
        with pytest.raises(error):
            _kernels.map_lz4_start((blob,), slots, offsets, nbytes, dst, out, ROW_NBYTES, threads)


def test_a_tasks_wait_from_many_threads_joins_once_and_answers_each():
    """Two threads waiting for one task: both calls joined its thread (one hung forever); now one joins and both
    get its answer."""
    rows = _frames_of(3_000, seed=4)
    encoded = _kernels.encode_lz4(rows, ROW_NBYTES, 1)
    nbytes = np.array([len(f) for f in encoded], np.int64)
    blob = b"".join(encoded)
    for _ in range(20):
        out = np.zeros_like(rows)
        task = _kernels.map_lz4_start(
            (blob,),
            np.zeros(len(rows), np.int32),
            np.cumsum(nbytes) - nbytes,
            nbytes,
            np.arange(len(rows)),
            out,
            ROW_NBYTES,
        )
        answers: list[tuple[int, int, int]] = []
        threads = [threading.Thread(target=lambda t=task, a=answers: a.append(t.wait())) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads)
        assert answers == [(-1, 0, 0)] * 2
        np.testing.assert_array_equal(out, rows)


def test_a_task_waited_for_in_a_forked_child_never_says_rows_it_did_not_decode_are():
    """A forked child has no copy of the task's thread: its wait() said (-1, 0) with the rows partly decoded, and hung
    when another thread of the parent was inside wait(); now a task not done when the process forked fails its first
    row with ESRCH."""
    rows = _frames_of(30_000, seed=6)
    encoded = _kernels.encode_lz4(rows, ROW_NBYTES, 1)
    nbytes = np.array([len(f) for f in encoded], np.int64)
    blob = b"".join(encoded)
    for waiting in (False, True):  # another thread of the parent inside wait() when it forks (its lock held)
        out = np.zeros_like(rows)
        task = _kernels.map_lz4_start(
            (blob,), np.zeros(len(rows), np.int32), np.cumsum(nbytes) - nbytes, nbytes, np.arange(len(rows)), out,
            ROW_NBYTES,
        )
        waiter = threading.Thread(target=task.wait)
        if waiting:
            waiter.start()
        pid = os.fork()
        if pid == 0:  # the child: exit 0 when the answer is true of its out, 1 otherwise; a hang is killed
            signal.alarm(120)
            failed, err, _ = task.wait()
            complete = bool((out == rows).all())
            del task  # a task dropped in the child does not wait either
            os._exit(0 if (failed == -1 and err == 0 and complete) or (failed == 0 and err == errno.ESRCH) else 1)
        assert os.waitpid(pid, 0)[1] == 0, f"waiting: {waiting}"
        assert task.wait() == (-1, 0, 0)
        np.testing.assert_array_equal(out, rows)
        if waiting:
            waiter.join()


def _on_tmpfs(path: Path) -> bool:
    """Whether ``path`` is on a file system in memory (no disk reads to count)."""
    mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
    best = max(
        (m for m in mounts if str(path).startswith(m[1].rstrip("/") + "/")), key=lambda m: len(m[1]), default=None
    )
    return best is not None and best[2] in ("tmpfs", "ramfs")


def test_pread_lz4_and_map_lz4_count_the_blocks_read_from_disk(tmp_path):
    """What the reader chooses between them by: 0 when every row was in the page cache, more once it was dropped."""
    if _on_tmpfs(tmp_path):
        pytest.skip("a file system in memory reads nothing from a disk")
    rows = _frames_of(64, seed=5)
    encoded = _kernels.encode_lz4(rows, ROW_NBYTES, 1)
    nbytes = np.array([len(f) for f in encoded], np.int64)
    gap = 8192  # rows two pages apart: each is a read of its own
    offsets = np.arange(len(rows), dtype=np.int64) * gap
    path = tmp_path / "f"
    with open(path, "wb") as f:
        for o, frame in zip(offsets.tolist(), encoded):
            f.seek(o)
            f.write(frame)
    out = np.zeros_like(rows)
    dst = np.arange(len(rows), dtype=np.int64)
    with open(path, "rb") as f:
        fd = f.fileno()
        fds = np.full(len(rows), fd, np.int32)
        for read in ("pread", "map"):
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            mapping = _kernels.map_file(fd, 0, os.fstat(fd).st_size)
            for cold in (True, False):
                if read == "pread":
                    got = _kernels.pread_lz4(fds, offsets, nbytes, dst, out, ROW_NBYTES)
                else:
                    got = _kernels.map_lz4(
                        (mapping,), np.zeros(len(rows), np.int32), offsets, nbytes, dst, out, ROW_NBYTES
                    )
                assert got[:2] == (-1, 0)
                np.testing.assert_array_equal(out, rows)
                assert (got[2] >= 8 * len(rows)) if cold else (got[2] == 0), (read, cold, got)
            del mapping


def test_crc32_runs_is_zlibs_crc32_of_each_run_chained_and_checks_its_arguments():
    data = np.random.default_rng(0).integers(0, 256, 10_000, np.uint8).tobytes()
    starts = np.array([0, 5, 5, 9_000, 10_000], np.int64)
    ends = np.array([5, 5, 4_096, 10_000, 10_000], np.int64)
    seeds = np.array([0, 7, 123456, 2**32 - 1, 42], np.uint32)
    crcs = seeds.copy()
    assert _kernels.crc32_runs(data, starts, ends, crcs) is None
    want = [zlib.crc32(data[a:b], int(c)) for a, b, c in zip(starts, ends, seeds)]
    assert crcs.tolist() == want
    for bad_starts, bad_ends in (([-1], [3]), ([4], [3]), ([0], [10_001])):  # before, backwards, past the end
        with pytest.raises(ValueError, match="outside data"):
            _kernels.crc32_runs(
                data, np.array(bad_starts, np.int64), np.array(bad_ends, np.int64), np.zeros(1, np.uint32)
            )
    with pytest.raises(ValueError, match="one entry per run"):
        _kernels.crc32_runs(data, np.zeros(2, np.int64), np.zeros(2, np.int64), np.zeros(1, np.uint32))
    with pytest.raises(BufferError):  # crcs are written: a read-only buffer is refused
        _kernels.crc32_runs(data, np.zeros(1, np.int64), np.zeros(1, np.int64), bytes(4))
    for starts, ends, crcs, name in (  # the bytes of other integer types are not taken as int64 / uint32
        (np.zeros(1), np.zeros(1, np.int64), np.zeros(1, np.uint32), "starts"),
        (np.zeros(2, np.int64), np.zeros(4, np.int32), np.zeros(2, np.uint32), "ends"),
        (np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros(4, np.uint8), "crcs"),
    ):
        with pytest.raises(ValueError, match=f"{name} must be"):
            _kernels.crc32_runs(data, starts, ends, crcs)


def test_pread_lz4_and_map_lz4_check_each_dst_as_they_use_it(tmp_path):
    """dst (and map_lz4's slots) sharing memory with out: decoding row 0 overwrites the dst of the rows after it (as
    another thread could, the GIL released). Each entry is checked when it is used, so those rows fail rather than
    land outside out or read outside a map."""
    blob, offsets, nbytes, rows = _lz4_rows(5)
    (tmp_path / "f").write_bytes(blob)
    out = np.zeros((5, *ROW), np.uint8)
    dst = out[4].reshape(-1).view(np.int64)[:5]
    dst[:] = [4, 0, 1, 2, 3]  # row 0 goes to out[4], over dst itself
    with open(tmp_path / "f", "rb") as f:
        assert _kernels.pread_lz4(np.full(5, f.fileno(), np.int32), offsets, nbytes, dst, out, ROW_NBYTES)[:2] == (1, 0)
    np.testing.assert_array_equal(out[4], rows[0])
    assert not (0 <= dst[1] < 5)  # what row 1 found: no row of out
    out[:] = 0
    dst[:] = [4, 0, 1, 2, 3]
    slots = out[4].reshape(-1)[64:].view(np.int32)[:5]  # the maps' slots too: row 0 overwrites them
    slots[:] = 0
    for start in (False, True):
        call = _kernels.map_lz4_start if start else _kernels.map_lz4
        got = call((blob,), slots, offsets, nbytes, dst, out, ROW_NBYTES)
        assert (got.wait() if start else got)[:2] == (1, 0)
        out[4] = 0
        dst[:], slots[:] = [4, 0, 1, 2, 3], 0


def test_crc32_runs_uses_the_runs_as_they_were_when_checked():
    """crcs sharing memory with ends: each crc written changes a later run's end after its check. The runs are
    copied before they are checked, so the call computes the runs it was given and never reads outside data."""
    data = np.random.default_rng(1).integers(0, 256, 4096, np.uint8).tobytes()
    ends = np.full(8, 4096, np.int64)
    crcs = ends.view(np.uint32)[8:]  # the last 4 ends, as 8 uint32
    seeds = crcs.copy()
    _kernels.crc32_runs(data, np.zeros(8, np.int64), ends, crcs)
    assert crcs.tolist() == [zlib.crc32(data, int(c)) for c in seeds]
