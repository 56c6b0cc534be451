"""The same store behaviour on object storage: s3fs against moto's S3 server on loopback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import zarr

from her_store import CorruptStoreError, EpisodeStore, StoreLockedError, open_store
from tests.conftest import assert_episode_equal, make_episode


def test_round_trip_resume_and_reader_refresh(s3_url, fetch):
    url, opts = s3_url
    obs, act = fetch
    eps = [make_episode(obs, act, T, seed=i, info_keys=("is_success",)) for i, T in enumerate([5, 50, 1, 20, 33])]
    with EpisodeStore.create(url, obs, act, storage_options=opts, info_keys=["is_success"], chunk_rows=16, metadata={"env_id": "X-v0"}) as store:
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


def test_ring_on_s3(s3_url, fetch):
    url, opts = s3_url
    obs, act = fetch
    eps = [make_episode(obs, act, 12, seed=i) for i in range(40)]
    with EpisodeStore.create(url, obs, act, storage_options=opts, capacity=100, chunk_rows=16, commit_interval=0) as store:
        for e in eps:
            store.append_episode(e)
        assert store.num_transitions == 96 and store.first_episode == 32
    with EpisodeStore.open(url, storage_options=opts) as store:
        for i in range(32, 40):
            assert_episode_equal(store.episode(i), eps[i])


def test_images_compressed_on_s3(s3_url):
    from tests.test_store import SPACE_CASES

    url, opts = s3_url
    obs, act = SPACE_CASES["uint8-image"]
    eps = [make_episode(obs, act, 9, seed=i) for i in range(4)]
    with EpisodeStore.create(url, obs, act, storage_options=opts) as store:
        for e in eps:
            store.append_episode(e)
    with EpisodeStore.open(url, storage_options=opts) as store:
        for i, e in enumerate(eps):
            assert_episode_equal(store.episode(i), e)


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
        "import sys, json, time\nfrom her_store import EpisodeStore\n"
        "s = EpisodeStore.open(sys.argv[1], mode='a', storage_options=json.loads(sys.argv[2]))\n"
        "print('locked', flush=True)\ntime.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, url, json.dumps(opts)], stdout=subprocess.PIPE, text=True)
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
    fs.pipe_file(lease, json.dumps({"pid": 1, "host": "elsewhere", "since": now, "expires": now + 60}).encode())
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
    path, a, b = next((arr["path"], a, b) for arr in root.attrs["her_store"]["layout"] for n, a, b in arr["columns"] if n == "observation")
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


def test_sampler_reads_s3_through_the_chunk_cache(s3_url, fetch):
    from her_store import HerSampler
    from tests.test_sampler import sparse_reward

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
            np.testing.assert_array_equal(b.observations["observation"].numpy(), np.stack([eps[e]["observation"][k] for e, k in zip(ids, t)]))
            np.testing.assert_array_equal(b.next_observations["observation"].numpy(), np.stack([eps[e]["observation"][k + 1] for e, k in zip(ids, t)]))
            cache = s.reader.arrays["packs/float32"]
            assert cache.misses == 10 and cache.hits == 0  # 620 rows in 10 chunks: one GET each
            s.sample()
            assert cache.misses == 10 and cache.hits == 10  # then served from the decoded-chunk cache
