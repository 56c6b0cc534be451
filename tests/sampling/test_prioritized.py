"""Prioritized sampling: episodes by their committed priority (energy), transitions by TD error (PER), their laws
checked by chi-square at large samples on a ring that has wrapped and across a resume, the importance weights
exactly, and the priorities' checkpoint through kill -9, a failed write and damaged files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from her_store import EpisodeStore, HerSampler, MixtureSampler, StoreError, open_store
from her_store.sampling.drawn import transition_keys
from her_store.sampling.episode_priority import episode_weights
from tests.conftest import fetch_spaces, in_forked_child, make_episode

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _priority(ep) -> float:
    """A priority spread over [0, 2) read from the episode's content (what a priority_fn may do)."""
    return float(abs(ep["observation"][0, 0]) % 2.0)


def _ring(path, n=150, capacity=600):
    obs, act = fetch_spaces()
    store = open_store(path, obs, act, capacity=capacity, priority_fn=_priority)
    for i in range(n):
        store.append_episode(make_episode(obs, act, 3 + i % 9, i))
    store.flush()
    assert store.first_episode > 0  # the ring has wrapped
    return store


def _counts(values: np.ndarray, cells: np.ndarray) -> np.ndarray:
    return np.array([np.count_nonzero(values == c) for c in cells])


@pytest.mark.parametrize("temperature,rank", [(1.0, None), (0.5, None), (2.0, "dense"), (1.0, "average")])
def test_energy_draws_episodes_by_priority_and_steps_uniformly_on_a_wrapped_ring(store_path, temperature, rank):
    store = _ring(store_path)
    table = store.episodes
    p = episode_weights(table["priority"], table["length"], temperature, rank)
    p = p / p.sum()
    sampler = HerSampler(store, 4096, prioritize="energy", temperature=temperature, rank=rank, n_sampled_goal=0,
                         seed=1)
    ids, steps = [], []
    for _ in range(40):
        b = sampler.sample()
        ids.append(b.episode_ids.numpy())
        steps.append(b.steps.numpy())
    ids, steps = np.concatenate(ids), np.concatenate(steps)
    assert set(ids.tolist()) <= set(table["episode_id"].tolist())
    counts = _counts(ids, table["episode_id"])
    assert chisquare(counts, p * len(ids)).pvalue > 1e-3
    # (episode, step) cells: each step of an episode equally likely
    lengths = dict(zip(table["episode_id"].tolist(), table["length"].tolist(), strict=True))
    cell = ids * 16 + steps
    keys = np.array([e * 16 + s for e in lengths for s in range(lengths[e])])
    want = np.array([p[i] / lengths[e] for i, e in enumerate(lengths) for _ in range(lengths[e])])
    assert chisquare(_counts(cell, keys), want * len(ids)).pvalue > 1e-3
    assert b.weights is None and b.indices is None
    store.close()


def test_energy_sampling_differs_from_uniform_where_priorities_differ(store_path):
    store = _ring(store_path)
    table = store.episodes
    top = table["episode_id"][np.argmax(table["priority"] / table["length"])]
    low = table["episode_id"][np.argmin(table["priority"] / table["length"])]
    for prioritize in (None, "energy"):
        ids = HerSampler(store, 20000, prioritize=prioritize, n_sampled_goal=0, seed=3).sample().episode_ids.numpy()
        share = np.count_nonzero(ids == top) / max(np.count_nonzero(ids == low), 1)
        if prioritize is None:
            assert share < 3
        else:
            assert share > 5
    store.close()


def _all_keys(store: EpisodeStore) -> tuple[np.ndarray, np.ndarray]:
    """Keys of every live transition, and the row of each."""
    t = store.episodes
    ids = np.repeat(t["episode_id"], t["length"])
    steps = np.concatenate([np.arange(n) for n in t["length"]])
    return transition_keys(ids, steps), np.repeat(t["start_row"], t["length"]) + steps


def _assert_per_law(sampler: HerSampler, keys: np.ndarray, p: np.ndarray, alpha: float, beta: float, batches: int):
    prob = p**alpha / (p**alpha).sum()
    weight_of = dict(zip(keys.tolist(), ((len(keys) * prob) ** -beta / (len(keys) * prob.min()) ** -beta).tolist(),
                         strict=True))
    drawn = []
    for _ in range(batches):
        b = sampler.sample()
        got = b.indices.numpy()
        drawn.append(got)
        want = np.array([weight_of[k] for k in got.tolist()], np.float32)
        np.testing.assert_allclose(b.weights.numpy(), want, rtol=2e-6)
    drawn = np.concatenate(drawn)
    order = np.argsort(keys)
    counts = np.bincount(np.searchsorted(keys[order], drawn), minlength=len(keys))
    assert chisquare(counts, prob[order] * len(drawn)).pvalue > 1e-3


def test_td_draws_transitions_by_p_alpha_with_exact_weights_on_a_wrapped_ring_and_after_a_resume(store_path):
    store = _ring(store_path)
    alpha, beta = 0.7, 0.5
    sampler = HerSampler(store, 4096, prioritize="td", alpha=alpha, beta=beta, n_sampled_goal=0, seed=2)
    first = sampler.sample()
    assert torch.all(first.weights == 1)  # every transition enters with the same (largest) priority
    keys, _ = _all_keys(store)
    td = np.random.default_rng(0).normal(0, 1, len(keys)) * np.where(np.arange(len(keys)) % 7 == 0, 10, 1)
    assert sampler.update_priorities(torch.as_tensor(keys), torch.as_tensor(td)) == len(keys)
    p = np.abs(td) + 1e-6
    _assert_per_law(sampler, keys, p, alpha, beta, 40)
    sampler.close()  # checkpoints
    resumed = HerSampler(store, 4096, prioritize="td", alpha=alpha, beta=beta, n_sampled_goal=0, seed=5)
    _assert_per_law(resumed, keys, p, alpha, beta, 25)
    resumed.beta = 1.0
    _assert_per_law(resumed, keys, p, alpha, 1.0, 3)
    resumed.close()
    store.close()


def test_evicted_transitions_leave_the_tree_and_new_ones_enter_at_the_largest_priority(store_path):
    store = _ring(store_path)
    sampler = HerSampler(store, 512, prioritize="td", n_sampled_goal=0, seed=0, priority_checkpoint=None)
    sampler.sample()
    keys, rows = _all_keys(store)
    sampler.update_priorities(keys, np.full(len(keys), 0.5))
    sampler.update_priorities(keys[:1], np.array([3.0]))  # the largest
    obs, act = fetch_spaces()
    for i in range(150, 190):
        store.append_episode(make_episode(obs, act, 3 + i % 9, i))
    store.flush()
    b = sampler.sample()
    live = set(store.episodes["episode_id"].tolist())
    assert set(b.episode_ids.tolist()) <= live
    assert sampler.update_priorities(keys, np.ones(len(keys))) == np.count_nonzero(np.isin(keys >> 32, list(live)))
    new_keys, new_rows = _all_keys(store)
    fresh = (new_keys >> 32) >= 150
    leaves = sampler.priorities.tree.leaves
    np.testing.assert_allclose(leaves[new_rows[fresh]], (3.0 + 1e-6) ** 0.6)
    live_rows = np.zeros(len(leaves), bool)
    live_rows[new_rows] = True
    assert not leaves[~live_rows].any()  # evicted rows and episodes' last rows hold nothing
    assert sampler.priorities.tree.total == pytest.approx(leaves[new_rows].sum())
    store.close()


def test_a_kill_9_after_update_priorities_resumes_with_the_last_checkpoint(tmp_path):
    path = tmp_path / "store"
    script = textwrap.dedent(f"""
        import os, signal
        import numpy as np
        from her_store import HerSampler, open_store
        from tests.conftest import fetch_spaces, make_episode
        from tests.sampling.test_prioritized import _all_keys
        obs, act = fetch_spaces()
        store = open_store({str(path)!r}, obs, act, capacity=800, commit_interval=0)
        for i in range(60):
            store.append_episode(make_episode(obs, act, 4 + i % 5, i))
        sampler = HerSampler(store, 64, prioritize="td", n_sampled_goal=0, priority_checkpoint=3600)
        sampler.sample()
        keys, _ = _all_keys(store)
        sampler.update_priorities(keys, np.arange(len(keys)) % 5 + 1.0)
        assert sampler.checkpoint_priorities()
        sampler.update_priorities(keys, np.full(len(keys), 100.0))
        for i in range(60, 70):
            store.append_episode(make_episode(obs, act, 4 + i % 5, i))
        sampler.sample()
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == -signal.SIGKILL
    with EpisodeStore.open(path) as store:
        assert store.num_episodes == 70
        sampler = HerSampler(store, 1024, prioritize="td", n_sampled_goal=0, seed=0)
        sampler.sample()
        keys, rows = _all_keys(store)
        old = (keys >> 32) < 60
        leaves = sampler.priorities.tree.leaves
        saved = (np.arange(np.count_nonzero(old)) % 5 + 1.0 + 1e-6) ** 0.6
        np.testing.assert_allclose(leaves[rows[old]], saved)  # the checkpoint's, not the 100s after it
        np.testing.assert_allclose(leaves[rows[~old]], (5.0 + 1e-6) ** 0.6)  # committed after it: the largest
        seen = set()
        for _ in range(30):
            seen |= set(sampler.sample().episode_ids.tolist())
        assert seen == set(store.episodes["episode_id"].tolist())  # every committed episode is sampleable


@pytest.mark.parametrize("failing_write", ["c0.", "manifest.json"])
def test_a_checkpoint_whose_write_fails_leaves_the_last_one_whole(store_path, failing_write):
    store = _ring(store_path)
    sampler = HerSampler(store, 256, prioritize="td", n_sampled_goal=0)
    sampler.sample()
    keys, rows = _all_keys(store)
    sampler.update_priorities(keys, np.full(len(keys), 2.0))
    assert sampler.checkpoint_priorities()
    sampler.update_priorities(keys, np.full(len(keys), 9.0))
    backend = store.backend
    real = backend.write_atomic

    def failing(key, data, fsync, if_match=None):
        if key.startswith(f"priorities/{failing_write}"):
            raise OSError(28, "No space left on device")
        return real(key, data, fsync, if_match)

    backend.write_atomic = failing
    try:
        with pytest.raises(StoreError, match="priorities checkpoint cannot be written .*No space.*the last one stays"):
            sampler.checkpoint_priorities()
    finally:
        backend.write_atomic = real
    # the manifest and its chunk, and the new chunk no manifest names when the manifest's write failed
    assert len(os.listdir(Path(store_path) / "priorities")) == (3 if failing_write == "manifest.json" else 2)
    resumed = HerSampler(store, 256, prioritize="td", n_sampled_goal=0)
    resumed.sample()
    np.testing.assert_allclose(resumed.priorities.tree.leaves[rows], (2.0 + 1e-6) ** 0.6)
    assert sampler.checkpoint_priorities()  # the failed chunks are written again, the unnamed ones replaced
    assert len(os.listdir(Path(store_path) / "priorities")) == 2
    store.close()


@pytest.mark.parametrize(
    "damage", ["json", "store_id", "rows", "short", "nan", "huge", "chunk_name", "nested", "manifest_dir", "dir_file"]
)
def test_a_damaged_checkpoint_is_not_used_and_the_sampler_starts_from_the_largest_priority(store_path, damage):
    store = _ring(store_path)
    sampler = HerSampler(store, 256, prioritize="td", n_sampled_goal=0)
    sampler.sample()
    keys, rows = _all_keys(store)
    sampler.update_priorities(keys, np.arange(len(keys)) % 3 + 0.5)
    sampler.close()
    d = Path(store_path) / "priorities"
    manifest = json.loads((d / "manifest.json").read_text())
    chunk = d / f"c0.{manifest['chunks']['0']}"
    if damage == "json":
        (d / "manifest.json").write_text("{")
    elif damage in ("store_id", "rows"):
        manifest[damage] = {"store_id": 1.0, "rows": 1 << 40}[damage]
        (d / "manifest.json").write_text(json.dumps(manifest))
    elif damage == "short":
        chunk.write_bytes(chunk.read_bytes()[:-8])
    elif damage in ("nan", "huge"):
        values = np.frombuffer(chunk.read_bytes(), "<f8").copy()
        values[rows[3]] = np.nan if damage == "nan" else 1e308  # finite, but two of them do not sum
        chunk.write_bytes(values.tobytes())
    elif damage == "nested":
        (d / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    elif damage == "manifest_dir":
        (d / "manifest.json").unlink()
        (d / "manifest.json").mkdir()
    elif damage == "dir_file":
        chunk.unlink()
        chunk.mkdir()
    else:
        manifest["chunks"] = {"../../zarr.json": 1}
        (d / "manifest.json").write_text(json.dumps(manifest))
    with pytest.warns(RuntimeWarning, match="priorities checkpoint .* is not used"):
        resumed = HerSampler(store, 256, prioritize="td", n_sampled_goal=0)
        resumed.sample()
    leaves = resumed.priorities.tree.leaves
    assert np.all(leaves[rows] == 1.0) and np.isfinite(leaves).all()
    if damage == "manifest_dir":
        (d / "manifest.json").rmdir()
    resumed.close()  # writes a whole checkpoint again
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = HerSampler(store, 256, prioritize="td", n_sampled_goal=0)
        again.sample()
    assert np.all(again.priorities.tree.leaves[rows] == 1.0)
    store.close()


def test_options_and_updates_are_checked_by_name(store_path):
    store = _ring(store_path)
    with pytest.raises(ValueError, match="prioritize must be None or one of"):
        HerSampler(store, 8, prioritize="rank")
    with pytest.raises(ValueError, match="temperature must be"):
        HerSampler(store, 8, prioritize="energy", temperature=0)
    with pytest.raises(ValueError, match="rank must be None or one of"):
        HerSampler(store, 8, prioritize="energy", rank="best")
    uniform = HerSampler(store, 8, n_sampled_goal=0)
    with pytest.raises(ValueError, match="update_priorities is for prioritize='td'"):
        uniform.update_priorities(np.zeros(8, np.int64), np.zeros(8))
    td = HerSampler(store, 8, prioritize="td", n_sampled_goal=0, priority_checkpoint=None)
    with pytest.raises(ValueError, match="before any batch"):
        td.update_priorities(np.zeros(1, np.int64), np.zeros(1))
    b = td.sample()
    with pytest.raises(ValueError, match="td_errors must be finite"):
        td.update_priorities(b.indices, torch.full((8,), float("nan")))
    with pytest.raises(ValueError, match="8 indices and 7 td_errors"):
        td.update_priorities(b.indices, torch.ones(7))
    with pytest.raises(ValueError, match="indices must be those of batches of this sampler"):
        td.update_priorities(b.indices + 1000, torch.ones(8))
    with pytest.raises(ValueError, match="beta must be"):
        td.beta = -1
    with pytest.raises(ValueError, match="prioritize='td' needs"):
        MixtureSampler([store], 8, prioritize="td")
    store.close()


def test_energy_weights_keep_their_order_at_temperatures_whose_powers_overflow(store_path):
    obs, act = fetch_spaces()
    priorities = iter([3.0, 5.0, 4.0, 1.0])
    with open_store(store_path, obs, act, priority_fn=lambda ep: next(priorities)) as store:
        for i in range(4):
            store.append_episode(make_episode(obs, act, 5, i))
        for temperature in (0.01, 0.002):  # 5 ** 500 overflows a float64
            sampler = HerSampler(store, 2000, prioritize="energy", temperature=temperature, n_sampled_goal=0)
            assert set(sampler.sample().episode_ids.tolist()) == {1}
    w = episode_weights(np.arange(1.0, 3001.0), np.ones(3000), 0.01, "dense")
    assert np.isfinite(w).all() and w.argmax() == 2999 and w[-1] == 1.0


def test_keys_that_no_batch_hands_out_are_refused_by_name(store_path):
    store = _ring(store_path)
    td = HerSampler(store, 8, prioritize="td", alpha=1.0, n_sampled_goal=0, priority_checkpoint=None)
    b = td.sample()
    for keys in (b.indices.float(), b.indices.numpy().astype(np.float64) + 0.5, b.indices > 0,
                 np.array(["5"] * 8), -b.indices - 1, np.full(8, 2**64 - 1, np.uint64)):
        with pytest.raises(ValueError, match="indices must be those of batches of this sampler"):
            td.update_priorities(keys, np.ones(8))
    with pytest.raises(ValueError, match="which a tree cannot sum"):
        td.update_priorities(b.indices, np.full(8, 1e300))
    assert td.update_priorities(b.indices, np.ones(8)) == 8
    store.close()


def test_a_growing_store_keeps_its_checkpoints_and_samplers_taking_turns_leave_whole_ones(tmp_path):
    obs, act = fetch_spaces()
    path = tmp_path / "s"
    with open_store(path, obs, act, chunk_rows=4096) as store:
        for i in range(4):
            store.append_episode(make_episode(obs, act, 500, i))
        grows = HerSampler(store, 64, prioritize="td", n_sampled_goal=0)  # made while the store is small
        grows.sample()
        for i in range(4, 640):  # 320,640 rows: the tree's second chunk of rows, and arrays grown several times
            store.append_episode(make_episode(obs, act, 500, i))
        keys, rows = _all_keys(store)
        grows.sample()
        grows.update_priorities(keys, np.full(len(keys), 4.0))
        grows.close()
    d = path / "priorities"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        a = HerSampler(EpisodeStore.open(path), 64, prioritize="td", n_sampled_goal=0)
        b = HerSampler(EpisodeStore.open(path), 64, prioritize="td", n_sampled_goal=0)
        a.sample()
        b.sample()
        np.testing.assert_allclose(a.priorities.tree.leaves[rows], (4.0 + 1e-6) ** 0.6)
        for turn, (sampler, value) in enumerate([(a, 2.0), (b, 3.0), (a, 5.0), (b, 6.0)]):
            part = keys[:1000] if turn % 2 else keys[-1000:]  # the first chunk of rows, then the last
            sampler.update_priorities(part, np.full(len(part), value))
            assert sampler.checkpoint_priorities()
            manifest = json.loads((d / "manifest.json").read_text())
            named = {f"c{c}.{g}" for c, g in manifest["chunks"].items()}
            assert set(os.listdir(d)) == named | {"manifest.json"}  # every file named, nothing else left
        last = HerSampler(EpisodeStore.open(path), 64, prioritize="td", n_sampled_goal=0)
        last.sample()
    leaves = last.priorities.tree.leaves  # the last checkpoint is b's whole tree: a's updates were never b's
    np.testing.assert_allclose(leaves[rows[:1000]], (6.0 + 1e-6) ** 0.6)
    np.testing.assert_allclose(leaves[rows[-1000:]], (4.0 + 1e-6) ** 0.6)


def test_a_forked_child_rebuilds_sums_a_thread_of_the_parent_was_updating(store_path):
    store = _ring(store_path)
    sampler = HerSampler(store, 64, prioritize="td", n_sampled_goal=0, priority_checkpoint=None)
    sampler.sample()
    tree = sampler.priorities.tree
    # the state a fork leaves when another thread was inside tree_set: a leaf written, the sums above it not yet
    live = int(np.flatnonzero(tree.leaves)[0])
    tree._sum[tree._leaf0 + live] = 50.0

    def child() -> bool:
        sampler.sample()
        t = sampler.priorities.tree
        return t.total == pytest.approx(t.leaves.sum()) and t.total > 50

    assert in_forked_child(child) == 0
    store.close()


def test_episodes_are_ordered_by_start_row_as_a_sort_orders_them():
    from her_store.sampling.transition_priority import _row_order

    rng = np.random.default_rng(0)
    for _ in range(2000):
        starts = np.sort(rng.choice(100, rng.integers(0, 12), replace=False))
        for case in (np.roll(starts, rng.integers(0, len(starts) + 1)), rng.permutation(starts)):  # a ring, any
            np.testing.assert_array_equal(_row_order(case), np.argsort(case, kind="stable"))
