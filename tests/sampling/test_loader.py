"""HerIterableDataset: DataLoader workers (fork and spawn) sample the store's rows, in streams of their own."""

from __future__ import annotations

import functools
import gc
import multiprocessing

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from her_store import EpisodeStore, open_store
from her_store.datasets.view import ShardedView
from her_store.errors import NotAStoreError
from her_store.sampling.loader import HerIterableDataset
from tests.conftest import fetch_spaces, make_episode

B = 8


def sparse_reward(achieved, desired, infos):
    """Module level, so that spawn workers unpickle it."""
    return -(np.linalg.norm(np.asarray(achieved) - np.asarray(desired), axis=-1) > 0.05).astype(np.float32)


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    """12 episodes of 5..16 steps (126 transitions)."""
    obs, act = fetch_spaces()
    path = str(tmp_path_factory.mktemp("loader") / "store")
    with EpisodeStore.create(path, obs, act) as store:
        for i in range(12):
            store.append_episode(make_episode(obs, act, T=5 + i, seed=i))
    return path


def dataset(source, **kw) -> HerIterableDataset:
    kw.setdefault("batch_size", B)
    return HerIterableDataset(source, reward_fn=sparse_reward, **kw)


def load(ds: HerIterableDataset, context: str | None = "fork", workers: int = 2) -> list:
    loader = DataLoader(ds, batch_size=None, num_workers=workers, multiprocessing_context=context if workers else None)
    return list(loader)


def draws(batches) -> list[tuple[list[int], list[int]]]:
    """Each batch's (episode ids, steps): what a stream drew."""
    return [(b.episode_ids.tolist(), b.steps.tolist()) for b in batches]


def assert_rows_from_store(batches, path: str) -> None:
    """Every row is the stored transition at its (episode_id, step); relabelled rows have recomputed rewards."""
    with EpisodeStore.open(path) as store:
        episodes = {}
        for b in batches:
            assert b.actions.device.type == "cpu" and b.actions.shape == (B, 4)
            for i, (e, t) in enumerate(zip(b.episode_ids.tolist(), b.steps.tolist())):
                ep = episodes.setdefault(e, store.episode(e))
                for k in ("observation", "achieved_goal"):
                    np.testing.assert_array_equal(b.observations[k][i].numpy(), ep[k][t])
                    np.testing.assert_array_equal(b.next_observations[k][i].numpy(), ep[k][t + 1])
                np.testing.assert_array_equal(b.actions[i].numpy(), ep["action"][t])
                if b.is_relabeled[i]:
                    want = sparse_reward(ep["achieved_goal"][t + 1], b.observations["desired_goal"][i].numpy(), {})
                    assert b.rewards[i, 0].item() == want
                else:
                    np.testing.assert_array_equal(b.observations["desired_goal"][i].numpy(), ep["desired_goal"][t])
                    assert b.rewards[i, 0].item() == ep["reward"][t]


def test_fork_workers_sample_store_rows_in_streams_of_their_own(store_path):
    ds = dataset(store_path, batches_per_epoch=6)
    batches = load(ds)
    assert len(batches) == 6 == len(DataLoader(ds, batch_size=None))
    assert_rows_from_store(batches, store_path)
    # in-order DataLoader: batch i came from worker i % 2
    w0, w1 = draws(batches[0::2]), draws(batches[1::2])
    assert all(a != b for a, b in zip(w0, w1))
    # worker 0's stream is a function of (seed, rank, worker id) only: the main process as worker 0 draws it too
    assert draws(load(dataset(store_path, batches_per_epoch=3), workers=0)) == w0
    assert draws(load(dataset(store_path, batches_per_epoch=6, seed=1))) != w0 + w1


@pytest.mark.slow
def test_spawn_workers_draw_the_fork_workers_streams(store_path):
    ds = dataset(store_path, batches_per_epoch=4)
    spawned = load(ds, "spawn")
    assert_rows_from_store(spawned, store_path)
    assert draws(spawned) == draws(load(ds, "fork"))
    assert draws(spawned[0::2]) != draws(spawned[1::2])


def test_ranks_draw_different_streams_and_the_same_ones_again(store_path):
    streams = [draws(load(dataset(store_path, batches_per_epoch=4, rank=r, world_size=2))) for r in (0, 1)]
    per_worker = [s[w] for s in streams for w in (0, 1)]  # 2 batches per rank, 1 per worker
    assert len({repr(s) for s in per_worker}) == 4
    assert draws(load(dataset(store_path, batches_per_epoch=4, rank=1, world_size=2))) == streams[1]


def _learner(init: str, rank: int, path: str, out) -> None:
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
        try:
            ds = dataset(path)
            out.put((rank, ds.rank, ds.world_size))
            dist.barrier()  # a learner leaving early would break the other's connection while it is being made
        finally:
            dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - shown by the test's assertion, not lost in a child's stderr
        out.put(repr(e))


def test_rank_and_world_size_default_to_torch_distributeds(store_path, tmp_path):
    ds = dataset(store_path)
    assert (ds.rank, ds.world_size) == (0, 1)  # torch.distributed is not initialised in this process
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    learners = [ctx.Process(target=_learner, args=(f"file://{tmp_path}/pg", r, store_path, out)) for r in (0, 1)]
    for p in learners:
        p.start()
    got = sorted(out.get(timeout=120) for _ in learners)
    for p in learners:
        p.join(120)
    assert got == [(0, 0, 2), (1, 1, 2)]


def test_epochs_and_passes_draw_new_streams(store_path):
    ds = dataset(store_path, batches_per_epoch=2)
    first = draws(load(ds))
    assert draws(load(ds)) == first  # fresh (not persistent) workers get a copy of the dataset: same epoch
    ds.set_epoch(1)
    assert draws(load(ds)) != first
    main = dataset(store_path, batches_per_epoch=2)
    assert draws(main) != draws(main)  # a second pass of the same copy (persistent workers, the main process)


def test_batches_per_epoch_is_the_total_over_workers_and_ranks(store_path):
    ds = dataset(store_path, batches_per_epoch=7)
    assert len(load(ds)) == 7 == len(ds)  # 4 + 3
    assert len(load(dataset(store_path, batches_per_epoch=1))) == 1  # worker 1 yields nothing
    ranks = [dataset(store_path, batches_per_epoch=6, rank=r, world_size=2) for r in (0, 1)]
    assert [len(load(d)) for d in ranks] == [3, 3] == [len(d) for d in ranks]
    assert len(load(dataset(store_path, batches_per_epoch=0))) == 0
    with pytest.raises(ValueError, match=r"multiple of world_size \(2\)"):
        dataset(store_path, batches_per_epoch=5, rank=0, world_size=2)
    with pytest.raises(TypeError, match="endless"):
        len(dataset(store_path))


def test_a_source_that_does_not_open_fails_in_the_main_process(tmp_path):
    missing = str(tmp_path / "no-store")
    with pytest.raises(NotAStoreError, match="NotAStoreError: [^\n]*no-store does not exist\n") as e:
        load(HerIterableDataset(missing, batch_size=B, n_sampled_goal=0))
    assert "DataLoader worker process" in str(e.value) and "rank 0, worker" in str(e.value)


def test_a_callable_source_is_opened_per_iteration_and_closed(store_path):
    # a picklable factory (the way a sharded view plugs in) draws what the path draws
    factory = functools.partial(EpisodeStore.open, store_path, "r")
    assert draws(load(dataset(factory, batches_per_epoch=4))) == draws(load(dataset(store_path, batches_per_epoch=4)))

    opened: list[EpisodeStore] = []

    def recording() -> EpisodeStore:
        opened.append(EpisodeStore.open(store_path))
        return opened[-1]

    it = iter(dataset(recording, batches_per_epoch=2))
    assert opened == []  # nothing is opened before the first batch is asked for (in the worker)
    assert len(list(it)) == 2 and opened[0]._closed
    endless = iter(dataset(recording))
    next(endless)
    assert not opened[1]._closed
    del endless
    gc.collect()
    assert opened[1]._closed
    with pytest.raises(TypeError, match="returned a dict; expected an EpisodeStore or a view"):
        next(iter(dataset(dict)))


def test_a_sharded_datasets_root_samples_every_shard(tmp_path):
    obs, act = fetch_spaces()
    root = str(tmp_path / "dataset")
    for s, name in enumerate(("actor-0", "actor-1")):
        with open_store(root, obs, act, shard=name) as shard:
            for i in range(4):
                shard.append_episode(make_episode(obs, act, T=6 + i, seed=10 * s + i))
    batches = load(dataset(root, batch_size=32, batches_per_epoch=2))
    with ShardedView(root) as view:
        for b in batches:
            for i, (s, e, t) in enumerate(zip(b.source.tolist(), b.episode_ids.tolist(), b.steps.tolist())):
                ep = view.episode(s, e)
                np.testing.assert_array_equal(b.observations["observation"][i].numpy(), ep["observation"][t])
                np.testing.assert_array_equal(b.actions[i].numpy(), ep["action"][t])
    assert set(torch.cat([b.source for b in batches]).tolist()) == {0, 1}
    assert draws(batches[:1]) != draws(batches[1:])


def test_bad_arguments_are_refused_here(store_path):
    for kw, match in [
        ({"device": "cuda"}, "workers sample on the CPU"),
        ({"prefetc": 2}, r"no argument\(s\) \['prefetc'\]"),
        ({"batch_size": 0}, "batch_size must be an int >= 1"),
        ({"batch_size": 2.5}, "batch_size must be an int >= 1"),
        ({"rank": 2, "world_size": 2}, "0 <= rank < world_size"),
        ({"rank": True, "world_size": 2}, "rank and world_size must be ints"),
        ({"batches_per_epoch": -1}, "batches_per_epoch must be an int >= 0"),
        ({"batches_per_epoch": 4.0}, "batches_per_epoch must be an int >= 0"),
        ({"batches_per_epoch": True}, "batches_per_epoch must be an int >= 0"),
        ({"n_sampled_goal": 2.5}, "n_sampled_goal must be an int >= 0, not a float: got 2.5"),
        ({"seed": -1}, "seed must be an int >= 0 or None: got -1"),
        ({"prefetch": True}, "prefetch must be an int >= 0, not a bool: got True"),
    ]:
        with pytest.raises((TypeError, ValueError), match=match):
            dataset(store_path, **kw)
    with pytest.raises(ValueError, match="storage_options apply to a path"):
        dataset(lambda: None, storage_options={"anon": True})
    with pytest.raises(TypeError, match="got int"):
        dataset(3)
    assert isinstance(dataset(store_path), torch.utils.data.IterableDataset)


def test_a_chunk_cut_short_under_fork_workers_is_an_io_error_when_the_parent_sampled_first(tmp_path):
    """The parent samples first (arming the SIGBUS guard of mapped reads in its process), then a DataLoader forks
    workers, which install torch's own SIGBUS handler; a chunk of uncompressed frames cut short in place under the
    workers' mappings killed a worker with a bus error. The worker's gather raises OSError EIO naming the chunk,
    which the DataLoader raises in the parent."""
    import os
    import re

    from her_store import HerSampler
    from tests.store.test_rows import ACT, BIG, _big_episode

    path = tmp_path / "s"
    with EpisodeStore.create(path, BIG, ACT, chunk_rows=128, compressors={"pixels": None}) as store:
        for e in range(6):
            store.append_episode(_big_episode(e))
        spec = store.layout.fields["pixels"][0]
        assert store.episodes["length"].sum() + 6 <= 128  # every frame in chunk 0
    with EpisodeStore.open(path) as store, HerSampler(store, B, reward_fn=sparse_reward, seed=0) as sampler:
        assert type(sampler.reader.arrays[spec.path]).__name__ == "MappedArray"
        sampler.sample()
    chunk = spec.chunk_key(0)
    loader = DataLoader(dataset(str(path), batch_size=32), batch_size=None, num_workers=2,
                        multiprocessing_context="fork")
    it = iter(loader)
    assert len([next(it), next(it)]) == 2  # one from each worker: each has mapped chunk 0
    os.truncate(path / chunk, 4096)  # the frames past the first page are gone
    with pytest.raises(OSError, match=rf"{re.escape(chunk)}: reading row \d+ failed: Input/output error"):
        for _ in range(100):
            next(it)
    del it
