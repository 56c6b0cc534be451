"""ZarrHerReplayBuffer in SB3's HER workflows: real training runs compared with SB3's own HerReplayBuffer."""

from __future__ import annotations

import gc
import os
import pickle
import warnings

import numpy as np
import pytest
from stable_baselines3 import DDPG, DQN, SAC, TD3
from stable_baselines3.common.callbacks import EvalCallback
from stable_baselines3.common.envs import BitFlippingEnv
from stable_baselines3.common.evaluation import evaluate_policy
from stable_baselines3.common.vec_env import SubprocVecEnv
from stable_baselines3.her import GoalSelectionStrategy as SB3Strategy
from stable_baselines3.her import HerReplayBuffer

from her_store import EpisodeStore, GoalSelectionStrategy
from her_store.integrations.sb3 import ZarrHerReplayBuffer
from her_store.integrations.sb3_layout import sb3_arrays


def tiny() -> dict:
    return dict(net_arch=[32, 32])  # a fresh dict: SAC adds its own entries to policy_kwargs


class TeeBuffer(ZarrHerReplayBuffer):
    """A ZarrHerReplayBuffer that also hands every add to SB3's own HerReplayBuffer (``shadow``) for comparison."""

    def __init__(self, buffer_size, observation_space, action_space, env=None, n_envs=1, **kwargs):
        super().__init__(buffer_size, observation_space, action_space, env, n_envs=n_envs, **kwargs)
        sb3_kw = {k: v for k, v in kwargs.items() if k in ("device", "handle_timeout_termination", "n_sampled_goal")}
        self.shadow = HerReplayBuffer(buffer_size, observation_space, action_space, env, n_envs=n_envs, **sb3_kw)

    def add(self, obs, next_obs, action, reward, done, infos):
        self.shadow.add({k: v.copy() for k, v in obs.items()}, next_obs, action.copy(), reward.copy(), done, infos)
        super().add(obs, next_obs, action, reward, done, infos)


def _assert_same_as_shadow(buffer: TeeBuffer) -> None:
    """End both buffers' unfinished episodes as load_replay_buffer does; then the store is SB3's buffer, row for row."""
    shadow, store = buffer.shadow, buffer.store
    with warnings.catch_warnings(record=True) as sb3_warned:
        warnings.simplefilter("always")
        shadow.truncate_last_trajectory()
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        buffer.truncate_last_trajectory()
    assert [str(w.message) for w in warned] == [str(w.message) for w in sb3_warned]
    nothing_pending = store.writer(buffer.n_envs)
    got = sb3_arrays(
        store, buffer.buffer_size, buffer.n_envs, [nothing_pending.pending(e) for e in range(buffer.n_envs)]
    )
    assert (got.pos, got.full) == (shadow.pos, shadow.full) == (buffer.pos, buffer.full)
    np.testing.assert_array_equal(got.current_ep_start, shadow._current_ep_start)
    for name in ("actions", "rewards", "dones", "timeouts", "ep_start", "ep_length"):
        np.testing.assert_array_equal(getattr(got, name), getattr(shadow, name), err_msg=name)
    for k in shadow.observations:
        np.testing.assert_array_equal(got.observations[k], shadow.observations[k], err_msg=k)
        np.testing.assert_array_equal(got.next_observations[k], shadow.next_observations[k], err_msg=k)
    assert (got.ep_length > 0).any()


@pytest.mark.parametrize("algo", [SAC, TD3, DDPG, DQN], ids=lambda a: a.__name__)
def test_training_stores_what_sb3s_buffer_holds(tmp_path, algo):
    env = BitFlippingEnv(n_bits=4, continuous=algo is not DQN, max_steps=6)
    model = algo(
        "MultiInputPolicy",
        env,
        buffer_size=10_000,
        learning_starts=40,
        batch_size=32,
        policy_kwargs=tiny(),
        replay_buffer_class=TeeBuffer,
        replay_buffer_kwargs=dict(path=str(tmp_path / "rb"), n_sampled_goal=4, goal_selection_strategy="future"),
        seed=0,
    )
    model.learn(120)
    assert model._n_updates > 0  # it trained on batches the store gave
    assert model.replay_buffer.store.num_episodes >= 120 // 6
    _assert_same_as_shadow(model.replay_buffer)


def test_subprocess_envs(tmp_path):
    env = SubprocVecEnv([lambda: BitFlippingEnv(n_bits=4, continuous=True, max_steps=5)] * 2, start_method="fork")
    try:
        model = SAC(
            "MultiInputPolicy",
            env,
            learning_starts=30,
            batch_size=16,
            policy_kwargs=tiny(),
            replay_buffer_class=TeeBuffer,
            replay_buffer_kwargs=dict(path=str(tmp_path / "rb")),
            seed=1,
        )
        model.learn(100)
        store = model.replay_buffer.store
        assert set(store.episodes["env_index"].tolist()) == {0, 1}
        _assert_same_as_shadow(model.replay_buffer)
    finally:
        env.close()


def _episode_rows(store: EpisodeStore) -> tuple[dict, np.ndarray]:
    """(obs, action, next obs) of every stored transition -> [(next achieved goals of its episode, step)], and every
    next achieved goal in the store."""
    where: dict = {}
    every = []
    for i in store.episodes["episode_id"]:
        ep = store.episode(int(i))
        goals = ep["achieved_goal"][1:].astype(np.float32)
        every.append(goals)
        for t in range(len(ep["action"])):
            key = _key(ep["observation"][t], ep["action"][t], ep["observation"][t + 1])
            where.setdefault(key, []).append((goals, t))
    return where, np.concatenate(every)


def _key(obs, action, next_obs) -> bytes:
    return b"".join(np.asarray(a, np.float32).tobytes() for a in (obs, np.ravel(action), next_obs))


@pytest.mark.parametrize(
    "strategy",
    [
        SB3Strategy.FUTURE,
        "future",
        SB3Strategy.FINAL,
        "final",
        SB3Strategy.EPISODE,
        "EPISODE",
        "random",
        GoalSelectionStrategy.RANDOM,
    ],
    ids=lambda s: f"{type(s).__name__}-{getattr(s, 'name', s)}",
)
def test_every_goal_strategy(tmp_path, strategy):
    """Relabelled goals follow the strategy's rule (SB3's formulas; random: any goal of the buffer)."""
    env = BitFlippingEnv(n_bits=10, max_steps=8)
    model = DQN(
        "MultiInputPolicy",
        env,
        learning_starts=60,
        batch_size=32,
        policy_kwargs=tiny(),
        replay_buffer_class=ZarrHerReplayBuffer,
        replay_buffer_kwargs=dict(path=str(tmp_path / "rb"), n_sampled_goal=4, goal_selection_strategy=strategy),
        seed=2,
    )
    model.learn(80)
    assert model._n_updates > 0
    buffer = model.replay_buffer
    batch = buffer.sample(200)
    where, every = _episode_rows(buffer.store)
    name = getattr(strategy, "name", strategy).lower()
    obs = {k: v.cpu().numpy().astype(np.float32) for k, v in batch.observations.items()}
    nxt = {k: v.cpu().numpy().astype(np.float32) for k, v in batch.next_observations.items()}
    actions = batch.actions.cpu().numpy()
    rewards = batch.rewards.cpu().numpy().ravel()
    # every row: reward = compute_reward(next achieved goal, desired goal); the goal is the next obs's too
    np.testing.assert_array_equal(rewards, env.compute_reward(nxt["achieved_goal"], obs["desired_goal"], None))
    np.testing.assert_array_equal(obs["desired_goal"], nxt["desired_goal"])
    relabelled = int(buffer.her_ratio * 200)
    earlier = 0
    for i in range(relabelled):
        goal = obs["desired_goal"][i]
        found = where[_key(obs["observation"][i], actions[i], nxt["observation"][i])]
        if name == "random":
            assert (every == goal).all(1).any()
            continue
        ok = []
        for goals, t in found:
            js = np.flatnonzero((goals == goal).all(1))
            allowed = {"future": js >= t, "final": js == len(goals) - 1, "episode": js >= 0}[name]
            ok.append(allowed.any())
            earlier += bool((js < t).any())
        assert any(ok), (name, i)
    if name == "episode":
        assert earlier > 0  # goals from before the transition were drawn
