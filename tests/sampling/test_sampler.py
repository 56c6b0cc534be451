"""HerSampler: SB3's relabelling statistics, bit-exact transitions, a reference model, edge cases, state, prefetch."""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
import pytest
import torch
from gymnasium import spaces
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from her_store import EpisodeStore, GoalContext, GoalSelectionStrategy, HerSampler
from her_store.errors import StoreError
from tests.conftest import fetch_spaces, make_episode


def sparse_reward(achieved, desired, infos):
    return -(np.linalg.norm(np.asarray(achieved) - np.asarray(desired), axis=-1) > 0.05).astype(np.float32)


def coded_episode(obs, act, eid: int, T: int, seed: int) -> dict:
    """achieved_goal row r of episode e is (e, r, 0): a goal tells which episode and row it came from."""
    ep = make_episode(obs, act, T, seed=seed)
    ep["achieved_goal"] = np.stack([np.full(T + 1, eid), np.arange(T + 1), np.zeros(T + 1)], axis=1).astype(np.float32)
    return ep


@pytest.fixture
def coded_store(tmp_path):
    """40 episodes of lengths 1..40 (so goals reveal (episode, row))."""
    obs, act = fetch_spaces()
    eps = [coded_episode(obs, act, i, T=i + 1, seed=i) for i in range(40)]
    with EpisodeStore.create(tmp_path / "s", obs, act) as store:
        for e in eps:
            store.append_episode(e)
        yield store, eps


def _chi2(counts: np.ndarray, expected: np.ndarray) -> float:
    return float(((counts - expected) ** 2 / expected).sum())


# critical values of chi-square at p = 0.001 for df = 1..40 (a false alarm once in a thousand runs; seeds are fixed)
def _chi2_crit(df: int) -> float:
    # Wilson-Hilferty approximation of the 0.999 quantile
    z = 3.090232
    return df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3


def test_relabelled_fraction_is_sb3s(coded_store):
    store, _ = coded_store
    for n_goal, B in [(4, 256), (1, 255), (8, 1000), (0, 64)]:
        s = HerSampler(store, B, n_sampled_goal=n_goal, reward_fn=sparse_reward, seed=1)
        b = s.sample()
        n = int((1 - 1 / (n_goal + 1)) * B)
        assert int(b.is_relabeled.sum()) == n and bool(b.is_relabeled[:n].all())


@pytest.mark.parametrize("strategy", ["future", "final", "episode"])
def test_goal_index_distribution_given_t(coded_store, strategy):
    store, _ = coded_store
    s = HerSampler(store, 65_536, n_sampled_goal=4, goal_selection_strategy=strategy, reward_fn=sparse_reward, seed=2)
    batches = [s.sample() for _ in range(8)]
    n = int(batches[0].is_relabeled.sum())
    ids = np.concatenate([b.episode_ids[:n].numpy() for b in batches])
    t = np.concatenate([b.steps[:n].numpy() for b in batches])
    goal = np.concatenate([b.observations["desired_goal"][:n].numpy() for b in batches])
    assert (goal[:, 0] == ids).all(), "the goal comes from the same episode"
    j = goal[:, 1].astype(int) - 1  # the goal is the achieved goal of the next observation at step j
    L = ids + 1
    assert ((0 <= j) & (j < L)).all()
    if strategy == "final":
        assert (j == L - 1).all()
        return
    if strategy == "future":
        assert (j >= t).all()
    # uniformity within a bucket of fixed (L, t): L = 20, t = 5
    sel = (L == 20) & (t == 5)
    lo = 5 if strategy == "future" else 0
    counts = np.bincount(j[sel] - lo, minlength=20 - lo)
    assert sel.sum() > 200 and len(counts) == 20 - lo
    assert _chi2(counts, np.full(len(counts), sel.sum() / len(counts))) < _chi2_crit(len(counts) - 1)
    if strategy == "episode":  # independent of t
        assert (j[(L == 30)] < 5).any() and (t[(L == 30) & (j < 5)] > 10).any()


def test_random_draws_goals_from_the_whole_store(coded_store):
    store, _ = coded_store
    s = HerSampler(store, 65_536, goal_selection_strategy="random", reward_fn=sparse_reward, seed=3)
    b = s.sample()
    n = int(b.is_relabeled.sum())
    goal = b.observations["desired_goal"][:n].numpy()
    src = goal[:, 0].astype(int)
    assert (src != b.episode_ids[:n].numpy()).mean() > 0.9
    # a transition-uniform draw: episode e is chosen with probability L_e / sum(L)
    lengths = np.arange(1, 41)
    counts = np.bincount(src, minlength=40)
    expected = n * lengths / lengths.sum()
    assert _chi2(counts, expected) < _chi2_crit(39)
    assert ((goal[:, 1] >= 1) & (goal[:, 1] <= lengths[src])).all()  # a next-observation row of that episode


def test_real_transitions_are_bit_exact_and_rewards_recomputed(coded_store):
    store, eps = coded_store
    s = HerSampler(store, 4096, reward_fn=sparse_reward, seed=4)
    b = s.sample()
    rel = b.is_relabeled.numpy()
    for i in range(len(rel)):
        e, t = int(b.episode_ids[i]), int(b.steps[i])
        ep = eps[e]
        for k in ("observation", "achieved_goal"):
            np.testing.assert_array_equal(b.observations[k][i].numpy(), ep[k][t])
            np.testing.assert_array_equal(b.next_observations[k][i].numpy(), ep[k][t + 1])
        np.testing.assert_array_equal(b.actions[i].numpy(), ep["action"][t])
        assert bool(b.truncated[i, 0]) == bool(ep["truncated"][t])
        assert float(b.dones[i, 0]) == float(ep["terminated"][t])
        if rel[i]:
            goal = b.observations["desired_goal"][i].numpy()
            np.testing.assert_array_equal(b.next_observations["desired_goal"][i].numpy(), goal)
            assert b.rewards[i, 0] == sparse_reward(ep["achieved_goal"][t + 1], goal, None)
        else:
            np.testing.assert_array_equal(b.observations["desired_goal"][i].numpy(), ep["desired_goal"][t])
            assert b.rewards[i, 0] == ep["reward"][t]


def test_sampling_before_any_commit_raises(tmp_path):
    obs, act = fetch_spaces()
    with EpisodeStore.create(tmp_path / "s", obs, act) as store:
        s = HerSampler(store, 8, reward_fn=sparse_reward)
        with pytest.raises(StoreError, match="no committed episode"):
            s.sample()
        store.append_episode(make_episode(obs, act, 3, seed=0))
        assert s.sample().actions.shape == (8, 4)


def test_episodes_of_length_one_and_extreme_batch_sizes(tmp_path):
    obs, act = fetch_spaces()
    with EpisodeStore.create(tmp_path / "s", obs, act) as store:
        eps = [make_episode(obs, act, 1, seed=i) for i in range(5)]
        for e in eps:
            store.append_episode(e)
        s = HerSampler(store, 1, reward_fn=sparse_reward, seed=0)
        b = s.sample()
        assert b.actions.shape == (1, 4) and not bool(b.is_relabeled[0])  # int(0.8 * 1) == 0
        b = s.sample(65_536)
        assert b.observations["observation"].shape == (65_536, 10)
        rel = b.is_relabeled.numpy()
        assert (b.steps.numpy() == 0).all()
        ids = b.episode_ids.numpy()
        want = np.stack([eps[e]["achieved_goal"][1] for e in ids[rel]])  # future with L = 1: j = t = 0
        np.testing.assert_array_equal(b.observations["desired_goal"].numpy()[rel], want)


@pytest.mark.parametrize(
    "reward_fn",
    [
        lambda a, d, i: sparse_reward(a, d, i).reshape(-1, 1),
        lambda a, d, i: sparse_reward(a, d, i).tolist(),
    ],
    ids=["column", "list"],
)
def test_reward_fn_may_return_a_column_or_a_list(coded_store, reward_fn):
    store, _ = coded_store
    b = HerSampler(store, 512, reward_fn=reward_fn, seed=5).sample()
    n = int(b.is_relabeled.sum())
    want = sparse_reward(
        b.next_observations["achieved_goal"][:n].numpy(), b.observations["desired_goal"][:n].numpy(), None
    )
    np.testing.assert_array_equal(b.rewards[:n, 0].numpy(), want)


def test_reward_fn_of_the_wrong_size_is_refused(coded_store):
    store, _ = coded_store
    with pytest.raises(ValueError, match=r"reward_fn returned 1 values"):
        HerSampler(store, 64, reward_fn=lambda a, d, i: 0.0).sample()


def test_default_reward_fn_comes_from_env_id(tmp_path):
    import gymnasium as gym

    env = gym.make("her_store/PointGoal-v0")
    with EpisodeStore.create(tmp_path / "s", env.observation_space, env.action_space) as store:
        with pytest.raises(StoreError, match="pass reward_fn=env.unwrapped.compute_reward"):
            HerSampler(store)
        store.update_metadata(env_id="her_store/PointGoal-v0")
        from her_store.cli.main import collect

        collect(store, "her_store/PointGoal-v0", 2, 120, progress=False)
        b = HerSampler(store, 256, seed=0).sample()
        n = int(b.is_relabeled.sum())
        want = env.unwrapped.compute_reward(
            b.next_observations["achieved_goal"][:n].numpy(), b.observations["desired_goal"][:n].numpy(), None
        )
        np.testing.assert_array_equal(b.rewards[:n, 0].numpy(), want)
        assert (b.rewards[:n, 0] == 0).any(), "future goals include reached ones"
        store.update_metadata(env_id="NoSuchEnv-v9")
        with pytest.raises(StoreError, match="NoSuchEnv-v9"):
            HerSampler(store)


def test_a_store_naming_a_module_runs_no_code(tmp_path, monkeypatch):
    """A downloaded store whose env_id names a module beside it: making the sampler must not import it."""
    marker = tmp_path / "ran"
    package = tmp_path / "downloaded" / "shared_dataset"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.syspath_prepend(str(package.parent))
    obs, act = fetch_spaces()
    with EpisodeStore.create(tmp_path / "s", obs, act, metadata={"env_id": "shared_dataset:Reach-v0"}) as store:
        store.append_episode(make_episode(obs, act, 5, seed=0))
    try:
        store = EpisodeStore.open(tmp_path / "s")
        with store, pytest.raises(StoreError, match=r"pass reward_fn=.*register the env"):
            HerSampler(store)
    finally:
        sys.modules.pop("shared_dataset", None)
    assert not marker.exists(), "the store's env_id made the sampler import a module"


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("batch_size", True, "batch_size must be an int >= 1, not a bool: got True"),
        ("batch_size", 2.5, "batch_size must be an int >= 1, not a float: got 2.5"),
        ("batch_size", 0, "batch_size must be an int >= 1: got 0"),
        ("n_sampled_goal", -1, "n_sampled_goal must be an int >= 0: got -1"),
        ("n_sampled_goal", 4.0, "n_sampled_goal must be an int >= 0, not a float: got 4.0"),
        ("prefetch", True, "prefetch must be an int >= 0, not a bool: got True"),
        ("prefetch", -2, "prefetch must be an int >= 0: got -2"),
        ("io_threads", -1, "io_threads must be an int >= 0 or None: got -1"),
        ("cache_bytes", 1.5e6, "cache_bytes must be an int >= 0, not a float: got 1500000.0"),
        ("seed", -1, "seed must be an int >= 0 or None: got -1"),
        ("seed", 1.0, "seed must be an int >= 0 or None, not a float: got 1.0"),
        ("refresh_interval", -0.5, "refresh_interval must be a real number >= 0 or None: got -0.5"),
        ("refresh_interval", float("nan"), "refresh_interval must be a real number >= 0 or None: got nan"),
        ("refresh_interval", "1", "refresh_interval must be a real number >= 0 or None, not a str: got '1'"),
        ("copy_info_dict", 1, "copy_info_dict must be True or False, not an int: got 1"),
        ("relabel_terminated", "yes", "relabel_terminated must be True or False, not a str: got 'yes'"),
        ("pin_memory", 0, "pin_memory must be True, False or None, not an int: got 0"),
        ("reward_fn", "sparse", "reward_fn must be a callable or None, not a str: got 'sparse'"),
        ("success_fn", 3, "success_fn must be a callable or None, not an int: got 3"),
    ],
)
def test_every_option_is_checked_naming_it_what_it_must_be_and_what_was_given(coded_store, option, value, message):
    """HerSampler(store, batch_size=True) sampled batches of one transition, and batch_size=2.5 batches of two: every
    option is checked when the sampler is made (a wrong type is a TypeError and a ValueError at once)."""
    store, _ = coded_store
    kw = {"reward_fn": sparse_reward, option: value}
    with pytest.raises(ValueError) as e:
        HerSampler(store, **kw)
    assert str(e.value) == message
    assert isinstance(e.value, TypeError) == (", not " in message)  # a wrong type, not a value out of range


def test_numpy_numbers_are_options_and_sample_checks_its_batch_size(coded_store):
    store, _ = coded_store
    kw = {"n_sampled_goal": np.uint8(3), "prefetch": np.int32(0), "io_threads": np.int64(2),
          "refresh_interval": np.float32(0.5), "seed": np.int64(4), "copy_info_dict": np.bool_(False)}
    with HerSampler(store, np.int64(16), reward_fn=sparse_reward, **kw) as sampler:
        assert sampler.batch_size == 16 and type(sampler.batch_size) is int and sampler.n_sampled_goal == 3
        assert sampler.refresh_interval == 0.5 and sampler.her_ratio == 0.75
        assert sampler.sample().actions.shape == (16, 4) and sampler.sample(np.int16(5)).actions.shape == (5, 4)
        for bad, message in [
            (True, "batch_size must be an int >= 1, not a bool: got True"),
            (2.5, "batch_size must be an int >= 1, not a float: got 2.5"),
            (0, "batch_size must be an int >= 1: got 0"),
        ]:
            with pytest.raises(ValueError) as e:
                sampler.sample(bad)
            assert str(e.value) == message


def test_callable_strategy_gets_the_context(coded_store):
    store, eps = coded_store
    seen = {}

    def two_ahead(ctx: GoalContext) -> np.ndarray:
        seen["ctx"] = ctx
        return ctx.achieved_goals(ctx.episode_ids, np.minimum(ctx.steps + 2, ctx.lengths - 1))

    b = HerSampler(store, 2000, goal_selection_strategy=two_ahead, reward_fn=sparse_reward, seed=6).sample()
    ctx = seen["ctx"]
    n = int(b.is_relabeled.sum())
    assert len(ctx.episode_ids) == n and isinstance(ctx.rng, np.random.Generator)
    j = b.observations["desired_goal"][:n, 1].numpy().astype(int) - 1
    np.testing.assert_array_equal(j, np.minimum(ctx.steps + 2, ctx.lengths - 1))
    np.testing.assert_array_equal(ctx.next_achieved_goals, b.next_observations["achieved_goal"][:n].numpy())
    # seed 002's shape: a goals -> goals transform
    noisy = HerSampler(
        store, 100, goal_selection_strategy=lambda c: c.desired_goals + 1.0, reward_fn=sparse_reward, seed=0
    ).sample()
    m = int(noisy.is_relabeled.sum())
    ids, t = noisy.episode_ids[:m].numpy(), noisy.steps[:m].numpy()
    np.testing.assert_array_equal(
        noisy.observations["desired_goal"][:m].numpy(),
        np.stack([eps[e]["desired_goal"][s] for e, s in zip(ids, t)]) + 1,
    )
    with pytest.raises(ValueError, match="goal strategy returned shape"):
        HerSampler(
            store, 100, goal_selection_strategy=lambda c: c.desired_goals[:, :2], reward_fn=sparse_reward
        ).sample()
    with pytest.raises(ValueError, match="not one of"):
        HerSampler(store, goal_selection_strategy="past", reward_fn=sparse_reward)
    assert (
        HerSampler(store, goal_selection_strategy=GoalSelectionStrategy.FINAL, reward_fn=sparse_reward).strategy
        is GoalSelectionStrategy.FINAL
    )


def test_relabel_terminated_marks_reached_goals(coded_store):
    store, _ = coded_store
    b = HerSampler(
        store, 4096, goal_selection_strategy="future", reward_fn=sparse_reward, relabel_terminated=True, seed=7
    ).sample()
    n = int(b.is_relabeled.sum())
    reached = (b.rewards[:n, 0] == 0).numpy()
    assert reached.any() and (~reached).any()
    np.testing.assert_array_equal(b.terminated[:n, 0].numpy().astype(bool), reached)  # stored flags are all False
    assert torch.equal(b.dones, b.terminated)
    plain = HerSampler(store, 4096, reward_fn=sparse_reward, seed=7).sample()
    assert not plain.terminated.any()


def test_copy_info_dict_reaches_reward_fn(tmp_path):
    obs, act = fetch_spaces()
    got = {}

    def rf(a, d, infos):
        got["infos"] = infos
        return sparse_reward(a, d, infos)

    with EpisodeStore.create(tmp_path / "s", obs, act, info_keys=["is_success"]) as store:
        eps = [make_episode(obs, act, 10, seed=i, info_keys=("is_success",)) for i in range(5)]
        for e in eps:
            store.append_episode(e)
        b = HerSampler(store, 50, reward_fn=rf, copy_info_dict=True, seed=0).sample()
        n = int(b.is_relabeled.sum())
        assert len(got["infos"]) == n and set(got["infos"][0]) == {"is_success"}
        ids, t = b.episode_ids.numpy(), b.steps.numpy()
        np.testing.assert_array_equal(b.infos["is_success"].numpy(), [eps[e]["is_success"][s] for e, s in zip(ids, t)])
        assert [float(x["is_success"]) for x in got["infos"]] == b.infos["is_success"][:n].tolist()
        HerSampler(store, 50, reward_fn=rf, seed=0).sample()
        assert got["infos"][0] == {}


@pytest.mark.parametrize("case", ["discrete", "multibinary", "uint8-image"])
def test_other_spaces_sample_with_their_dtypes(tmp_path, case):
    from tests.store.test_store import SPACE_CASES

    obs, act = SPACE_CASES[case]
    eps = [make_episode(obs, act, 12, seed=i) for i in range(30)]
    with EpisodeStore.create(tmp_path / "s", obs, act) as store:
        for e in eps:
            store.append_episode(e)

        def rf(a, d, i):
            return -(np.abs(np.asarray(a, np.float32) - np.asarray(d, np.float32)).sum(-1) > 0).astype(np.float32)

        b = HerSampler(store, 300, reward_fn=rf, seed=0).sample()
        for k in obs.spaces:
            assert b.observations[k].dtype == torch.from_numpy(np.zeros(1, eps[0][k].dtype)).dtype
        ids, t = b.episode_ids.numpy(), b.steps.numpy()
        for k in obs.spaces:
            if k == "desired_goal":
                continue
            np.testing.assert_array_equal(b.observations[k].numpy(), np.stack([eps[e][k][s] for e, s in zip(ids, t)]))
            np.testing.assert_array_equal(
                b.next_observations[k].numpy(), np.stack([eps[e][k][s + 1] for e, s in zip(ids, t)])
            )
        np.testing.assert_array_equal(b.actions.numpy(), np.stack([eps[e]["action"][s] for e, s in zip(ids, t)]))


def test_ring_that_has_just_wrapped(tmp_path):
    obs, act = fetch_spaces()
    with EpisodeStore.create(tmp_path / "s", obs, act, capacity=100, chunk_rows=32) as store:
        eps = {}
        i = 0
        while store.commit_record.write_row >= store.commit_record.write_row and i < 200:
            before = store.commit_record.write_row
            eps[i] = make_episode(obs, act, 20, seed=i)
            store.append_episode(eps[i])
            store.flush()
            i += 1
            if store.commit_record.write_row < before:  # wrapped on this append
                break
        assert store.commit_record.write_row == 21
        b = HerSampler(store, 2000, reward_fn=sparse_reward, seed=0).sample()
        ids, t = b.episode_ids.numpy(), b.steps.numpy()
        assert set(ids) == set(range(store.first_episode, store.end_episode))
        np.testing.assert_array_equal(
            b.next_observations["observation"].numpy(), np.stack([eps[e]["observation"][s + 1] for e, s in zip(ids, t)])
        )


@pytest.mark.parametrize("prefetch", [0, 1])
def test_a_ring_that_laps_the_view_draws_from_a_fresh_snapshot(tmp_path, prefetch):
    obs, act = fetch_spaces()
    eps = {i: coded_episode(obs, act, i, 10, seed=i) for i in range(12)}
    with EpisodeStore.create(tmp_path / "s", obs, act, capacity=40, chunk_rows=16, commit_interval=0) as writer:
        for i in range(4):
            writer.append_episode(eps[i])
        store = EpisodeStore.open(tmp_path / "s")
        sampler = HerSampler(store, 64, reward_fn=sparse_reward, seed=0, refresh_interval=3600, prefetch=prefetch)
        with store, sampler as s:
            assert s.refresh().end == 4
            for i in range(4, 12):  # the ring evicts every episode of the sampler's view
                writer.append_episode(eps[i])
            assert writer.first_episode > 4
            for _ in range(2):  # drawn afresh, then (prefetch) from a restarted producer
                b = s.sample()
                ids, t = b.episode_ids.numpy(), b.steps.numpy()
                assert ids.min() >= writer.first_episode
                want = np.stack([eps[e]["action"][k] for e, k in zip(ids, t)])
                np.testing.assert_array_equal(b.actions.numpy(), want)


def test_a_sampler_on_the_writers_handle_does_not_force_commits(tmp_path):
    obs, act = fetch_spaces()
    interval = 2.0
    with EpisodeStore.create(tmp_path / "s", obs, act, commit_interval=interval) as store:
        s = HerSampler(store, 32, reward_fn=sparse_reward, seed=0)
        started = time.monotonic()
        for i in range(200):
            store.append_episode(make_episode(obs, act, 5, seed=i))
            s.sample()
        elapsed = time.monotonic() - started
        on_disk = json.loads((tmp_path / "s" / "commit.json").read_bytes())
        # the first commit (nothing was committed), then one per commit_interval
        assert on_disk["generation"] <= 2 + elapsed / interval, (on_disk, elapsed)
        time.sleep(interval)  # the group commit is due: the next batch commits and is drawn from every episode
        assert s.sample(2000).episode_ids.max() == 199
        assert json.loads((tmp_path / "s" / "commit.json").read_bytes())["end_episode"] == 200


def test_state_dict_replays_the_same_batches_with_and_without_prefetch(coded_store):
    store, _ = coded_store

    def ids(sampler, n):
        return [sampler.sample().episode_ids.numpy().copy() for _ in range(n)]

    a = HerSampler(store, 64, reward_fn=sparse_reward, seed=11)
    first = ids(a, 3)
    state = a.state_dict()
    rest = ids(a, 4)
    b = HerSampler(store, 64, reward_fn=sparse_reward, seed=999)
    b.load_state_dict(state)
    assert all(np.array_equal(x, y) for x, y in zip(ids(b, 4), rest))
    with HerSampler(store, 64, reward_fn=sparse_reward, seed=11, prefetch=3) as p:
        got = ids(p, 3)
        assert all(np.array_equal(x, y) for x, y in zip(got, first))
        mid = p.state_dict()
        assert mid == state  # the state after the batches handed out, not after the prefetched ones
        assert all(np.array_equal(x, y) for x, y in zip(ids(p, 4), rest))
        p.load_state_dict(state)
        assert all(np.array_equal(x, y) for x, y in zip(ids(p, 4), rest))
        assert p.sample(10).actions.shape == (10, 4)  # another size: synchronous, same generator


def test_a_sample_waiting_for_a_prefetched_batch_hears_when_another_thread_closes_the_sampler(coded_store):
    """close() in another thread while sample() waits for the producer's next batch: sample() waited forever; now it
    raises, naming what happened, and the sampler samples again afterwards."""
    import threading

    store, _ = coded_store
    sampler = HerSampler(store, 64, reward_fn=sparse_reward, seed=5, prefetch=1)
    sampler.sample()
    make, slow, producing = sampler._make_batch, threading.Event(), threading.Event()

    def slow_batch(*args, **kwargs):  # storage that has become slow: the producer's batch takes until it is stopped
        if slow.is_set():
            producing.set()
            sampler._prefetcher.stopping.wait(300)
        return make(*args, **kwargs)

    sampler._make_batch = slow_batch
    slow.set()
    queue, gets = sampler._prefetcher.queue, []
    get = queue.get
    queue.get = lambda *args, **kwargs: (gets.append(1), get(*args, **kwargs))[1]  # each look for a batch
    outcome: list[str] = []

    def consume() -> None:
        try:
            for _ in range(5):
                sampler.sample()
            outcome.append("all sampled")
        except StoreError as e:
            outcome.append(str(e))

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    assert producing.wait(300)  # the producer is inside its batch until the sampler stops
    while not queue.empty():  # a batch made before: the consumer takes it
        time.sleep(0.01)
    looked = len(gets)
    while len(gets) < looked + 2:  # then waits for the next, looking again every 0.1 s
        time.sleep(0.01)
    sampler.close()
    consumer.join(timeout=120)
    assert not consumer.is_alive()
    assert outcome == [
        (
            "the sampler's prefetching was stopped (close() or load_state_dict() in another thread) while sample() "
            "waited for a batch"
        )
    ]
    slow.clear()
    assert sampler.sample().actions.shape == (64, 4)
    sampler.close()


def test_a_forked_child_samples_a_prefetching_sampler_from_a_producer_of_its_own(coded_store, tmp_path):
    """A prefetching sampler that sampled before a fork: the child inherited the queue but not the producer thread,
    and its sample() waited forever on a queue nobody filled. The child starts a producer of its own and draws what
    the parent draws after the batches it handed out, each row the stored transition."""
    import multiprocessing

    writer, eps = coded_store
    writer.flush()

    def rows_of(b) -> tuple[list[int], list[int]]:
        return b.episode_ids.tolist(), b.steps.tolist()

    def wrong(b) -> int:
        """Rows of ``b`` that are not the stored transition at their (episode, step)."""
        bad = 0
        for i, (e, t) in enumerate(zip(*rows_of(b))):
            ep = eps[e]
            bad += not np.array_equal(b.observations["observation"][i].numpy(), ep["observation"][t])
            bad += not np.array_equal(b.next_observations["achieved_goal"][i].numpy(), ep["achieved_goal"][t + 1])
            bad += not np.array_equal(b.actions[i].numpy(), ep["action"][t])
        return bad

    def child(sampler: HerSampler, conn) -> None:
        batches = [sampler.sample() for _ in range(3)]
        conn.send(([rows_of(b) for b in batches], sum(map(wrong, batches))))

    ctx = multiprocessing.get_context("fork")
    with EpisodeStore.open(tmp_path / "s") as store, HerSampler(store, 64, reward_fn=sparse_reward, seed=7,
                                                               prefetch=2) as sampler:
        before = [sampler.sample() for _ in range(2)]
        assert sampler._prefetcher.thread is not None and wrong(before[0]) == 0
        mine, theirs = ctx.Pipe()
        proc = ctx.Process(target=child, args=(sampler, theirs))
        proc.start()
        try:
            got = mine.recv() if mine.poll(60) else None
        finally:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        after = [sampler.sample() for _ in range(3)]
    assert got is not None, "the child sampled nothing within 60 s"
    assert proc.exitcode == 0
    child_rows, child_wrong = got
    assert child_rows == [rows_of(b) for b in after] and child_wrong == 0
    assert all(wrong(b) == 0 for b in after)


def test_iteration_and_threaded_gathers_agree(coded_store):
    store, _ = coded_store
    it = iter(HerSampler(store, 512, reward_fn=sparse_reward, seed=3))
    a = [next(it) for _ in range(2)]
    with HerSampler(store, 512, reward_fn=sparse_reward, seed=3, io_threads=4) as threaded:
        b = [threaded.sample() for _ in range(2)]
    for x, y in zip(a, b):
        for k in x.observations:
            assert torch.equal(x.observations[k], y.observations[k])
        assert torch.equal(x.rewards, y.rewards)


def _image_store(path, compressors: dict) -> tuple[EpisodeStore, list[dict]]:
    """12 episodes with a 3x8x8 image (a sharded LZ4 array by default, in shards of 16 rows)."""
    obs, act = fetch_spaces()
    obs = spaces.Dict({**obs.spaces, "pixels": spaces.Box(0, 255, (3, 8, 8), np.uint8)})
    eps = [make_episode(obs, act, 5 + i, seed=i) for i in range(12)]
    store = EpisodeStore.create(path, obs, act, chunk_rows=16, compressors=compressors)
    for e in eps:
        store.append_episode(e)
    return store, eps


def _assert_frames(b, eps: list[dict]) -> None:
    ids, t = b.episode_ids.numpy(), b.steps.numpy()
    np.testing.assert_array_equal(
        b.observations["pixels"].numpy(), np.stack([eps[e]["pixels"][s] for e, s in zip(ids, t)])
    )
    np.testing.assert_array_equal(
        b.next_observations["pixels"].numpy(), np.stack([eps[e]["pixels"][s + 1] for e, s in zip(ids, t)])
    )


def test_io_threads_default_decodes_images_on_every_core_and_zero_in_the_caller(tmp_path):
    """By default the frames of a store with sharded arrays are decoded on one thread per core (other stores gather
    in the calling thread); io_threads=0 decodes them in the calling thread: the same batches, the stored frames."""
    store, eps = _image_store(tmp_path / "sharded", {})
    with store, HerSampler(store, 256, reward_fn=sparse_reward, seed=5) as default:
        assert any(a.sharded for a in store.layout.arrays)
        assert (default.reader.io_threads, default.reader.decode_threads) == (0, os.cpu_count())
        with HerSampler(store, 256, reward_fn=sparse_reward, seed=5, io_threads=0) as caller:
            assert (caller.reader.io_threads, caller.reader.decode_threads) == (0, 0)
            for _ in range(2):
                a, b = default.sample(), caller.sample()
                _assert_frames(a, eps)
                assert torch.equal(a.episode_ids, b.episode_ids) and torch.equal(a.steps, b.steps)
                for k in a.observations:
                    assert torch.equal(a.observations[k], b.observations[k])
                    assert torch.equal(a.next_observations[k], b.next_observations[k])
    store, eps = _image_store(tmp_path / "raw", {"pixels": None})
    with store, HerSampler(store, 256, reward_fn=sparse_reward, seed=5) as raw:
        assert not any(a.sharded for a in store.layout.arrays)
        assert (raw.reader.io_threads, raw.reader.decode_threads) == (0, 0)
        _assert_frames(raw.sample(), eps)


def test_a_reader_process_sees_new_commits(tmp_path):
    obs, act = fetch_spaces()
    with EpisodeStore.create(tmp_path / "s", obs, act, commit_interval=0) as writer:
        writer.append_episode(make_episode(obs, act, 5, seed=0))
        with EpisodeStore.open(tmp_path / "s") as reader:
            s = HerSampler(reader, 256, reward_fn=sparse_reward, seed=0, refresh_interval=0)
            assert set(s.sample().episode_ids.numpy()) == {0}
            for i in range(1, 4):
                writer.append_episode(make_episode(obs, act, 5, seed=i))
            assert set(s.sample().episode_ids.numpy()) == {0, 1, 2, 3}


# -- reference model -----------------------------------------------------------------------------------------
@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("append"), st.integers(1, 25)),
            st.tuples(st.just("sample"), st.integers(1, 300)),
        ),
        min_size=1,
        max_size=40,
    ),
    capacity=st.one_of(st.none(), st.integers(25, 120)),
)
def test_against_an_in_memory_model(tmp_path_factory, ops, capacity):
    obs, act = fetch_spaces()
    path = tmp_path_factory.mktemp("ref") / "s"
    model: dict[int, dict] = {}
    next_id = 0
    with EpisodeStore.create(path, obs, act, capacity=capacity, chunk_rows=16, commit_interval=0) as store:
        s = HerSampler(store, 8, reward_fn=sparse_reward, seed=0)
        for op, n in ops:
            if op == "append":
                ep = coded_episode(obs, act, next_id, n, seed=next_id)
                assert store.append_episode(ep) == next_id
                model[next_id] = ep
                next_id += 1
                live = sorted(model)
                while capacity is not None and sum(len(model[i]["action"]) for i in live) > capacity:
                    del model[live.pop(0)]
                for gone in [i for i in model if i < store.first_episode]:
                    del model[gone]  # row space may evict beyond the transition count
                assert store.num_transitions == sum(len(e["action"]) for e in model.values())
                continue
            if not model:
                with pytest.raises(StoreError):
                    s.sample(n)
                continue
            b = s.sample(n)
            ids, t = b.episode_ids.numpy(), b.steps.numpy()
            rel = b.is_relabeled.numpy()
            assert set(ids) <= set(model)
            for i in range(n):
                ep = model[int(ids[i])]
                assert 0 <= t[i] < len(ep["action"])
                np.testing.assert_array_equal(b.observations["observation"][i].numpy(), ep["observation"][t[i]])
                np.testing.assert_array_equal(
                    b.next_observations["achieved_goal"][i].numpy(), ep["achieved_goal"][t[i] + 1]
                )
                goal = b.observations["desired_goal"][i].numpy()
                if rel[i]:
                    assert goal[0] == ids[i] and t[i] + 1 <= goal[1] <= len(ep["action"])
                else:
                    np.testing.assert_array_equal(goal, ep["desired_goal"][t[i]])
                    assert b.rewards[i, 0] == ep["reward"][t[i]]


def test_a_batch_waits_for_every_pending_gather_even_when_one_fails():
    """A batch's frames are gathered later (decoded while the rest of the batch is assembled): when one pending
    gather raises, the others are still waited for (no thread left writing into a batch being dropped), and the
    error is raised."""
    from her_store.sampling.gather import finish_all

    done: list[int] = []

    def fails() -> None:
        done.append(0)
        raise OSError("a disk error")

    with pytest.raises(OSError, match="a disk error"):
        finish_all([fails, lambda: done.append(1), lambda: done.append(2)])
    assert done == [0, 1, 2]
    finish_all([])


def test_a_wrong_device_state_or_compressors_is_an_error_naming_it(coded_store, tmp_path):
    """torch's own errors for a device name, a KeyError for a state_dict without 'rng', and a dict() of a str of
    compressors said nothing of which option was wrong."""
    from her_store import open_store

    store, _ = coded_store
    for device in ("bogus", object()):
        with pytest.raises(ValueError, match=r"device must be a torch.device or its name"):
            HerSampler(store, 8, reward_fn=sparse_reward, device=device)
    sampler = HerSampler(store, 8, reward_fn=sparse_reward, seed=0)
    state = sampler.state_dict()
    want = sampler.sample()
    for bad in ({}, {"rng": "garbage"}, {"rng": {"bit_generator": "MT19937"}}, 5):
        with pytest.raises(ValueError, match=r"not a sampler's state_dict\(\): expected a dict whose 'rng' is a PCG64"):
            sampler.load_state_dict(bad)
    sampler.load_state_dict(state)
    assert sampler.sample().episode_ids.tolist() == want.episode_ids.tolist()
    obs, act = fetch_spaces()
    with pytest.raises(TypeError, match="compressors must be a mapping"):
        open_store(tmp_path / "z", obs, act, compressors="zstd")


def test_a_sampler_of_a_writing_handle_samples_in_a_forked_child_when_a_commit_is_due(tmp_path):
    """snapshot() commits a writing handle's staged episodes when the group commit is due; in a forked child (which
    may not write through the parent's handle) it refused the read instead. The child reads what is committed."""
    import time

    from tests.conftest import in_forked_child

    obs, act = fetch_spaces()
    with EpisodeStore.create(tmp_path / "s", obs, act, commit_interval=0.05) as store:
        for i in range(4):
            store.append_episode(coded_episode(obs, act, i, T=5, seed=i))
        with HerSampler(store, 16, reward_fn=sparse_reward, seed=0) as sampler:
            sampler.sample()
            store.append_episode(coded_episode(obs, act, 4, T=5, seed=4))  # staged
            time.sleep(0.1)  # the group commit is due

            def child() -> bool:
                return set(sampler.sample().episode_ids.tolist()) <= set(range(5))

            assert in_forked_child(child) == 0
            assert store.num_episodes == 5


def test_a_cuda_device_without_cuda_or_a_malformed_generator_state_is_refused_by_name(coded_store):
    """device='cuda' on a torch without CUDA was accepted and failed at the first batch with torch's error; a state
    whose generator state is malformed raised a TypeError or KeyError of numpy's."""
    store, _ = coded_store
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"device 'cuda': this torch has no CUDA device"):
            HerSampler(store, 8, reward_fn=sparse_reward, device="cuda")
    sampler = HerSampler(store, 8, reward_fn=sparse_reward, seed=0)
    good = sampler.state_dict()["rng"]
    for bad in ({**good, "state": 5}, {**good, "state": {"state": 1}}):
        with pytest.raises(ValueError, match=r"not a sampler's state_dict\(\)"):
            sampler.load_state_dict({"rng": bad})
