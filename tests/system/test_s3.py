"""The same store behaviour on object storage: s3fs against moto's S3 server on loopback."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import zarr

from her_store import EpisodeStore, open_store
from her_store.errors import CorruptStoreError, StoreLockedError
from tests.conftest import ROOT, assert_episode_equal, make_episode, remote_handle_forks


def test_a_create_over_someone_elses_zarr_array_on_s3_changes_nothing(s3_url, fetch):
    from her_store.errors import StoreExistsError

    url, opts = s3_url
    obs, act = fetch
    theirs = zarr.open_array(f"{url}/episodes/length", mode="w", shape=(4,), dtype="f8", storage_options=opts)
    theirs[:] = 7.5
    with pytest.raises(StoreExistsError, match="already holds episodes/length/zarr.json"):
        EpisodeStore.create(url, obs, act, storage_options=opts)
    again = zarr.open_array(f"{url}/episodes/length", mode="r", storage_options=opts)
    assert again.dtype == np.float64 and again[:].tolist() == [7.5] * 4


def test_round_trip_resume_and_reader_refresh(s3_url, fetch):
    url, opts = s3_url
    obs, act = fetch
    eps = [make_episode(obs, act, T, seed=i, info_keys=("is_success",)) for i, T in enumerate([5, 50, 1, 20, 33])]
    with EpisodeStore.create(
        url, obs, act, storage_options=opts, info_keys=["is_success"], chunk_rows=16, metadata={"env_id": "X-v0"}
    ) as store:
        for e in eps[:3]:
            store.append_episode(e)
        store.flush()  # object storage commits every 2 s by default
        with EpisodeStore.open(url, storage_options=opts) as reader:
            assert reader.num_episodes == 3
            store.append_episode(eps[3])
            store.flush()
            assert reader.refresh() == 1
            assert_episode_equal(reader.episode(3), eps[3])
    with open_store(url, obs, act, storage_options=opts, info_keys=["is_success"]) as store:
        assert store.append_episode(eps[4]) == 4
    with EpisodeStore.open(url, storage_options=opts) as store:
        assert store.metadata["env_id"] == "X-v0" and len(store) == sum(len(e["action"]) for e in eps)
        for i, e in enumerate(eps):
            assert_episode_equal(store.episode(i), e)


@pytest.mark.slow
def test_a_reader_refuses_a_store_created_again_under_it_on_s3(s3_url, fetch):
    """An S3 store deleted and created again under an open reader is another store: refresh says so (its root
    object's ETag, then its created_at) rather than pair the new index with chunks it cached from the old one. A card
    edit, which replaces zarr.json too, is not a new store."""
    import s3fs

    url, opts = s3_url
    obs, act = fetch
    with EpisodeStore.create(url, obs, act, storage_options=opts, commit_interval=0) as w:
        for i in range(4):
            w.append_episode(make_episode(obs, act, 5, seed=i))
    with EpisodeStore.open(url, storage_options=opts) as reader:
        assert reader.episode(3) is not None
        with EpisodeStore.open(url, mode="a", storage_options=opts, commit_interval=0) as w:
            w.update_metadata(description="edited")
            w.append_episode(make_episode(obs, act, 5, seed=4))
        assert reader.refresh() == 1
        s3fs.S3FileSystem(**opts).rm(url, recursive=True)
        with EpisodeStore.create(url, obs, act, storage_options=opts, commit_interval=0) as w:
            for i in range(6):
                w.append_episode(make_episode(obs, act, 3, seed=100 + i))
        with pytest.raises(CorruptStoreError, match="created again since this handle opened it"):
            reader.refresh()
        s3fs.S3FileSystem(**opts).rm(url, recursive=True)
        with pytest.raises(CorruptStoreError, match="removed"):
            reader.refresh()


@pytest.mark.slow
def test_ring_on_s3(s3_url, fetch):
    url, opts = s3_url
    obs, act = fetch
    eps = [make_episode(obs, act, 12, seed=i) for i in range(40)]
    with EpisodeStore.create(
        url, obs, act, storage_options=opts, capacity=100, chunk_rows=16, commit_interval=0
    ) as store:
        for e in eps:
            store.append_episode(e)
        assert store.num_transitions == 96 and store.first_episode == 32
    with EpisodeStore.open(url, storage_options=opts) as store:
        for i in range(32, 40):
            assert_episode_equal(store.episode(i), eps[i])


def test_images_compressed_on_s3(s3_url):
    from tests.store.test_store import SPACE_CASES

    url, opts = s3_url
    obs, act = SPACE_CASES["uint8-image"]
    eps = [make_episode(obs, act, 9, seed=i) for i in range(4)]
    with EpisodeStore.create(url, obs, act, storage_options=opts) as store:
        for e in eps:
            store.append_episode(e)
    with EpisodeStore.open(url, storage_options=opts) as store:
        for i, e in enumerate(eps):
            assert_episode_equal(store.episode(i), e)


@pytest.mark.slow
def test_lease_names_the_holder_and_a_dead_holder_is_taken_over(s3_url, fetch):
    url, opts = s3_url
    obs, act = fetch
    with EpisodeStore.create(url, obs, act, storage_options=opts):
        with pytest.raises(StoreLockedError, match=rf"pid {os.getpid()} on host {socket.gethostname()}"):
            EpisodeStore.open(url, mode="a", storage_options=opts)
    # released on close
    EpisodeStore.open(url, mode="a", storage_options=opts).close()
    # a writer killed with -9 leaves its lease behind; a dead pid on this host makes it stale
    code = (
        "import sys, json\nfrom her_store import EpisodeStore\n"
        "s = EpisodeStore.open(sys.argv[1], mode='a', storage_options=json.loads(sys.argv[2]))\n"
        "print('locked', flush=True)\nsys.stdin.read()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, url, json.dumps(opts)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    with pytest.raises(StoreLockedError, match=f"pid {proc.pid}"):
        EpisodeStore.open(url, mode="a", storage_options=opts)
    proc.kill()
    proc.wait()
    with EpisodeStore.open(url, mode="a", storage_options=opts) as store:
        assert store.append_episode(make_episode(obs, act, 3, seed=0)) == 0


def test_an_expired_lease_of_another_host_is_taken_over(s3_url, fetch):
    import s3fs

    url, opts = s3_url
    obs, act = fetch
    EpisodeStore.create(url, obs, act, storage_options=opts).close()
    fs = s3fs.S3FileSystem(**opts)
    lease = url[len("s3://") :] + "/writer.lock"
    now = time.time()
    fs.pipe_file(lease, json.dumps({"pid": 1, "host": "elsewhere", "since": now, "expires": now + 3600}).encode())
    with pytest.raises(StoreLockedError, match="pid 1 on host elsewhere"):
        EpisodeStore.open(url, mode="a", storage_options=opts)
    fs.pipe_file(lease, json.dumps({"pid": 1, "host": "elsewhere", "since": now - 120, "expires": now - 60}).encode())
    EpisodeStore.open(url, mode="a", storage_options=opts).close()


def test_plain_zarr_reads_the_s3_store(s3_url, fetch):
    url, opts = s3_url
    obs, act = fetch
    e = make_episode(obs, act, 7, seed=5)
    with EpisodeStore.create(url, obs, act, storage_options=opts) as store:
        store.append_episode(e)
    root = zarr.open_group(url, mode="r", storage_options=opts)
    path, a, b = next(
        (arr["path"], a, b)
        for arr in root.attrs["her_store"]["layout"]
        for n, a, b in arr["columns"]
        if n == "observation"
    )
    start, T = int(root["episodes/start_row"][0]), int(root["episodes/length"][0])
    np.testing.assert_array_equal(root[path][start : start + T + 1, a:b], e["observation"])


def test_corrupt_commit_record_on_s3(s3_url, fetch):
    import s3fs

    url, opts = s3_url
    obs, act = fetch
    EpisodeStore.create(url, obs, act, storage_options=opts).close()
    s3fs.S3FileSystem(**opts).pipe_file(url[len("s3://") :] + "/commit.json", b"garbage")
    with pytest.raises(CorruptStoreError, match="unreadable"):
        EpisodeStore.open(url, storage_options=opts)


@pytest.mark.slow
def test_sampler_reads_s3_through_the_chunk_cache(s3_url, fetch):
    from her_store import HerSampler
    from tests.sampling.test_sampler import sparse_reward

    url, opts = s3_url
    obs, act = fetch
    eps = [make_episode(obs, act, 30, seed=i) for i in range(20)]
    with EpisodeStore.create(url, obs, act, storage_options=opts, chunk_rows=64) as store:
        for e in eps:
            store.append_episode(e)
    with EpisodeStore.open(url, storage_options=opts) as store:
        with HerSampler(store, 500, reward_fn=sparse_reward, seed=0) as s:
            b = s.sample()
            ids, t = b.episode_ids.numpy(), b.steps.numpy()
            np.testing.assert_array_equal(
                b.observations["observation"].numpy(), np.stack([eps[e]["observation"][k] for e, k in zip(ids, t)])
            )
            np.testing.assert_array_equal(
                b.next_observations["observation"].numpy(),
                np.stack([eps[e]["observation"][k + 1] for e, k in zip(ids, t)]),
            )
            cache = s.reader.arrays["packs/float32"]
            assert cache.misses == 10 and cache.hits == 0  # 620 rows in 10 chunks: one GET each
            s.sample()
            assert cache.misses == 10 and cache.hits == 10  # then served from the decoded-chunk cache



# A writer that takes the lease, says so, waits for a line on stdin, then appends two episodes and commits them.
LEASED_WRITER = """
import json, sys
from her_store import EpisodeStore
from her_store.errors import StoreLockedError
from tests.conftest import fetch_spaces, make_episode
obs, act = fetch_spaces()
store = EpisodeStore.open(sys.argv[1], mode="a", storage_options=json.loads(sys.argv[2]), lease_ttl=float(sys.argv[3]),
                          commit_interval=3600)
print("locked", flush=True)
sys.stdin.readline()
try:
    for seed in (100, 101):
        store.append_episode(make_episode(obs, act, 7, seed=seed))
    store.flush()
    print("committed", flush=True)
except StoreLockedError as e:
    print("refused", e, flush=True)
"""


def _take_over(url: str, opts: dict, deadline_s: float = 120.0) -> EpisodeStore:
    """Open for append as soon as the current lease is stale (polls: a loaded machine may be slow to get there)."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            return EpisodeStore.open(url, mode="a", storage_options=opts, commit_interval=0)
        except StoreLockedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _lease(url: str, opts: dict) -> dict:
    import s3fs

    return json.loads(s3fs.S3FileSystem(**opts).cat_file(url[len("s3://") :] + "/writer.lock"))


@pytest.mark.slow
def test_a_suspended_writer_that_lost_its_lease_commits_nothing(s3_url, fetch):
    url, opts = s3_url
    obs, act = fetch
    EpisodeStore.create(url, obs, act, storage_options=opts).close()
    proc = subprocess.Popen(
        [sys.executable, "-c", LEASED_WRITER, url, json.dumps(opts), "2.0"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
    )
    try:
        assert proc.stdout.readline().strip() == "locked"
        os.kill(proc.pid, signal.SIGSTOP)  # frozen (a suspended VM, a long GC pause): no renewal past its TTL
        eps = [make_episode(obs, act, 9, seed=i) for i in range(3)]
        with _take_over(url, opts) as b:
            for e in eps:
                b.append_episode(e)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        os.kill(proc.pid, signal.SIGCONT)
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()  # SIGKILL ends a stopped process too
        proc.wait()
    assert out.startswith("refused"), out
    assert "lost its writer lease" in out and f"pid {os.getpid()}" in out, out
    with EpisodeStore.open(url, storage_options=opts) as store:
        assert (store.first_episode, store.end_episode) == (0, 3)
        assert len(store) == 27
        for i, e in enumerate(eps):
            assert_episode_equal(store.episode(i, verify=True), e)


@pytest.mark.slow
def test_an_idle_writer_keeps_its_lease_past_its_ttl(s3_url, fetch):
    url, opts = s3_url
    obs, act = fetch
    ttl = 3.0
    with EpisodeStore.create(url, obs, act, storage_options=opts, lease_ttl=ttl, commit_interval=0) as a:
        first, deadline = _lease(url, opts), time.monotonic() + 300
        while _lease(url, opts)["expires"] <= first["expires"] + ttl:  # idle: no append, no commit
            assert time.monotonic() < deadline, "the lease was not renewed after its first expiry in 300 s"
            time.sleep(0.2)
        # renewed in the background after the time the first lease expired: still held
        with pytest.raises(StoreLockedError, match=rf"pid {os.getpid()} on host"):
            EpisodeStore.open(url, mode="a", storage_options=opts)
        e = make_episode(obs, act, 5, seed=1)
        assert a.append_episode(e) == 0
    assert f"her_store lease {url}" not in [t.name for t in threading.enumerate()]  # renewal stopped at close
    with EpisodeStore.open(url, storage_options=opts) as store:
        assert_episode_equal(store.episode(0), e)


@pytest.mark.slow
def test_a_writer_checks_its_lease_before_every_commit(s3_url, fetch):
    import s3fs

    url, opts = s3_url
    obs, act = fetch
    # a long TTL: its background renewal does not run during this test, so only the pre-commit check can refuse
    a = EpisodeStore.create(url, obs, act, storage_options=opts, lease_ttl=3600, commit_interval=3600)
    for seed in (100, 101):
        a.append_episode(make_episode(obs, act, 7, seed=seed))
    # another host judged the lease expired (its clock runs ahead) and broke it; B then takes over
    now = time.time()
    s3fs.S3FileSystem(**opts).pipe_file(
        url[len("s3://") :] + "/writer.lock",
        json.dumps({"pid": 1, "host": "elsewhere", "token": "x", "since": now - 1200, "expires": now - 600}).encode(),
    )
    eps = [make_episode(obs, act, 9, seed=i) for i in range(3)]
    b = EpisodeStore.open(url, mode="a", storage_options=opts, commit_interval=0)
    for e in eps:
        b.append_episode(e)
    time.sleep(0.5)  # A idles a little, then commits what it staged
    with pytest.raises(StoreLockedError, match="lost its writer lease"):
        a.flush()
    with pytest.raises(StoreLockedError):
        a.close()  # its staged episodes are still refused; closing must not remove B's lease
    with pytest.raises(StoreLockedError, match=rf"pid {os.getpid()} on host"):
        EpisodeStore.open(url, mode="a", storage_options=opts)
    b.close()
    with EpisodeStore.open(url, storage_options=opts) as store:
        assert (store.first_episode, store.end_episode) == (0, 3)
        for i, e in enumerate(eps):
            assert_episode_equal(store.episode(i, verify=True), e)


_FROZEN_MID_COMMIT = """
import json, os, signal, sys
sys.path.insert(0, sys.argv[3])
import s3fs
real = s3fs.S3FileSystem._pipe_file
armed = [False]

async def pipe(self, path, data, *a, **k):
    if armed[0] and "/packs/" in path:  # past the commit's lease check, at its first data chunk
        armed[0] = False
        print("frozen", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    return await real(self, path, data, *a, **k)

s3fs.S3FileSystem._pipe_file = pipe
from her_store import EpisodeStore
from her_store.errors import StoreLockedError
from tests.conftest import fetch_spaces, make_episode
obs, act = fetch_spaces()
a = EpisodeStore.open(
    sys.argv[1], mode="a", storage_options=json.loads(sys.argv[2]), lease_ttl=2.0, commit_interval=100
)
for i in range(2):
    a.append_episode(make_episode(obs, act, 6, seed=100 + i))
armed[0] = True
try:
    a.flush()
    print("committed", flush=True)
except StoreLockedError:
    print("refused", flush=True)
"""


@pytest.mark.slow
def test_a_writer_frozen_in_the_middle_of_a_commit_cannot_replace_the_next_writers_commits(s3_url, fetch):
    """Frozen past its lease after its pre-commit check, writer A resumes inside its commit: the index and the
    commit record are fenced, so B's commit record stands and the store opens; only rows of the data chunk A was
    writing can be damaged (FORMAT.md, Locking), and those fail their crc32."""
    url, opts = s3_url
    obs, act = fetch
    first = make_episode(obs, act, 5, seed=0)
    with EpisodeStore.create(url, obs, act, storage_options=opts) as store:
        store.append_episode(first)
    root = ROOT
    a = subprocess.Popen(
        [sys.executable, "-c", _FROZEN_MID_COMMIT, url, json.dumps(opts), root], stdout=subprocess.PIPE, text=True
    )
    assert a.stdout.readline().strip() == "frozen"
    time.sleep(3.0)  # past A's lease_ttl
    theirs = [make_episode(obs, act, 4, seed=200 + i) for i in range(3)]
    with EpisodeStore.open(url, mode="a", storage_options=opts, commit_interval=0) as b:
        assert [b.append_episode(e) for e in theirs] == [1, 2, 3]
    os.kill(a.pid, signal.SIGCONT)
    assert a.stdout.readline().strip() == "refused"
    a.wait(timeout=120)
    with EpisodeStore.open(url, storage_options=opts) as store:
        assert store.end_episode == 4 and list(store.episodes["length"]) == [5, 4, 4, 4]
        assert_episode_equal(store.episode(0), first)
        for i, e in enumerate(theirs, 1):
            try:
                assert_episode_equal(store.episode(i), e)
            except CorruptStoreError:
                pass  # rows of the one data chunk A wrote while frozen: found by their crc32


# -- sharded image arrays read by byte range ------------------------------------------------------------------------
PIXELS = (3, 8, 8)


def _pixel_spaces():
    from gymnasium import spaces

    box = spaces.Box(-np.inf, np.inf, (2,), np.float32)
    obs = spaces.Dict({"observation": spaces.Box(0, 255, PIXELS, np.uint8), "achieved_goal": box, "desired_goal": box})
    return obs, spaces.Box(-1.0, 1.0, (2,), np.float32)


def _frames(e, s) -> np.ndarray:
    """The model's frames of episodes ``e`` at steps ``s``: the first pixels say (e, s); a third of the frames are
    otherwise zeros, the rest noise, so frames compress to different sizes and rewriting rows of a shard moves the
    byte ranges of the rows after them."""
    e, s = np.asarray(e, np.uint64), np.asarray(s, np.uint64)
    x = (e[:, None] * np.uint64(7919) + s[:, None] * np.uint64(104729) + np.arange(192, dtype=np.uint64)) * np.uint64(
        2654435761
    )
    f = ((x >> np.uint64(13)) % np.uint64(251)).astype(np.uint8)
    f[(e + s) % np.uint64(3) == 0] = 0
    f[:, 0], f[:, 1], f[:, 2] = e % np.uint64(256), e // np.uint64(256), s
    return f.reshape(-1, *PIXELS)


def _pixel_episode(e: int) -> dict[str, np.ndarray]:
    T = 2 + e % 5
    s = np.arange(T + 1)
    goal = np.stack([np.full(T + 1, e), s], axis=1).astype(np.float32)
    return {
        "observation": _frames(np.full(T + 1, e), s), "achieved_goal": goal, "desired_goal": goal + 100,
        "action": np.zeros((T, 2), np.float32), "reward": np.zeros(T, np.float32),
        "terminated": np.zeros(T, bool), "truncated": np.arange(T) == T - 1,
    }


def _pixel_store(url: str, opts: dict, capacity: int | None = None) -> EpisodeStore:
    obs, act = _pixel_spaces()
    return EpisodeStore.create(url, obs, act, storage_options=opts, chunk_rows=16, capacity=capacity, commit_interval=0)


def _rows_of(view, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(episode, step) of array rows of the view's episodes."""
    e = np.array([i for i in range(view.first, view.end) for _ in range(int(view.lengths[i - view.first]) + 1)])
    s = np.concatenate([np.arange(int(n) + 1) for n in view.lengths])
    at = np.concatenate([np.arange(int(r), int(r) + int(n) + 1) for r, n in zip(view.start_rows, view.lengths)])
    where = {int(a): i for i, a in enumerate(at)}
    k = np.array([where[int(r)] for r in rows])
    return e[k], s[k]


@pytest.mark.slow
def test_a_sharded_frame_read_under_a_replaced_shards_index_reads_the_index_again(s3_url):
    from her_store.format.frames import parse_index
    from her_store.store.rows import ChunkReader

    url, opts = s3_url
    fs = __import__("s3fs").S3FileSystem(**opts)
    with _pixel_store(url, opts, capacity=40) as w, EpisodeStore.open(url, storage_options=opts) as r:
        for e in range(16):  # the ring has wrapped: the next episode overwrites rows in the middle of a shard
            w.append_episode(_pixel_episode(e))
        r.refresh()
        reader = ChunkReader(r, io_threads=0)
        arr = reader.arrays["steps/observation"]
        arr.WHOLE_RUNS = 1 << 30  # every shard read by ranges
        view = r.snapshot()
        reader.observe(view)
        cr, n_shards = arr.chunk_rows, w.commit_record.array_rows // arr.chunk_rows

        def index(c: int) -> np.ndarray:
            return np.stack(parse_index(fs.cat_file(f"{url[5:]}/{arr._key(c)}"), cr, "")).T

        live = np.concatenate([np.arange(a, a + n + 1) for a, n in zip(view.start_rows, view.lengths)])
        np.testing.assert_array_equal(reader.gather("steps/observation", live), _frames(*_rows_of(view, live)))
        assert arr._ranged is True  # moto refuses a GET whose If-Match names another ETag
        assert arr.misses == n_shards and arr.replaced == 0  # each shard's index read once
        gets = arr.gets
        np.testing.assert_array_equal(reader.gather("steps/observation", live[:2]), _frames(*_rows_of(view, live[:2])))
        assert arr.gets == gets + 1  # two adjacent frames: one ranged GET, the index cached

        before = np.stack([index(c) for c in range(n_shards)])
        w.append_episode(_pixel_episode(16))  # replaces the shards it writes (one PUT each); not observed here
        after = np.stack([index(c) for c in range(n_shards)])
        r.refresh()
        new = np.arange(r.snapshot().start_rows[-1], r.snapshot().start_rows[-1] + r.snapshot().lengths[-1] + 1)
        kept = np.setdiff1d(live, new)  # rows of the view's episodes the commit did not overwrite
        moved = kept[(before[kept // cr, kept % cr] != after[kept // cr, kept % cr]).any(axis=1)]
        assert len(moved), "the commit moved no live frame: old offsets would still be right"
        np.testing.assert_array_equal(reader.gather("steps/observation", moved), _frames(*_rows_of(view, moved)))
        assert arr.replaced == len(np.unique(moved // cr))  # each such shard answered 412, its index read again
        reader.close()


@pytest.mark.slow
def test_a_readers_sampler_reads_every_frame_while_the_writer_appends_and_a_ring_wraps(s3_url):
    from her_store import HerSampler
    from tests.sampling.test_sampler import sparse_reward

    url, opts = s3_url
    with _pixel_store(url, opts, capacity=16) as w, EpisodeStore.open(url, storage_options=opts) as r:
        for e in range(4):
            w.append_episode(_pixel_episode(e))
        r.refresh()
        # the view is refreshed every third batch only: most batches read shards replaced since it was taken
        with HerSampler(r, 24, reward_fn=sparse_reward, seed=0, refresh_interval=3600) as sampler:
            arr = sampler.reader.arrays["steps/observation"]
            for e in range(4, 14):
                arr.WHOLE_RUNS = 1 << 30 if e % 4 < 2 else 1  # shards read by ranges, then whole, then by ranges
                if e % 3 == 0:
                    sampler.refresh()
                b = sampler.sample()
                ids, t = b.episode_ids.numpy(), b.steps.numpy()
                np.testing.assert_array_equal(b.observations["observation"].numpy(), _frames(ids, t), f"batch {e}")
                np.testing.assert_array_equal(b.next_observations["observation"].numpy(), _frames(ids, t + 1))
                w.append_episode(_pixel_episode(e))
            assert arr._ranged is True and arr.replaced > 0  # conditional GETs found replaced shards
        written = sum(2 + e % 5 + 1 for e in range(14))
        assert written >= 2 * w.commit_record.array_rows  # the ring wrapped twice


@pytest.mark.slow
def test_a_crafted_shard_on_s3_is_a_corrupt_store(s3_url):
    import google_crc32c
    import s3fs

    from her_store.format.frames import build_shard, index_nbytes
    from her_store.store.rows import ChunkReader

    url, opts = s3_url
    with _pixel_store(url, opts) as w:
        for e in range(3):
            w.append_episode(_pixel_episode(e))
    fs = s3fs.S3FileSystem(**opts)
    key = f"{url[5:]}/steps/observation/c.0.0.0.0"
    good, n = fs.cat_file(key), index_nbytes(16)
    index = np.frombuffer(good[-n:-4], "<u8").reshape(16, 2).copy()
    index[5] = [len(good) - n - 10, 20]  # ten bytes past the shard's data
    past = good[:-n] + index.tobytes() + google_crc32c.value(index.tobytes()).to_bytes(4, "little")
    crafted = {
        "fails its crc32c": good[:-1] + bytes([good[-1] ^ 1]),
        "points past the shard": past,
        "not one row's LZ4 block": build_shard([b"\xff" * 40] * 16),
        "shorter than the index": b"tiny",
    }
    for match, raw in crafted.items():
        fs.pipe_file(key, raw)
        with EpisodeStore.open(url, storage_options=opts) as r:
            for runs in (1 << 30, 1):  # rows 0 and 5 read by ranges, then the shard whole
                reader = ChunkReader(r, io_threads=0)
                reader.arrays["steps/observation"].WHOLE_RUNS = runs
                reader.observe(r.snapshot())
                with pytest.raises(CorruptStoreError, match=match):
                    reader.gather("steps/observation", np.array([0, 5]))
                reader.close()


def test_sharded_frames_where_gets_cannot_be_conditioned_are_read_whole():
    from her_store.store.rows import ChunkReader

    url = f"memory://s{os.getpid()}-{time.monotonic_ns()}/store"
    with _pixel_store(url, {}) as w:
        for e in range(6):
            w.append_episode(_pixel_episode(e))
        reader = ChunkReader(w, io_threads=0)
        view = w.snapshot()
        reader.observe(view)
        arr = reader.arrays["steps/observation"]
        rows = np.array([1, 9, 20, 21, 2])
        np.testing.assert_array_equal(reader.gather("steps/observation", rows), _frames(*_rows_of(view, rows)))
        assert arr._ranged is False and arr.gets == 2  # no ETag to condition on: shards 0 and 1 fetched whole
        reader.close()


def test_a_handle_and_a_sampler_on_s3_read_in_a_forked_child(s3_url):
    """Made in the parent, used in a forked child: refresh, an episode, the parent's sampler and a new one all read
    (they raised fsspec's "not fork-safe" or botocore's error of a future on another loop)."""
    from tests.conftest import fetch_spaces

    url, opts = s3_url
    obs, act = fetch_spaces()
    with EpisodeStore.create(url, obs, act, storage_options=opts) as store:
        for i in range(6):
            store.append_episode(make_episode(obs, act, 5 + i, i))
    remote_handle_forks(url, opts)
