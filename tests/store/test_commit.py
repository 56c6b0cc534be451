"""The commit protocol of her_store/commit.py: group commits, and appends that raise leaving no trace."""

from __future__ import annotations

import errno
import os
import threading
import time

import numpy as np
import pytest
from gymnasium import spaces

from her_store import EpisodeStore
from her_store.errors import EpisodeValidationError
from her_store.ops.verify import verify
from her_store.storage import LocalBackend
from her_store.store.frame_writer import FrameWriter as ShardWriter
from tests.conftest import FailingTask, assert_episode_equal, make_episode


def _fail_commit_records(monkeypatch, times: int = 1) -> None:
    real, left = LocalBackend.write_atomic, {"n": times}

    def write_atomic(self, key, data, fsync, if_match=None):
        if key == "commit.json" and left["n"] > 0:
            left["n"] -= 1
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, key, data, fsync, if_match)

    monkeypatch.setattr(LocalBackend, "write_atomic", write_atomic)


@pytest.mark.parametrize("capacity", [None, 60])
def test_an_append_whose_commit_fails_leaves_no_trace(store_path, fetch, monkeypatch, capacity):
    """The episode of the failing call is unstaged (a retry stores it once); episodes staged by earlier calls
    are kept for the next commit; in-memory evictions the call caused are undone."""
    obs, act = fetch
    eps = [make_episode(obs, act, 10, seed=i) for i in range(12)]
    store = EpisodeStore.create(store_path, obs, act, capacity=capacity, chunk_rows=32, commit_interval=3600)
    for e in eps[:4]:
        store.append_episode(e)
    store.flush()
    store.append_episode(eps[4])  # staged, not committed (the interval is an hour)
    store.commit_interval = 0
    first = store._index.first
    _fail_commit_records(monkeypatch)
    with pytest.raises(OSError, match="No space"):
        store.append_episode(eps[5])
    assert store._index.end == 5 and store._index.first >= first
    assert store.append_episode(eps[5]) == 5  # the retry gets the id the failed call would have had
    for e in eps[6:]:
        store.append_episode(e)
    store.close()
    with EpisodeStore.open(store_path) as store:
        assert store.end_episode == 12
        for i in range(store.first_episode, 12):
            assert_episode_equal(store.episode(i), eps[i])
        if capacity:
            assert store.num_transitions <= capacity and store.first_episode > 0


def test_a_ring_commit_never_leaves_an_empty_store_for_a_crash_to_keep(tmp_path, fetch, monkeypatch):
    """A ring store's staged rows used to grow past its capacity between group commits, evicting every committed
    episode: the commit then published an eviction record with no live episode, and a writer killed before its
    commit record reopened empty (and readers meanwhile saw an empty store). Staged rows now stay within half the
    ring: the store as a crash at each eviction record leaves it opens clean with at least a third of its capacity
    in committed episodes, each bit-exact."""
    import shutil

    from her_store.store.commit import Committer

    obs, act = fetch
    capacity, T = 600, 49
    eps = [make_episode(obs, act, T, seed=i) for i in range(60)]
    path = tmp_path / "ring"
    crashes: list[str] = []
    real = Committer._publish

    def publish(self, record):
        old = self.commit_record
        real(self, record)
        evicting = record.first_episode > old.first_episode and record.end_episode == old.end_episode
        if evicting and len(crashes) < 8:  # an eviction record in place: what kill -9 here leaves
            crashes.append(str(tmp_path / f"crash{len(crashes)}"))
            shutil.copytree(path, crashes[-1])

    monkeypatch.setattr(Committer, "_publish", publish)
    with EpisodeStore.create(path, obs, act, capacity=capacity, commit_interval=3600) as store:
        for e in eps:  # no commit falls due by time: only the stage's bound commits
            store.append_episode(e)
    for crashed in crashes:
        assert verify(crashed).clean
        with EpisodeStore.open(crashed) as store:
            assert store.num_transitions >= capacity // 3, (crashed, store.num_episodes)
            for i in range(store.first_episode, store.end_episode):
                assert_episode_equal(store.episode(i), eps[i])
    assert len(crashes) >= 3


def test_an_episode_longer_than_the_capacity_changes_nothing(store_path, fetch):
    obs, act = fetch
    with EpisodeStore.create(store_path, obs, act, capacity=30, commit_interval=0) as store:
        store.append_episode(make_episode(obs, act, 20, seed=0))
        with pytest.raises(EpisodeValidationError, match="longer than the store's capacity 30"):
            store.append_episode(make_episode(obs, act, 31, seed=1))
        assert store.num_episodes == 1 and store.append_episode(make_episode(obs, act, 5, seed=2)) == 1


def test_sampling_a_writers_handle_commits_only_when_due(store_path, fetch):
    """A snapshot (what a sampler draws from) does not force a commit while the group commit is not due."""
    obs, act = fetch
    with EpisodeStore.create(store_path, obs, act, commit_interval=3600) as store:
        store.append_episode(make_episode(obs, act, 5, seed=0))
        assert len(store.snapshot()) == 1  # nothing committed yet: the first snapshot commits
        generation = store._committer.commit_record.generation
        for i in range(1, 50):
            store.append_episode(make_episode(obs, act, 5, seed=i))
            assert len(store.snapshot()) == 1
        assert store._committer.commit_record.generation == generation
        store.commit_interval = 0
        assert len(store.snapshot()) == 50


def test_an_interrupt_after_the_record_is_in_place_counts_the_commit(store_path, fetch, monkeypatch):
    """Ctrl-C arriving just as the rename returns: the episode is committed, so the handle must know it; the
    next append gets the next id and generation, and a reader sees both episodes intact."""
    obs, act = fetch
    eps = [make_episode(obs, act, 4 + i, seed=i) for i in range(3)]
    store = EpisodeStore.create(store_path, obs, act, commit_interval=0)
    store.append_episode(eps[0])
    reader = EpisodeStore.open(store_path)
    real = os.replace

    def interrupted(src, dst):
        real(src, dst)
        monkeypatch.setattr(os, "replace", real)
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        store.append_episode(eps[1])
    assert store.append_episode(eps[2]) == 2
    generation = store.commit_record.generation
    store.close()
    assert reader.refresh() == 2 and reader.commit_record.generation == generation
    for i, e in enumerate(eps):
        assert_episode_equal(reader.episode(i), e)


@pytest.mark.slow
def test_a_commit_record_write_that_raised_after_it_happened_counts(s3_url, fetch, monkeypatch):
    """Object storage: the PUT of the record was applied and its reply lost. The append succeeds (the record is
    read back), and no episode id or generation is used twice."""
    import s3fs

    url, opts = s3_url
    obs, act = fetch
    eps = [make_episode(obs, act, 4 + i, seed=i) for i in range(3)]
    real, armed = s3fs.S3FileSystem._pipe_file, {"on": False}

    async def reply_lost(self, path, data, *a, **k):
        out = await real(self, path, data, *a, **k)
        if armed["on"] and path.endswith("commit.json"):
            armed["on"] = False
            raise OSError("connection reset by peer")
        return out

    monkeypatch.setattr(s3fs.S3FileSystem, "_pipe_file", reply_lost)
    s3fs.S3FileSystem.clear_instance_cache()  # instances bind their sync methods when made
    store = EpisodeStore.create(url, obs, act, storage_options=opts, commit_interval=0)
    store.append_episode(eps[0])
    armed["on"] = True
    assert store.append_episode(eps[1]) == 1
    assert not armed["on"]
    assert store.append_episode(eps[2]) == 2
    store.close()
    with EpisodeStore.open(url, storage_options=opts) as reader:
        assert reader.end_episode == 3 and reader.commit_record.generation == 3
        for i, e in enumerate(eps):
            assert_episode_equal(reader.episode(i), e)


def _image_spaces():
    obs = spaces.Dict(
        {
            "observation": spaces.Box(0, 255, (3, 16, 16), np.uint8),
            "achieved_goal": spaces.Box(-1, 1, (3,), np.float32),
            "desired_goal": spaces.Box(-1, 1, (3,), np.float32),
        }
    )
    return obs, spaces.Box(-1, 1, (2,), np.float32)


@pytest.fixture
def lz4_threads(monkeypatch) -> list:
    """LZ4 frames of these small images encoded on C threads, as an episode of real frames is: the tasks started."""
    from her_store import _kernels
    from her_store.store import frame_writer as shard_module

    monkeypatch.setattr(shard_module, "SPLIT_BYTES", 1)
    real, tasks = _kernels.encode_lz4_start, []

    def start(*args):
        tasks.append(real(*args))
        return tasks[-1]

    monkeypatch.setattr(_kernels, "encode_lz4_start", start)
    return tasks


@pytest.mark.parametrize("codec", ["lz4", "zstd"])
def test_frames_encoded_across_threads_are_committed_with_their_checksums(store_path, monkeypatch, lz4_threads, codec):
    """Image episodes whose frames threads encode (LZ4: C threads with the appending thread; zstd: the encoder pool
    with it), the caller reusing its arrays as soon as append returns: every frame is stored as given and every
    crc32 matches (verify reads them all)."""
    obs, act = _image_spaces()
    real, by_threads = ShardWriter._encode_part, []

    def encode_part(self, rows):
        if threading.current_thread() is not threading.main_thread():
            by_threads.append(len(rows))
        return real(self, rows)

    monkeypatch.setattr(ShardWriter, "_encode_part", encode_part)
    eps = [make_episode(obs, act, 30, seed=i) for i in range(12)]
    with EpisodeStore.create(store_path, obs, act, commit_interval=3600, compressors={"observation": codec}) as store:
        for e in eps:
            given = {k: v.copy() for k, v in e.items()}
            store.append_episode(given)
            for v in given.values():
                v[...] = 0  # the caller's arrays, reused at once
        threads = store._committer._sharded["steps/observation"]._threads
    assert bool(by_threads if codec == "zstd" else lz4_threads) == bool(threads)
    with EpisodeStore.open(store_path) as store:
        assert verify(store).clean
        for i, e in enumerate(eps):
            assert_episode_equal(store.episode(i), e)
        assert np.all(store.episodes["crc32"] != 0)


def test_an_append_whose_frames_cannot_be_encoded_leaves_no_trace(store_path, monkeypatch):
    """The encoder pool's thread fails while it still reads the caller's rows, and so does the calling thread: append
    raises once the thread is done with them, and nothing of the episode is kept."""
    obs, act = _image_spaces()
    real, failures, read_after = ShardWriter._encode_part, {"thread": 0, "main": 0}, []

    def encode_part(self, rows):
        who = "main" if threading.current_thread() is threading.main_thread() else "thread"
        if failures[who] > 0:
            failures[who] -= 1
            if who == "thread":
                started.set()
                time.sleep(0.3)  # still reading the caller's rows when the calling thread fails
                read_after.append(returned.is_set())
            else:
                started.wait(10)  # the thread has started its share
            raise MemoryError("no memory for the encoded rows")
        return real(self, rows)

    returned, started = threading.Event(), threading.Event()
    monkeypatch.setattr(ShardWriter, "_encode_part", encode_part)
    eps = [make_episode(obs, act, 30, seed=i) for i in range(3)]
    store = EpisodeStore.create(store_path, obs, act, commit_interval=3600, compressors={"observation": "zstd"})
    if not store._committer._sharded["steps/observation"]._threads:
        pytest.skip("one core: no encoder thread")
    store.append_episode(eps[0])
    failures.update(thread=1, main=1)  # both parts of episode 1 fail: append raises
    with pytest.raises(MemoryError):
        store.append_episode(eps[1])
    returned.set()
    assert read_after == [False]  # the thread was done with the rows before append raised
    _appended_again(store, store_path, eps)


def _appended_again(store: EpisodeStore, store_path, eps: list) -> None:
    """After an append of eps[1] failed: the store holds eps[0] alone, the retry gets id 1, and every episode reads
    back as given."""
    assert store._index.end == 1
    assert store.append_episode(eps[1]) == 1  # the retry gets the id the failed call would have had
    store.append_episode(eps[2])
    store.close()
    _reads_back(store_path, eps)


def _reads_back(store_path, eps: list) -> None:
    """The store at ``store_path`` holds exactly ``eps``, as given, every checksum matching."""
    with EpisodeStore.open(store_path) as back:
        assert back.end_episode == len(eps) and verify(back).clean
        for i, e in enumerate(eps):
            assert_episode_equal(back.episode(i), e)


def test_an_append_whose_lz4_task_and_caller_fail_leaves_no_trace(store_path, monkeypatch, lz4_threads):
    """The C threads' task fails (out of memory), and so does the calling thread's encode of the rows again: append
    raises once no thread reads the caller's rows, and nothing of the episode is kept."""
    from her_store import _kernels

    obs, act = _image_spaces()
    eps = [make_episode(obs, act, 30, seed=i) for i in range(3)]
    store = EpisodeStore.create(store_path, obs, act, commit_interval=3600)
    if not store._committer._sharded["steps/observation"]._threads:
        pytest.skip("one core: no encoder thread")
    store.append_episode(eps[0])
    counting, real_part = _kernels.encode_lz4_start, ShardWriter._encode_part
    monkeypatch.setattr(_kernels, "encode_lz4_start", lambda *a: FailingTask(counting(*a)))

    def encode_part(self, rows):
        raise MemoryError("no memory for the encoded rows")

    monkeypatch.setattr(ShardWriter, "_encode_part", encode_part)
    with pytest.raises(MemoryError):
        store.append_episode(eps[1])
    assert len(lz4_threads) == 2 and all(t.done() for t in lz4_threads)
    monkeypatch.setattr(_kernels, "encode_lz4_start", counting)
    monkeypatch.setattr(ShardWriter, "_encode_part", real_part)
    _appended_again(store, store_path, eps)


def test_an_append_failing_on_one_image_key_waits_for_the_threads_reading_another(store_path, monkeypatch):
    """Two image keys: the encoder pool's threads still encode the first key's frames when encoding the second fails;
    append raises only once no thread reads the caller's rows."""
    obs, act = _image_spaces()
    obs = spaces.Dict({**obs.spaces, "pixels": spaces.Box(0, 255, (3, 16, 16), np.uint8)})
    real, log = ShardWriter._encode_part, []

    def encode_part(self, rows):
        in_thread = threading.current_thread() is not threading.main_thread()
        if in_thread and self.array.path.endswith("observation") and fail.is_set():
            started.set()
            time.sleep(0.3)
            log.append("thread done")
        if not in_thread and self.array.path.endswith("pixels") and fail.is_set():
            started.wait(10)  # the thread is reading the first key's rows
            raise MemoryError("no memory for the encoded rows")
        return real(self, rows)

    fail, started = threading.Event(), threading.Event()
    monkeypatch.setattr(ShardWriter, "_encode_part", encode_part)
    store = EpisodeStore.create(
        store_path, obs, act, commit_interval=3600, compressors={"observation": "zstd", "pixels": "zstd"}
    )
    if not store._committer._sharded["steps/observation"]._threads:
        pytest.skip("one core: no encoder thread")
    eps = [make_episode(obs, act, 30, seed=i) for i in range(2)]
    store.append_episode(eps[0])
    fail.set()
    with pytest.raises(MemoryError):
        store.append_episode(eps[1])
    log.append("append raised")
    assert log == ["thread done", "append raised"]
    fail.clear()
    store.append_episode(eps[1])
    store.close()
    _reads_back(store_path, eps)


def test_an_append_failing_on_one_lz4_image_key_waits_for_the_c_threads_encoding_another(
    store_path, monkeypatch, lz4_threads
):
    """Two LZ4 image keys: C threads still encode the first key's frames when starting the second's fails; append
    raises only once they are done with the caller's rows, and the retry stores the episode."""
    from her_store import _kernels

    obs, act = _image_spaces()
    obs = spaces.Dict({**obs.spaces, "pixels": spaces.Box(0, 255, (3, 16, 16), np.uint8)})
    store = EpisodeStore.create(store_path, obs, act, commit_interval=3600)
    if not store._committer._sharded["steps/observation"]._threads:
        pytest.skip("one core: no encoder thread")
    eps = [make_episode(obs, act, 30, seed=i) for i in range(2)]
    store.append_episode(eps[0])
    counting, log = _kernels.encode_lz4_start, []

    class Logged:  # the first key's task, whose wait() is logged
        def __init__(self, task) -> None:
            self.task = task

        def wait(self):
            log.append(("waited", self.task.done()))
            return self.task.wait()

    def start(*args):
        if log:  # the second key's
            raise MemoryError("no memory for the task")
        log.append("started")
        return Logged(counting(*args))

    monkeypatch.setattr(_kernels, "encode_lz4_start", start)
    with pytest.raises(MemoryError):
        store.append_episode(eps[1])
    log.append("append raised")
    assert [e if isinstance(e, str) else e[0] for e in log] == ["started", "waited", "append raised"]
    assert lz4_threads[-1].done()
    monkeypatch.setattr(_kernels, "encode_lz4_start", counting)
    store.append_episode(eps[1])
    store.close()
    _reads_back(store_path, eps)
