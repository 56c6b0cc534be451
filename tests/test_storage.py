"""The writer lock and lease of her_store/storage.py: lease_ttl checks, fenced take-over, the no-If-Match fallback."""

from __future__ import annotations

import json
import math
import os
import time
import uuid

import pytest

from her_store import EpisodeStore, StoreLockedError, open_store
from her_store.storage import Location, WriterLock
from tests.conftest import assert_episode_equal, make_episode


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, "60", True, None])
def test_lease_ttl_must_be_a_positive_number(store_path, fetch, bad):
    obs, act = fetch
    with pytest.raises(ValueError, match=rf"lease_ttl must be a positive, finite number of seconds, got {bad!r}"):
        EpisodeStore.create(store_path, obs, act, lease_ttl=bad)
    EpisodeStore.create(store_path, obs, act, lease_ttl=0.5).close()
    with pytest.raises(ValueError, match="lease_ttl must be"):
        EpisodeStore.open(store_path, mode="a", lease_ttl=bad)
    with pytest.raises(ValueError, match="lease_ttl must be"):
        open_store(store_path, obs, act, lease_ttl=bad)
    with open_store(store_path, obs, act, lease_ttl=10) as store:  # the failed opens left the lock free
        assert store.num_episodes == 0


def _lease_record(host: str, expires: float) -> bytes:
    record = {"pid": 1, "host": host, "token": uuid.uuid4().hex, "since": time.time(), "expires": expires}
    return json.dumps(record).encode()


def test_a_lost_lease_is_refused_where_if_match_is_ignored(fetch):
    """fsspec's memory filesystem ignores If-Match: the lease falls back to comparing its token before each write."""
    obs, act = fetch
    url = f"memory://her-store-lease-{uuid.uuid4().hex}"
    with EpisodeStore.create(url, obs, act, lease_ttl=600, commit_interval=0) as store:
        kept = make_episode(obs, act, 4, seed=0)
        store.append_episode(kept)
    a = EpisodeStore.open(url, mode="a", lease_ttl=600, commit_interval=3600)
    a.append_episode(make_episode(obs, act, 6, seed=1))
    loc = Location(url)
    other = _lease_record("elsewhere", time.time() + 600)  # another writer broke the lease and holds it
    loc.fs.pipe_file(loc.key_path("writer.lock"), other)
    with pytest.raises(StoreLockedError, match="lost its writer lease writer.lock to pid 1 on host elsewhere"):
        a.flush()
    with pytest.raises(StoreLockedError):
        a.close()
    assert loc.read_bytes("writer.lock") == other  # closing left the other writer's lease alone
    with EpisodeStore.open(url) as store:
        assert store.num_episodes == 1
        assert_episode_equal(store.episode(0), kept)
    loc.fs.rm_file(loc.key_path("writer.lock"))
    EpisodeStore.open(url, mode="a").close()
    assert not loc.exists("writer.lock")  # a writer that still holds its lease removes it on close


def test_two_writers_taking_over_one_stale_lease_on_s3(s3_url, monkeypatch):
    """B takes the stale lease over between A's read of it and A's write: A's write, conditioned on the ETag it
    read, fails, and A is refused instead of overwriting (or deleting) B's fresh lease."""
    url, opts = s3_url
    loc = Location(url, opts)
    loc.fs.makedirs(loc.root, exist_ok=True)
    loc.fs.pipe_file(loc.key_path("writer.lock"), _lease_record("elsewhere", time.time() - 1))
    a = WriterLock(Location(url, opts), "writer.lock", lease_ttl=60)
    b = WriterLock(Location(url, opts), "writer.lock", lease_ttl=60)
    read, taken = a.location.read_bytes, []

    def read_then_b_takes_over(key: str) -> bytes | None:
        raw = read(key)
        if not taken:
            b.acquire()
            taken.append(b)
        return raw

    monkeypatch.setattr(a.location, "read_bytes", read_then_b_takes_over)
    with pytest.raises(StoreLockedError, match=rf"pid {os.getpid()}"):
        a.acquire()
    b.ensure_held()  # B still holds it: its lease is as B last wrote it
    b.release()
    a.release()
