"""ChunkReader: the decoded-chunk cache serves committed rows only and reads again exactly the chunks commits change."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zarr.codecs
from gymnasium import spaces

from her_store import EpisodeStore, HerSampler
from her_store.errors import CorruptStoreError
from her_store.storage.files import drop_page_cache
from her_store.store.cached_rows import CachedArray
from her_store.store.frame_rows import WARM_GATHERS, FrameArray
from her_store.store.rows import MIN_ROWS_PER_THREAD, ChunkReader
from tests.conftest import DATA, ROOT
from tests.sampling.test_sampler import sparse_reward
from tests.system.test_differential import ACT, OBS, episode, rows, wrong_rows

CHUNK_ROWS = 16
V1_STORE = Path(DATA) / "v1_store"  # made by the version 1 code: tests/data/make_old_store.py


def _create(path, capacity: int | None = None) -> EpisodeStore:
    """Zstd observations (the cache) beside raw packs (memory-mapped); small chunks; every append commits."""
    return EpisodeStore.create(
        path, OBS, ACT, capacity=capacity, chunk_rows=CHUNK_ROWS, commit_interval=0,
        compressors={"observation": zarr.codecs.ZstdCodec()},
    )


def _committed_rows(store: EpisodeStore, first: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row, episode, step) of every row of the live episodes with id >= first (length + 1 rows each)."""
    table = store.episodes
    keep = table["episode_id"] >= (store.first_episode if first is None else first)
    ids, starts, n = table["episode_id"][keep], table["start_row"][keep], table["length"][keep] + 1
    step = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
    return np.repeat(starts, n) + step, np.repeat(ids, n), step


def test_a_commit_reloads_exactly_the_chunks_its_rows_reach(tmp_path):
    with _create(tmp_path / "s") as store:
        for e in range(3):
            store.append_episode(episode(e))
        reader = ChunkReader(store)
        arr = reader.arrays["steps/observation"]
        assert isinstance(arr, CachedArray)
        reader.observe(store.snapshot())
        r, e, s = _committed_rows(store)
        np.testing.assert_array_equal(reader.gather(arr.spec.path, r), rows(e, s)["observation"])
        for i in range(3, 6):  # the first of them fills the tail of a chunk read above
            store.append_episode(episode(i))
        reader.observe(store.snapshot())
        misses = arr.misses
        r, e, s = _committed_rows(store)
        np.testing.assert_array_equal(reader.gather(arr.spec.path, r), rows(e, s)["observation"])
        new_rows = _committed_rows(store, first=3)[0]
        assert (new_rows[0] // CHUNK_ROWS) * CHUNK_ROWS < new_rows[0], "the new rows begin inside a cached chunk"
        assert arr.misses - misses == len(np.unique(new_rows // CHUNK_ROWS))  # and the chunks before them are kept
        reader.observe(store.snapshot())  # nothing new: nothing is read again
        misses = arr.misses
        reader.gather(arr.spec.path, r)
        assert arr.misses == misses
        reader.close()


def test_a_reader_that_fell_a_whole_ring_behind(tmp_path):
    with _create(tmp_path / "s", capacity=48) as writer:
        for e in range(4):
            writer.append_episode(episode(e))
        store = EpisodeStore.open(tmp_path / "s")
        with store, HerSampler(store, 256, reward_fn=sparse_reward, seed=0, refresh_interval=0) as sampler:
            assert wrong_rows(sampler.sample(), 0, 4) is None  # every chunk of the ring is cached now
            seen_end = store.end_episode
            e = 4
            while writer.first_episode < seen_end + 2:  # every row the reader saw is overwritten, some twice
                writer.append_episode(episode(e))
                e += 1
            b = sampler.sample()
            assert b.episode_ids.min() >= seen_end
            assert wrong_rows(b, writer.first_episode, writer.end_episode) is None


@pytest.mark.slow
def test_the_prefetch_thread_gathers_while_commits_change_cached_chunks(tmp_path):
    for capacity in (None, 48):
        with _create(tmp_path / f"s{capacity}", capacity) as store:
            store.append_episode(episode(0))
            with HerSampler(store, 64, reward_fn=sparse_reward, seed=0, prefetch=2) as sampler:
                for e in range(1, 60):
                    store.append_episode(episode(e))
                    problem = wrong_rows(sampler.sample(), 0, store.end_episode)
                    assert problem is None, f"capacity {capacity}, after episode {e}: {problem}"


def _drop_row_from_its_shard(store_path, path: str, row: int, shard_rows: int) -> None:
    """Rewrite the shard holding ``row`` with a valid index that marks the row never written."""
    from her_store.format.frames import build_shard, parse_index

    f = store_path / path / f"c.{row // shard_rows}.0.0.0"
    raw = f.read_bytes()
    offsets, nbytes = parse_index(raw, shard_rows, str(f))
    frames = [None if o < 0 else raw[o : o + n] for o, n in zip(offsets.tolist(), nbytes.tolist())]
    frames[row % shard_rows] = None
    f.write_bytes(build_shard(frames))


@pytest.mark.parametrize("codec", ["lz4", "zstd"])  # the C batch path and the row-by-row path
def test_a_committed_row_missing_from_its_shard_is_damage_not_zeros(tmp_path, codec):
    with EpisodeStore.create(tmp_path / "s", OBS, ACT, chunk_rows=CHUNK_ROWS, compressors={"pixels": codec}) as store:
        for e in range(4):
            store.append_episode(episode(e))
    _drop_row_from_its_shard(tmp_path / "s", "steps/pixels", 1, CHUNK_ROWS)  # episode 0, step 1
    store = EpisodeStore.open(tmp_path / "s")
    reader = ChunkReader(store, io_threads=0)
    reader.observe(store.snapshot())
    np.testing.assert_array_equal(
        reader.gather("steps/pixels", np.array([2]))[0], rows(np.array([0]), np.array([2]))["pixels"][0]
    )
    with pytest.raises(CorruptStoreError, match="committed row 1 is missing from its shard"):
        reader.gather("steps/pixels", np.array([3, 1]))
    with pytest.raises(CorruptStoreError, match="do not match the crc32"):
        store.episode(0)
    reader.close()
    store.close()


@pytest.mark.parametrize("warm", [0, 10**9], ids=["mapped", "pread"])
def test_an_undecodable_frame_fails_the_batch_that_samples_it_and_not_the_next(tmp_path, monkeypatch, warm):
    """A frame's bytes garbled in its shard (the index intact): the sampler's batch, its frames decoded while the
    rest of it was assembled, raises a CorruptStoreError naming the shard and row; gathers and batches not reading
    that row are right."""
    from her_store.format.frames import parse_index
    from her_store.store import frame_rows as reader_module

    monkeypatch.setattr(reader_module, "WARM_GATHERS", warm)
    path = tmp_path / "s"
    with EpisodeStore.create(path, OBS, ACT, chunk_rows=CHUNK_ROWS) as store:
        for e in range(4):
            store.append_episode(episode(e))
    shard = path / "steps" / "pixels" / "c.0.0.0.0"
    raw = bytearray(shard.read_bytes())
    offsets, nbytes = parse_index(bytes(raw), CHUNK_ROWS, str(shard))
    raw[offsets[5] + 4 : offsets[5] + nbytes[5]] = b"\xff" * (int(nbytes[5]) - 4)  # row 5: episode 0, step 5
    shard.write_bytes(bytes(raw))
    with EpisodeStore.open(path) as store, HerSampler(store, 64, reward_fn=sparse_reward, seed=0, io_threads=2) as s:
        with pytest.raises(CorruptStoreError, match=r"c\.0\.0\.0\.0: row 5 is not one row's LZ4 block"):
            for _ in range(50):
                s.sample()
        r, e, t = _committed_rows(store)
        keep = r != 5
        for _ in range(2):  # the same sampler's gathers of every other row, pending meanwhile, then finished
            got, finish = s.reader.gather_later("steps/pixels", r[keep])
            finish()
            np.testing.assert_array_equal(got, rows(e[keep], t[keep])["pixels"])
        for _ in range(20):  # and its batches: right, or failing on row 5 again
            try:
                b = s.sample()
            except CorruptStoreError as err:
                assert "row 5 is not one row's LZ4 block" in str(err)
            else:
                assert wrong_rows(b, 0, 4) is None


def test_a_version_1_chunk_decoding_to_fewer_bytes_is_damage(tmp_path):
    """A version 1 Blosc chunk whose frame is valid but holds less than a chunk: refused, not half-filled."""
    import numcodecs

    path = tmp_path / "v1"
    shutil.copytree(V1_STORE, path)
    store = EpisodeStore.open(path)
    reader = ChunkReader(store)
    reader.observe(store.snapshot())
    arr = reader.arrays["steps/pixels"]
    assert isinstance(arr, CachedArray) and not isinstance(arr, FrameArray)
    rows_live = np.arange(store.episodes["start_row"][0], store.episodes["start_row"][0] + 3)
    chunk = int(rows_live[0]) // arr.chunk_rows
    (path / "steps" / "pixels" / "c" / str(chunk) / "0" / "0" / "0").write_bytes(
        numcodecs.Blosc("lz4").encode(np.full(100, 7, np.uint8))
    )
    with pytest.raises(CorruptStoreError, match="cannot be decoded"):
        reader.gather("steps/pixels", rows_live)
    reader.close()
    store.close()


def test_a_samplers_first_gather_opens_every_shard_with_committed_rows_at_once(tmp_path):
    """Cold, a shard's index is a disk read: the first gather reads them all in parallel rather than one per gather."""
    with EpisodeStore.create(tmp_path / "s", OBS, ACT, chunk_rows=CHUNK_ROWS) as store:  # LZ4 pixels, 16-row shards
        for e in range(12):
            store.append_episode(episode(e))
    store = EpisodeStore.open(tmp_path / "s")
    shards = -(-store.commit_record.write_row // CHUNK_ROWS)
    reader = ChunkReader(store, io_threads=2)
    reader.observe(store.snapshot())
    arr = reader.arrays["steps/pixels"]
    assert isinstance(arr, FrameArray) and shards > 4
    np.testing.assert_array_equal(
        reader.gather("steps/pixels", np.array([0]))[0], rows(np.array([0]), np.array([0]))["pixels"][0]
    )
    assert arr.misses == shards  # every shard opened by the first gather
    reader.gather("steps/pixels", np.arange(store.commit_record.write_row))
    assert arr.misses == shards  # and none again
    reader.close()
    store.close()


BIG = spaces.Dict({**OBS.spaces, "pixels": spaces.Box(0, 255, (3, 48, 48), np.uint8)})  # 6.9 KB frames, 2 pages


def _big_episode(e: int) -> dict[str, np.ndarray]:
    """Episode ``e`` with frames of noise of its own (LZ4 cannot shrink them: each row spans pages)."""
    ep = episode(e)
    return {**ep, "pixels": np.random.default_rng(e).integers(0, 256, (len(ep["pixels"]), 3, 48, 48), np.uint8)}


def test_warm_gathers_decode_from_the_mapped_shards_and_a_cold_one_goes_back_to_pread(tmp_path):
    """Frames are read with pread while the disk serves them and decoded from the mapped shards once WARM_GATHERS
    gathers in a row found every row in the page cache; a mapped gather that read from disk, and an eviction, go
    back to pread. Every gather, in either mode, on the pool or started and finished later, reads the same rows."""
    from tests.format.test_frames import _on_tmpfs

    path = tmp_path / "s"
    with EpisodeStore.create(path, BIG, ACT, chunk_rows=CHUNK_ROWS) as store:  # LZ4 pixels in 16-row shards
        episodes = [_big_episode(e) for e in range(24)]
        for ep in episodes:
            store.append_episode(ep)
        want = np.concatenate([ep["pixels"] for ep in episodes])  # row r of the store (no ring: rows in order)
    store = EpisodeStore.open(path)
    reader = ChunkReader(store, io_threads=2)
    reader.observe(store.snapshot())
    arr = reader.arrays["steps/pixels"]
    assert isinstance(arr, FrameArray) and arr.codec.is_lz4
    rng = np.random.default_rng(0)

    def gather(later: bool = False) -> None:
        r = rng.integers(0, len(want), 96)
        if later:
            got, finish = reader.gather_later("steps/pixels", r)
            finish()
        else:
            got = reader.gather("steps/pixels", r)
        np.testing.assert_array_equal(got, want[r])

    for i in range(WARM_GATHERS):  # written moments ago: in the page cache
        gather(later=i % 2 == 1)
    assert arr.mapped_gathers == 0
    for i in range(4):
        gather(later=i % 2 == 1)
    assert arr.mapped_gathers == 4
    arr.evict_page_cache()
    gather()
    assert arr.mapped_gathers == 4  # read with pread again
    reader.gather("steps/pixels", np.arange(len(want)))  # every row back in the page cache
    for _ in range(WARM_GATHERS):
        gather()
    assert arr.mapped_gathers == 4
    gather()
    assert arr.mapped_gathers == 5  # mapped again
    if not _on_tmpfs(tmp_path):  # (a file system in memory reads nothing from a disk: there is no cold to see)
        for m in arr._maps.values():  # the pages dropped under the mappings, as memory pressure would
            m.drop_pages()
        for f in sorted((path / "steps" / "pixels").glob("c.*")):
            drop_page_cache(str(f))
        gather()  # mapped, and its page faults read from disk
        assert arr.mapped_gathers == 6
        gather()
        assert arr.mapped_gathers == 6  # pread again
    reader.close()
    store.close()


def _big_store_reader(path: Path, compressors: dict | None = None) -> tuple[EpisodeStore, ChunkReader, np.ndarray]:
    """A store of 4 episodes of noise frames at ``path``, opened again for reading, a reader of it (2 threads) and
    every frame as appended."""
    with EpisodeStore.create(path, BIG, ACT, chunk_rows=CHUNK_ROWS, compressors=compressors) as store:
        episodes = [_big_episode(e) for e in range(4)]
        for ep in episodes:
            store.append_episode(ep)
    store = EpisodeStore.open(path)
    reader = ChunkReader(store, io_threads=2)
    reader.observe(store.snapshot())
    return store, reader, np.concatenate([ep["pixels"] for ep in episodes])


@pytest.mark.parametrize("warm", [0, 10**9], ids=["mapped", "pread"])
def test_a_shard_cut_short_in_place_under_a_sampler_is_an_io_error_naming_it(tmp_path, monkeypatch, warm):
    """Another process cuts a shard short in place while a sampler has it open (and mapped): the gathers reading
    past its new end raise OSError EIO naming the shard and row (a mapped read past the end raised SIGBUS, which
    killed the process), and the rows before it still read."""
    import errno

    from her_store.store import frame_rows as reader_module

    monkeypatch.setattr(reader_module, "WARM_GATHERS", warm)
    path = tmp_path / "s"
    store, reader, want = _big_store_reader(path)
    assert np.array_equal(reader.gather("steps/pixels", np.arange(CHUNK_ROWS)), want[:CHUNK_ROWS])  # shard 0 open
    shard = path / "steps" / "pixels" / "c.0.0.0.0"
    os.truncate(shard, 8 * 4096)  # rows past the first pages of the shard are gone
    reader.arrays["steps/pixels"].evict_page_cache()
    with pytest.raises(OSError, match=r"c\.0\.0\.0\.0: reading row \d+ failed") as e:
        reader.gather("steps/pixels", np.arange(CHUNK_ROWS))
    assert e.value.errno == errno.EIO
    np.testing.assert_array_equal(reader.gather("steps/pixels", np.array([0, 1])), want[:2])
    reader.close()
    store.close()


def test_an_uncompressed_chunk_cut_short_in_place_under_a_sampler_is_an_io_error_naming_it(tmp_path):
    """Another process cuts a memory-mapped chunk of uncompressed frames short in place: a gather reading past its new
    end raised SIGBUS in numpy's copy, which killed the process; now it raises OSError EIO naming the chunk and the
    row, and the rows before the cut still read."""
    import errno

    path = tmp_path / "s"
    store, reader, want = _big_store_reader(path, {"pixels": None})
    spec = store.layout.fields["pixels"][0]  # the frames are the uint8 pack's one column
    pixels = reader.arrays[spec.path]
    assert type(pixels).__name__ == "MappedArray" and spec.columns == (("pixels", 0, want[0].size),)

    def gather(rows: np.ndarray) -> np.ndarray:
        return reader.gather(spec.path, rows).reshape(-1, *want.shape[1:])

    assert np.array_equal(gather(np.arange(2 * CHUNK_ROWS)), want[: 2 * CHUNK_ROWS])
    chunk = path / pixels.spec.chunk_key(0)
    row_nbytes = pixels.spec.row_nbytes
    os.truncate(chunk, 3 * row_nbytes)  # rows 3.. of chunk 0 are gone (the page holding row 3 goes with them)
    pixels.evict_page_cache()
    with pytest.raises(OSError, match=rf"{pixels.spec.chunk_key(0)}: reading row \d+ failed") as e:
        gather(np.arange(CHUNK_ROWS))
    assert e.value.errno == errno.EIO
    for some in (np.array([0, 1]), np.arange(CHUNK_ROWS, 2 * CHUNK_ROWS), np.array([1, CHUNK_ROWS + 2])):
        np.testing.assert_array_equal(gather(some), want[some])  # before the cut, and chunk 1
    # a chunk of small rows cut within its last page: the rows past the cut read as zeros from the mapping (no
    # SIGBUS there); they fail too
    floats = store.layout.fields["reward"][0].path
    kept = reader.gather(floats, np.arange(CHUNK_ROWS))
    row_nbytes = reader.arrays[floats].spec.row_nbytes
    assert CHUNK_ROWS * row_nbytes < 4096
    os.truncate(path / reader.arrays[floats].spec.chunk_key(0), 3 * row_nbytes)
    with pytest.raises(OSError, match=r"reading row 5 failed") as e:
        reader.gather(floats, np.array([1, 5, 2]))
    assert e.value.errno == errno.EIO
    np.testing.assert_array_equal(reader.gather(floats, np.array([2, 0])), kept[[2, 0]])
    reader.close()
    store.close()


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="the advice is read from Linux's /proc/self/smaps")
def test_only_a_reader_of_rows_in_order_maps_chunks_with_readahead(tmp_path):
    """A sampler's chunks are mapped for random rows (MADV_RANDOM: a page fault reads its page alone); those an
    export's reader maps (rows read in order: random_access False) keep the kernel's readahead."""
    from tests.kernels.test_kernels import _advised_random

    store, reader, want = _big_store_reader(tmp_path / "s", {"pixels": None})
    spec = store.layout.fields["pixels"][0]
    pixels = reader.arrays[spec.path]
    np.testing.assert_array_equal(reader.gather(spec.path, np.array([1])).reshape(1, *want.shape[1:]), want[[1]])
    pixels.random_access = False
    rows = np.array([CHUNK_ROWS + 2])
    np.testing.assert_array_equal(reader.gather(spec.path, rows).reshape(1, *want.shape[1:]), want[rows])
    assert [_advised_random(pixels._maps[c][0]) for c in (0, 1)] == [True, False]
    reader.close()
    store.close()


_HANDLER_AFTER_A_GATHER = """
import faulthandler, mmap, os, signal, sys
import numpy as np
from her_store._kernels import _frames

path, case = sys.argv[1], sys.argv[2]
row = 4096
with open(path, "wb") as f:
    f.write(bytes(8 * row))
f = open(path, "r+b")
m = mmap.mmap(f.fileno(), 8 * row, access=mmap.ACCESS_READ)
rows, out = np.arange(8, dtype=np.int64), np.zeros((8, row), np.uint8)
print(_frames.take_rows(m, rows, 0, 0, out, row), flush=True)
if case == "python handler":  # installed over ours: a cut mapping still fails its row, a sent signal reaches it
    signal.signal(signal.SIGBUS, lambda *_: print("handled", flush=True))
    os.ftruncate(f.fileno(), 2 * row)
    print(_frames.take_rows(m, rows, 0, 0, out, row), flush=True)
    os.kill(os.getpid(), signal.SIGBUS)
    print("on", flush=True)
else:  # faulthandler installed over ours, a gather, faulthandler disabled: a fault outside a gather ends the process
    faulthandler.enable()
    print(_frames.take_rows(m, rows, 0, 0, out, row), flush=True)
    faulthandler.disable()
    os.ftruncate(f.fileno(), 0)
    print(np.frombuffer(m, np.uint8).sum())
"""


@pytest.mark.slow
@pytest.mark.parametrize("case", ["python handler", "faulthandler disabled"])
def test_a_handler_installed_over_the_guard_after_a_gather(tmp_path, case):
    """A SIGBUS handler installed after a gather armed the guard took SIGBUS first: a Python one returned, so a gather
    from a chunk cut short under its mapping faulted forever. The next gather puts the guard back over it: the row
    fails with EIO, and other SIGBUS reach the handler. A handler the guard was put back over and that its owner
    takes away again (faulthandler disabled) is not called: the fault ends the process, as it did before."""
    import signal
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _HANDLER_AFTER_A_GATHER, str(tmp_path / "f"), case],
                          capture_output=True, timeout=60, check=False)
    if case == "python handler":
        assert (done.returncode, done.stdout.split()) == (0, [b"(-1,", b"0)", b"(2,", b"5)", b"handled", b"on"])
    else:
        assert (done.returncode, done.stdout.split()) == (-signal.SIGBUS, [b"(-1,", b"0)", b"(-1,", b"0)"])


def test_a_forked_child_gathers_with_threads_of_its_own(tmp_path):
    """A reader whose gathers are split across its threads, used before a fork: the child's first split gather
    waited forever for the parent's threads, which a child does not have; it starts its own."""
    import signal

    path = tmp_path / "s"
    store, reader, want = _big_store_reader(path, {"pixels": None})
    spec = store.layout.fields["pixels"][0]
    reader.io_threads = 2  # the uint8 pack's gathers split too
    rows = np.arange(len(want))
    assert len(rows) >= 2 * MIN_ROWS_PER_THREAD
    assert np.array_equal(reader.gather(spec.path, rows).reshape(want.shape), want)
    pid = os.fork()
    if pid == 0:  # the child: exit 0 when its gathers are right, 1 otherwise; a hang is killed
        signal.signal(signal.SIGALRM, signal.SIG_DFL)  # (whatever a test runner's plugins set)
        signal.alarm(120)
        ok = np.array_equal(reader.gather(spec.path, rows).reshape(want.shape), want)
        os._exit(0 if ok else 1)
    assert os.waitpid(pid, 0)[1] == 0
    reader.close()
    store.close()


@pytest.mark.parametrize("codec", ["lz4", "raw", "zstd"])  # FrameArray, MappedArray, CachedArray
def test_a_forked_child_gathers_though_a_thread_of_the_parent_held_the_readers_locks(tmp_path, codec):
    """A thread of the parent (a prefetching sampler's producer, a gather on the reader's threads) holds the locks of
    the reader and its arrays at the moment of a fork: in the child that thread is gone and its locks stayed held,
    so the child's first gather waited forever. The child makes them anew and reads every row right."""
    import signal
    import threading

    import zarr

    compressors = {"lz4": None, "raw": {"pixels": None}, "zstd": {"pixels": zarr.codecs.ZstdCodec(level=1)}}[codec]
    store, reader, want = _big_store_reader(tmp_path / "s", compressors)
    path = store.layout.fields["pixels"][0].path
    arr = reader.arrays[path]
    rows = np.arange(len(want))
    assert np.array_equal(reader.gather(path, rows).reshape(want.shape), want)
    locks = [reader._lock, arr._lock, *(shares._lock for shares in (getattr(arr, "MAPS", None),
                                                                   getattr(arr, "OPEN", None)) if shares)]
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        for lock in locks:
            lock.acquire()
        held.set()
        release.wait()
        for lock in locks:
            lock.release()

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(60)
    pid = os.fork()
    if pid == 0:  # the child: exit 0 when its gathers are right, 1 otherwise; a hang is ended by the alarm
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(60)
        reader.observe(store.snapshot())
        ok = all(np.array_equal(reader.gather(path, rows[::step]).reshape(want[::step].shape),
                                want[::step]) for step in (1, 3))
        os._exit(0 if ok else 1)
    release.set()
    holder.join()
    status = os.waitpid(pid, 0)[1]
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"the child ended with status {status:#x}"
    assert np.array_equal(reader.gather(path, rows).reshape(want.shape), want)
    reader.close()
    store.close()


def test_a_forked_child_gathers_though_the_parent_forked_while_a_gather_grew_the_shard_tables(tmp_path):
    """A gather of the parent's threads was growing the frame reader's per-shard tables at the fork (its tags grown,
    its table not yet): the child kept the torn tables and every gather there failed (IndexError, or a broadcast
    error). The child makes them anew and reads every row right."""
    from tests.conftest import in_forked_child

    store, reader, want = _big_store_reader(tmp_path / "s")
    arr = reader.arrays["steps/pixels"]
    rows = np.arange(len(want))
    assert np.array_equal(reader.gather("steps/pixels", rows).reshape(want.shape), want)
    # what a _grow holds between its first step and its last: the tags grown, the other tables not yet
    arr._tags = np.full(len(arr._tags) + 4, -1, np.int64)
    arr._fds, arr._bases, arr._used = np.full(0, -1, np.int32), np.zeros(0, np.int64), np.zeros(0, np.int64)
    arr._table = np.full((0, 2), -1, np.int64)

    def child() -> bool:
        reader.observe(store.snapshot())
        return np.array_equal(reader.gather("steps/pixels", rows).reshape(want.shape), want)

    assert in_forked_child(child) == 0
    reader.close()
    store.close()


def test_a_mapped_shard_a_commit_replaced_still_reads_what_was_committed(tmp_path, monkeypatch):
    """A ring rewrites its shards while a sampler in another handle decodes from their mappings (on C threads): a
    shard replaced by a rename leaves the old mapping whole (no SIGBUS, no bytes of the new file under old offsets),
    and the gathers after the commit map the new file."""
    from her_store.store import frame_rows as reader_module

    monkeypatch.setattr(reader_module, "SPLIT_BYTES", 1)  # these small frames split as real ones do
    path = tmp_path / "s"
    with EpisodeStore.create(path, OBS, ACT, capacity=48, chunk_rows=CHUNK_ROWS, commit_interval=0) as writer:
        for e in range(4):
            writer.append_episode(episode(e))
        store = EpisodeStore.open(path)
        with store, HerSampler(store, 64, reward_fn=sparse_reward, seed=0, refresh_interval=0, io_threads=2) as sampler:
            arr = sampler.reader.arrays["steps/pixels"]
            for e in range(4, 40):
                b = sampler.sample()
                assert wrong_rows(b, writer.first_episode if e == 4 else 0, writer.end_episode) is None
                writer.append_episode(episode(e))
                problem = wrong_rows(sampler.sample(), writer.first_episode, writer.end_episode)
                assert problem is None, f"after episode {e}: {problem}"
            assert arr.mapped_gathers > 40


@pytest.mark.slow
def test_a_store_of_more_chunks_than_it_may_map_keeps_its_descriptors_bounded(tmp_path, monkeypatch):
    """Each mapped chunk holds a descriptor: a sampler of a store a writer keeps growing, in chunks of 16 rows, maps at
    most its arrays' share of MAPS at once and maps the others again when it samples them, reading the same rows."""
    import contextlib
    import os

    from her_store.store.mapped_rows import MappedArray

    monkeypatch.setattr(MappedArray.MAPS, "most", 16)  # 8 each for the two packs (fewer if other maps are alive)
    path = tmp_path / "s"

    def open_chunks() -> int:
        """Read-only descriptors of pack chunk files (the writer's, in this process too, are read-write)."""
        found = 0
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(FileNotFoundError):  # the listing's own descriptor, closed since
                name = os.readlink(f"/proc/self/fd/{fd}")
                flags = int(Path(f"/proc/self/fdinfo/{fd}").read_text().split("flags:")[1].split()[0], 8)
                found += name.startswith(str(path / "packs")) and flags & os.O_ACCMODE == os.O_RDONLY
        return found

    with _create(path) as store, HerSampler(store, 64, reward_fn=sparse_reward, seed=0, refresh_interval=0) as sampler:
        packs = [a for p, a in sampler.reader.arrays.items() if p.startswith("packs/")]
        assert packs and all(isinstance(a, MappedArray) for a in packs)
        for e in range(40):  # about 30 chunks of 16 rows per pack
            store.append_episode(episode(e))
            for _ in range(3):
                assert wrong_rows(sampler.sample(), 0, e + 1) is None
            assert all(len(a._maps) <= 8 for a in packs)
            assert open_chunks() <= 16
        assert max(len(a._maps) for a in packs) > 1  # it did map chunks


@pytest.mark.parametrize("codec", ["lz4", "zstd"])
def test_a_gather_over_more_shards_than_may_be_open_takes_them_a_group_at_a_time(tmp_path, monkeypatch, codec):
    """Every shard a gather touches was opened before the cap on open shards applied: a batch of 1,024 over 2-row
    shards raised OSError (too many open files) at the usual limit of 1,024 descriptors. A gather now opens at most
    half the cap at once (a group of shards at a time), and reads the same rows, within a descriptor limit the
    ungrouped gather overran."""
    import os
    import resource

    monkeypatch.setattr(FrameArray.OPEN, "most", 16)
    path = tmp_path / "s"
    compressors = None if codec == "lz4" else {"pixels": zarr.codecs.ZstdCodec()}
    with EpisodeStore.create(path, OBS, ACT, chunk_rows=2, compressors=compressors) as store:
        for e in range(30):
            store.append_episode(episode(e))
    store = EpisodeStore.open(path)
    table = store.episodes
    e = np.repeat(table["episode_id"], table["length"] + 1)
    s = np.concatenate([np.arange(n + 1) for n in table["length"]])
    at = np.repeat(table["start_row"], table["length"] + 1) + s
    reader = ChunkReader(store, io_threads=2)
    reader.observe(store.snapshot())
    arr = reader.arrays["steps/pixels"]
    assert isinstance(arr, FrameArray) and len(np.unique(at // arr.chunk_rows)) > 100
    order = np.random.default_rng(0).permutation(len(at))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # room for the 16 shards it may keep, the few descriptors each open takes on its way, and the process's own
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 64, hard))
    try:
        got = reader.gather("steps/pixels", at[order])
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    np.testing.assert_array_equal(got, rows(e[order], s[order])["pixels"])
    assert len(arr._files) <= 16
    reader.close()
    store.close()


def test_a_samplers_image_arrays_share_its_open_shard_files(tmp_path, monkeypatch):
    """Each image array kept up to MAX_OPEN shard files open, so a store of four image fields in tiny shards ran a
    sampler out of descriptors (a raw OSError) at a limit one array alone kept within. The arrays now share the
    bound: batches of 1,024 sample within it, every frame its (episode, step)'s."""
    import os
    import resource

    from gymnasium import spaces

    from her_store.store.mapped_rows import MappedArray

    monkeypatch.setattr(FrameArray.OPEN, "most", 64)
    monkeypatch.setattr(MappedArray.MAPS, "most", 16)  # the packs' 2-row chunks: mapped, each holding a descriptor
    names = [f"pix{k}" for k in range(4)]
    obs = spaces.Dict({**{k: v for k, v in OBS.spaces.items() if k != "pixels"},
                       **{k: spaces.Box(0, 255, (3, 8, 8), np.uint8) for k in names}})
    path = tmp_path / "s"
    with EpisodeStore.create(path, obs, ACT, chunk_rows=2) as store:
        for e in range(30):
            ep = episode(e)
            pixels = ep.pop("pixels")
            store.append_episode({**ep, **{k: pixels + np.uint8(j) for j, k in enumerate(names)}})
    store = EpisodeStore.open(path)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with HerSampler(store, 1024, reward_fn=sparse_reward, seed=0, io_threads=2) as sampler:
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 64 + 64, hard))
        try:
            batches = [sampler.sample() for _ in range(3)]
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert sum(len(a._files) for a in sampler.reader.arrays.values() if isinstance(a, FrameArray)) <= 64
    for b in batches:
        for frames in (b.observations, b.next_observations):
            first = frames["pix0"].numpy()
            e = first[:, 0, 0, 0].astype(np.int64) + 256 * first[:, 0, 0, 1].astype(np.int64)
            s = first[:, 0, 0, 2].astype(np.int64)
            want = rows(e, s)["pixels"]
            for j, k in enumerate(names):
                np.testing.assert_array_equal(frames[k].numpy(), want + np.uint8(j))
    store.close()


@pytest.mark.parametrize("where", ["raw", "shard"])
def test_evicting_the_page_cache_passes_over_what_is_no_file_of_the_store(tmp_path, where):
    """evict_page_cache walked every file of an array and opened each to drop its pages: a FIFO left past the commit
    blocked it forever, and a link had it open a file outside the store. It now leaves them alone."""
    import signal

    path = tmp_path / "s"
    with EpisodeStore.create(path, OBS, ACT, chunk_rows=CHUNK_ROWS) as store:
        for e in range(3):
            store.append_episode(episode(e))
    store = EpisodeStore.open(path)
    c = store.commit_record.write_row // CHUNK_ROWS + 1  # the chunk after the last: every walk over them reaches it
    key = f"packs/float32/c/{c}/0" if where == "raw" else f"steps/pixels/c.{c}.0.0.0"
    (path / key).parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path / key)
    with HerSampler(store, 16, reward_fn=sparse_reward, seed=0) as sampler:
        sampler.sample()
        def stop(*_):
            raise TimeoutError("evict_page_cache blocked")

        old = signal.signal(signal.SIGALRM, stop)
        signal.alarm(120)  # a blocked open fails the test rather than hanging the suite
        try:
            sampler.reader.evict_page_cache()
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)
        sampler.sample()
    store.close()


@pytest.mark.slow
def test_the_samplers_of_many_stores_in_one_process_share_its_open_files(tmp_path, monkeypatch):
    """Each sampler kept its own bound of open shard files, so a mixture over six image stores in tiny shards ran the
    process out of descriptors (a raw OSError) at a limit one sampler kept within. Every image array and mapped
    chunk of the process now shares one bound: the mixture samples within that limit, every frame its (episode,
    step)'s, and a sampler closed gives its share back."""
    import resource

    from her_store.sampling.mixture import MixtureSampler
    from her_store.store.mapped_rows import MappedArray

    monkeypatch.setattr(FrameArray.OPEN, "most", 64, raising=False)
    monkeypatch.setattr(MappedArray.MAPS, "most", 16, raising=False)
    stores = []
    for k in range(6):
        with EpisodeStore.create(tmp_path / f"s{k}", OBS, ACT, chunk_rows=2) as store:
            for e in range(30):
                store.append_episode(episode(e))
        stores.append(EpisodeStore.open(tmp_path / f"s{k}"))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with MixtureSampler(stores, "transitions", 1024, reward_fn=sparse_reward, seed=0, io_threads=2) as mixture:
        sharded = [a for s in mixture.samplers for a in s.reader.arrays.values() if isinstance(a, FrameArray)]
        assert len(sharded) == 6 and all(len(np.unique(a._newest)) > 1 for a in sharded)
        # room for the 64 shard files and 16 maps, what each open takes on its way, and the process's own
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 64 + 16 + 48, hard))
        try:
            batches = [mixture.sample() for _ in range(4)]
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert sum(len(a._files) for a in sharded) <= 64
        assert sharded[0].max_entries <= 64 // 6 + 1
        mixture.samplers[0].close()
        assert sharded[1].max_entries >= 64 // 5 - 1
    for b in batches:  # every store holds episodes 0..29
        assert wrong_rows(b, 0, 30) is None
    for store in stores:
        store.close()


_OUT_OF_DESCRIPTORS = """
import os, resource, sys
sys.path.insert(0, sys.argv[2])
from her_store import EpisodeStore, HerSampler, StoreError
from tests.sampling.test_sampler import sparse_reward
store = EpisodeStore.open(sys.argv[1])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
with HerSampler(store, 256, reward_fn=sparse_reward, seed=0, io_threads=0) as sampler:
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 1, hard))
    try:
        sampler.sample()
        print("sampled")
    except StoreError as e:
        print(f"{type(e).__name__}: {e}")
"""


def test_a_sampler_out_of_descriptors_says_so(tmp_path):
    """Below the few files each array keeps, a gather cannot open its shards: a StoreError naming the array, the
    limit and what to do, not a raw OSError naming 'steps'. (In a process of its own: no other test's objects let
    descriptors go while it gathers.)"""
    with EpisodeStore.create(tmp_path / "s", OBS, ACT, chunk_rows=2) as store:
        for e in range(10):
            store.append_episode(episode(e))
    run = subprocess.run(
        [sys.executable, "-c", _OUT_OF_DESCRIPTORS, str(tmp_path / "s"), ROOT],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert re.match(
        r"StoreError: .*out of file descriptors \(the process may have [\d,]+ open\)", run.stdout
    ), run.stdout
