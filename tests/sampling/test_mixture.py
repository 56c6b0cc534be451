"""MixtureSampler: each store's share of a batch, uniform over all transitions, rows bit-exact per source, spaces
checked, weights checked, local + S3 + HTTP stores in one mixture, a store set that grows, resumable state."""

from __future__ import annotations

import functools
import os
import re
import threading

import numpy as np
import pytest
import torch
from gymnasium import spaces

from her_store import EpisodeStore, GoalMixture, HerSampler, open_dataset, open_store
from her_store.errors import SchemaMismatchError, StoreError
from her_store.ops.copy import copy_store
from her_store.sampling.mixture import MixtureSampler, StoreSet
from tests.conftest import fetch_spaces, make_episode
from tests.http_server import RangeHandler, Server
from tests.sampling.test_sampler import _chi2, _chi2_crit, coded_episode


def sparse_reward(achieved, desired, infos):
    return -(np.linalg.norm(np.asarray(achieved) - np.asarray(desired), axis=-1) > 0.05).astype(np.float32)


def fill(path, lengths, seed, obs=None, act=None, **kw) -> EpisodeStore:
    """A writing store holding one episode per length (every append commits)."""
    if obs is None:
        obs, act = fetch_spaces()
    store = EpisodeStore.create(path, obs, act, commit_interval=0, **kw)
    for i, T in enumerate(lengths):
        store.append_episode(make_episode(obs, act, T, seed=seed + i, info_keys=tuple(kw.get("info_keys", ()))))
    return store


@pytest.fixture
def three(tmp_path):
    stores = [fill(tmp_path / f"s{k}", [3 + k, 5, 2 * k + 1], seed=100 * k) for k in range(3)]
    yield stores
    for s in stores:
        s.close()


def check_rows(batch, stores) -> None:
    """Every row is its store's (episode, step) row; a relabelled row's goal is a later achieved goal of that same
    episode and its reward is recomputed from it."""
    B = len(batch.actions)
    src, ids, steps = batch.source.numpy(), batch.episode_ids.numpy(), batch.steps.numpy()
    her = batch.is_relabeled.numpy()
    assert batch.source.dtype == torch.int64 and batch.source.shape == (B,)
    episodes = {}
    for j in range(B):
        key = (int(src[j]), int(ids[j]))
        if key not in episodes:
            episodes[key] = stores[key[0]].episode(key[1])
        ep, t = episodes[key], int(steps[j])
        for k in ("observation", "achieved_goal"):
            np.testing.assert_array_equal(batch.observations[k][j].numpy(), ep[k][t])
            np.testing.assert_array_equal(batch.next_observations[k][j].numpy(), ep[k][t + 1])
        np.testing.assert_array_equal(batch.actions[j].numpy(), ep["action"][t])
        assert bool(batch.truncated[j, 0]) == bool(ep["truncated"][t])
        goal = batch.observations["desired_goal"][j].numpy()
        if her[j]:
            later = ep["achieved_goal"][t + 1 :]
            assert (later == goal).all(axis=1).any(), f"row {j}: the goal is not a later achieved goal of its episode"
            assert batch.rewards[j, 0] == sparse_reward(ep["achieved_goal"][t + 1], goal, {})
        else:
            np.testing.assert_array_equal(goal, ep["desired_goal"][t])
            assert batch.rewards[j, 0] == ep["reward"][t]


def test_each_stores_share_and_the_relabelled_rows(three, tmp_path):
    weights = [0.2, 0.5, 0.3, 0.0]
    stores = [*three, fill(tmp_path / "unused", [4], seed=7)]
    B, n = 256, 150
    with MixtureSampler(stores, [2, 5, 3, 0], B, seed=3, reward_fn=sparse_reward) as m:
        np.testing.assert_allclose(m.weights, weights)
        M = int(m.her_ratio * B)
        assert M == int(0.8 * B)
        counts, her_counts = np.zeros(4, int), np.zeros(4, int)
        for _ in range(n):
            b = m.sample()
            src, her = b.source.numpy(), b.is_relabeled.numpy()
            assert len(src) == B and her[:M].all() and not her[M:].any(), "the first int(her_ratio * B) are relabelled"
            counts += np.bincount(src, minlength=4)
            her_counts += np.bincount(src[her], minlength=4)
        check_rows(b, stores)
    p = np.array(weights)
    # 5 standard deviations of a binomial count: a false alarm less than once in a million runs (the seed is fixed)
    bound = 5 * np.sqrt(B * n * p * (1 - p))
    assert (np.abs(counts - B * n * p) <= bound).all(), (counts, B * n * p, bound)
    assert counts[3] == 0
    # each store's rows are relabelled at her_ratio: its relabelled count is binomial over the M rows of each batch
    her_bound = 5 * np.sqrt(M * n * p * (1 - p))
    assert (np.abs(her_counts - M * n * p) <= her_bound).all(), (her_counts, M * n * p)
    stores[3].close()


def test_transitions_weights_are_uniform_over_every_committed_transition(tmp_path):
    a = fill(tmp_path / "a", [2, 5, 9], seed=0)
    b = fill(tmp_path / "b", [4], seed=10)
    c = fill(tmp_path / "c", [], seed=20)  # nothing committed: no samples, no error
    stores = [a, b, c]
    with MixtureSampler(stores, "transitions", 512, seed=5, n_sampled_goal=0) as m:
        np.testing.assert_allclose(m.weights, [16 / 20, 4 / 20, 0])
        rows = [m.sample() for _ in range(40)]
        # (store, episode, step) -> one code among the 20 transitions
        offsets = {(0, 0): 0, (0, 1): 2, (0, 2): 7, (1, 0): 16}
        code = np.concatenate(
            [
                np.array([offsets[(s, e)] for s, e in zip(r.source.tolist(), r.episode_ids.tolist())]) + r.steps.numpy()
                for r in rows
            ]
        )
        counts = np.bincount(code, minlength=20)
        assert len(counts) == 20
        expected = np.full(20, len(code) / 20)
        assert _chi2(counts, expected) < _chi2_crit(19), counts
        # c commits an episode: at the next refresh its share is its transitions' share
        c.append_episode(make_episode(*fetch_spaces(), 20, seed=21))
        np.testing.assert_array_equal(m.refresh(), [16, 4, 20])
        np.testing.assert_allclose(m.weights, [0.4, 0.1, 0.5])
        share = np.mean(np.concatenate([m.sample().source.numpy() for _ in range(10)]) == 2)
        assert abs(share - 0.5) < 5 * np.sqrt(0.25 / 5120)
    for s in stores:
        s.close()


def test_rows_equal_their_stores_episode_rows_and_batches_resume(three):
    kw = {"seed": 11, "reward_fn": sparse_reward, "goal_selection_strategy": "future"}
    with MixtureSampler(three, [1, 1, 1], 128, **kw) as m:
        for _ in range(3):
            check_rows(m.sample(), three)
        state = m.state_dict()
        after = [m.sample() for _ in range(3)]
    with MixtureSampler(three, [1, 1, 1], 128, **kw) as m2:
        m2.load_state_dict(state)
        for x, y in zip(after, [m2.sample() for _ in range(3)]):
            for f in ("source", "episode_ids", "steps", "actions", "rewards", "is_relabeled"):
                assert (getattr(x, f) == getattr(y, f)).all(), f
            assert (x.observations["desired_goal"] == y.observations["desired_goal"]).all()
    with HerSampler(three[0], 8, reward_fn=sparse_reward) as one:
        assert one.sample().source is None  # a single store's batch names no source
    with MixtureSampler(three, [1, 1, 1], 128, **{**kw, "seed": 12}) as m3:
        m3.sample(), m3.sample()
        assert not (m3.sample().steps == after[0].steps).all(), "another seed draws other batches"


def test_spaces_must_match(tmp_path):
    obs, act = fetch_spaces()
    ref = fill(tmp_path / "ref", [3], seed=0, info_keys=["is_success"])
    cases = {
        "wide": (*fetch_spaces(obs_dim=12), [], "observation 'observation' has shape [12], expected [10]"),
        "f64": (
            spaces.Dict({**obs.spaces, "observation": spaces.Box(-np.inf, np.inf, (10,), np.float64)}),
            act, [], "observation 'observation' has dtype 'float64', expected 'float32'",
        ),
        "discrete": (obs, spaces.Discrete(4), [], "action 'action' has type 'Discrete', expected 'Box'"),
        "bounds": (obs, spaces.Box(-2.0, 2.0, (4,), np.float32), [], "action 'action' has low"),
        "extra": (
            spaces.Dict({**obs.spaces, "image": spaces.Box(0, 255, (2, 2), np.uint8)}),
            act, [], "store 1 has field 'image', store 0 has not",
        ),
    }
    for name, (o, a, infos, message) in cases.items():
        other = fill(tmp_path / name, [2], seed=1, obs=o, act=a, info_keys=infos)
        pattern = rf"store 1 \(.*{name}\) does not match store 0 .*{re.escape(message)}"
        with pytest.raises(SchemaMismatchError, match=pattern):
            MixtureSampler([ref, other], [1, 1], reward_fn=sparse_reward)
        other.close()
    # info keys are part of a batch only with copy_info_dict
    plain = fill(tmp_path / "plain", [2], seed=2)
    MixtureSampler([ref, plain], [1, 1], reward_fn=sparse_reward).close()
    with pytest.raises(SchemaMismatchError, match="store 0 has field 'is_success', store 1 has not"):
        MixtureSampler([ref, plain], [1, 1], reward_fn=sparse_reward, copy_info_dict=True)
    plain.close()
    ref.close()


def test_weights_are_checked(three, tmp_path):
    for weights, message in [
        ([1, 1], r"weights has 2 value\(s\) \(shape \(2,\)\); expected one per store, 3"),
        ([[1, 1, 1]], "expected one per store, 3"),
        ([1, -1, 1], r"weights must be >= 0, .* \(weight 1\)"),
        ([0, 0, 0], "must not all be 0"),
        ([1, float("nan"), 1], r"must be finite numbers, .* \(weight 1\)"),
        ([1, 1, float("inf")], r"must be finite numbers, .* \(weight 2\)"),
        (["a", 1, 1], "sequence of non-negative numbers or 'transitions'"),
        ("uniform", "weights must be a sequence of numbers or 'transitions', got 'uniform'"),
    ]:
        with pytest.raises(ValueError, match=message):
            MixtureSampler(three, weights, reward_fn=sparse_reward)
    with pytest.raises(ValueError, match="at least one store"):
        MixtureSampler([], "transitions")
    with pytest.raises(TypeError, match="sequence of EpisodeStore"):
        MixtureSampler(three[0], "transitions")
    with pytest.raises(ValueError, match="does not prefetch"):
        MixtureSampler(three, "transitions", reward_fn=sparse_reward, prefetch=2)
    with pytest.raises(TypeError, match="n_sampled_goals"):
        MixtureSampler(three, "transitions", n_sampled_goals=2)
    empty = fill(tmp_path / "empty", [], seed=0)
    with MixtureSampler([three[0], empty], [1, 0], 32, reward_fn=sparse_reward) as m:
        assert (m.sample().source == 0).all()  # weight 0 on an empty store: fine
    with MixtureSampler([three[0], empty], [1, 1e-9], 32, reward_fn=sparse_reward) as m, pytest.raises(
        StoreError, match=r"store 1 \(.*empty\) has weight 1e-09 and no committed episode"
    ):
        m.sample()
    with MixtureSampler([empty], "transitions", 32, reward_fn=sparse_reward) as m, pytest.raises(
        StoreError, match="no store has a committed episode"
    ):
        m.sample()
    empty.close()


@pytest.fixture
def http_base(tmp_path):
    pytest.importorskip("aiohttp", reason='pip install "her_store[http]"')
    root = tmp_path / "served"
    root.mkdir()
    server = Server(("127.0.0.1", 0), functools.partial(RangeHandler, directory=str(root)))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_local_an_s3_and_an_http_store_in_one_mixture(tmp_path, s3_url, http_base):
    url, opts = s3_url
    root, base = http_base
    local = fill(tmp_path / "local", [6, 3], seed=0)
    fill(tmp_path / "to-s3", [4, 5, 6], seed=50, chunk_rows=16).close()
    copy_store(tmp_path / "to-s3", url, dest_storage_options=opts)  # an offline dataset put on object storage
    fill(root / "served", [5, 7], seed=80).close()
    with EpisodeStore.open(url, storage_options=opts) as s3, EpisodeStore.open(f"{base}/served") as http:
        stores = [local, s3, http]
        with MixtureSampler(stores, "transitions", 96, seed=1, reward_fn=sparse_reward) as m:
            np.testing.assert_array_equal(m.refresh(), [9, 15, 12])
            seen = set()
            for _ in range(2):
                b = m.sample()
                check_rows(b, stores)
                seen |= set(b.source.tolist())
            assert seen == {0, 1, 2}
    local.close()


class Directory:
    """A real StoreSet: every store under a local directory, opened read-only, in the order they appeared."""

    def __init__(self, root) -> None:
        self.root = str(root)
        self.stores: list[EpisodeStore] = []
        self.refresh()

    def refresh(self) -> int:
        known = {os.path.basename(s.url) for s in self.stores}
        new = sorted(n for n in os.listdir(self.root) if n not in known)
        self.stores += [EpisodeStore.open(os.path.join(self.root, n)) for n in new]
        return len(new)

    def close(self) -> None:
        for s in self.stores:
            s.close()


def test_refresh_picks_up_a_new_store_of_a_store_set(tmp_path):
    root = tmp_path / "shards"
    root.mkdir()
    fill(root / "actor-0", [4, 4], seed=0).close()
    shards = Directory(root)
    assert isinstance(shards, StoreSet)
    with pytest.raises(ValueError, match="takes weights='transitions'"):
        MixtureSampler(shards, [1.0], reward_fn=sparse_reward)
    with MixtureSampler(shards, "transitions", 64, seed=2, reward_fn=sparse_reward, refresh_interval=3600) as m:
        assert len(m.samplers) == 1 and (m.sample().source == 0).all()
        fill(root / "actor-1", [8, 8, 8], seed=10).close()
        assert len(m.samplers) == 1  # not before a refresh (the interval is an hour)
        np.testing.assert_array_equal(m.refresh(), [8, 24])
        assert len(m.samplers) == 2 and m.samplers[1].store is shards.stores[1]
        b = m.sample(512)
        check_rows(b, shards.stores)
        share = float(np.mean(b.source.numpy() == 1))
        assert abs(share - 0.75) < 5 * np.sqrt(0.75 * 0.25 / 512)
        shards.stores.reverse()  # a set that moves its stores breaks the meaning of source: refused
        with pytest.raises(StoreError, match="no longer lists store 0"):
            m.refresh()
    shards.close()


@pytest.mark.parametrize("strategy", ["random", GoalMixture(0.0, 0.5, 0.5)], ids=["random", "mixture"])
def test_random_goals_come_from_a_rows_own_store_of_a_list_and_from_every_store_of_a_set(tmp_path, strategy):
    """A list of stores is a mixture of separate datasets: a row's random goal (``random``, a GoalMixture's random
    share) is an achieved goal of its own store. The same stores as a StoreSet are one dataset: a random goal comes
    from either store by its share of the transitions (3/4 and 1/4), whichever store the row came from."""
    obs, act = fetch_spaces()
    root = tmp_path / "set"
    root.mkdir()
    for k, n in enumerate((12, 4)):  # achieved goal (1000 k + i, r, 0) at row r of episode i of store k
        with EpisodeStore.create(root / f"s{k}", obs, act) as store:
            for i in range(n):
                store.append_episode(coded_episode(obs, act, 1000 * k + i, T=6, seed=i))
    share, p_random = np.array([0.75, 0.25]), 1.0 if strategy == "random" else strategy.p_random
    kw = {"goal_selection_strategy": strategy, "reward_fn": sparse_reward, "seed": 1}

    def goal_stores(m: MixtureSampler) -> tuple[np.ndarray, np.ndarray]:
        b = m.sample()
        her = b.is_relabeled.numpy()
        return b.observations["desired_goal"].numpy()[her, 0].astype(np.int64) // 1000, b.source.numpy()[her]

    stores = [EpisodeStore.open(root / f"s{k}") for k in range(2)]
    with MixtureSampler(stores, "transitions", 8192, **kw) as m:
        goal, source = goal_stores(m)
        assert len(goal) > 4000 and (goal == source).all()
    for s in stores:
        s.close()
    shards = Directory(root)
    with MixtureSampler(shards, "transitions", 8192, **kw) as m:
        goal, source = goal_stores(m)
        q = p_random * (1 - share[source])  # the chance that a row's goal comes from the other store
        assert abs((goal != source).sum() - q.sum()) < 5 * np.sqrt((q * (1 - q)).sum())
    shards.close()


def test_a_store_sets_goal_mixture_without_random_goals_relabels_from_each_rows_own_episode(tmp_path):
    """A store set's samplers take random goals from a source over all its stores; a part of a batch whose
    relabelled rows drew no random goal (a GoalMixture with p_random 0) asked it for none, which failed an
    assertion. Each relabelled row's goal is a current or later achieved goal of its own episode."""
    obs, act = fetch_spaces()
    root = str(tmp_path / "dataset")
    for k in range(2):  # achieved goal (1000 k + i, r, 0) at row r of episode i of shard k
        with open_store(root, obs, act, shard=f"actor-{k}") as writer:
            for i in range(3):
                writer.append_episode(coded_episode(obs, act, 1000 * k + i, T=6, seed=i))
    mixture = GoalMixture(0.5, 0.5, 0.0)
    with open_dataset(root) as view, MixtureSampler(
        view, weights="transitions", batch_size=256, goal_selection_strategy=mixture, reward_fn=sparse_reward, seed=2
    ) as m:
        for _ in range(3):
            b = m.sample()
            goal, steps = b.observations["desired_goal"].numpy(), b.steps.numpy()
            assert b.is_relabeled.all() and set(b.source.tolist()) == {0, 1}
            np.testing.assert_array_equal(goal[:, 0], 1000 * b.source.numpy() + b.episode_ids.numpy())
            assert (goal[:, 1] >= steps + 1).all() and (goal[:, 1] <= 6).all()


def test_a_sharded_datasets_view_samples_uniformly_and_grows(tmp_path):
    obs, act = fetch_spaces()
    root = str(tmp_path / "dataset")
    writers = [open_store(root, obs, act, shard=f"actor-{k}", commit_interval=0) for k in range(2)]
    for k, w in enumerate(writers):
        for i in range(k + 1):
            w.append_episode(make_episode(obs, act, 8, seed=10 * k + i))
    with open_dataset(root) as view, MixtureSampler(view, "transitions", 600, seed=4, reward_fn=sparse_reward) as m:
        assert isinstance(view, StoreSet)
        np.testing.assert_allclose(m.weights, [1 / 3, 2 / 3])
        b = m.sample()
        check_rows(b, view.stores)
        writers.append(open_store(root, obs, act, shard="actor-2", commit_interval=0))
        writers[2].append_episode(make_episode(obs, act, 24, seed=99))
        np.testing.assert_array_equal(m.refresh(), [8, 16, 24])
        assert view.shards[2] == "actor-2"
        b = m.sample()
        check_rows(b, view.stores)
        share = np.bincount(b.source.numpy(), minlength=3) / 600
        assert (np.abs(share - [1 / 6, 1 / 3, 1 / 2]) < 5 * np.sqrt(0.25 / 600)).all(), share
    for w in writers:
        w.close()


def test_the_per_store_samplers_options_are_checked_once_naming_them(three):
    for kw, message in [
        ({"n_sampled_goal": True}, "n_sampled_goal must be an int >= 0, not a bool: got True"),
        ({"refresh_interval": -1}, "refresh_interval must be a real number >= 0 or None: got -1"),
        ({"seed": -1}, "seed must be an int >= 0 or None: got -1"),
        ({"copy_info_dict": "no"}, "copy_info_dict must be True or False, not a str: got 'no'"),
    ]:
        with pytest.raises(ValueError) as e:
            MixtureSampler(three, "transitions", 32, reward_fn=sparse_reward, **kw)
        assert str(e.value) == message
    with MixtureSampler(three, "transitions", np.int64(32), reward_fn=sparse_reward, n_sampled_goal=np.int8(1)) as m:
        assert m.batch_size == 32 and m.her_ratio == 0.5 and all(s.config == m.samplers[0].config.replace(
            seed=s.config.seed) for s in m.samplers)
        assert m.sample().actions.shape == (32, 4)


def test_misuse_is_refused_and_large_weights_keep_their_proportions(three):
    """Weights whose sum overflows keep their proportions; numbers given as text or flags, a batch size that is not an
    int, a closed mixture, and a state of other stores are refused (a refused state changes nothing); a state goes to
    the store of its URL wherever that store now is."""
    with MixtureSampler(three, [1e308, 1e308, 0], 1000, reward_fn=sparse_reward, seed=0) as m:
        counts = np.bincount(m.sample().source.numpy(), minlength=3)
        assert abs(counts[0] - 500) < 5 * np.sqrt(250) and counts[2] == 0
    for weights in (["1", "2", "3"], [True, False, True]):
        with pytest.raises(ValueError, match="non-negative numbers"):
            MixtureSampler(three, weights, reward_fn=sparse_reward)
    for size in (2.7, True, 0):
        with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
            MixtureSampler(three, "transitions", size, reward_fn=sparse_reward)
    m = MixtureSampler(three, "transitions", 16, reward_fn=sparse_reward, seed=1)
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        m.sample(2.5)
    state = m.state_dict()
    want = [m.sample() for _ in range(3)]
    with pytest.raises(ValueError, match="not a MixtureSampler state"):
        m.load_state_dict({"rng": {"bit_generator": "nonsense"}, "stores": [], "samplers": []})
    with pytest.raises(ValueError, match="the state is of stores"):
        m.load_state_dict({**state, "stores": state["stores"][:2], "samplers": state["samplers"][:2]})
    m.load_state_dict(state)
    for got, ref in zip([m.sample() for _ in range(3)], want):
        assert torch.equal(got.source, ref.source) and torch.equal(got.episode_ids, ref.episode_ids)
    m.close()
    with pytest.raises(StoreError, match="closed"):
        m.sample()
    # the same stores listed in another order: each store's sampler state follows its URL
    with MixtureSampler(three[::-1], "transitions", 16, reward_fn=sparse_reward, seed=2) as r:
        r.load_state_dict(state)
        for pos, store in enumerate(three[::-1]):
            assert r.samplers[pos].state_dict() == state["samplers"][state["stores"].index(store.url)]
