"""StepWriter: interleaved episodes of n_envs environments assembled from per-step adds."""

from __future__ import annotations

import numpy as np
import pytest
from gymnasium import spaces

from her_store import EpisodeStore, EpisodeValidationError
from tests.conftest import assert_episode_equal, make_episode


def _drive(writer, per_env: list[list[dict]], info_style: str = "list") -> None:
    """Step every env through its episodes; an env whose episodes are used up keeps stepping a spare one."""
    n_envs = len(per_env)
    cursor = [0] * n_envs  # which episode
    t = [0] * n_envs  # step within it
    while any(c < len(eps) for c, eps in zip(cursor, per_env)):
        eps = [per_env[e][min(cursor[e], len(per_env[e]) - 1)] for e in range(n_envs)]
        live = [cursor[e] < len(per_env[e]) for e in range(n_envs)]
        step = [t[e] if live[e] else 0 for e in range(n_envs)]
        keys = [k for k in eps[0] if eps[0][k].shape[0] == eps[0]["action"].shape[0] + 1]
        obs = {k: np.stack([eps[e][k][step[e]] for e in range(n_envs)]) for k in keys}
        nxt = {k: np.stack([eps[e][k][step[e] + 1] for e in range(n_envs)]) for k in keys}
        col = lambda name: np.stack([eps[e][name][step[e]] for e in range(n_envs)])  # noqa: E731
        term, trunc = col("terminated"), col("truncated")
        # a spare (finished) env must not end an episode: it only fills the batch
        term = term & np.array(live)
        trunc = trunc & np.array(live)
        if "is_success" in eps[0]:
            succ = col("is_success")
            infos = [{"is_success": s} for s in succ] if info_style == "list" else {"is_success": succ}
        else:
            infos = None
        writer.add(obs, nxt, col("action"), col("reward"), term, trunc, infos)
        for e in range(n_envs):
            if not live[e]:
                continue
            t[e] += 1
            if t[e] == len(eps[e]["action"]):
                cursor[e] += 1
                t[e] = 0


@pytest.mark.parametrize("n_envs, info_style", [(1, "list"), (3, "list"), (4, "dict")])
def test_interleaved_envs_produce_the_same_episodes(store_path, fetch, n_envs, info_style):
    obs, act = fetch
    rng = np.random.default_rng(n_envs)
    per_env = [
        [make_episode(obs, act, int(rng.integers(1, 40)), seed=100 * e + i, info_keys=("is_success",), terminated=bool(i % 2))
         for i in range(5)]
        for e in range(n_envs)
    ]
    with EpisodeStore.create(store_path, obs, act, info_keys=["is_success"]) as store:
        writer = store.writer(n_envs)
        _drive(writer, per_env, info_style)
        table = store.episodes
        assert store.num_episodes == 5 * n_envs
        for e in range(n_envs):
            ids = table["episode_id"][table["env_index"] == e]
            assert len(ids) == 5
            for i, eid in enumerate(ids):
                assert_episode_equal(store.episode(int(eid)), per_env[e][i])
        assert sorted(writer.episode_ids) == list(range(5 * n_envs))


def test_flush_partial_ends_unfinished_episodes_as_truncated(store_path, fetch):
    obs, act = fetch
    ep = make_episode(obs, act, 10, seed=0, terminated=True)
    with EpisodeStore.create(store_path, obs, act) as store:
        w = store.writer(1)
        for t in range(4):
            w.add(
                {k: ep[k][t : t + 1] for k in obs.spaces},
                {k: ep[k][t + 1 : t + 2] for k in obs.spaces},
                ep["action"][t : t + 1], ep["reward"][t : t + 1], ep["terminated"][t : t + 1], ep["truncated"][t : t + 1],
            )
        assert store.num_episodes == 0 and list(w.pending_steps) == [4]
        assert w.flush_partial() == [0]
        got = store.episode(0)
        assert got.length == 4
        np.testing.assert_array_equal(got["observation"], ep["observation"][:5])  # last row = last next_obs
        np.testing.assert_array_equal(got["truncated"], [False, False, False, True])
        assert not got["terminated"].any()
        assert w.flush_partial() == []


def test_long_episodes_grow_the_staging_buffer(store_path, fetch):
    obs, act = fetch
    long_ep = make_episode(obs, act, 500, seed=1)
    short = [make_episode(obs, act, 3, seed=10 + i) for i in range(200)]
    with EpisodeStore.create(store_path, obs, act) as store:
        _drive(store.writer(2), [[long_ep], short])
        table = store.episodes
        (long_id,) = table["episode_id"][table["env_index"] == 0]
        assert_episode_equal(store.episode(int(long_id)), long_ep)
        assert (table["env_index"] == 1).sum() == 200


def test_discrete_actions_accept_sb3_shape(store_path):
    goal = spaces.Box(-1, 1, (2,), np.float32)
    obs = spaces.Dict({"observation": goal, "achieved_goal": goal, "desired_goal": goal})
    with EpisodeStore.create(store_path, obs, spaces.Discrete(4)) as store:
        w = store.writer(2)
        o = {k: np.zeros((2, 2), np.float32) for k in obs.spaces}
        w.add(o, o, np.array([[1], [3]]), np.zeros(2), np.array([True, True]), np.zeros(2, bool))
        np.testing.assert_array_equal([store.episode(i)["action"][0] for i in range(2)], [1, 3])


def test_bad_steps_are_refused_with_the_field_named(store_path, fetch):
    obs, act = fetch
    with EpisodeStore.create(store_path, obs, act) as store:
        w = store.writer(2)
        o = {k: np.zeros((2, s.shape[0]), np.float32) for k, s in obs.spaces.items()}
        bad_obs = dict(o, observation=np.zeros((2, 9), np.float32))
        with pytest.raises(EpisodeValidationError, match=r"'observation' of one step has shape \(2, 9\), expected \(2, 10\)"):
            w.add(bad_obs, o, np.zeros((2, 4)), np.zeros(2), np.zeros(2, bool), np.zeros(2, bool))
        with pytest.raises(EpisodeValidationError, match="'terminated' has dtype float64, expected bool"):
            w.add(o, o, np.zeros((2, 4)), np.zeros(2), np.zeros(2), np.zeros(2, bool))
        with pytest.raises(ValueError, match="n_envs"):
            store.writer(0)


def test_plain_python_values_take_the_converting_path(store_path):
    goal = spaces.Box(-1, 1, (2,), np.float32)
    obs = spaces.Dict({"observation": goal, "achieved_goal": goal, "desired_goal": goal})
    with EpisodeStore.create(store_path, obs, spaces.Box(-1, 1, (1,), np.float32)) as store:
        w = store.writer(1)
        o = {k: [[0.5, -0.5]] for k in obs.spaces}
        n = {k: [[0.25, 0.75]] for k in obs.spaces}
        assert w.add(o, n, [[0.1]], [1.0], [False], [True]) == [0]
        ep = store.episode(0)
        np.testing.assert_array_equal(ep["observation"], np.array([[0.5, -0.5], [0.25, 0.75]], np.float32))
        assert ep["reward"].tolist() == [1.0] and ep["truncated"].tolist() == [True]
