"""The commit protocol of her_store/commit.py: group commits, and appends that raise leaving no trace."""

from __future__ import annotations

import errno

import pytest

from her_store import EpisodeStore, EpisodeValidationError
from her_store.storage import Location
from tests.conftest import assert_episode_equal, make_episode


def _fail_commit_records(monkeypatch, times: int = 1) -> None:
    real, left = Location.write_atomic, {"n": times}

    def write_atomic(self, key, data, fsync):
        if key == "commit.json" and left["n"] > 0:
            left["n"] -= 1
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, key, data, fsync)

    monkeypatch.setattr(Location, "write_atomic", write_atomic)


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
