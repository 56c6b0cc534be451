"""ChunkReader: the decoded-chunk cache serves committed rows only and reads again exactly the chunks commits change."""

from __future__ import annotations

import numpy as np
import zarr.codecs

from her_store import EpisodeStore, HerSampler
from her_store.reader import CachedArray, ChunkReader
from tests.test_differential import ACT, OBS, episode, rows, wrong_rows
from tests.test_sampler import sparse_reward

CHUNK_ROWS = 16


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


def test_the_prefetch_thread_gathers_while_commits_change_cached_chunks(tmp_path):
    for capacity in (None, 48):
        with _create(tmp_path / f"s{capacity}", capacity) as store:
            store.append_episode(episode(0))
            with HerSampler(store, 64, reward_fn=sparse_reward, seed=0, prefetch=2) as sampler:
                for e in range(1, 60):
                    store.append_episode(episode(e))
                    problem = wrong_rows(sampler.sample(), 0, store.end_episode)
                    assert problem is None, f"capacity {capacity}, after episode {e}: {problem}"
