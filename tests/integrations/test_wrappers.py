"""integrations.wrappers: GoalEnvFlattener round trips, and recorders whose episodes equal what the envs produced."""

from __future__ import annotations

import gc
import signal
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces
from gymnasium.vector import AsyncVectorEnv, AutoresetMode, SyncVectorEnv
from hypothesis import given, settings
from hypothesis import strategies as st

from her_store import EpisodeStore, open_store
from her_store.envs import ENV_ID, PointGoalEnv
from her_store.errors import ReadOnlyStoreError, SchemaMismatchError
from her_store.integrations.wrappers import GoalEnvFlattener, RecordEpisodes, RecordingWarning, RecordVectorEpisodes
from tests.conftest import GOAL_KEYS, ROOT, assert_episode_equal, random_rows


class SpaceEnv(gym.Env):
    """A goal env of any observation space: observations are samples of it; the goal is reached at random."""

    def __init__(self, observation_space: spaces.Dict) -> None:
        self.observation_space = observation_space
        self.action_space = spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.observation_space.seed(seed)
        return self.observation_space.sample(), {}

    def step(self, action):
        return self.observation_space.sample(), 0.0, bool(action), False, {}

    def compute_reward(self, achieved_goal, desired_goal, info):
        return -np.any(np.asarray(achieved_goal) != np.asarray(desired_goal), axis=-1).astype(np.float32)


def bit_flipping_env(**kwargs: object) -> gym.Env:
    """SB3's BitFlippingEnv (a goal env of MultiBinary or Discrete observations); the test skips without SB3."""
    envs = pytest.importorskip("stable_baselines3.common.envs", reason='pip install "her_store[sb3]"')
    return envs.BitFlippingEnv(**kwargs)


def goal_dict(**subs: spaces.Space) -> spaces.Dict:
    return spaces.Dict({k: subs[k] for k in (*GOAL_KEYS, *sorted(set(subs) - set(GOAL_KEYS)))})


# -- GoalEnvFlattener ----------------------------------------------------------------------------------------------


def test_box_spaces_flatten_in_sb2_key_order_and_reset_step_return_flat_vectors():
    env = GoalEnvFlattener(gym.make(ENV_ID))
    assert env.keys == GOAL_KEYS and (env.obs_dim, env.goal_dim) == (4, 2)
    space = env.observation_space
    assert isinstance(space, spaces.Box) and space.dtype == np.float32 and space.shape == (8,)
    np.testing.assert_array_equal(space.low, [-np.inf] * 4 + [-1.0] * 4)
    obs, info = env.reset(seed=3)
    raw = env.unwrapped._obs()
    np.testing.assert_array_equal(obs, np.concatenate([raw[k] for k in GOAL_KEYS]))
    assert space.contains(obs)
    obs, reward, *_ = env.step(np.ones(2, np.float32))
    goals = env.convert_obs_to_dict(obs)
    assert env.compute_reward(goals["achieved_goal"], goals["desired_goal"], info) == reward
    # compute_reward through the wrapper, batched over leading axes
    batch = env.convert_obs_to_dict(np.stack([obs, np.concatenate([obs[:4], obs[4:6], obs[4:6]])]))
    np.testing.assert_array_equal(env.compute_reward(batch["achieved_goal"], batch["desired_goal"], None), [-1, 0])


@st.composite
def box_spaces(draw):
    dtypes = [np.float32, np.float64, np.uint8, np.int16]
    shapes = st.lists(st.integers(1, 3), min_size=1, max_size=3).map(tuple)
    goal_shape, goal_dtype = draw(shapes), draw(st.sampled_from(dtypes))
    subs = {"observation": (draw(shapes), draw(st.sampled_from(dtypes)))}
    subs.update(achieved_goal=(goal_shape, goal_dtype), desired_goal=(goal_shape, goal_dtype))
    if draw(st.booleans()):
        subs["extra"] = (draw(shapes), draw(st.sampled_from(dtypes)))
    made = {}
    for k, (shape, dtype) in subs.items():
        lo, hi = (-5, 5) if np.dtype(dtype).kind in "fi" else (0, 200)
        made[k] = spaces.Box(lo, hi, shape, dtype)
    return goal_dict(**made), draw(st.lists(st.integers(0, 3), max_size=2).map(tuple))


@settings(max_examples=40, deadline=None)
@given(box_spaces(), st.integers(0, 2**31))
def test_box_round_trip_is_exact_for_any_shapes_dtypes_and_batch(case, seed):
    obs_space, batch = case
    env = GoalEnvFlattener(SpaceEnv(obs_space))
    rng = np.random.default_rng(seed)
    n = int(np.prod(batch))
    obs = {k: random_rows(s, n, rng).reshape(*batch, *s.shape) for k, s in obs_space.spaces.items()}
    flat = env.convert_dict_to_obs(obs)
    assert flat.shape == (*batch, env.observation_space.shape[0]) and flat.dtype == env.observation_space.dtype
    back = env.convert_obs_to_dict(flat)
    assert list(back) == [*GOAL_KEYS, *(["extra"] if "extra" in obs_space.spaces else [])]
    for k, v in obs.items():
        assert back[k].dtype == obs_space[k].dtype and back[k].shape == v.shape, k
        np.testing.assert_array_equal(back[k], v, err_msg=k)
    np.testing.assert_array_equal(env.convert_dict_to_obs(back), flat)
    if not batch:
        assert env.observation_space.contains(flat)


def test_multibinary_spaces_become_one_multibinary_and_the_bit_flipping_env_runs_through():
    env = GoalEnvFlattener(bit_flipping_env(n_bits=4))
    assert env.observation_space == spaces.MultiBinary(12) and env.observation_space.dtype == np.int8
    obs, _ = env.reset(seed=0)
    assert obs.dtype == np.int8 and env.observation_space.contains(obs)
    np.testing.assert_array_equal(env.convert_obs_to_dict(obs)["desired_goal"], np.ones(4, np.int8))
    bits = np.random.default_rng(0).integers(0, 2, (5, 3, 12)).astype(np.int8)
    d = env.convert_obs_to_dict(bits)
    assert d["observation"].shape == (5, 3, 4) and d["observation"].dtype == np.int8
    np.testing.assert_array_equal(env.convert_dict_to_obs(d), bits)
    flat = bits.reshape(15, 12)
    got = env.compute_reward(flat[:, 4:8], flat[:, 8:], None)
    np.testing.assert_array_equal(got, -(flat[:, 4:8] != flat[:, 8:]).any(axis=1).astype(np.float32))


def test_discrete_spaces_become_one_entry_each_of_a_multidiscrete():
    env = GoalEnvFlattener(bit_flipping_env(n_bits=3, discrete_obs_space=True))
    assert env.observation_space == spaces.MultiDiscrete([8, 8, 8]) and (env.obs_dim, env.goal_dim) == (1, 1)
    obs, _ = env.reset(seed=1)
    assert obs.shape == (3,) and obs[2] == 7 and env.observation_space.contains(obs)
    d = env.convert_obs_to_dict(obs)
    assert d["desired_goal"].shape == () and int(d["desired_goal"]) == 7
    shifted = GoalEnvFlattener(SpaceEnv(goal_dict(observation=spaces.Discrete(5, start=-2),
                                                  achieved_goal=spaces.Discrete(3, start=10),
                                                  desired_goal=spaces.Discrete(3, start=10))))
    assert shifted.observation_space == spaces.MultiDiscrete([5, 3, 3], start=[-2, 10, 10])
    batch = {"observation": np.array([[-2, 2]]), "achieved_goal": np.array([[10, 12]]),
             "desired_goal": np.array([[11, 11]])}
    flat = shifted.convert_dict_to_obs(batch)
    np.testing.assert_array_equal(flat, [[[-2, 10, 11], [2, 12, 11]]])
    back = shifted.convert_obs_to_dict(flat)
    for k, v in batch.items():
        np.testing.assert_array_equal(back[k], v)
    assert all(shifted.observation_space.contains(row) for row in flat[0])


@pytest.mark.parametrize(
    "space, error, message",
    [
        (spaces.Box(-1, 1, (6,)), TypeError, "needs a Dict observation space"),
        (spaces.Dict({"observation": spaces.Box(-1, 1, (2,)), "desired_goal": spaces.Box(-1, 1, (2,))}), ValueError,
         r"has no \['achieved_goal'\]"),
        (goal_dict(observation=spaces.Box(-1, 1, (2,)), achieved_goal=spaces.MultiBinary(2),
                   desired_goal=spaces.MultiBinary(2)), TypeError,
         "sub-spaces of one type .*'observation' is Box, 'achieved_goal' is MultiBinary"),
        (goal_dict(observation=spaces.MultiDiscrete([2, 3]), achieved_goal=spaces.Discrete(2),
                   desired_goal=spaces.Discrete(2)), TypeError,
         r"observation_space\['observation'\] is MultiDiscrete; GoalEnvFlattener flattens Box, MultiBinary"),
    ],
)
def test_spaces_that_cannot_be_flattened_are_refused_by_name(space, error, message):
    with pytest.raises(error, match=message):
        GoalEnvFlattener(SpaceEnv(space))


def test_bad_values_to_convert_are_refused_by_name():
    env = GoalEnvFlattener(gym.make(ENV_ID))
    good = {"observation": np.zeros((2, 4)), "achieved_goal": np.zeros((2, 2)), "desired_goal": np.zeros((2, 2))}
    cases = [
        ([good], TypeError, "obs_dict must be a mapping"),
        ({k: v for k, v in good.items() if k != "desired_goal"}, ValueError, r"obs_dict has no \['desired_goal'\]"),
        ({**good, "achieved_goal": np.zeros((2, 3))}, ValueError,
         r"obs_dict\['achieved_goal'\] has shape \(2, 3\), expected \(\*batch, 2\)"),
        ({**good, "desired_goal": np.zeros(2)}, ValueError, r"obs_dict\['desired_goal'\] has batch shape \(\)"),
        ({**good, "observation": np.zeros((2, 4), complex)}, TypeError, "has dtype complex128, which does not cast"),
    ]
    for value, error, message in cases:
        with pytest.raises(error, match=message):
            env.convert_dict_to_obs(value)
    with pytest.raises(ValueError, match=r"observations have shape \(3, 7\), expected \(\*batch, 8\)"):
        env.convert_obs_to_dict(np.zeros((3, 7)))
    with pytest.raises(ValueError, match=r"shape \(\), expected"):
        env.convert_obs_to_dict(np.float32(0))
    bits = GoalEnvFlattener(bit_flipping_env(n_bits=2))
    with pytest.raises(TypeError, match="dtype float64, which does not cast to the flat int8"):
        bits.convert_obs_to_dict(np.zeros(6))


def test_no_value_is_changed_silently_by_the_flat_dtype_or_either_conversion():
    big = spaces.Box(0, 2**62, (2,), np.int64)
    floats = spaces.Box(-1, 1, (2,), np.float64)
    with pytest.raises(TypeError, match=r"would be float64 .*'observation' int64, 'achieved_goal' float64.*"
                                        r"observation_space\['observation'\] \(int64, bounds 0..4611686018427387904\)"):
        GoalEnvFlattener(SpaceEnv(goal_dict(observation=big, achieved_goal=floats, desired_goal=floats)))
    small = spaces.Box(0, 5, (2,), np.int64)
    with pytest.raises(TypeError, match=r"'observation' uint64, 'achieved_goal' int64"):
        GoalEnvFlattener(SpaceEnv(goal_dict(observation=spaces.Box(0, 2**63, (2,), np.uint64), achieved_goal=small,
                                            desired_goal=small)))
    with pytest.raises(TypeError, match=r"observation_space\['desired_goal'\] \(int64, bounds -9007199254740993..0"):
        GoalEnvFlattener(SpaceEnv(goal_dict(observation=floats, achieved_goal=floats,
                                            desired_goal=spaces.Box(-(2**53) - 1, 0, (2,), np.int64))))
    with pytest.raises(TypeError, match=r"Discrete sub-spaces' dtypes \('observation' uint64, 'achieved_goal' int64"):
        GoalEnvFlattener(SpaceEnv(goal_dict(observation=spaces.Discrete(3, dtype=np.uint64),
                                            achieved_goal=spaces.Discrete(3), desired_goal=spaces.Discrete(3))))
    # integers within 2**53 in a float64 flat vector come back exactly, and whole
    exact = GoalEnvFlattener(SpaceEnv(goal_dict(observation=spaces.Box(-(2**53), 2**53, (2,), np.int64),
                                                achieved_goal=floats, desired_goal=floats)))
    assert exact.observation_space.dtype == np.float64
    obs = {"observation": np.array([2**53, -(2**53) + 1]), "achieved_goal": np.zeros(2), "desired_goal": np.ones(2)}
    back = exact.convert_obs_to_dict(exact.convert_dict_to_obs(obs))
    assert back["observation"].dtype == np.int64 and back["observation"].tolist() == [2**53, -(2**53) + 1]
    with pytest.raises(ValueError, match=r"obs_dict\['observation'\] has 9007199254740993 at \(0,\), which float64 "
                                         "cannot hold exactly"):
        exact.convert_dict_to_obs({**obs, "observation": np.array([2**53 + 1, 0])})
    for bad, at in ((0.5, "0.5 at \\(0, 1\\)"), (np.nan, "nan at \\(0, 1\\)"), (2.0**63, "9.223372036854776e\\+18")):
        flat = np.zeros((1, 6))
        flat[0, 1] = bad
        with pytest.raises(ValueError, match=rf"\[..., 0:2\] \('observation'\) has {at}.*which int64 cannot hold"):
            exact.convert_obs_to_dict(flat)
    env = GoalEnvFlattener(gym.make(ENV_ID))  # float32
    zeros = {"observation": np.zeros(4), "achieved_goal": np.zeros(2), "desired_goal": np.zeros(2)}
    with pytest.raises(ValueError, match=r"obs_dict\['observation'\] has 1e\+300 at \(0,\), which overflows float32"):
        env.convert_dict_to_obs({**zeros, "observation": np.full(4, 1e300)})
    with pytest.raises(ValueError, match=r"the flat vector has 1e\+300 at \(0,\), which overflows float32"):
        env.convert_obs_to_dict(np.full(8, 1e300))
    with pytest.raises(ValueError, match="the flat vector has 1099511627777 at \\(0,\\), which float32 cannot hold"):
        env.convert_obs_to_dict(np.full(8, 2**40 + 1, np.int64))
    np.testing.assert_array_equal(env.convert_obs_to_dict(np.full(8, 2**40, np.int64))["observation"], [2.0**40] * 4)
    assert env.convert_dict_to_obs({**zeros, "observation": np.full(4, 0.1)})[0] == np.float32(0.1)  # rounded
    # integers going back to a narrower or unsigned sub-space: refused when they do not fit
    ints = GoalEnvFlattener(SpaceEnv(goal_dict(observation=spaces.Box(-5, 5, (1,), np.int16),
                                               achieved_goal=spaces.Box(0, 200, (1,), np.uint8),
                                               desired_goal=spaces.Box(0, 200, (1,), np.uint8))))
    assert ints.observation_space.dtype == np.int16
    with pytest.raises(ValueError, match=r"\[..., 1:2\] \('achieved_goal'\) has -1 at \(0,\), which uint8 cannot"):
        ints.convert_obs_to_dict(np.array([0, -1, 0], np.int16))
    with pytest.raises(ValueError, match=r"\[..., 2:3\] \('desired_goal'\) has 256 at \(0,\), which uint8 cannot"):
        ints.convert_obs_to_dict(np.array([0, 0, 256], np.int16))
    with pytest.raises(ValueError, match=r"the flat vector has 40000 at \(1,\), which int16 cannot hold"):
        ints.convert_obs_to_dict(np.array([0, 40000, 0], np.int32))


# -- recording: references logged by the envs themselves --------------------------------------------------------------


class Log(gym.Wrapper):
    """Logs what the env returns, episode by episode: the reference every recorded episode is compared with."""

    def __init__(self, env: gym.Env, log: list) -> None:
        super().__init__(env)
        self.log = log

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        self.log.append({"obs": [obs], "action": [], "reward": [], "terminated": [], "truncated": [], "info": []})
        return obs, {**info, "t": 0}

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        info = {**info, "t": len(self.log[-1]["action"]) + 1}  # an info that differs between a step and a reset
        for k, v in zip(("obs", "action", "reward", "terminated", "truncated", "info"),
                        (obs, action, reward, terminated, truncated, info)):
            self.log[-1][k].append(v)
        return obs, reward, terminated, truncated, info


def logged_episodes(log: list, info_keys=("is_success", "t")) -> list[dict]:
    """The logged episodes with steps, in the store's episode shape; one cut short is ended as truncated."""
    out = []
    for e in log:
        if not e["action"]:
            continue
        ep = {k: np.stack([np.asarray(o[k]) for o in e["obs"]]) for k in e["obs"][0]}
        ep["action"] = np.stack([np.asarray(a) for a in e["action"]])
        ep["reward"] = np.asarray(e["reward"], np.float32)
        ep["terminated"] = np.asarray(e["terminated"], bool)
        ep["truncated"] = np.asarray(e["truncated"], bool)
        ep["truncated"][-1] |= not ep["terminated"][-1]
        for k in info_keys:
            ep[k] = np.asarray([i.get(k, 0) for i in e["info"]], np.float32)
        out.append(ep)
    return out


def stored(path, env_index=None) -> list[dict]:
    with EpisodeStore.open(path) as store:
        table = store.episodes
        ids = table["episode_id"] if env_index is None else table["episode_id"][table["env_index"] == env_index]
        return [dict(store.episode(i)) for i in ids]


def assert_same_episodes(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want), (len(got), len(want))
    for g, w in zip(got, want):
        w = {k: v.astype(g[k].dtype) if k == "action" else v for k, v in w.items()}
        assert_episode_equal(g, w)


@pytest.mark.parametrize("kind", ["point", "bits", "bits-discrete"])
def test_every_episode_of_a_single_env_is_recorded_as_the_env_produced_it(tmp_path, kind):
    log: list = []
    if kind == "point":
        env = Log(gym.make(ENV_ID, max_episode_steps=6), log)
    else:
        env = Log(bit_flipping_env(n_bits=2, max_steps=4, discrete_obs_space=kind == "bits-discrete"), log)
    env = RecordEpisodes(env, tmp_path / "run", info_keys=["is_success", "t"], commit_interval=0)
    assert env.store.metadata["env_id"] == (ENV_ID if kind == "point" else "BitFlippingEnv-v0")
    env.action_space.seed(0)
    env.reset(seed=0)
    for t in range(40):
        _, _, terminated, truncated, _ = env.step(env.action_space.sample())
        if terminated or truncated or t == 17:  # step 17: a reset mid-episode ends it as truncated
            env.reset()
    env.close()  # the unfinished episode too
    want = logged_episodes(log)
    assert env.episode_ids == list(range(len(want))) and sum(len(w["action"]) for w in want) == 40
    assert any(w["terminated"].any() for w in want) == (kind != "point")
    assert_same_episodes(stored(tmp_path / "run"), want)
    env.close()  # idempotent


def make_point(k: int, log: list | None = None):
    def make():
        env = PointGoalEnv(max_episode_steps=k)
        return env if log is None else Log(env, log)

    return make


@pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP])
def test_every_episode_of_each_env_of_sync_and_async_vector_envs_is_recorded(tmp_path, mode):
    lengths = (3, 4, 6)
    logs: list[list] = [[] for _ in lengths]
    sync = SyncVectorEnv([make_point(k, log) for k, log in zip(lengths, logs)], autoreset_mode=mode)
    runs = {"sync": sync, "async": AsyncVectorEnv([make_point(k, []) for k in lengths], autoreset_mode=mode)}
    for name, venv in runs.items():
        envs = RecordVectorEpisodes(venv, tmp_path / name, info_keys=["is_success", "t"])
        assert envs.autoreset_mode == mode
        rng = np.random.default_rng(0)
        envs.reset(seed=5)
        for t in range(24):
            envs.step(rng.uniform(-1, 1, (3, 2)).astype(np.float32))
            if t == 13:  # env 1 has just ended; a reset of every env ends the running episodes as truncated
                envs.reset(seed=9)
        envs.close()
        assert len(envs.episode_ids) == sum(len(logged_episodes(log)) for log in logs)
    for i, log in enumerate(logs):
        want = logged_episodes(log)
        assert len(want) >= 3
        assert_same_episodes(stored(tmp_path / "sync", env_index=i), want)
        assert_same_episodes(stored(tmp_path / "async", env_index=i), want)


def test_disabled_autoreset_records_what_masked_resets_end(tmp_path):
    logs: list[list] = [[], []]
    venv = SyncVectorEnv([make_point(k, log) for k, log in zip((2, 5), logs)], autoreset_mode="Disabled")
    envs = RecordVectorEpisodes(venv, tmp_path / "run", info_keys=["is_success", "t"])
    envs.reset(seed=1)
    for t in range(9):
        _, _, terminated, truncated, _ = envs.step(np.full((2, 2), 0.5, np.float32))
        done = terminated | truncated
        if t == 3:  # env 1 reset mid-episode, with env 0 which just ended
            done[1] = True
        if done.any():
            envs.reset(options={"reset_mask": done})
    envs.flush()
    assert len(stored(tmp_path / "run")) == len(envs.episode_ids) == 6  # committed while the recorder still runs
    envs.close()
    for i, log in enumerate(logs):
        assert_same_episodes(stored(tmp_path / "run", env_index=i), logged_episodes(log))
    assert len(logged_episodes(logs[1])) == 2  # the first cut short at step 4 by the masked reset


def test_recorders_inside_a_sync_vector_env_share_one_open_store(tmp_path):
    logs: list[list] = [[], []]
    obs_space, act_space = PointGoalEnv().observation_space, PointGoalEnv().action_space
    with open_store(tmp_path / "run", obs_space, act_space) as store:
        fns = [lambda k=k, log=log: RecordEpisodes(Log(PointGoalEnv(max_episode_steps=k), log), store)
               for k, log in zip((2, 3), logs)]
        venv = SyncVectorEnv(fns)
        venv.reset(seed=0)
        for _ in range(7):
            venv.step(np.zeros((2, 2), np.float32))
        venv.close()
        assert store.metadata == {}  # envs made without a registered id leave no env_id

    def order(e):
        return (len(e["action"]), float(e["observation"][0, 0]))  # env 0: 2 or 1 steps, env 1: 3

    got = sorted(stored(tmp_path / "run"), key=order)
    want = sorted(logged_episodes(logs[0], ()) + logged_episodes(logs[1], ()), key=order)
    assert [len(e["action"]) for e in want] == [1, 2, 2, 3, 3]
    assert_same_episodes(got, want)


# -- what training scripts do ------------------------------------------------------------------------------------------


def test_sb3_trains_on_the_flattened_env_and_every_step_it_took_is_in_the_store(tmp_path):
    SAC = pytest.importorskip("stable_baselines3", reason='pip install "her_store[sb3]"').SAC

    env = GoalEnvFlattener(RecordEpisodes(gym.make(ENV_ID, max_episode_steps=8), tmp_path / "run"))
    model = SAC("MlpPolicy", env, buffer_size=100, learning_starts=30, batch_size=16, seed=0,
                policy_kwargs={"net_arch": [16]})
    model.learn(total_timesteps=60)
    env.close()
    episodes = stored(tmp_path / "run")
    flat = np.concatenate([env.convert_dict_to_obs({k: ep[k][:-1] for k in GOAL_KEYS}) for ep in episodes])
    rb = model.replay_buffer
    assert len(flat) == 60 and rb.pos == 60
    np.testing.assert_array_equal(rb.observations[:60, 0], flat)
    np.testing.assert_allclose(rb.actions[:60, 0], np.concatenate([ep["action"] for ep in episodes]), atol=1e-6)
    np.testing.assert_array_equal(rb.rewards[:60, 0], np.concatenate([ep["reward"] for ep in episodes]))


# -- bad inputs ------------------------------------------------------------------------------------------------------


def test_a_store_that_does_not_fit_the_env_is_refused_and_left_intact(tmp_path):
    path = tmp_path / "bits"
    bits = bit_flipping_env(n_bits=3)
    with RecordEpisodes(bits, path) as env:
        env.reset(seed=0)
        for _ in range(3):
            if any(env.step(0)[2:4]):
                env.reset()
    n = len(stored(path))
    assert n >= 1
    with pytest.raises(SchemaMismatchError, match="observation_space differs"):
        RecordEpisodes(gym.make(ENV_ID), path)
    other = bit_flipping_env(n_bits=3)
    other.spec = gym.envs.registration.EnvSpec("other-v0", "no-entry-point")
    with pytest.raises(SchemaMismatchError, match="holds episodes of env 'BitFlippingEnv-v0', this env is 'other-v0'"):
        RecordEpisodes(other, path)
    with RecordEpisodes(other, tmp_path / "named", metadata={"env_id": "named-v0"}) as named:
        assert named.store.metadata == {"env_id": "named-v0"}  # a card given explicitly wins over the env's id
    with open_store(path) as store:
        with pytest.raises(SchemaMismatchError, match="this env is 'other-v0'"):
            RecordEpisodes(other, store)
        with pytest.raises(SchemaMismatchError, match="action_space differs"):
            RecordEpisodes(bit_flipping_env(n_bits=3, continuous=True), store)
        with pytest.raises(TypeError, match=r"store options \['capacity'\] apply only when the recorder opens"):
            RecordEpisodes(bits, store, capacity=10)
    with pytest.raises(SchemaMismatchError, match="capacity=None"):
        RecordEpisodes(bits, path, capacity=10)
    with EpisodeStore.open(path) as store, pytest.raises(ReadOnlyStoreError):
        RecordEpisodes(bits, store)
    with pytest.raises(TypeError, match="store must be an EpisodeStore or a path, got int"):
        RecordEpisodes(bits, 3)
    with pytest.raises(TypeError, match="wrap a vector env with RecordVectorEpisodes"):
        RecordEpisodes(SyncVectorEnv([lambda: bit_flipping_env(n_bits=3)]), path)
    with pytest.raises(TypeError, match="wrap a single env with RecordEpisodes"):
        RecordVectorEpisodes(bits, path)
    assert len(stored(path)) == n  # nothing lost, nothing added


class Corrupt(gym.Wrapper):
    """At step ``at`` (counted over the env's life) reports a value the store refuses, in the info or the obs."""

    def __init__(self, env, at: int, where: str) -> None:
        super().__init__(env)
        self.at, self.where, self.t = at, where, 0

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.t += 1
        if self.t == self.at and self.where == "info":
            info = {**info, "is_success": 1e39}  # no float32 holds it
        elif self.t == self.at:  # a float64 no float32 holds, or a bit of 2 (a vector env would cast the float)
            bad = obs["observation"]
            obs = {**obs, "observation": np.full(bad.shape, 2 if bad.dtype == np.int8 else 1e39)}
        return obs, reward, terminated, truncated, info


def test_a_refused_step_drops_the_episodes_it_belonged_to_and_recording_goes_on(tmp_path):
    logs: list[list] = [[], []]
    fns = [lambda: Corrupt(Log(PointGoalEnv(max_episode_steps=4), logs[0]), 6, "info"),
           lambda: Log(PointGoalEnv(max_episode_steps=3), logs[1])]
    envs = RecordVectorEpisodes(SyncVectorEnv(fns), tmp_path / "run", info_keys=["is_success", "t"])
    envs.reset(seed=0)
    for t in range(16):
        if t == 6:  # env 0's step 6 (its second episode: t=4 was its reset); env 1 ends its second episode
            with pytest.warns(RecordingWarning) as warned:
                *_, truncated, infos = envs.step(np.zeros((2, 2), np.float32))
            assert [str(w.message).split(" was dropped")[0][-26:] for w in warned] == [
                "env 0's episode of 2 steps", "env 1's episode of 3 steps"]
            assert {w.filename for w in warned} == {__file__}  # the warnings point at the caller's step
            assert truncated.tolist() == [False, True] and infos["is_success"][0] == 1e39  # the env's values
        else:
            envs.step(np.zeros((2, 2), np.float32))
    envs.close()
    assert [(d.env, d.steps) for d in envs.dropped] == [(0, 2), (1, 3)]
    assert all(d.reason.startswith("EpisodeValidationError: infos['is_success']") for d in envs.dropped)
    want0, want1 = logged_episodes(logs[0]), logged_episodes(logs[1])
    assert_same_episodes(stored(tmp_path / "run", env_index=0), want0[:1] + want0[2:])
    assert_same_episodes(stored(tmp_path / "run", env_index=1), want1[:1] + want1[2:])


def test_an_observation_refused_at_reset_drops_that_episode_only(tmp_path):
    log: list = []
    env = RecordEpisodes(Corrupt(Log(PointGoalEnv(max_episode_steps=5), log), 7, "obs"), tmp_path / "run")
    env.reset(seed=0)
    for t in range(1, 13):
        _, _, terminated, truncated, _ = env.step(np.zeros(2, np.float32))
        if t == 7:  # mid-episode: the step's obs is only checked when the episode ends
            with pytest.warns(RecordingWarning, match=r"env 0's episode of 2 steps .*next_obs\['observation'\]"):
                obs, _ = env.reset()
            assert obs["observation"].shape == (4,)
        if terminated or truncated or t == 7:
            env.reset()  # after the refused reset nothing is pending any more
    env.close()
    assert [(d.env, d.steps) for d in env.dropped] == [(0, 2)]
    want = logged_episodes(log, ())
    assert [len(w["action"]) for w in want] == [5, 2, 5]
    assert_same_episodes(stored(tmp_path / "run"), [want[0], *want[2:]])


def test_a_vector_env_must_be_reset_before_it_is_recorded(tmp_path):
    envs = RecordVectorEpisodes(SyncVectorEnv([make_point(3)]), tmp_path / "run")
    with pytest.raises(gym.error.ResetNeeded, match="needs a reset"):
        envs.step(np.zeros((1, 2), np.float32))
    envs.close()
    assert stored(tmp_path / "run") == []


def test_a_masked_reset_whose_episode_is_refused_drops_the_running_episodes_of_the_other_envs(tmp_path):
    logs: list[list] = [[], []]
    fns = [lambda: Corrupt(Log(bit_flipping_env(n_bits=8, max_steps=5), logs[0]), 2, "obs"),
           lambda: Log(bit_flipping_env(n_bits=8, max_steps=3), logs[1])]
    envs = RecordVectorEpisodes(SyncVectorEnv(fns, autoreset_mode="Disabled"), tmp_path / "run")
    envs.reset(seed=0)
    for t in range(12):
        _, _, terminated, truncated, _ = envs.step(np.zeros(2, np.int64))
        done = terminated | truncated
        if t == 1:  # env 0's bad observation is checked when its episode is ended: env 1's is cut short too
            with pytest.warns(RecordingWarning, match=r"next_obs\['observation'\]"):
                envs.reset(options={"reset_mask": np.array([True, False])})
            assert [(d.env, d.steps) for d in envs.dropped] == [(0, 2), (1, 2)]
        elif done.any():
            envs.reset(options={"reset_mask": done})
    envs.close()
    for i, log in enumerate(logs):
        want = logged_episodes(log, ())
        assert [len(w["action"]) for w in want][:3] == [[2, 5, 5], [3, 3, 3]][i]
        assert_same_episodes(stored(tmp_path / "run", env_index=i), want[1:])


def test_episodes_longer_than_the_capacity_are_dropped_with_a_warning_and_the_env_values_still_returned(tmp_path):
    log: list = []
    env = RecordEpisodes(Log(PointGoalEnv(max_episode_steps=5), log), tmp_path / "run", capacity=3)
    env.reset(seed=0)

    def step():
        return env.step(np.zeros(2, np.float32))

    for _ in range(4):
        step()
    with pytest.warns(RecordingWarning, match=r"env 0's episode of 5 steps was dropped, not recorded \("
                                              r"EpisodeValidationError: .*capacity 3\).*1 dropped so far"):
        _, _, terminated, truncated, info = step()  # truncated by the env at its capacity + 2
    assert (terminated, truncated, info["t"]) == (False, True, 5)  # the caller learns that the episode ended
    env.reset()
    step(), step()
    env.reset()  # 2 steps: recorded
    for _ in range(4):
        step()
    with pytest.warns(RecordingWarning, match="episode of 4 steps was dropped.*2 dropped so far"):
        env.reset()
    step(), step(), step()
    env.close()
    want = logged_episodes(log, ())
    assert [len(w["action"]) for w in want] == [5, 2, 4, 3] and env.episode_ids == [0, 1]
    assert [(d.env, d.steps) for d in env.dropped] == [(0, 5), (0, 4)]
    assert_same_episodes(stored(tmp_path / "run"), want[3:])  # the ring of 3 transitions evicted the 2-step one


def test_a_loop_that_resets_on_the_returned_end_records_no_bogus_episode_after_a_dropped_one(tmp_path):
    env = RecordEpisodes(PointGoalEnv(max_episode_steps=5), tmp_path / "run", capacity=3)
    env.reset(seed=0)

    def loop():  # the loop of every training script: 5 + 5 steps dropped, then 3 recorded at close
        for _ in range(13):
            _, _, terminated, truncated, _ = env.step(np.zeros(2, np.float32))
            if terminated or truncated:
                env.reset()

    with pytest.warns(RecordingWarning):
        loop()
    env.flush()
    assert stored(tmp_path / "run") == []  # a flush commits, and ends no running episode
    env.close()
    assert [d.steps for d in env.dropped] == [5, 5] and [len(e["action"]) for e in stored(tmp_path / "run")] == [3]
    # a loop that never resets: the steps after the end belong to no episode
    env = RecordEpisodes(PointGoalEnv(max_episode_steps=2), tmp_path / "steps")
    env.reset(seed=0)
    env.step(np.zeros(2, np.float32))
    *_, truncated, _ = env.step(np.zeros(2, np.float32))
    assert truncated
    with pytest.warns(RecordingWarning, match="stepped after its episode ended, without a reset"):
        env.step(np.zeros(2, np.float32)), env.step(np.zeros(2, np.float32))
    env.reset()
    env.step(np.zeros(2, np.float32))
    env.close()
    assert [len(e["action"]) for e in stored(tmp_path / "steps")] == [2, 1] and env.dropped == []


def test_a_store_given_open_is_left_to_its_owner(tmp_path):
    point = PointGoalEnv(max_episode_steps=2)
    zero = np.zeros(2, np.float32)
    with open_store(tmp_path / "run", point.observation_space, point.action_space) as store:
        done = RecordEpisodes(point, store)
        done.reset(seed=0)
        done.step(zero), done.step(zero)
        running = RecordEpisodes(PointGoalEnv(), store)
        running.reset(seed=1)
        running.step(zero)
    assert len(stored(tmp_path / "run")) == 1
    done.close()  # its episode ended: nothing left to write to the closed store
    with pytest.warns(
        RecordingWarning, match=r"episode of 1 steps was dropped, not recorded \(StoreError: .*is closed"
    ):
        running.close()
    assert [(d.env, d.steps) for d in running.dropped] == [(0, 1)]


def test_a_recorder_never_closed_ends_its_episode_and_closes_its_store_when_collected(tmp_path):
    log: list = []
    env = RecordEpisodes(Log(PointGoalEnv(), log), tmp_path / "run", commit_interval=60)
    env.reset(seed=0)
    for _ in range(3):
        env.step(np.zeros(2, np.float32))
    del env
    gc.collect()
    point = PointGoalEnv()
    with open_store(tmp_path / "run", point.observation_space, point.action_space):  # the lock was released
        pass
    assert_same_episodes(stored(tmp_path / "run"), logged_episodes(log, ()))


def test_the_ids_listed_at_a_flush_survive_a_kill_and_those_after_it_are_documented_as_lost(tmp_path):
    path = tmp_path / "run"
    script = f"""
import os, signal, numpy as np
from her_store.envs import PointGoalEnv
from her_store.integrations.wrappers import RecordEpisodes
env = RecordEpisodes(PointGoalEnv(max_episode_steps=2), {str(path)!r}, commit_interval=3600)
env.reset(seed=0)
for t in range(8):  # four 2-step episodes; the first two flushed
    if any(env.step(np.zeros(2, np.float32))[2:4]):
        env.reset()
    if t == 3:
        env.flush()
print(env.episode_ids, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""
    run = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=120,
                         cwd=Path(ROOT))
    assert run.returncode == -signal.SIGKILL and run.stdout.split("\n")[0] == "[0, 1, 2, 3]", run.stderr
    assert [len(e["action"]) for e in stored(path)] == [2, 2]  # 0 and 1; 2 and 3 were never committed
    with RecordEpisodes(PointGoalEnv(max_episode_steps=2), path) as env:
        env.reset(seed=0)
        env.step(np.zeros(2, np.float32)), env.step(np.zeros(2, np.float32))
        assert env.episode_ids == [2]  # the store gives the lost id again, as documented
