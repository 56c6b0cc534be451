"""ZarrHerReplayBuffer in SB3's HER workflows: real training runs compared with SB3's own HerReplayBuffer."""

from __future__ import annotations

import gc
import os
import warnings

import numpy as np
import pytest
import torch as th

from her_store import EpisodeStore, GoalSelectionStrategy
from her_store.errors import StoreLockedError
from her_store.integrations.sb3_layout import sb3_arrays

pytest.importorskip("stable_baselines3", reason='pip install "her_store[sb3]"')

from stable_baselines3 import DDPG, DQN, SAC, TD3
from stable_baselines3.common.callbacks import EvalCallback
from stable_baselines3.common.envs import BitFlippingEnv
from stable_baselines3.common.evaluation import evaluate_policy
from stable_baselines3.common.monitor import Monitor
from stable_baselines3.common.vec_env import SubprocVecEnv
from stable_baselines3.her import GoalSelectionStrategy as SB3Strategy
from stable_baselines3.her import HerReplayBuffer

from her_store.integrations.sb3 import ZarrHerReplayBuffer


def tiny() -> dict:
    return {"net_arch": [32, 32]}  # a fresh dict: SAC adds its own entries to policy_kwargs


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
    """End both buffers' unfinished episodes as load_replay_buffer does; then the buffer's SB3 attributes, read
    from its store, are SB3's own, row for row."""
    shadow = buffer.shadow
    with warnings.catch_warnings(record=True) as sb3_warned:
        warnings.simplefilter("always")
        shadow.truncate_last_trajectory()
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        buffer.truncate_last_trajectory()
    assert [str(w.message) for w in warned] == [str(w.message) for w in sb3_warned]
    assert (buffer.pos, buffer.full) == (shadow.pos, shadow.full)
    np.testing.assert_array_equal(buffer._current_ep_start, shadow._current_ep_start)
    for name in ("actions", "rewards", "dones", "timeouts", "ep_start", "ep_length"):
        np.testing.assert_array_equal(getattr(buffer, name), getattr(shadow, name), err_msg=name)
    for k in shadow.observations:
        np.testing.assert_array_equal(buffer.observations[k], shadow.observations[k], err_msg=k)
        np.testing.assert_array_equal(buffer.next_observations[k], shadow.next_observations[k], err_msg=k)
    assert (buffer.ep_length > 0).any()
    nothing_pending = buffer.store.writer(buffer.n_envs)  # the layout of the store alone is the same
    got = sb3_arrays(
        buffer.store, buffer.buffer_size, buffer.n_envs, [nothing_pending.pending(e) for e in range(buffer.n_envs)]
    )
    np.testing.assert_array_equal(got.ep_length, shadow.ep_length)


@pytest.mark.slow
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
        replay_buffer_kwargs={"path": str(tmp_path / "rb"), "n_sampled_goal": 4, "goal_selection_strategy": "future"},
        seed=0,
    )
    model.learn(120)
    assert model._n_updates > 0  # it trained on batches the store gave
    assert model.replay_buffer.store.num_episodes >= 120 // 6
    _assert_same_as_shadow(model.replay_buffer)


def test_dqn_on_discrete_observations(tmp_path):
    """SB3's own tests train DQN + HER on Discrete observations (SB3 shapes them (1,), the store ())."""
    env = BitFlippingEnv(n_bits=4, continuous=False, max_steps=4, discrete_obs_space=True)
    model = DQN(
        "MultiInputPolicy",
        env,
        buffer_size=1000,
        learning_starts=20,
        batch_size=16,
        policy_kwargs=tiny(),
        replay_buffer_class=TeeBuffer,
        replay_buffer_kwargs={"path": str(tmp_path / "rb"), "n_sampled_goal": 2},
        seed=0,
    )
    model.learn(50)
    assert model._n_updates > 0
    batch = model.replay_buffer.sample(8)
    assert batch.observations["achieved_goal"].shape == batch.next_observations["desired_goal"].shape == (8, 1)
    _assert_same_as_shadow(model.replay_buffer)


@pytest.mark.slow
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
            replay_buffer_kwargs={"path": str(tmp_path / "rb")},
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
    ids=lambda s: f"{type(s).__module__.split('.')[0]}-{getattr(s, 'name', s)}",
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
        replay_buffer_kwargs={"path": str(tmp_path / "rb"), "n_sampled_goal": 4, "goal_selection_strategy": strategy},
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


def _sac(env, tmp_path, **kw):
    return SAC(
        "MultiInputPolicy",
        env,
        learning_starts=30,
        batch_size=16,
        policy_kwargs=tiny(),
        replay_buffer_class=ZarrHerReplayBuffer,
        replay_buffer_kwargs={"path": str(tmp_path / "rb")},
        seed=3,
        **kw,
    )


def _steps(buffer: ZarrHerReplayBuffer) -> int:
    """Steps the buffer holds: stored, and staged in unfinished episodes."""
    return buffer.store.num_transitions + int(buffer._writer.pending_steps.sum())


@pytest.fixture
def no_gc():
    """The cycle collector off, as between two of its runs: a dropped SB3 model is then still in memory."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.mark.slow
def test_save_load_learn_goes_on_appending_to_the_store(tmp_path, no_gc):
    """model.load rebuilds the buffer from its kwargs: the store it names is resumed, not wiped (right after
    ``del model``, as SB3's docs do it: the dropped model's buffer releases the store)."""
    env = BitFlippingEnv(n_bits=4, continuous=True, max_steps=5)
    model = _sac(env, tmp_path)
    model.learn(60)
    model.save(tmp_path / "model")
    before = {k: v.copy() for k, v in model.replay_buffer.store.episodes.items()}
    del model
    model = SAC.load(tmp_path / "model", env=env)
    assert isinstance(model.replay_buffer, ZarrHerReplayBuffer)
    assert model.replay_buffer.store.num_episodes == len(before["episode_id"])
    model.learn(60, reset_num_timesteps=False)
    after = model.replay_buffer.store.episodes
    assert len(after["episode_id"]) > len(before["episode_id"])
    for column in ("episode_id", "length", "crc32", "env_index"):
        np.testing.assert_array_equal(after[column][: len(before[column])], before[column], err_msg=column)
    assert model.num_timesteps == 120
    buffer = model.replay_buffer  # SB3's attributes of the resumed buffer: every stored step, at the rows SB3 uses
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        buffer.truncate_last_trajectory()
    n = buffer.store.num_transitions
    assert (buffer.pos, buffer.full) == (n % buffer.buffer_size, n >= buffer.buffer_size)
    assert (buffer.ep_length > 0).sum() == n and buffer._current_ep_start[0] == buffer.pos


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:The last trajectory in the replay buffer will be truncated")
def test_sb3s_documented_save_and_load_flows_work_as_written(tmp_path, no_gc):
    """SB3's docs example (save, save_replay_buffer, del model, load, load_replay_buffer) and loading a handle
    into the model that saved it; a buffer still in use keeps the store to itself."""
    env = BitFlippingEnv(n_bits=4, continuous=True, max_steps=5)
    model = _sac(env, tmp_path)
    model.learn(40)
    model.save(tmp_path / "her_sac")
    model.save_replay_buffer(tmp_path / "her_rb")
    model.load_replay_buffer(tmp_path / "her_rb")  # the buffer it replaces is in a cycle of SB3's callbacks
    assert _steps(model.replay_buffer) == 40
    del model
    model = SAC.load(tmp_path / "her_sac", env=env)
    model.load_replay_buffer(tmp_path / "her_rb")
    model.learn(20, reset_num_timesteps=False)
    assert _steps(model.replay_buffer) == 60
    with pytest.raises(StoreLockedError, match=r"close it first \(model.replay_buffer.close\(\)\)"):
        SAC.load(tmp_path / "her_sac", env=env)  # the loaded model's buffer is in use
    model.replay_buffer.close()


@pytest.mark.slow
def test_save_and_load_replay_buffer_into_a_new_model(tmp_path, no_gc):
    """The pickle is a handle; loading it gives the stored episodes, the last one truncated as SB3 does."""
    env = BitFlippingEnv(n_bits=4, continuous=True, max_steps=5)
    model = _sac(env, tmp_path)
    model.learn(63)
    while model.replay_buffer.store.num_transitions == model.num_timesteps:  # until an episode is unfinished
        model.learn(1, reset_num_timesteps=False)
    steps, stored = model.num_timesteps, model.replay_buffer.store.num_transitions
    model.save_replay_buffer(tmp_path / "handle")
    assert os.path.getsize(tmp_path / "handle.pkl") < 64_000
    with open(tmp_path / "handle.pkl", "rb") as f:
        assert b"observations" not in f.read()  # no arrays of transitions in it
    del model
    model = SAC(
        "MultiInputPolicy",
        env,
        learning_starts=0,
        batch_size=16,
        policy_kwargs=tiny(),
        replay_buffer_class=ZarrHerReplayBuffer,
        replay_buffer_kwargs={"path": str(tmp_path / "other")},
    )
    with pytest.warns(UserWarning, match="The last trajectory in the replay buffer will be truncated"):
        model.load_replay_buffer(tmp_path / "handle")
    store = model.replay_buffer.store
    assert store.url.endswith("rb") and store.num_transitions == steps
    last = store.episode(store.end_episode - 1)
    assert last["truncated"][-1] and not last["terminated"][-1] and len(last["action"]) == steps - stored
    model.learn(20)
    assert store.num_transitions > steps


def test_a_full_ring_keeps_at_most_buffer_size_transitions(tmp_path):
    env = BitFlippingEnv(n_bits=4, max_steps=5)
    model = DQN(
        "MultiInputPolicy",
        env,
        buffer_size=48,
        learning_starts=20,
        batch_size=16,
        policy_kwargs=tiny(),
        replay_buffer_class=TeeBuffer,
        replay_buffer_kwargs={"path": str(tmp_path / "rb")},
        seed=4,
    )
    model.learn(150)
    buffer, store, shadow = model.replay_buffer, model.replay_buffer.store, model.replay_buffer.shadow
    assert model._n_updates > 0
    assert (buffer.pos, buffer.full, buffer.size()) == (shadow.pos, shadow.full, shadow.size())
    assert 0 < store.num_transitions <= 48 and store.first_episode > 0
    # every row SB3 can sample is in the store, where SB3 has it (the ring evicted only what SB3 overwrote)
    sampleable = shadow.ep_length > 0
    np.testing.assert_array_equal(buffer.ep_length, shadow.ep_length)
    np.testing.assert_array_equal(buffer._current_ep_start, shadow._current_ep_start)
    for name in ("actions", "rewards", "dones", "timeouts", "ep_start"):
        np.testing.assert_array_equal(getattr(buffer, name)[sampleable], getattr(shadow, name)[sampleable])
    for k in shadow.observations:
        np.testing.assert_array_equal(buffer.next_observations[k][sampleable], shadow.next_observations[k][sampleable])
    batch = buffer.sample(64)
    assert batch.actions.shape == (64, 1) and batch.rewards.shape == (64, 1)
    with EpisodeStore.open(tmp_path / "rb") as reader:  # what is on disk, seen by another handle
        assert reader.num_transitions <= 48


def test_eval_callback_during_learn(tmp_path):
    env = BitFlippingEnv(n_bits=4, continuous=True, max_steps=5)
    callback = EvalCallback(
        Monitor(BitFlippingEnv(n_bits=4, continuous=True, max_steps=5)),
        eval_freq=40,
        n_eval_episodes=2,
        log_path=str(tmp_path),
    )
    model = _sac(env, tmp_path)
    model.learn(80, callback=callback)
    assert callback.evaluations_timesteps == [40, 80]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.replay_buffer.truncate_last_trajectory()
    assert model.replay_buffer.store.num_transitions == 80  # evaluation steps are not stored


def test_image_observations(tmp_path):
    env = BitFlippingEnv(n_bits=4, max_steps=5, image_obs_space=True)
    model = DQN(
        "MultiInputPolicy",
        env,
        buffer_size=200,
        learning_starts=20,
        batch_size=8,
        policy_kwargs={"net_arch": [32], "features_extractor_kwargs": {"cnn_output_dim": 16}},
        replay_buffer_class=TeeBuffer,
        replay_buffer_kwargs={"path": str(tmp_path / "rb")},
        seed=5,
    )
    model.learn(44)
    assert model._n_updates > 0
    batch = model.replay_buffer.sample(8)
    assert batch.observations["observation"].shape == (8, 1, 36, 36)
    assert model.replay_buffer.store.episode(0)["observation"].dtype == np.uint8
    _assert_same_as_shadow(model.replay_buffer)


@pytest.mark.slow
def test_a_seeded_run_is_reproducible(tmp_path):
    """SB3's seed fixes every batch its buffer draws (whatever the wall clock does, e.g. when group commits fall),
    so two runs train the same weights, as with SB3's own buffer."""
    weights = []
    for run in range(2):
        model = DQN(
            "MultiInputPolicy",
            BitFlippingEnv(n_bits=4, max_steps=5),
            buffer_size=1_000,
            learning_starts=30,
            batch_size=32,
            train_freq=1,
            policy_kwargs=tiny(),
            replay_buffer_class=ZarrHerReplayBuffer,
            replay_buffer_kwargs={"path": str(tmp_path / f"rb{run}")},
            seed=6,
        )
        model.learn(120)
        weights.append(th.cat([p.detach().flatten() for p in model.policy.parameters()]))
    assert th.equal(*weights)


def _success_rate(buffer_class, tmp_path) -> float:
    env = BitFlippingEnv(n_bits=5, max_steps=5)
    kwargs = {"n_sampled_goal": 4, "goal_selection_strategy": "future"}
    if buffer_class is ZarrHerReplayBuffer:
        kwargs["path"] = str(tmp_path / "rb")
    model = DQN(
        "MultiInputPolicy",
        env,
        buffer_size=2_000,  # SB3's buffer scans every row per sample: a million would dominate the run
        learning_starts=60,
        batch_size=64,
        policy_kwargs=tiny(),
        replay_buffer_class=buffer_class,
        replay_buffer_kwargs=kwargs,
        learning_rate=1e-3,
        exploration_fraction=0.3,
        target_update_interval=250,
        gamma=0.9,
        train_freq=1,
        seed=0,
    )
    model.learn(800)
    successes: list[bool] = []
    evaluate_policy(
        model,
        Monitor(BitFlippingEnv(n_bits=5, max_steps=5)),
        n_eval_episodes=50,
        callback=lambda local, _: successes.append(local["info"]["is_success"]) if local["done"] else None,
    )
    return float(np.mean(successes))


@pytest.mark.slow
def test_dqn_learns_bit_flipping_as_well_as_with_sb3s_buffer(tmp_path):
    ours, sb3 = _success_rate(ZarrHerReplayBuffer, tmp_path), _success_rate(HerReplayBuffer, tmp_path)
    assert sb3 >= 0.8  # the task is learnt in this budget
    assert ours >= sb3 - 0.2, (ours, sb3)
