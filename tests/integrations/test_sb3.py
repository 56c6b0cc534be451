"""ZarrHerReplayBuffer: SB3's HerReplayBuffer contract over a disk store, with real SB3 training runs."""

from __future__ import annotations

import copy
import os
import pickle
import shutil
import subprocess
import sys
import threading
import time
import warnings

import gymnasium as gym
import numpy as np
import pytest
import torch as th
from gymnasium import spaces

from her_store import EpisodeStore, open_store
from her_store.checks import ArgumentTypeError
from her_store.envs import PointGoalEnv
from her_store.errors import EpisodeValidationError, NotAStoreError, SchemaMismatchError, StoreError, StoreLockedError

pytest.importorskip("stable_baselines3", reason='pip install "her_store[sb3]"')

from stable_baselines3 import DDPG, DQN, SAC, TD3
from stable_baselines3.common.envs import BitFlippingEnv
from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv, VecEnvWrapper, VecNormalize
from stable_baselines3.her import GoalSelectionStrategy as SB3Strategy
from stable_baselines3.her import HerReplayBuffer

from her_store.integrations.sb3 import ZarrHerReplayBuffer
from tests.conftest import DATA
from tests.data import make_sb3_handle as saved_handle


class RecordingPointGoal(PointGoalEnv):
    """PointGoal that records the infos compute_reward gets and has a vectorised compute_terminated."""

    def __init__(self, max_episode_steps: int = 5) -> None:
        super().__init__(max_episode_steps=max_episode_steps)
        self.reward_infos: list = []

    def compute_reward(self, achieved_goal, desired_goal, info):
        self.reward_infos.append(info)
        return super().compute_reward(achieved_goal, desired_goal, info)

    def compute_terminated(self, achieved_goal, desired_goal, info):
        return np.linalg.norm(np.asarray(achieved_goal) - np.asarray(desired_goal), axis=-1) < 0.5


def _venv(n_envs: int = 1, T: int = 5, cls=DummyVecEnv, **kw):
    return cls([lambda: RecordingPointGoal(T) for _ in range(n_envs)], **kw)


def _buffer(venv, buffer_size: int = 1000, **kw) -> ZarrHerReplayBuffer:
    return ZarrHerReplayBuffer(
        buffer_size, venv.observation_space, venv.action_space, env=venv, n_envs=venv.num_envs, **kw
    )


def _collect(buffers, venv, steps: int, seed: int = 0, obs=None):
    """Step ``venv`` with random actions and add every step to each buffer as SB3's _store_transition does; return
    the last observations (``obs`` given: go on from them, without a reset)."""
    rng = np.random.default_rng(seed)
    if obs is None:
        venv.seed(seed)
        obs = venv.reset()
    for _ in range(steps):
        action = rng.uniform(-1, 1, (venv.num_envs, 2)).astype(np.float32)
        new_obs, reward, done, infos = venv.step(action)
        next_obs = copy.deepcopy(new_obs)
        for i, d in enumerate(done):
            if d:
                for k in next_obs:
                    next_obs[k][i] = infos[i]["terminal_observation"][k]
        for b in buffers:
            b.add(obs, next_obs, action, reward, done, infos)
        obs = new_obs
    return obs


def _rows_by_obs(store: EpisodeStore) -> dict[bytes, tuple[int, int]]:
    """(episode id, step) of every stored transition, keyed by its observation and desired goal."""
    out = {}
    for eid in store.episodes["episode_id"]:
        ep = store.episode(int(eid))
        for t in range(len(ep["action"])):
            out[ep["observation"][t].tobytes() + ep["desired_goal"][t].tobytes()] = (int(eid), t)
    return out


def _learn(cls, env, steps: int = 60, **kw):
    kwargs = {
        "learning_starts": 30, "batch_size": 16, "policy_kwargs": {"net_arch": [32, 32]}, "seed": 0, "train_freq": 4
    }
    model = cls("MultiInputPolicy", env, replay_buffer_class=ZarrHerReplayBuffer, **{**kwargs, **kw})
    model.learn(steps)
    return model


# -- training runs -----------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("algo", [SAC, TD3, DDPG])
def test_continuous_algorithms_train_into_the_store(tmp_path, algo):
    env = BitFlippingEnv(n_bits=4, continuous=True, max_steps=4)
    model = _learn(algo, env, replay_buffer_kwargs={"path": tmp_path / "rb", "goal_selection_strategy": "future"})
    rb = model.replay_buffer
    assert isinstance(rb, ZarrHerReplayBuffer) and rb.env is model.get_env()
    stored = len(rb.store) + int(rb._writer.pending_steps.sum())
    assert stored == model.num_timesteps == 60 == rb.size()
    assert rb.store.num_episodes >= 60 // 4
    rb.close()
    with EpisodeStore.open(tmp_path / "rb") as store:  # committed, readable by anyone
        assert store.num_episodes >= 15
        ep = store.episode(store.first_episode)
        assert ep["observation"].dtype == np.int8 and ep["action"].shape[1] == 4


@pytest.mark.slow
def test_dqn_trains_on_image_observations_and_samples_sb3_shapes(tmp_path):
    env = BitFlippingEnv(n_bits=4, image_obs_space=True, max_steps=4)
    model = _learn(
        DQN, env, steps=28, learning_starts=20, batch_size=8, learning_rate=1e-3,
        replay_buffer_kwargs={"path": str(tmp_path / "rb"), "goal_selection_strategy": SB3Strategy.FINAL},
    )
    rb = model.replay_buffer
    batch = rb.sample(8)
    assert batch.observations["observation"].shape == (8, 1, 36, 36)
    assert batch.observations["observation"].dtype == th.uint8
    assert batch.actions.shape == (8, 1) and batch.rewards.shape == (8, 1) and batch.dones.shape == (8, 1)
    assert batch.discounts is None
    # final: the relabelled goal is the episode's last achieved goal, whose reward env.compute_reward gives
    n = int(rb.her_ratio * 8)
    ag, dg = batch.next_observations["achieved_goal"].numpy(), batch.observations["desired_goal"].numpy()
    want = env.compute_reward(ag[:n], dg[:n], None)
    np.testing.assert_array_equal(batch.rewards[:n, 0].numpy(), want)


@pytest.mark.slow
@pytest.mark.parametrize("cls", [DummyVecEnv, SubprocVecEnv])
def test_several_envs_keep_their_episodes_apart(tmp_path, cls):
    kw = {"start_method": "fork"} if cls is SubprocVecEnv else {}
    venv = _venv(2, T=5, cls=cls, **kw)
    try:
        model = SAC(
            "MultiInputPolicy", venv, replay_buffer_class=ZarrHerReplayBuffer, learning_starts=20, batch_size=16,
            buffer_size=1000,
            policy_kwargs={"net_arch": [32, 32]}, seed=0, train_freq=4, replay_buffer_kwargs={"path": tmp_path / "rb"},
        )
        model.learn(40)  # 20 steps of 2 envs
        rb = model.replay_buffer
        table = rb.store.episodes
        assert sorted(np.bincount(table["env_index"]).tolist()) == [4, 4]
        assert set(table["length"].tolist()) == {5} and table["truncated"].all()
        assert rb.pos == 20 and rb.buffer_size == 500 and rb.size() == 20
        assert rb.sample(16).observations["observation"].shape == (16, 4)
    finally:
        venv.close()


class Counting(gym.Env):
    """A goal env whose observation is (env, episode, step): every stored transition tells where it came from."""

    observation_space = spaces.Dict(
        {
            "observation": spaces.Box(-np.inf, np.inf, (3,), np.float32),
            "achieved_goal": spaces.Box(-np.inf, np.inf, (1,), np.float32),
            "desired_goal": spaces.Box(-np.inf, np.inf, (1,), np.float32),
        }
    )
    action_space = spaces.Box(-1, 1, (1,), np.float32)

    def __init__(self, wid: int, T: int = 12) -> None:
        self.wid, self.T, self.ep, self.t = wid, T, -1, 0

    def _obs(self):
        return {"observation": np.array([self.wid, self.ep, self.t], np.float32),
                "achieved_goal": np.array([self.t], np.float32), "desired_goal": np.array([self.T], np.float32)}

    def reset(self, *, seed=None, options=None):
        self.ep, self.t = self.ep + 1, 0
        return self._obs(), {}

    def step(self, action):
        self.t += 1
        return self._obs(), -1.0, False, self.t == self.T, {}

    def compute_reward(self, achieved_goal, desired_goal, info):
        return -(np.abs(achieved_goal - desired_goal).sum(-1) > 0).astype(np.float32)


def test_learn_called_again_ends_the_episodes_its_reset_cut(tmp_path):
    """SB3 resets its VecEnv at the start of every learn() (reset_num_timesteps=True, the default), cutting the
    episodes under way. The store keeps a step's next observation as the following row, so the cut episode ran on
    into the reset observation: stored transitions jumped from step 3 of one episode to step 0 of the next. The
    reset now ends them, truncated at their last step, whose next observation the env did give."""
    venv = DummyVecEnv([lambda w=w: Counting(w) for w in range(2)])
    model = SAC(
        "MultiInputPolicy", venv, replay_buffer_class=ZarrHerReplayBuffer, learning_starts=1000, buffer_size=5000,
        policy_kwargs={"net_arch": [8]}, seed=0, replay_buffer_kwargs={"path": tmp_path / "rb"},
    )
    for _ in range(3):
        model.learn(30)  # 15 steps of each env: one whole episode of 12, then 3 steps cut by the next learn's reset
    rb = model.replay_buffer
    with pytest.warns(UserWarning, match="will be truncated"):
        rb.truncate_last_trajectory()  # the last learn's cut episodes
    store = rb.store
    assert store.num_episodes == 12
    for eid in range(store.first_episode, store.end_episode):
        frames = store.episode(eid)["observation"]
        w, ep = frames[0, 0], frames[0, 1]
        np.testing.assert_array_equal(frames, [[w, ep, t] for t in range(len(frames))], err_msg=f"episode {eid}")
    lengths = sorted(store.episodes["length"].tolist())
    assert lengths == [3] * 6 + [12] * 6 and store.episodes["truncated"].all()
    rb.close()


def test_an_env_set_between_learns_starts_new_episodes(tmp_path):
    """An episode under way when the model gets new envs (model.set_env) ran on into the new env's first observation.
    Each stored episode is now one env's consecutive steps, and the env pickles (as VecNormalize.save does) as it
    did: the buffer keeps nothing in it."""
    import pickle as pkl

    venv = DummyVecEnv([lambda w=w: Counting(w) for w in range(2)])
    model = SAC(
        "MultiInputPolicy", venv, replay_buffer_class=ZarrHerReplayBuffer, learning_starts=1000, buffer_size=5000,
        policy_kwargs={"net_arch": [8]}, seed=0, replay_buffer_kwargs={"path": tmp_path / "rb"},
    )
    model.learn(30)  # 15 steps each: 3 pending
    model.set_env(DummyVecEnv([lambda w=w: Counting(w + 10) for w in range(2)]))
    model.learn(30, reset_num_timesteps=False)  # set_env's envs are reset by this learn: the old envs' episodes end
    pkl.loads(pkl.dumps(venv))  # the env holds nothing of the buffer's
    rb = model.replay_buffer
    with pytest.warns(UserWarning, match="will be truncated"):
        rb.truncate_last_trajectory()
    store = rb.store
    for eid in range(store.first_episode, store.end_episode):
        frames = store.episode(eid)["observation"]
        w, ep = frames[0, 0], frames[0, 1]
        np.testing.assert_array_equal(frames, [[w, ep, t] for t in range(len(frames))], err_msg=f"episode {eid}")
    assert sorted(store.episodes["length"].tolist()) == [3] * 4 + [12] * 4
    assert sorted(set(store.episodes["env_index"].tolist())) == [0, 1]
    rb.close()


class Float64Goal(gym.Env):
    """A goal env whose spaces are all float64 (SB3 casts the actions it stores to float32, not the observations)."""

    def __init__(self) -> None:
        def box(n):
            return spaces.Box(-1, 1, (n,), np.float64)

        self.observation_space = spaces.Dict({"observation": box(3), "achieved_goal": box(2), "desired_goal": box(2)})
        self.action_space = box(2)
        self.t = 0

    def _obs(self):
        return {k: space.sample() for k, space in self.observation_space.spaces.items()}

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.observation_space.seed(seed)
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        self.t += 1
        return self._obs(), -1.0, False, self.t >= 5, {}

    def compute_reward(self, achieved_goal, desired_goal, info):
        return -(np.linalg.norm(achieved_goal - desired_goal, axis=-1) > 0.05).astype(np.float32)


@pytest.mark.parametrize(
    "make",
    [
        Float64Goal,
        lambda: BitFlippingEnv(n_bits=4, continuous=False, max_steps=4, discrete_obs_space=True),
        lambda: BitFlippingEnv(n_bits=4, continuous=False, max_steps=4),
        lambda: BitFlippingEnv(n_bits=4, continuous=True, max_steps=4),
    ],
    ids=["float64", "discrete-obs", "discrete-action", "continuous"],
)
def test_batches_have_sb3s_dtypes_and_shapes(tmp_path, make):
    """Every field of a batch (and the goals compute_reward gets) has the dtype and shape of SB3's own batches."""
    venv = DummyVecEnv([make])
    ours = _buffer(venv, path=tmp_path / "rb")
    sb3 = HerReplayBuffer(1000, venv.observation_space, venv.action_space, env=venv)
    venv.seed(0)
    venv.action_space.seed(0)
    obs = venv.reset()
    for _ in range(12):
        action = np.array([venv.action_space.sample()])
        new_obs, reward, done, infos = venv.step(action)
        next_obs = copy.deepcopy(new_obs)
        if done[0]:
            next_obs = {k: np.asarray(v)[None] for k, v in infos[0]["terminal_observation"].items()}
        for b in (ours, sb3):
            b.add(obs, next_obs, action, reward, done, infos)
        obs = new_obs
    got, want = ours.sample(8), sb3.sample(8)
    for name in ("actions", "rewards", "dones"):
        assert getattr(got, name).dtype == getattr(want, name).dtype, name
        assert getattr(got, name).shape == getattr(want, name).shape, name
    for field in ("observations", "next_observations"):
        for k, v in getattr(want, field).items():
            assert (getattr(got, field)[k].dtype, getattr(got, field)[k].shape) == (v.dtype, v.shape), (field, k)
    ours.close()


def test_sac_trains_on_float64_spaces(tmp_path):
    model = _learn(SAC, Float64Goal(), steps=30, learning_starts=20, replay_buffer_kwargs={"path": tmp_path / "rb"})
    assert model._n_updates > 0 and model.replay_buffer.sample(4).actions.dtype == th.float32
    model.replay_buffer.close()


# -- relabelling agrees with SB3's semantics ---------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["future", "final", "episode", "random", "FUTURE"])
def test_relabelled_goals_rewards_and_dones_follow_sb3(tmp_path, strategy):
    venv = _venv(2, T=6)
    rb = _buffer(venv, path=tmp_path / "rb", goal_selection_strategy=strategy, n_sampled_goal=4)
    _collect([rb], venv, 40)
    where = _rows_by_obs(rb.store)
    batch = rb.sample(200)
    n = int(rb.her_ratio * 200)
    assert n == 160
    obs = {k: v.numpy() for k, v in batch.observations.items()}
    nxt = {k: v.numpy() for k, v in batch.next_observations.items()}
    np.testing.assert_array_equal(nxt["desired_goal"], obs["desired_goal"])
    np.testing.assert_array_equal(batch.rewards[:, 0].numpy(), venv.env_method(
        "compute_reward", nxt["achieved_goal"], obs["desired_goal"], None, indices=[0])[0])
    assert not batch.dones.any()  # every episode was truncated: dones = done * (1 - timeout)
    table = rb.store.episodes
    relabelled_away = 0
    for i in range(200):
        key = obs["observation"][i].tobytes()
        eid, t = next(v for k, v in where.items() if k.startswith(key))
        ep = rb.store.episode(eid)
        goal = obs["desired_goal"][i]
        if i >= n:  # real transitions keep their goal
            np.testing.assert_array_equal(goal, ep["desired_goal"][t])
            continue
        L = int(table["length"][table["episode_id"] == eid][0])
        steps = np.flatnonzero((ep["achieved_goal"][1:] == goal).all(axis=1))
        if strategy.lower() == "final":
            assert L - 1 in steps
        elif strategy.lower() == "future":
            assert (steps >= t).any()
        elif strategy == "episode":
            assert steps.size
        else:
            relabelled_away += steps.size == 0  # random: a goal from anywhere in the store
    if strategy == "random":
        assert relabelled_away > n // 2


def test_handle_timeout_termination_false_makes_truncations_terminal(tmp_path):
    venv = _venv(1, T=4)
    rb = _buffer(venv, path=tmp_path / "rb", handle_timeout_termination=False, n_sampled_goal=0)
    _collect([rb], venv, 40)
    where = _rows_by_obs(rb.store)
    batch = rb.sample(100)
    for i in range(100):
        key = batch.observations["observation"][i].numpy().tobytes()
        _, t = next(v for k, v in where.items() if k.startswith(key))
        assert batch.dones[i, 0] == float(t == 3)


def test_sample_normalises_with_vec_normalize(tmp_path):
    venv = _venv(1, T=5)
    rb = _buffer(venv, path=tmp_path / "rb", n_sampled_goal=1)
    _collect([rb], venv, 30)
    norm = VecNormalize(venv, norm_obs_keys=["observation", "desired_goal", "achieved_goal"])
    for k in norm.obs_rms:
        norm.obs_rms[k].mean[:] = 0.5
        norm.obs_rms[k].var[:] = 4.0
    norm.ret_rms.var = np.array(4.0)
    batch = rb.sample(64, env=norm)
    stored = {rb.store.episode(int(e))["observation"][t].tobytes()
              for e in rb.store.episodes["episode_id"] for t in range(5)}
    raw = norm.unnormalize_obs({k: v.numpy() for k, v in batch.observations.items()})
    for row in raw["observation"]:
        assert row.astype(np.float32).tobytes() in stored or np.any(
            [np.allclose(row, np.frombuffer(s, np.float32), atol=1e-5) for s in stored])
    assert set(np.round(batch.rewards.numpy().ravel(), 4)) <= {0.0, -0.5}


def test_copy_info_dict_stores_numeric_infos_and_passes_them_to_compute_reward(tmp_path):
    venv = _venv(1, T=5)
    rb = _buffer(venv, path=tmp_path / "rb", copy_info_dict=True)
    assert rb.store is None  # created at the first add, when the info keys are seen
    _collect([rb], venv, 20)
    assert rb.info_keys == ("is_success",) and rb.store.info_keys == ("is_success",)
    ep = rb.store.episode(0)
    assert ep["is_success"].shape == (5,)
    env0 = venv.envs[0]
    env0.reward_infos.clear()
    rb.sample(10)
    (infos,) = env0.reward_infos
    assert len(infos) == 8 and all(set(i) == {"is_success"} for i in infos)
    rb.close()
    again = _buffer(venv, path=tmp_path / "rb", copy_info_dict=True)  # resumed: info keys from the store
    assert again.info_keys == ("is_success",) and len(again.store) == 20


class LateSuccess(RecordingPointGoal):
    """Reports ``is_success`` (and a non-numeric entry) only at an episode's last step."""

    def step(self, action):
        obs, reward, terminated, truncated, _ = super().step(action)
        info = {"is_success": 1.0, "note": "end"} if terminated or truncated else {}
        return obs, reward, terminated, truncated, info


def test_info_keys_appearing_after_the_first_add_are_warned_about_once(tmp_path):
    venv = DummyVecEnv([lambda: LateSuccess(5)])
    rb = _buffer(venv, path=tmp_path / "rb", copy_info_dict=True)
    with pytest.warns(
        UserWarning, match=r"infos carry \['is_success'\], which are not stored.*info_keys=\['is_success'\]"
    ) as w:
        _collect([rb], venv, 20)
    assert len([x for x in w if "infos carry" in str(x.message)]) == 1 and rb.info_keys == ()
    rb.close()
    rb = _buffer(venv, path=tmp_path / "given", copy_info_dict=True, info_keys=["is_success"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _collect([rb], venv, 20)
    ep = rb.store.episode(0)
    assert ep["is_success"].tolist() == [0, 0, 0, 0, 1]  # entries an info lacks are stored as 0
    venv.envs[0].reward_infos.clear()
    rb.sample(10)
    assert sorted({i["is_success"] for i in venv.envs[0].reward_infos[0]}) <= [0.0, 1.0]
    rb.close()
    rb = _buffer(venv, path=tmp_path / "none", copy_info_dict=True, info_keys=[])  # none, knowingly
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _collect([rb], venv, 5)
        back = pickle.loads(pickle.dumps(rb))  # the handle keeps that choice
        rb.close()
        back.set_env(venv)
        _collect([back], venv, 5)
    back.close()


def test_relabel_terminated_uses_compute_terminated(tmp_path):
    venv = _venv(1, T=5)
    rb = _buffer(venv, path=tmp_path / "rb", relabel_terminated=True, goal_selection_strategy="final")
    _collect([rb], venv, 30)
    batch = rb.sample(100)
    n = int(rb.her_ratio * 100)
    ag, dg = batch.next_observations["achieved_goal"].numpy(), batch.observations["desired_goal"].numpy()
    want = np.linalg.norm(ag - dg, axis=-1) < 0.5
    np.testing.assert_array_equal(batch.dones[:n, 0].numpy().astype(bool), want[:n])
    assert not batch.dones[n:].any()


# -- SB3's attributes and counters ---------------------------------------------------------------------------
def test_arrays_read_as_sb3s_own_buffer_after_the_same_adds(tmp_path):
    venv = _venv(2, T=4)
    ours = _buffer(venv, buffer_size=40, path=tmp_path / "rb")
    theirs = HerReplayBuffer(40, venv.observation_space, venv.action_space, env=venv, n_envs=2)
    _collect([ours, theirs], venv, 13)
    assert (ours.pos, ours.full, ours.size()) == (theirs.pos, theirs.full, theirs.size()) == (13, False, 13)
    for name in ("actions", "rewards", "dones", "timeouts", "ep_start", "ep_length", "_current_ep_start"):
        np.testing.assert_array_equal(getattr(ours, name), getattr(theirs, name), err_msg=name)
    for k in theirs.observations:
        np.testing.assert_array_equal(ours.observations[k], theirs.observations[k])
        np.testing.assert_array_equal(ours.next_observations[k], theirs.next_observations[k])
    _collect([ours, theirs], venv, 12, seed=1)  # the ring wraps (20 rows per env)
    assert (ours.pos, ours.full, ours.size()) == (theirs.pos, theirs.full, theirs.size()) == (5, True, 20)
    assert len(ours.store) <= 40
    ours.reset()
    theirs.reset()
    assert (ours.pos, ours.full, ours.size()) == (theirs.pos, theirs.full, theirs.size()) == (0, False, 0)
    assert len(ours.store) > 0  # reset keeps the stored episodes
    _collect([ours, theirs], venv, 6, seed=2)  # after a reset, the new steps are at rows 0..pos - 1, as SB3's
    assert ours.pos == theirs.pos == 6
    for name in ("actions", "rewards", "dones", "timeouts"):
        np.testing.assert_array_equal(getattr(ours, name)[:6], getattr(theirs, name)[:6], err_msg=name)
    for k in theirs.observations:
        np.testing.assert_array_equal(ours.observations[k][:6], theirs.observations[k][:6])
        np.testing.assert_array_equal(ours.next_observations[k][:6], theirs.next_observations[k][:6])
    ours.close()


def test_a_store_of_whole_episodes_resumed_with_several_envs(tmp_path):
    """Episodes appended whole (no env recorded) take the env columns in turn: pos and SB3's arrays agree."""
    venv = _venv(1, T=5)
    rb = _buffer(venv, path=tmp_path / "rb")
    _collect([rb], venv, 15)
    store = open_store(str(tmp_path / "whole"), venv.observation_space, venv.action_space, capacity=1000)
    for i in range(3):
        store.append_episode(rb.store.episode(i))
    store.close()
    two = _buffer(_venv(2, T=5), path=tmp_path / "whole")
    assert two.store.episodes["env_index"].tolist() == [-1, -1, -1]
    assert (two.pos, two.size()) == (10, 10)  # episodes 0 and 2 in env 0's column, 1 in env 1's
    assert two.ep_length[:10].tolist() == [[5, 0]] * 5 + [[5, 5]] * 5
    np.testing.assert_array_equal(two.actions[5:10, 1], rb.store.episode(1)["action"])
    rb.close()
    two.close()


def test_device_may_be_reassigned(tmp_path):
    venv = _venv(1)
    rb = _buffer(venv, path=tmp_path / "rb", device="cpu")
    _collect([rb], venv, 10)
    rb.device = th.device("meta")
    batch = rb.sample(4)
    assert batch.actions.device.type == "meta" and batch.observations["observation"].device.type == "meta"


# -- save, load, copy ----------------------------------------------------------------------------------------
def test_save_and_load_replay_buffer_write_a_small_handle_and_resume(tmp_path):
    env = BitFlippingEnv(n_bits=4, continuous=True, max_steps=4)
    model = _learn(SAC, env, steps=42, replay_buffer_kwargs={"path": str(tmp_path / "rb")})
    rb = model.replay_buffer
    pending = rb._writer.pending(0)
    T = len(pending["action"])
    assert T > 0
    committed = len(rb.store)
    model.save_replay_buffer(tmp_path / "handle")
    assert os.path.getsize(tmp_path / "handle.pkl") < 8_000
    assert sorted(os.listdir(tmp_path)) == ["handle.pkl", "rb"]  # no copy of the data anywhere
    model.save(tmp_path / "model")
    rb.close()
    del model, rb

    loaded = SAC.load(tmp_path / "model", env=env)  # builds a buffer on the same path: resumes, never wipes
    assert len(loaded.replay_buffer.store) == committed
    with pytest.warns(UserWarning, match="last trajectory in the replay buffer will be truncated"):
        loaded.load_replay_buffer(tmp_path / "handle")
    rb = loaded.replay_buffer
    assert len(rb.store) == committed + T and rb.pos == loaded.num_timesteps
    last = rb.store.episode(rb.store.end_episode - 1)
    np.testing.assert_array_equal(last["action"], pending["action"])
    assert last["truncated"].tolist() == [False] * (T - 1) + [True]
    loaded.learn(20, reset_num_timesteps=False)
    assert len(rb.store) + int(rb._writer.pending_steps.sum()) == loaded.num_timesteps == rb.pos


def test_a_handle_saved_by_an_earlier_version_loads_and_resumes_its_unfinished_episodes(tmp_path, monkeypatch):
    # pickled by the code of tests/data/make_sb3_handle.py's commit, the class named by its path then
    with open(os.path.join(DATA, "sb3_handle_v1.pkl"), "rb") as f:
        data = f.read()
    assert b"her_store.integrations.sb3\x94\x8c\x13ZarrHerReplayBuffer" in data
    monkeypatch.chdir(tmp_path)  # the handle names its store by the relative path "store"
    venv = saved_handle.venv()
    rb = saved_handle.buffer(venv)  # the same ended episodes, in a store made by today's code
    saved_handle.fill(rb)
    rb.close()  # the unfinished episodes are not stored: only the handle holds them
    back = pickle.loads(data)
    assert isinstance(back, ZarrHerReplayBuffer) and back.env is None and back.store is None
    assert (back.n_envs, back.total_capacity, back.pos, back.n_sampled_goal) == (2, 100, 9, 2)
    assert back.goal_selection_strategy == SB3Strategy.FUTURE and back.info_keys == ("is_success",)
    back.set_env(venv)
    assert back.sample(8).rewards.shape == (8, 1) and back.store.url.endswith("store")
    with pytest.warns(UserWarning, match="will be truncated"):
        back.truncate_last_trajectory()
    table = back.store.episodes
    assert table["length"].tolist() == [3, 5, 4, 2, 4] and table["env_index"].tolist() == [0, 1, 0, 0, 1]
    for eid, env, episode, length in ((3, 0, 2, 2), (4, 1, 1, 4)):
        ep = back.store.episode(eid)
        for k in range(length + 1):
            for key, want in saved_handle.state(env, episode, k).items():
                np.testing.assert_array_equal(ep[key][k], want)
        assert ep["truncated"].tolist() == [False] * (length - 1) + [True]
    back.close()


def test_a_handle_loads_without_env_and_holds_no_data(tmp_path):
    venv = _venv(1, T=5)
    rb = _buffer(venv, buffer_size=10_000, path=tmp_path / "rb")
    _collect([rb], venv, 200)
    small = len(pickle.dumps(rb))
    _collect([rb], venv, 2003, seed=1)
    blob = pickle.dumps(rb)
    assert len(blob) < small + 1000  # the handle does not grow with the data (3 pending steps)
    rb.close()
    back = pickle.loads(blob)
    assert back.env is None and (back.pos, back.full) == (2203, False) and back.store is None
    with pytest.warns(UserWarning, match="will be truncated"):
        back.truncate_last_trajectory()
    assert len(back.store) == 2203 and back.store.num_episodes == 441
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        back.truncate_last_trajectory()  # nothing unfinished: no warning
    with pytest.raises(ValueError, match="needs a VecEnv to call compute_reward"):
        back.sample(4)
    back.set_env(venv)
    with pytest.raises(ValueError, match="already initialized"):
        back.set_env(venv)
    assert back.sample(4).rewards.shape == (4, 1)


def test_a_handle_whose_run_went_on_and_ended_its_episodes_loads_without_a_word(tmp_path):
    venv = _venv(1, T=5)
    rb = _buffer(venv, path=tmp_path / "rb")
    _collect([rb], venv, 7)
    blob = pickle.dumps(rb)  # 2 steps pending
    _collect([rb], venv, 5, seed=1)  # the run goes on: its reset ends that episode, then one more is stored
    rb.close()
    back = pickle.loads(blob)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the expected resume of a run that went on: nothing to say
        back.truncate_last_trajectory()
    assert back.store.num_episodes == 3 and back.store.episodes["length"].tolist() == [5, 2, 5]


def test_a_handle_stages_again_what_the_store_lacks_and_not_what_its_run_went_on_to_store(tmp_path):
    # env 0's episodes are 3 steps, env 1's 8; the run saves its handle, goes on 2 steps and dies (no truncation)
    venv = DummyVecEnv([lambda: RecordingPointGoal(3), lambda: RecordingPointGoal(8)])
    rb = _buffer(venv, path=tmp_path / "rb")
    obs = _collect([rb], venv, 4)
    assert rb._writer.pending_steps.tolist() == [1, 4] and rb.store.num_episodes == 1
    blob = pickle.dumps(rb)
    saved = [rb._writer.pending(e) for e in range(2)]
    _collect([rb], venv, 2, seed=1, obs=obs)  # env 0 ends the episode it had begun; env 1's goes on
    assert rb._writer.pending_steps.tolist() == [0, 6]
    rb.close()  # as a kill: env 1's 6 steps are not stored
    back = pickle.loads(blob)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        back.truncate_last_trajectory()  # env 1's 4 saved steps are staged again, and ended here
    assert [str(w.message).splitlines()[0] for w in caught] == ["The last trajectory in the replay buffer will be "
                                                                 "truncated."]
    table = back.store.episodes
    assert table["length"].tolist() == [3, 3, 4] and table["env_index"].tolist() == [0, 0, 1]
    assert all(np.array_equal(back.store.episode(2)[k], saved[1][k]) for k in ("observation", "action", "reward"))
    assert np.array_equal(back.store.episode(1)["action"][:1], saved[0]["action"])  # env 0's went on in the store


def test_a_handle_whose_store_another_writer_moved_on_drops_its_pending_steps_with_a_warning(tmp_path):
    venv = _venv(1, T=5)
    rb = _buffer(venv, path=tmp_path / "rb")
    _collect([rb], venv, 7)
    blob = pickle.dumps(rb)  # 2 steps pending
    rb.close()  # not stored
    other = _buffer(venv, path=tmp_path / "rb")  # another writer's episode, which does not continue them
    _collect([other], venv, 5, seed=1)
    other.close()
    back = pickle.loads(blob)
    dropped = r"holds episodes of envs \[0\] committed after this buffer was saved \(episode ids 1..1\) that do not "
    with pytest.warns(
        UserWarning, match=dropped + r"continue .* those unfinished episodes \(2 steps\), which the store"
    ):
        back.truncate_last_trajectory()
    assert back.store.episodes["length"].tolist() == [5, 5]


def test_a_handle_whose_store_was_replaced_by_a_shorter_one_says_so(tmp_path):
    venv = _venv(1, T=5)
    rb = _buffer(venv, path=tmp_path / "rb")
    _collect([rb], venv, 12)
    blob = pickle.dumps(rb)  # episodes 0 and 1, 2 steps pending
    rb.close()
    shutil.rmtree(tmp_path / "rb")
    again = _buffer(venv, path=tmp_path / "rb")
    _collect([again], venv, 5, seed=1)
    again.close()
    back = pickle.loads(blob)
    with pytest.warns(UserWarning, match="holds 1 episode ids, fewer than the 2 this buffer saw"):
        back.truncate_last_trajectory()
    assert back.store.num_episodes == 1


def test_a_temporary_store_is_removed_at_close_unless_a_handle_was_saved(tmp_path):
    venv = _venv(1)
    rb = _buffer(venv)
    _collect([rb], venv, 10)
    where = os.path.dirname(rb.url)
    rb.close()
    assert not os.path.exists(where)
    rb = _buffer(venv)
    _collect([rb], venv, 10)
    blob = pickle.dumps(rb)
    del rb
    back = pickle.loads(blob)
    back.set_env(venv)
    assert back.sample(4).rewards.shape == (4, 1) and len(back.store) == 10
    back.close()


def test_a_handle_that_cannot_be_pickled_says_why_and_keeps_no_temporary_store(tmp_path):
    venv = _venv(1)
    rb = _buffer(venv, goal_selection_strategy=lambda ctx: ctx.desired_goals)
    _collect([rb], venv, 12)
    where = os.path.dirname(rb.url)
    with pytest.raises(pickle.PicklingError, match=r"goal_selection_strategy <function .*<lambda>.*module level"):
        pickle.dumps(rb)
    rb.close()
    assert not os.path.exists(where)  # no handle was written: the temporary store went at close
    rb = _buffer(venv)
    rb.storage_options = {"opener": lambda: None}  # any other part that cannot be pickled
    with pytest.raises(pickle.PicklingError, match="cannot save a handle of this ZarrHerReplayBuffer: .*lambda"):
        pickle.dumps(rb)
    where = os.path.dirname(rb.url)
    rb.close()
    assert not os.path.exists(where)


def test_deepcopy_is_an_independent_buffer_in_a_new_temporary_store(tmp_path):
    venv = _venv(1)
    rb = _buffer(venv, path=tmp_path / "rb")
    _collect([rb], venv, 10)
    twin = copy.deepcopy(rb)
    assert twin.env is None and twin.url != rb.url and twin.pos == 10
    twin.set_env(venv)
    _collect([twin], venv, 5, seed=3)
    assert len(twin.store) == 15 and len(rb.store) == 10
    assert twin.sample(4).rewards.shape == (4, 1)
    where = os.path.dirname(twin.url)
    twin.close()
    assert not os.path.exists(where) and len(rb.store) == 10
    as_url = _buffer(venv, path=f"file://{tmp_path}/url")
    _collect([as_url], venv, 5)
    url_twin = copy.deepcopy(as_url)
    url_twin.set_env(venv)
    assert len(url_twin._require_store()) == 5
    url_twin.close()
    remote = _buffer(venv, path="memory://sb3-deepcopy-test")
    with pytest.raises(StoreError, match="on object storage"):
        copy.deepcopy(remote)
    remote.close()


# -- refused inputs, the store intact ----------------------------------------------------------------------
def test_bad_spaces_and_options_are_refused(tmp_path):
    box = spaces.Box(-1, 1, (2,), np.float32)
    with pytest.raises(SchemaMismatchError, match="observation_space must be a gymnasium Dict"):
        ZarrHerReplayBuffer(10, box, box, path=tmp_path / "never")
    with pytest.raises(SchemaMismatchError, match=r"missing \['desired_goal'\]"):
        ZarrHerReplayBuffer(10, spaces.Dict({"observation": box, "achieved_goal": box}), box, path=tmp_path / "never")
    mixed = spaces.Dict({"observation": box, "achieved_goal": box, "desired_goal": spaces.Box(-1, 1, (3,))})
    with pytest.raises(SchemaMismatchError, match="same shape and dtype"):
        ZarrHerReplayBuffer(10, mixed, box, copy_info_dict=True, path=tmp_path / "never")
    with pytest.raises(SchemaMismatchError, match="action"):
        ZarrHerReplayBuffer(10, spaces.Dict({k: box for k in ("observation", "achieved_goal", "desired_goal")}),
                            spaces.Tuple([box]), copy_info_dict=True, path=tmp_path / "never")
    venv = _venv(1)
    for kw, match in [
        ({"optimize_memory_usage": True}, "optimize_memory_usage"),
        ({"goal_selection_strategy": "nearest"}, "is not one of"),
        ({"n_sampled_goal": -1}, "n_sampled_goal"),
        ({"info_keys": ["x"]}, "only used with copy_info_dict"),
    ]:
        with pytest.raises(ValueError, match=match):
            _buffer(venv, path=tmp_path / "never", **kw)
    with pytest.raises(ValueError, match="buffer_size"):
        _buffer(venv, buffer_size=0)
    assert not os.path.exists(tmp_path / "never")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"buffer_size": True}, ArgumentTypeError, "buffer_size must be an int >= 1, not a bool: got True"),
        ({"buffer_size": 1000.0}, ArgumentTypeError, "buffer_size must be an int >= 1, not a float: got 1000.0"),
        ({"buffer_size": 2**52}, ValueError, "buffer_size must be an int <= 4503599627370495: got 4503599627370496"),
        ({"n_envs": 1.0}, ArgumentTypeError, "n_envs must be an int >= 1, not a float: got 1.0"),
        ({"n_envs": -1}, ValueError, "n_envs must be an int >= 1: got -1"),
        ({"n_sampled_goal": 2.5}, ArgumentTypeError, "n_sampled_goal must be an int >= 0, not a float: got 2.5"),
        ({"n_sampled_goal": True}, ArgumentTypeError, "n_sampled_goal must be an int >= 0, not a bool: got True"),
        ({"copy_info_dict": "x"}, ArgumentTypeError, "copy_info_dict must be True or False, not a str: got 'x'"),
        ({"copy_info_dict": 1}, ArgumentTypeError, "copy_info_dict must be True or False, not an int: got 1"),
        ({"handle_timeout_termination": 0}, ArgumentTypeError, "handle_timeout_termination must be True or False"),
        ({"relabel_terminated": "yes"}, ArgumentTypeError, "relabel_terminated must be True or False, not a str"),
        ({"optimize_memory_usage": 0}, ArgumentTypeError, "optimize_memory_usage must be True or False, not an int"),
        ({"prefetch": 2.5}, ArgumentTypeError, "prefetch must be an int >= 0, not a float: got 2.5"),
        ({"prefetch": "x"}, ArgumentTypeError, "prefetch must be an int >= 0, not a str: got 'x'"),
        ({"prefetch": -1}, ValueError, "prefetch must be an int >= 0: got -1"),
        ({"io_threads": True}, ArgumentTypeError, "io_threads must be an int >= 0 or None, not a bool: got True"),
        ({"io_threads": 1.5}, ArgumentTypeError, "io_threads must be an int >= 0 or None, not a float: got 1.5"),
        ({"io_threads": -2}, ValueError, "io_threads must be an int >= 0 or None: got -2"),
        ({"copy_info_dict": True, "info_keys": "is_success"}, ArgumentTypeError, "info_keys must be a sequence of str"),
        ({"storage_options": "anon"}, ArgumentTypeError, "storage_options must be a mapping or None, got 'anon'"),
    ],
)
def test_options_are_checked_by_name_before_anything_is_made(tmp_path, kwargs, error, match):
    """Every option is checked as it is given (2.5 is no count, 1 or "x" no flag), before the store is made."""
    venv = _venv(1)
    args = {"buffer_size": 1000, "observation_space": venv.observation_space, "action_space": venv.action_space,
            "env": venv, "n_envs": 1, "path": tmp_path / "never"}
    with pytest.raises(error, match=match):
        ZarrHerReplayBuffer(**{**args, **kwargs})
    assert not os.path.exists(tmp_path / "never")


def test_numpy_ints_and_bools_are_accepted_and_kept_as_python_ones(tmp_path):
    venv = _venv(1)
    rb = ZarrHerReplayBuffer(
        np.int64(1000), venv.observation_space, venv.action_space, env=venv, device=th.device("cpu"),
        n_envs=np.int32(1), handle_timeout_termination=np.bool_(True), n_sampled_goal=np.int64(2),
        copy_info_dict=np.bool_(False), relabel_terminated=np.bool_(False), prefetch=np.uint8(1),
        io_threads=np.int64(2), path=tmp_path / "rb",
    )
    config = (rb.total_capacity, rb.n_envs, rb.n_sampled_goal, rb.prefetch, rb.io_threads, rb.copy_info_dict)
    assert config == (1000, 1, 2, 1, 2, False) and all(type(v) in (int, bool) for v in config)
    assert rb.her_ratio == pytest.approx(2 / 3)
    _collect([rb], venv, 10)
    assert rb.sample(8).rewards.shape == (8, 1)
    handle = pickle.loads(pickle.dumps(rb))  # the handle holds the options as kept
    rb.close()
    assert (handle.total_capacity, handle.io_threads, handle.prefetch) == (1000, 2, 1)
    handle.close()


def test_a_store_of_other_spaces_or_capacity_is_refused_and_kept(tmp_path):
    venv = _venv(1)
    rb = _buffer(venv, path=tmp_path / "rb")
    _collect([rb], venv, 10)
    rb.close()
    other = BitFlippingEnv(n_bits=4, continuous=True)
    with pytest.raises(SchemaMismatchError):
        ZarrHerReplayBuffer(1000, other.observation_space, other.action_space, path=tmp_path / "rb")
    with pytest.raises(SchemaMismatchError, match="capacity"):
        _buffer(venv, buffer_size=500, path=tmp_path / "rb")
    with EpisodeStore.open(tmp_path / "rb") as store:
        assert store.num_episodes == 2


def test_bad_steps_are_refused_and_change_nothing(tmp_path):
    venv = _venv(1)
    rb = _buffer(venv, path=tmp_path / "rb")
    with pytest.raises(RuntimeError, match="Unable to sample before the end of the first episode"):
        rb.sample(4)
    _collect([rb], venv, 7)
    obs = {k: v.copy() for k, v in rb._writer._last_next.items()}  # the episode goes on (a reset would end it)
    action = np.zeros((1, 2), np.float32)
    reward, done, infos = np.zeros(1, np.float32), np.zeros(1, bool), [{}]
    with pytest.raises(EpisodeValidationError, match="observation"):
        rb.add({**obs, "observation": np.zeros((1, 5), np.float32)}, obs, action, reward, done, infos)
    with pytest.raises(EpisodeValidationError, match="action"):
        rb.add(obs, obs, np.zeros((1, 3), np.float32), reward, done, infos)
    with pytest.raises(EpisodeValidationError, match="desired_goal"):
        rb.add({k: v for k, v in obs.items() if k != "desired_goal"}, obs, action, reward, done, infos)
    jump = {**obs, "observation": obs["observation"] + 1}  # a reset in between, and a refused action: it ended the
    with pytest.raises(EpisodeValidationError, match="action"):  # episode before the step was refused
        rb.add(jump, jump, np.zeros((1, 3), np.float32), reward, done, infos)
    assert rb._writer.pending_steps.tolist() == [2] and len(rb.store) == 5 and rb.pos == 7
    extra = {**obs, "velocity": np.zeros((1, 2), np.float32)}  # a key outside the space: ignored, as SB3 ignores it
    rb.add(extra, extra, action, reward, done, infos)
    assert rb._writer.pending_steps.tolist() == [3]


def test_the_integration_is_an_sb3_her_buffer_and_takes_sb3_names():
    env = gym.make("her_store/PointGoal-v0")
    rb = ZarrHerReplayBuffer(100, env.observation_space, env.action_space, goal_selection_strategy=SB3Strategy.EPISODE)
    assert isinstance(rb, HerReplayBuffer) and rb.goal_selection_strategy is SB3Strategy.EPISODE  # SB3's enum
    assert rb.her_ratio == pytest.approx(0.8) and rb.size() == 0
    rb.truncate_last_trajectory()  # nothing added: nothing to do
    rb.close()
    rb.close()


def test_a_store_another_live_process_writes_is_refused(tmp_path):
    """Collecting this process's garbage cannot free a lock another process holds: still refused."""
    venv = _venv(1)
    _buffer(venv, path=tmp_path / "rb").close()
    code = (
        "import sys, her_store; s = her_store.EpisodeStore.open(sys.argv[1], 'a'); "
        "print(1, flush=True); sys.stdin.read()"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path / "rb")], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert holder.stdout.readline().strip() == b"1"
        with pytest.raises(StoreLockedError, match=f"pid {holder.pid}"):
            _buffer(venv, path=tmp_path / "rb")
        other = _buffer(venv, path=tmp_path / "other")  # a buffer of this process holds a store: gc, then retry
        with pytest.raises(StoreLockedError, match=f"pid {holder.pid}.*close it first"):
            _buffer(venv, path=tmp_path / "rb")
        other.close()
    finally:
        holder.communicate(b"")
    _buffer(venv, path=tmp_path / "rb").close()  # free again once that process has ended


def test_a_closed_buffer_refuses_use_and_a_handle_of_a_removed_store_says_so(tmp_path):
    venv = _venv(1)
    rb = _buffer(venv, path=tmp_path / "rb")
    _collect([rb], venv, 5)
    blob = pickle.dumps(rb)
    rb.close()
    obs = venv.reset()
    with pytest.raises(StoreError, match="is closed"):
        rb.add(obs, obs, np.zeros((1, 2), np.float32), np.zeros(1, np.float32), np.zeros(1, bool), [{}])
    with pytest.raises(StoreError, match="is closed"):
        rb.sample(4)
    import shutil

    shutil.rmtree(tmp_path / "rb")
    back = pickle.loads(blob)
    back.set_env(venv)
    with pytest.raises(NotAStoreError, match="loaded from a handle"):
        back.sample(4)
    assert not os.path.exists(tmp_path / "rb")  # no empty store made in its place
    with pytest.raises(ValueError, match="infos must be a list of 1 dicts"):
        _buffer(venv, path=tmp_path / "other").add(obs, obs, np.zeros((1, 2), np.float32), 0, False, None)


def test_prefetching_sampler_and_default_relabelled_dones(tmp_path):
    env = BitFlippingEnv(n_bits=3, continuous=True, max_steps=3)  # no compute_terminated: reward 0 means done
    model = _learn(SAC, env, steps=40, replay_buffer_kwargs={
        "path": tmp_path / "rb", "prefetch": 2, "io_threads": 2, "relabel_terminated": True,
        "goal_selection_strategy": "future"})
    batch = model.replay_buffer.sample(16)
    n = int(model.replay_buffer.her_ratio * 16)
    np.testing.assert_array_equal(batch.dones[:n].numpy(), (batch.rewards[:n].numpy() == 0).astype(np.float32))


class ThreadRecorder(VecEnvWrapper):
    """A VecEnvWrapper recording the thread of every call that uses the wrapped VecEnv."""

    def __init__(self, venv):
        super().__init__(venv)
        self.threads: set[str] = set()

    def reset(self):
        self.threads.add(threading.current_thread().name)
        return self.venv.reset()

    def step_wait(self):
        self.threads.add(threading.current_thread().name)
        return self.venv.step_wait()

    def env_method(self, method_name, *args, indices=None, **kwargs):
        self.threads.add(threading.current_thread().name)
        return self.venv.env_method(method_name, *args, indices=indices, **kwargs)


def test_prefetch_never_uses_the_pipes_of_a_subprocess_env_from_another_thread(tmp_path):
    """With a SubprocVecEnv the training thread alone talks to the workers (no prefetch, with a warning), and
    the relabelled rewards are the env's; a DummyVecEnv is prefetched for."""
    venv = ThreadRecorder(_venv(2, T=5, cls=SubprocVecEnv, start_method="fork"))
    try:
        rb = _buffer(venv, path=tmp_path / "rb", prefetch=2, n_sampled_goal=4)
        _collect([rb], venv, 20)
        with pytest.warns(UserWarning, match=r"prefetch=2\) does not prefetch with ThreadRecorder\(SubprocVecEnv\)"):
            batches = [rb.sample(32) for _ in range(4)]
        assert venv.threads == {threading.current_thread().name}
        for b in batches:
            want = PointGoalEnv().compute_reward(
                b.next_observations["achieved_goal"].numpy(), b.observations["desired_goal"].numpy(), {}
            )
            np.testing.assert_array_equal(b.rewards.numpy().ravel(), want)
        rb.close()
    finally:
        venv.close()
    venv = ThreadRecorder(_venv(1, T=5))
    rb = _buffer(venv, path=tmp_path / "dummy", prefetch=2)
    _collect([rb], venv, 20)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rb.sample(32), rb.sample(32)
    assert "her_store-prefetch" in venv.threads  # rewards computed ahead, in the envs of this process
    rb.close()


KILLED_RUN = """
import sys
from stable_baselines3 import SAC
from stable_baselines3.common.envs import BitFlippingEnv
from her_store.integrations.sb3 import ZarrHerReplayBuffer
env = BitFlippingEnv(n_bits=4, continuous=True, max_steps=4)
model = SAC("MultiInputPolicy", env, replay_buffer_class=ZarrHerReplayBuffer, learning_starts=10**9,
            replay_buffer_kwargs={"path": sys.argv[1]}, policy_kwargs={"net_arch": [8]})
model.learn(10**7)
"""


@pytest.mark.slow
def test_a_killed_run_resumes_from_its_last_commit(tmp_path):
    import signal
    import subprocess
    import sys

    path = str(tmp_path / "rb")
    proc = subprocess.Popen([sys.executable, "-c", KILLED_RUN, path])
    try:
        deadline = time.monotonic() + 300  # only a hang takes this long
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the run never committed 5 episodes"
            try:
                with EpisodeStore.open(path) as store:
                    if store.num_episodes >= 5:
                        break
            except NotAStoreError:
                pass
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    env = BitFlippingEnv(n_bits=4, continuous=True, max_steps=4)
    model = _learn(SAC, env, steps=20, learning_starts=10, replay_buffer_kwargs={"path": path})
    store = model.replay_buffer.store
    assert store.num_episodes >= 10
    for eid in range(store.first_episode, store.end_episode):
        store.episode(eid)  # every committed episode intact (crc checked)


class ScalarTerminated(RecordingPointGoal):
    """compute_terminated that is not vectorised (one answer for the whole batch), or answers with a wrong size."""

    wrong_size = False

    def compute_terminated(self, achieved_goal, desired_goal, info):
        return np.ones(3, bool) if self.wrong_size else True


def test_a_compute_terminated_answering_once_is_broadcast_and_a_wrong_size_refused(tmp_path):
    venv = DummyVecEnv([ScalarTerminated])
    rb = _buffer(venv, path=tmp_path / "rb", relabel_terminated=True)
    _collect([rb], venv, 10)
    batch = rb.sample(10)
    assert batch.dones[:8].all() and not batch.dones[8:].any()
    venv.envs[0].wrong_size = True
    with pytest.raises(ValueError, match="compute_terminated returned 3 values"):
        rb.sample(10)
    fresh = _buffer(venv, path=tmp_path / "fresh", copy_info_dict=True)
    with pytest.raises(RuntimeError, match="Unable to sample before the end of the first episode"):
        fresh.sample(4)
    assert fresh.store is None and not os.path.exists(tmp_path / "fresh")


def test_every_finished_episode_is_sampled_and_a_seeded_buffer_draws_the_same_batches(tmp_path):
    venv = _venv(1, T=5)
    batches = []
    for run in range(2):
        np.random.seed(7)  # what SB3's set_random_seed does
        rb = _buffer(venv, path=tmp_path / f"rb{run}", n_sampled_goal=0)
        rb.store.commit_interval = 1e6  # no commit by time
        _collect([rb], venv, 10)
        first = rb.sample(50)
        _collect([rb], venv, 5, seed=1)  # a third episode ends
        later = rb.sample(200)
        seen = {rb.store.episode(2)["observation"][t].tobytes() for t in range(5)}  # (reading commits too)
        assert any(row.numpy().tobytes() in seen for row in later.observations["observation"])
        batches.append((first, later))
    for a, b in zip(*batches):
        for k in a.observations:
            np.testing.assert_array_equal(a.observations[k], b.observations[k])
        np.testing.assert_array_equal(a.actions, b.actions)


# -- prioritized replay --------------------------------------------------------------------------------------
def test_energy_prioritization_trains_sac_unchanged_and_survives_the_handle(tmp_path):
    from her_store.sampling.episode_priority import EpisodePriorityDraw

    env = DummyVecEnv([lambda: RecordingPointGoal(5)])
    model = _learn(SAC, env, replay_buffer_kwargs={"path": tmp_path / "rb", "prioritize": "energy"})
    rb = model.replay_buffer
    assert isinstance(rb._sampler(16).draw, EpisodePriorityDraw)
    assert rb.store.episodes["priority"].min() > 0  # the point moved in every episode: each has energy
    handle = pickle.dumps(rb)
    rb.close()
    loaded = pickle.loads(handle)
    loaded.env = env
    assert loaded.prioritize == "energy" and len(loaded.sample(8).observations["observation"]) == 8
    assert isinstance(loaded._sampler(8).draw, EpisodePriorityDraw)
    loaded.close()


def test_td_prioritization_is_refused_with_what_to_use_instead(tmp_path):
    venv = _venv()
    with pytest.raises(ValueError, match="SB3's algorithms do not pass TD errors"):
        _buffer(venv, path=tmp_path / "rb", prioritize="td")
