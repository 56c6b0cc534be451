"""StepWriter: interleaved episodes of n_envs environments assembled from per-step adds."""

from __future__ import annotations

import errno
import os
import re

import numpy as np
import pytest
from gymnasium import spaces

from her_store import EpisodeStore, HerSampler
from her_store.errors import EpisodeValidationError, StoreError, StoreLockedError
from her_store.storage import LocalBackend
from tests.conftest import assert_episode_equal, fetch_spaces, make_episode


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
        col = {name: np.stack([eps[e][name][step[e]] for e in range(n_envs)]) for name in eps[0] if name not in keys}
        term, trunc = col["terminated"], col["truncated"]
        # a spare (finished) env must not end an episode: it only fills the batch
        term = term & np.array(live)
        trunc = trunc & np.array(live)
        if "is_success" in eps[0]:
            succ = col["is_success"]
            infos = [{"is_success": s} for s in succ] if info_style == "list" else {"is_success": succ}
        else:
            infos = None
        writer.add(obs, nxt, col["action"], col["reward"], term, trunc, infos)
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
        [
            make_episode(
                obs, act, int(rng.integers(1, 40)), seed=100 * e + i, info_keys=("is_success",), terminated=bool(i % 2)
            )
            for i in range(5)
        ]
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


def test_eight_envs_append_image_episodes_into_shards_and_sampled_frames_are_theirs(store_path, fetch):
    """Eight envs' image episodes, interleaved step by step, land in a sharded array (shards of 16 rows, most
    filled by several episodes): every episode reads back whole, and every sampled frame is its episode's."""
    obs, act = fetch
    obs = spaces.Dict({**obs.spaces, "pixels": spaces.Box(0, 255, (3, 8, 8), np.uint8)})
    rng = np.random.default_rng(8)
    per_env = [[make_episode(obs, act, int(rng.integers(1, 12)), seed=100 * e + i) for i in range(3)] for e in range(8)]
    with EpisodeStore.create(store_path, obs, act, chunk_rows=16) as store:
        writer = store.writer(8)
        _drive(writer, per_env)
        store.flush()
        assert store._root["steps/pixels"].shards == (16, 3, 8, 8)
        table = store.episodes
        assert store.num_episodes == 24
        model = {}
        for e in range(8):
            for i, eid in enumerate(table["episode_id"][table["env_index"] == e]):
                model[int(eid)] = per_env[e][i]
                assert_episode_equal(store.episode(int(eid)), per_env[e][i])
        with HerSampler(store, 256, n_sampled_goal=0, seed=0) as sampler:
            b = sampler.sample()
        ids, t = b.episode_ids.numpy(), b.steps.numpy()
        assert len(set(ids.tolist())) > 16
        np.testing.assert_array_equal(
            b.observations["pixels"].numpy(), [model[e]["pixels"][s] for e, s in zip(ids, t)]
        )
        np.testing.assert_array_equal(
            b.next_observations["pixels"].numpy(), [model[e]["pixels"][s + 1] for e, s in zip(ids, t)]
        )


def test_flush_partial_ends_unfinished_episodes_as_truncated(store_path, fetch):
    obs, act = fetch
    ep = make_episode(obs, act, 10, seed=0, terminated=True)
    with EpisodeStore.create(store_path, obs, act) as store:
        w = store.writer(1)
        for t in range(4):
            w.add(
                {k: ep[k][t : t + 1] for k in obs.spaces},
                {k: ep[k][t + 1 : t + 2] for k in obs.spaces},
                ep["action"][t : t + 1],
                ep["reward"][t : t + 1],
                ep["terminated"][t : t + 1],
                ep["truncated"][t : t + 1],
            )
        assert store.num_episodes == 0 and list(w.pending_steps) == [4]
        assert w.flush_partial() == [0]
        got = store.episode(0)
        assert got.length == 4
        np.testing.assert_array_equal(got["observation"], ep["observation"][:5])  # last row = last next_obs
        np.testing.assert_array_equal(got["truncated"], [False, False, False, True])
        assert not got["terminated"].any()
        assert w.flush_partial() == []


def test_cut_resets_ends_the_episode_of_an_env_whose_obs_does_not_follow_its_last_step(store_path, fetch):
    """An env whose obs is not, byte for byte in the stored dtypes, the last add's next_obs was reset in between: its
    episode ends there, truncated, with that next_obs as its final observation. NaNs compare by their bytes, obs in
    another dtype or not contiguous compare as stored, an env with no pending step is never cut, and a refused step
    ends nothing."""
    obs, act = fetch
    eps = [make_episode(obs, act, 6, seed=e) for e in range(2)]
    eps[1]["observation"][:, 0] = np.nan

    def row(t):
        return {k: np.stack([e[k][t] for e in eps]) for k in obs.spaces}

    def action(t):
        return np.stack([e["action"][t] for e in eps])

    no = np.zeros(2, bool)
    with EpisodeStore.create(store_path, obs, act) as store:
        w = store.writer(2)
        for t in range(3):  # the first: nothing pending, nothing to cut
            assert w.add(row(t), row(t + 1), action(t), np.zeros(2, np.float32), no, no, cut_resets=True) == []
        follows = {k: np.repeat(v, 2, axis=0)[::2].astype(np.float64) for k, v in row(3).items()}  # float64, strided
        assert w.add(follows, row(4), action(3), np.zeros(2, np.float32), no, no, cut_resets=True) == []
        assert list(w.pending_steps) == [4, 4]
        reset = row(4)
        reset["achieved_goal"][1] += 1
        with pytest.raises(EpisodeValidationError, match="action"):
            w.add(reset, row(5), action(4)[:, :1], np.zeros(2, np.float32), no, no, cut_resets=True)
        assert list(w.pending_steps) == [4, 4] and store.num_episodes == 0
        (cut,) = w.add(reset, row(5), action(4), np.zeros(2, np.float32), no, no, cut_resets=True)
        assert list(w.pending_steps) == [5, 1]
        ep = store.episode(cut)
        want = {k: v[:5] if k in obs.spaces else v[:4] for k, v in eps[1].items()}
        want["reward"], want["truncated"] = np.zeros(4, np.float32), np.eye(1, 4, 3, dtype=bool)[0]
        want["terminated"] = np.zeros(4, bool)
        assert_episode_equal(ep, want)


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
        with pytest.raises(EpisodeValidationError, match=r"obs\['observation'\] has shape \(2, 9\), expected \(2, 10"):
            w.add(bad_obs, o, np.zeros((2, 4)), np.zeros(2), np.zeros(2, bool), np.zeros(2, bool))
        with pytest.raises(EpisodeValidationError, match="terminated has dtype float64, expected bool"):
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


def _steps(ep: dict, keys, t: int, n_envs: int) -> tuple:
    """Step ``t`` of ``ep`` for every env: (obs, next_obs, action, reward, terminated, truncated) with n_envs rows."""
    def rows(a):
        return np.repeat(a[t : t + 1], n_envs, axis=0)

    obs = {k: rows(ep[k]) for k in keys}
    nxt = {k: np.repeat(ep[k][t + 1 : t + 2], n_envs, axis=0) for k in keys}
    return obs, nxt, rows(ep["action"]), rows(ep["reward"]), rows(ep["terminated"]), rows(ep["truncated"])


def _with_infos(args: tuple, ep: dict, t: int, n_envs: int) -> tuple:
    return (*args, [{"is_success": ep["is_success"][t]} for _ in range(n_envs)])


def _bad_step(case: str, obs, nxt, action, reward, term, trunc, infos):
    """One step of every env broken in one field (the last step: every env ends on it)."""
    if case == "next_obs with a row missing":  # the reported case: n_envs=3, a 2-row next_obs
        nxt = dict(nxt, achieved_goal=nxt["achieved_goal"][:2])
    elif case == "next_obs without a key":
        nxt = {k: v for k, v in nxt.items() if k != "desired_goal"}
    elif case == "obs without a key":
        obs = {k: v for k, v in obs.items() if k != "observation"}
    elif case == "obs with a key the store does not hold":  # was dropped without a word
        obs = dict(obs, velocity=obs["observation"])
    elif case == "next_obs with a key the store does not hold":
        nxt = dict(nxt, velocity=nxt["observation"])
    elif case == "next_obs overflowing float32":
        nxt = dict(nxt, observation=nxt["observation"].astype(np.float64))
        nxt["observation"][2, 0] = 1e39
    elif case == "action transposed":  # (4, 3) for (3, 4): the same size, so it used to be reshaped and scrambled
        action = np.ascontiguousarray(action.T)
    elif case == "reward overflowing float32":
        reward = reward.astype(np.float64)
        reward[1] = -1e300
    elif case == "infos of two envs":
        infos = infos[:2]
    elif case == "infos of numbers":
        infos = [1.0, 0.0, 1.0]
    return obs, nxt, action, reward, term, trunc, infos


BAD_STEPS = {
    "next_obs with a row missing": r"next_obs\['achieved_goal'\] has shape \(2, 3\), expected \(3, 3\)",
    "next_obs without a key": r"next_obs has no key 'desired_goal'",
    "obs without a key": r"obs has no key 'observation'",
    "obs with a key the store does not hold": r"obs has keys \['velocity'\] the store does not hold",
    "next_obs with a key the store does not hold": r"next_obs has keys \['velocity'\] the store does not hold",
    "next_obs overflowing float32": r"next_obs\['observation'\] has 1e\+39 at \(2, 0\), which overflows float32",
    "action transposed": r"action has shape \(4, 3\), expected \(3, 4\)",
    "reward overflowing float32": r"reward has -1e\+300 at \(1,\), which overflows float32",
    "infos of two envs": r"infos\['is_success'\] has shape \(2,\), expected \(3,\)",
    "infos of numbers": r"infos must be a list of dicts \(one per env\) or a dict of arrays, got \[1\.0, 0\.0, 1\.0\]",
}


@pytest.mark.parametrize("case", list(BAD_STEPS))
def test_a_failed_add_leaves_every_env_as_before(store_path, fetch, case):
    obs, act = fetch
    n_envs = 3
    ep = make_episode(obs, act, 3, seed=7, info_keys=("is_success",), terminated=True)
    with EpisodeStore.create(store_path, obs, act, info_keys=["is_success"]) as store:
        w = store.writer(n_envs)
        for t in range(2):
            assert w.add(*_with_infos(_steps(ep, obs.spaces, t, n_envs), ep, t, n_envs)) == []
        last = _with_infos(_steps(ep, obs.spaces, 2, n_envs), ep, 2, n_envs)
        with pytest.raises(EpisodeValidationError, match=BAD_STEPS[case]):
            w.add(*_bad_step(case, *last))
        assert store.num_episodes == 0 and list(w.pending_steps) == [2, 2, 2]
        assert w.add(*last) == [0, 1, 2]  # the next correct step stores clean episodes with exactly one end
        for i in range(n_envs):
            got = store.episode(i)
            assert_episode_equal(got, ep)
            assert int(got["terminated"].sum() + got["truncated"].sum()) == 1
        assert list(w.pending_steps) == [0, 0, 0]


def test_flush_partial_refuses_a_bad_last_next_obs_and_changes_nothing(store_path, fetch):
    obs, act = fetch
    ep = make_episode(obs, act, 3, seed=8)
    with EpisodeStore.create(store_path, obs, act) as store:
        w = store.writer(3)
        w.add(*_steps(ep, obs.spaces, 0, 3))
        o, nxt, *rest = _steps(ep, obs.spaces, 1, 3)
        w.add(o, dict(nxt, achieved_goal=nxt["achieved_goal"][:2]), *rest)  # no env ends: next_obs is not read
        with pytest.raises(EpisodeValidationError, match=r"last add's next_obs\['achieved_goal'\] has shape \(2, 3"):
            w.flush_partial()
        assert store.num_episodes == 0 and list(w.pending_steps) == [2, 2, 2]
        w.add(*_steps(ep, obs.spaces, 1, 3))  # the step again, correct this time
        assert w.flush_partial() == [0, 1, 2]
        want = {k: v[[0, 1, 1, 2]] if k in obs.spaces else v[[0, 1, 1]] for k, v in ep.items()}  # steps 0, 1, 1
        want["truncated"] = np.array([False, False, True])
        for i in range(3):
            assert_episode_equal(store.episode(i), want)


def test_an_episode_longer_than_the_capacity_is_dropped_and_its_env_writes_again(store_path, fetch):
    obs, act = fetch
    long_ep, short = make_episode(obs, act, 6, seed=1), make_episode(obs, act, 2, seed=2)
    with EpisodeStore.create(store_path, obs, act, capacity=5) as store:
        w = store.writer(2)

        def both(a, b):
            return tuple(
                {k: np.concatenate([x[k], y[k]]) for k in x} if isinstance(x, dict) else np.concatenate([x, y])
                for x, y in zip(a, b)
            )

        for t in range(5):
            w.add(*both(_steps(long_ep, obs.spaces, t, 1), _steps(short, obs.spaces, t % 2, 1)))
        assert w.episode_ids == [0, 1] and list(w.pending_steps) == [5, 1]
        # env 0's episode (6 steps) and env 1's (2 steps) end on the same step
        with pytest.raises(EpisodeValidationError, match=r"env 0: episode of 6 steps dropped .*capacity 5") as info:
            w.add(*both(_steps(long_ep, obs.spaces, 5, 1), _steps(short, obs.spaces, 1, 1)))
        assert str(info.value).endswith("the other ended episodes were appended [2]")
        assert list(w.pending_steps) == [0, 0] and w.episode_ids == [0, 1, 2]
        ((env, steps, reason),) = w.dropped  # which env lost which episode, without parsing the message
        assert (env, steps) == (0, 6) and reason.startswith("EpisodeValidationError: ") and "capacity 5" in reason
        assert_episode_equal(store.episode(2), short)
        for t in range(2):  # env 0 is not wedged: its next episode is stored whole
            w.add(*both(_steps(short, obs.spaces, t, 1), _steps(short, obs.spaces, t, 1)))
        assert w.episode_ids == [0, 1, 2, 3, 4]
        for i in (3, 4):
            assert_episode_equal(store.episode(i), short)
        table = store.episodes
        assert dict(zip(table["episode_id"].tolist(), table["env_index"].tolist()))[3] == 0


@pytest.mark.parametrize("fault", ["full disk", "lease lost"])
def test_a_store_error_while_appending_drops_that_env_and_chains_the_cause(store_path, fetch, monkeypatch, fault):
    obs, act = fetch
    ep = make_episode(obs, act, 2, seed=3)
    if fault == "full disk":  # the data rows' write fails; the error is wrapped in a StoreError
        where, name, injected, raised = os, "pwrite", OSError(errno.ENOSPC, "No space left on device"), StoreError
    else:  # the commit record's write is refused; a her_store error keeps its class
        where, name, injected = LocalBackend, "write_atomic", StoreLockedError("another writer took over the lease")
        raised = StoreLockedError
    with EpisodeStore.create(store_path, obs, act, commit_interval=0.0) as store:
        w = store.writer(2)
        w.add(*_steps(ep, obs.spaces, 0, 2))
        real, calls = getattr(where, name), []

        def fail_once(*args, **kwargs):
            calls.append(args)
            if len(calls) == 1:
                raise injected
            return real(*args, **kwargs)

        monkeypatch.setattr(where, name, fail_once)
        cause = rf"\({type(injected).__name__}: {re.escape(str(injected))}\)"
        message = rf"env 0: episode of 2 steps dropped {cause}.*appended \[\d+\]"
        with pytest.raises(raised, match=message) as info:
            w.add(*_steps(ep, obs.spaces, 1, 2))  # both envs end: env 0's append fails, env 1's goes through
        assert info.type is raised and info.value.__cause__ is injected
        assert [(d.env, d.steps) for d in w.dropped] == [(0, 2)] and injected.__class__.__name__ in w.dropped[0].reason
        monkeypatch.undo()
        assert list(w.pending_steps) == [0, 0]
        (appended,) = w.episode_ids
        assert store.episodes["env_index"][store.episodes["episode_id"] == appended].tolist() == [1]
        assert_episode_equal(store.episode(appended), ep)
        for t in range(2):  # env 0 starts afresh: one clean episode with one end
            w.add(*_steps(ep, obs.spaces, t, 2))
        for eid in w.episode_ids[1:]:
            assert_episode_equal(store.episode(eid), ep)


def _valued_spaces() -> tuple[spaces.Dict, spaces.Space, dict]:
    goal = spaces.Box(-np.inf, np.inf, (2,), np.float32)
    obs = spaces.Dict(
        {
            "observation": goal,
            "achieved_goal": goal,
            "desired_goal": goal,
            "pixels": spaces.Box(0, 255, (2, 2), np.uint8),
            "bits": spaces.MultiBinary(3),
        }
    )
    return obs, spaces.MultiDiscrete([3, 4]), {"stage": spaces.Discrete(3, start=1)}


def _put(a: np.ndarray, value, dtype=None) -> np.ndarray:
    """A copy of ``a`` (in ``dtype``) with its second row's first value set to ``value``."""
    a = a.astype(dtype or a.dtype)
    a.reshape(len(a), -1)[1, 0] = value
    return a


BAD_VALUES = {
    "uint16 300 for uint8": (
        "pixels", lambda a: _put(a, 300, np.uint16), r"has 300 at \(1, 0, 0\), which uint8 cannot hold \(0\.\.255\)"
    ),
    "uint64 beyond int64": (
        "action", lambda a: _put(a, 2**63, np.uint64), r"has 9223372036854775808 at \(1, 0\), which int64 cannot hold"
    ),
    "MultiDiscrete above nvec": (
        "action", lambda a: _put(a, 3), r"has 3 at \(1, 0\), outside its space's range 0\.\.2"
    ),
    "MultiDiscrete below 0": ("action", lambda a: _put(a, -1), r"has -1 at \(1, 0\), outside its space's range 0\.\.2"),
    "Discrete below start": ("stage", lambda a: _put(a, 0), r"has 0 at \(1,\), outside its space's range 1\.\.3"),
    "Discrete above start + n": ("stage", lambda a: _put(a, 4), r"has 4 at \(1,\), outside its space's range 1\.\.3"),
    "MultiBinary 2": ("bits", lambda a: _put(a, 2), r"has 2 at \(1, 0\), outside its space's range 0\.\.1"),
    "float64 beyond float32": (
        "observation", lambda a: _put(a, 1e39, np.float64), r"has 1e\+39 at \(1, 0\), which overflows float32"
    ),
    "int64 2**24 + 1 for float32": (  # was stored as 2**24
        "observation", lambda a: _put(a, 2**24 + 1, np.int64),
        r"has 16777217 at \(1, 0\), which float32 cannot hold exactly \(it would store 16777216\.0\)",
    ),
    "uint64 2**64 - 1 for float32": (
        "observation",
        lambda a: _put(a, 2**64 - 1, np.uint64),
        r"has 18446744073709551615 at \(1, 0\), which float32 cannot hold exactly",
    ),
}


@pytest.mark.parametrize("path", ["append_episode", "StepWriter.add"])
@pytest.mark.parametrize("case", list(BAD_VALUES))
def test_values_a_cast_or_the_space_would_change_are_refused(store_path, case, path):
    obs, act, info = _valued_spaces()
    name, spoil, message = BAD_VALUES[case]
    ep = make_episode(obs, act, 3, seed=5)
    ep["stage"] = np.array([1, 2, 3])
    with EpisodeStore.create(store_path, obs, act, info_keys=info) as store:
        if path == "append_episode":
            with pytest.raises(EpisodeValidationError, match=rf"field '{name}' {message}"):
                store.append_episode(dict(ep, **{name: spoil(ep[name])}))
        else:
            # each env steps the episode's rows in order: env i is at row i, so env 1 holds the spoiled value
            step = {k: v[:3] for k, v in ep.items()}
            label = rf"obs\['{name}'\]" if name in obs.spaces else (rf"infos\['{name}'\]" if name == "stage" else name)
            w = store.writer(3)
            spoiled = dict(step, **{name: spoil(step[name])})
            infos = [{"stage": s} for s in spoiled["stage"]]
            with pytest.raises(EpisodeValidationError, match=rf"{label} {message}"):
                w.add({k: spoiled[k] for k in obs.spaces}, {k: step[k] for k in obs.spaces}, spoiled["action"],
                      spoiled["reward"], np.ones(3, bool), np.zeros(3, bool), infos)
            assert list(w.pending_steps) == [0, 0, 0]
        assert store.num_episodes == 0


def test_casts_that_keep_values_are_accepted(store_path):
    obs, act, info = _valued_spaces()
    ep = make_episode(obs, act, 3, seed=6)
    ep["stage"] = np.array([3, 1, 2])
    given = dict(ep)
    given["pixels"] = ep["pixels"].astype(np.uint16)  # values 0..255 fit uint8
    given["observation"] = ep["observation"].astype(np.float64)
    given["observation"][0] = [np.nan, np.inf]  # NaN and inf given as such are kept
    given["bits"] = ep["bits"].astype(bool)
    given["action"] = ep["action"].astype(np.uint8)
    given["reward"] = np.array([2**30, -(2**40), 7], np.int64)  # integers float32 holds exactly, however large
    want = dict(
        ep, observation=given["observation"].astype(np.float32), reward=np.array([2**30, -(2**40), 7], np.float32)
    )
    with EpisodeStore.create(store_path, obs, act, info_keys=info) as store:
        store.append_episode(given)
        w = store.writer(1)
        for t in range(3):
            row = {k: v[t : t + 1] for k, v in given.items()}
            w.add({k: row[k] for k in obs.spaces}, {k: given[k][t + 1 : t + 2] for k in obs.spaces}, row["action"],
                  row["reward"], row["terminated"], row["truncated"], [{"stage": int(row["stage"][0])}])
        assert w.episode_ids == [1]
        for i in range(2):
            got = store.episode(i)
            np.testing.assert_array_equal(got["observation"][0], [np.nan, np.inf])
            assert_episode_equal(got, want)


def test_an_interrupt_between_envs_drops_the_ended_episodes_not_yet_appended(tmp_path, monkeypatch):
    """KeyboardInterrupt while env 1's ended episode is appended: envs 1 and 2 drop theirs (none is merged with
    the next episode), and the loop can go on."""
    obs, act = fetch_spaces()
    store = EpisodeStore.create(str(tmp_path / "s"), obs, act, commit_interval=0)
    w = store.writer(n_envs=3)
    rng = np.random.default_rng(0)

    def step(done: bool) -> list[int]:
        o = {k: rng.standard_normal((3, *s.shape)).astype(np.float32) for k, s in obs.spaces.items()}
        n = {k: rng.standard_normal((3, *s.shape)).astype(np.float32) for k, s in obs.spaces.items()}
        a = rng.standard_normal((3, 4)).astype(np.float32)
        return w.add(o, n, a, np.zeros(3, np.float32), np.zeros(3, bool), np.full(3, done))

    for _ in range(3):
        step(False)
    real, calls = EpisodeStore.append_validated, {"n": 0}

    def interrupted(self, *args):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(self, *args)

    monkeypatch.setattr(EpisodeStore, "append_validated", interrupted)
    with pytest.raises(KeyboardInterrupt):
        step(True)
    monkeypatch.undo()
    assert list(w.pending_steps) == [0, 0, 0]
    for _ in range(2):
        step(False)
    step(True)
    store.close()
    with EpisodeStore.open(str(tmp_path / "s")) as r:
        for i in range(r.first_episode, r.end_episode):
            ep = r.episode(i)
            assert int((ep["terminated"] | ep["truncated"]).sum()) == 1
        assert sorted(r.episodes["length"].tolist()) == [3, 3, 3, 4]


def test_pending_gives_each_envs_unfinished_episode_as_append_episode_takes_it(store_path, fetch):
    obs_space, act_space = fetch
    eps = [make_episode(obs_space, act_space, 5, seed=s) for s in (1, 2)]
    with EpisodeStore.create(store_path, obs_space, act_space) as store:
        w = store.writer(n_envs=2)
        assert all(len(v) == 0 for v in w.pending(0).values())
        for t in range(3):
            obs = {k: np.stack([e[k][t] for e in eps]) for k in obs_space.spaces}
            nxt = {k: np.stack([e[k][t + 1] for e in eps]) for k in obs_space.spaces}
            steps = (np.stack([e[name][t] for e in eps]) for name in ("action", "reward", "terminated", "truncated"))
            w.add(obs, nxt, *steps)
        for env, ep in enumerate(eps):
            got = w.pending(env)
            for k in obs_space.spaces:
                np.testing.assert_array_equal(got[k], ep[k][:4])
            for k in ("action", "reward", "terminated", "truncated"):
                np.testing.assert_array_equal(got[k], ep[k][:3])
        got["action"][:] = 99  # a copy: the staged rows are untouched
        assert not (w.pending(1)["action"] == 99).any()
        with pytest.raises(IndexError, match="env 2 out of range"):
            w.pending(2)



def _step(eps, t):
    """obs, next_obs and the per-step columns of step ``t[e]`` of each env's episode ``eps[e]``."""
    keys = [k for k in eps[0] if len(eps[0][k]) == len(eps[0]["action"]) + 1]
    obs = {k: np.stack([ep[k][s] for ep, s in zip(eps, t)]) for k in keys}
    nxt = {k: np.stack([ep[k][s + 1] for ep, s in zip(eps, t)]) for k in keys}

    def col(name):
        return np.stack([ep[name][s] for ep, s in zip(eps, t)])

    return obs, nxt, col("action"), col("reward"), col("terminated"), col("truncated")


@pytest.mark.parametrize("lists", [False, True], ids=["arrays", "lists"])
def test_skip_leaves_an_env_between_episodes_out_of_that_step(store_path, fetch, lists):
    obs_space, act_space = fetch
    a, b, c = (make_episode(obs_space, act_space, T, seed=s) for T, s in ((2, 1), (4, 2), (3, 3)))
    # env 0: episode a, a skipped step (a vector env's autoreset step: it repeats a's last values), episode c;
    # env 1: episode b, then skipped steps. Skipped values must not reach any episode.
    plan = [((a, 0), (b, 0), False, False), ((a, 1), (b, 1), False, False), ((a, 1), (b, 2), True, False),
            ((c, 0), (b, 3), False, False), ((c, 1), (b, 3), False, True), ((c, 2), (b, 3), False, True)]
    with EpisodeStore.create(store_path, obs_space, act_space) as store:
        w = store.writer(n_envs=2)
        ids = []
        for (e0, t0), (e1, t1), skip0, skip1 in plan:
            obs, nxt, action, reward, terminated, truncated = _step([e0, e1], [t0, t1])
            if lists:  # what a vector env's caller may pass: converted, and the skip mask still applies
                action, reward = action.tolist(), reward.tolist()
            ids += w.add(obs, nxt, action, reward, terminated, truncated, skip=np.array([skip0, skip1]))
        assert ids == [0, 1, 2] and w.pending_steps.tolist() == [0, 0]
        for i, want in enumerate((a, b, c)):
            assert_episode_equal(dict(store.episode(i)), want)


def test_skip_is_refused_for_an_env_in_an_episode_and_for_a_bad_mask(store_path, fetch):
    obs_space, act_space = fetch
    a, b = (make_episode(obs_space, act_space, 3, seed=s) for s in (1, 2))
    with EpisodeStore.create(store_path, obs_space, act_space) as store:
        w = store.writer(n_envs=2)
        w.add(*_step([a, b], [0, 0]))
        with pytest.raises(EpisodeValidationError, match="skip names env 1, which has 1 pending steps"):
            w.add(*_step([a, b], [1, 1]), skip=np.array([False, True]))
        for bad in (np.array([1, 0]), np.array([True]), np.ones((2, 1), bool)):
            with pytest.raises(EpisodeValidationError, match=r"skip must be a bool array of shape \(2,\)"):
                w.add(*_step([a, b], [1, 1]), skip=bad)
        assert w.pending_steps.tolist() == [1, 1]  # nothing refused was staged
        w.add(*_step([a, b], [1, 1]), skip=np.array([False, False]))
        assert w.add(*_step([a, b], [2, 2])) == [0, 1]
        assert_episode_equal(dict(store.episode(0)), a)
        assert_episode_equal(dict(store.episode(1)), b)


def test_flush_partial_of_some_envs_leaves_the_others_running(store_path, fetch):
    obs_space, act_space = fetch
    eps = [make_episode(obs_space, act_space, 4, seed=s) for s in (1, 2, 3)]
    with EpisodeStore.create(store_path, obs_space, act_space) as store:
        w = store.writer(n_envs=3)
        for t in range(2):
            w.add(*_step(eps, [t, t, t]))
        for bad in ([3], [-1], [True], [0.0]):
            with pytest.raises(IndexError, match="out of range for a writer of 3 envs"):
                w.flush_partial(envs=bad)
        assert w.flush_partial(envs=[1]) == [0]
        assert w.pending_steps.tolist() == [2, 0, 2]
        cut = {k: v[:3] if len(v) == 5 else v[:2].copy() for k, v in eps[1].items()}
        cut["truncated"][-1] = True
        assert_episode_equal(dict(store.episode(0)), cut)
        for t in range(2, 4):
            w.add(*_step(eps, [t, t, t]), skip=np.array([False, True, False]))
        store.flush()
        assert store.num_episodes == 3
        assert_episode_equal(dict(store.episode(1)), eps[0])
        assert_episode_equal(dict(store.episode(2)), eps[2])


def test_restore_pending_carries_unfinished_episodes_into_a_new_writer(store_path, fetch):
    obs_space, act_space = fetch
    eps = [make_episode(obs_space, act_space, 6, seed=s, terminated=True) for s in (11, 12)]
    with EpisodeStore.create(store_path, obs_space, act_space) as store:
        w = store.writer(n_envs=2)
        for t in range(3):
            w.add(*_step(eps, [t, t]))
        saved = [w.pending(0), w.pending(1)]
        fresh = store.writer(n_envs=2)
        fresh.restore_pending(saved)
        np.testing.assert_array_equal(fresh.pending_steps, [3, 3])
        for t in range(3, 6):  # continuing gives the episodes an uninterrupted writer gives
            fresh.add(*_step(eps, [t, t]))
        table = store.episodes
        assert list(table["env_index"]) == [0, 1]
        for e in range(2):
            assert_episode_equal(store.episode(int(table["episode_id"][e])), eps[e])
        other = store.writer(n_envs=2)
        other.restore_pending([saved[0], {k: v[:0] for k, v in saved[1].items()}])  # env 1 had nothing staged
        np.testing.assert_array_equal(other.pending_steps, [3, 0])
        (eid,) = other.flush_partial()
        got = store.episode(eid)
        np.testing.assert_array_equal(got["observation"], eps[0]["observation"][:4])
        assert list(got["truncated"]) == [False, False, True]


def test_restore_pending_refuses_a_busy_writer_and_bad_episodes(store_path, fetch):
    obs_space, act_space = fetch
    eps = [make_episode(obs_space, act_space, 4, seed=s) for s in (1, 2)]
    with EpisodeStore.create(store_path, obs_space, act_space) as store:
        w = store.writer(n_envs=2)
        w.add(*_step(eps, [0, 0]))
        saved = [w.pending(0), w.pending(1)]
        with pytest.raises(ValueError, match=r"staged steps for envs \[0, 1\]"):
            w.restore_pending(saved)
        fresh = store.writer(n_envs=2)
        with pytest.raises(ValueError, match=r"one episode per env \(2\), got 1"):
            fresh.restore_pending(saved[:1])
        bad = dict(saved[1], action=np.zeros((1, 7), np.float32))
        with pytest.raises(EpisodeValidationError, match="pending episode of env 1: field 'action' has shape"):
            fresh.restore_pending([saved[0], bad])
        assert not fresh.pending_steps.any()
        long = {k: np.concatenate([v] * 1500) for k, v in saved[0].items()}  # more steps than the staging buffer
        long.update({k: long[k][:1501] for k in obs_space.spaces})
        fresh.restore_pending([long, saved[1]])
        np.testing.assert_array_equal(fresh.pending_steps, [1500, 1])
        assert fresh.flush_partial() == [0, 1]
        assert store.episode(0)["action"].shape == (1500, 4)


def test_cut_resets_holds_on_every_path_of_an_add(store_path, fetch):
    """Found by a hostile test of cut_resets: values given as lists (converted, then added again) lost it; obs given
    in float64 after an env had ended (its next_obs then kept as float32) were never compared; a cut episode the
    store refused threw the whole step away (the other envs' steps and ends with it, and the next add cut them); a
    next_obs with a key the store does not hold, at a step that ended nothing, wedged every later cut."""
    obs, act = fetch
    T = 8
    eps = [make_episode(obs, act, T, seed=e) for e in range(2)]

    def row(t):
        return {k: np.stack([e[k][t] for e in eps]) for k in obs.spaces}

    def action(t):
        return np.stack([e["action"][t] for e in eps])

    no, zero = np.zeros(2, bool), np.zeros(2, np.float32)
    with EpisodeStore.create(store_path, obs, act) as store:
        w = store.writer(2)
        w.add(row(0), row(1), action(0), zero, no, no)
        reset = row(5)
        assert len(w.add(reset, row(6), action(1).tolist(), zero.tolist(), no, no, cut_resets=True)) == 2  # lists
        w.add(row(6), row(7), action(6), zero, np.array([True, False]), no)  # env 0 ends: next_obs kept as float32
        jump = {k: v.astype(np.float64) for k, v in row(2).items()}
        jump["observation"][0] = row(7)["observation"][0]  # env 0's new episode starts at its reset obs: goes on...
        jump = {k: np.where(np.arange(2).reshape(2, *[1] * (v.ndim - 1)) == 0, row(7)[k], v) for k, v in jump.items()}
        assert len(w.add(jump, row(3), action(2), zero, no, no, cut_resets=True)) == 1  # ...env 1 was reset
        assert list(w.pending_steps) == [1, 1]
        with pytest.raises(EpisodeValidationError, match=r"next_obs has keys \['velocity'\]"):
            w.add(row(3), {**row(4), "velocity": zero}, action(3), zero, no, no)
        assert list(w.pending_steps) == [1, 1]
    capped = store_path + "-ring"
    with EpisodeStore.create(capped, obs, act, capacity=4) as store:
        w = store.writer(2)
        for t in range(4):  # env 0: 4 steps, env 1: 2 episodes of 2
            w.add(row(t), row(t + 1), action(t), zero, no, np.array([False, t % 2 == 1]))
        w.add(row(4), row(5), action(4), zero, no, no)  # env 0: 5 steps, more than the ring holds
        moved = row(6)
        moved["achieved_goal"][0] += 1  # env 0 was reset: its 5-step episode is cut, and refused
        with pytest.raises(EpisodeValidationError, match="env 0: episode of 5 steps dropped"):
            w.add(moved, row(7), action(6), zero, no, np.array([False, True]), cut_resets=True)
        assert [d.env for d in w.dropped] == [0]
        assert list(w.pending_steps) == [1, 0]  # the step was staged: env 0's new episode, env 1's end appended
        ids = list(w.episode_ids)
        assert store.episode(ids[-1])["truncated"][-1]
        assert w.add(row(7), row(8), action(7), zero, no, no, cut_resets=True) == []  # nothing cut wrongly


def test_a_step_writer_of_something_else_than_a_store_is_refused_by_name():
    """StepWriter("path", 2) raised AttributeError: 'str' object has no attribute 'schema'."""
    from her_store import StepWriter

    for not_a_store in ("runs/fetch", None, object()):
        with pytest.raises(TypeError, match=r"StepWriter appends to an EpisodeStore open for appending, not \w+"):
            StepWriter(not_a_store, 2)
