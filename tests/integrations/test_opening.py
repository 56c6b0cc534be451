"""One road to the store for every integration: a path given to a buffer, a storage, the simple API or a recorder
builds one backend for its place, and the store is opened or created once on it, for a new store and a resumed one
alike (whether a store is there is asked of that backend, never of a second opening)."""

from __future__ import annotations

import contextlib
import gc
import importlib
import pickle
import sys
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

from her_store import storage
from her_store.envs import PointGoalEnv
from her_store.integrations.recorders import RecordEpisodes, RecordVectorEpisodes
from her_store.integrations.rllte import HerReplayStorage
from her_store.integrations.simple import HindsightExperienceReplay
from her_store.storage import Backend
from her_store.store.episode_store import EpisodeStore

NEW, RESUMED = {"backends": 1, "create": 1}, {"backends": 1, "open": 1}


@pytest.fixture
def openings(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Counts, from here on, of backends built by ``open_backend`` from a path or URL (a backend handed to it is
    returned as it is) and of calls of ``EpisodeStore.open`` and ``EpisodeStore.create``."""
    with contextlib.suppress(ImportError):  # loaded first, so that it reaches open_backend through the counter
        importlib.import_module("her_store.integrations.sb3")
    counts: Counter = Counter()
    built = storage.open_backend

    def open_backend(path_or_url, storage_options=None):
        if not isinstance(path_or_url, Backend):
            counts["backends"] += 1
        return built(path_or_url, storage_options)

    for name, module in list(sys.modules.items()):
        if name.startswith("her_store") and getattr(module, "open_backend", None) is built:
            monkeypatch.setattr(module, "open_backend", open_backend)
    for method in ("open", "create"):
        unbound = getattr(EpisodeStore, method).__func__

        def counted(cls, *args, _unbound=unbound, _method=method, **kwargs):
            counts[_method] += 1
            return _unbound(cls, *args, **kwargs)

        monkeypatch.setattr(EpisodeStore, method, classmethod(counted))
    return counts


def _counted(openings: Counter, write: Callable[[], None]) -> dict[str, int]:
    openings.clear()
    write()
    return dict(openings)


def _episode(env: gym.Env) -> Iterator[tuple]:
    """A whole episode of ``env`` (5 steps), as (obs, action, reward, next_obs, terminated, truncated, info)."""
    obs, _ = env.reset(seed=0)
    while True:
        action = np.full(env.action_space.shape, 0.1, np.float32)
        nxt, reward, terminated, truncated, info = env.step(action)
        yield obs, action, reward, nxt, terminated, truncated, info
        if terminated or truncated:
            return
        obs = nxt


# -- rllte, the simple API, the recorders --------------------------------------------------------------------------
def _rllte(path: Path) -> None:
    env = PointGoalEnv(max_episode_steps=5)
    rb = HerReplayStorage(env.observation_space, env.action_space, reward_fn=env.compute_reward, path=path)
    for obs, action, reward, nxt, terminated, truncated, info in _episode(env):
        batch = {k: v[None] for k, v in obs.items()}
        rb.add(batch, action[None], np.array([reward]), np.array([terminated]), np.array([truncated]), [info],
               {k: v[None] for k, v in nxt.items()})
    assert len(rb.writer.episode_ids) == 1  # the episode was appended
    rb.close()


def _simple(goal_dim: int | None) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        her = HindsightExperienceReplay(4, 2, 100, 8, path=path, goal_dim=goal_dim)
        for t in range(5):
            her.store_transition(np.full(4, t), np.zeros(2), 0.0, np.full(4, t + 1), t == 4, np.zeros(2))
        assert len(her.storage.writer.episode_ids) == 1
        her.close()

    return write


def _recorder(path: Path) -> None:
    env = RecordEpisodes(gym.make("her_store/PointGoal-v0", max_episode_steps=5), path)
    env.reset(seed=0)
    while not any(env.step(env.action_space.sample())[2:4]):
        pass
    assert len(env.episode_ids) == 1
    env.close()


def _vector_recorder(path: Path) -> None:
    envs = gym.make_vec("her_store/PointGoal-v0", num_envs=2, vectorization_mode="sync", max_episode_steps=5)
    envs = RecordVectorEpisodes(envs, path)
    envs.reset(seed=0)
    while not envs.episode_ids:
        envs.step(envs.action_space.sample())
    envs.close()


@pytest.mark.parametrize(
    "write",
    [_rllte, _simple(2), _simple(None), _recorder, _vector_recorder],
    ids=["rllte", "simple", "simple-goal-dim-at-first-transition", "RecordEpisodes", "RecordVectorEpisodes"],
)
def test_a_path_builds_one_backend_and_opens_the_store_once(tmp_path, openings, write):
    path = tmp_path / "store"
    assert _counted(openings, lambda: write(path)) == NEW
    assert _counted(openings, lambda: write(path)) == RESUMED
    assert _counted(openings, lambda: write(str(path))) == RESUMED


# -- SB3 -------------------------------------------------------------------------------------------------------
def _sb3_buffer(path: Path | None, **kwargs):
    from stable_baselines3.common.vec_env import DummyVecEnv

    from her_store.integrations.sb3 import ZarrHerReplayBuffer

    venv = DummyVecEnv([lambda: PointGoalEnv(max_episode_steps=5)])
    return ZarrHerReplayBuffer(1000, venv.observation_space, venv.action_space, env=venv, path=path, **kwargs), venv


def _sb3_steps(rb, venv, steps: int) -> None:
    obs = venv.reset()
    for _ in range(steps):
        action = np.full((1, 2), 0.1, np.float32)
        nxt, reward, done, infos = venv.step(action)
        rb.add(obs, nxt, action, reward, done, infos)
        obs = nxt


def _sb3(**kwargs) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        rb, venv = _sb3_buffer(path, **kwargs)
        _sb3_steps(rb, venv, 5)
        assert rb.store is not None and rb.sample(4).rewards.shape == (4, 1)  # the episode was committed
        rb.close()

    return write


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"copy_info_dict": True}, {"copy_info_dict": True, "info_keys": ["is_success"]}],
    ids=["plain", "info-keys-inferred", "info-keys-given"],
)
def test_a_zarr_her_replay_buffer_builds_one_backend_and_opens_its_store_once(tmp_path, openings, kwargs):
    pytest.importorskip("stable_baselines3")
    path = tmp_path / "rb"
    assert _counted(openings, lambda: _sb3(**kwargs)(path)) == NEW
    assert _counted(openings, lambda: _sb3(**kwargs)(path)) == RESUMED


def test_a_loaded_handle_builds_one_backend_and_opens_its_store_once(tmp_path, openings):
    """The handle names a store that existed: whether it is still there is asked of the backend then opened."""
    pytest.importorskip("stable_baselines3")
    rb, venv = _sb3_buffer(tmp_path / "rb")
    _sb3_steps(rb, venv, 7)  # one episode and two steps of the next
    handle = pickle.dumps(rb)
    rb.close()

    def load() -> None:
        loaded = pickle.loads(handle)
        loaded.set_env(venv)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # SB3's warning that the unfinished episode is truncated
            loaded.truncate_last_trajectory()
        assert loaded.store.num_episodes == 2
        loaded.close()

    assert _counted(openings, load) == RESUMED


@pytest.mark.filterwarnings("ignore:The last trajectory in the replay buffer will be truncated")
def test_sb3s_load_flow_opens_the_store_once_per_buffer(tmp_path, openings):
    """``del model``, ``SAC.load`` (a buffer from the saved kwargs resumes the store while the dropped model's buffer,
    in a reference cycle, still holds its lock) and ``load_replay_buffer``: each buffer opens the store once."""
    pytest.importorskip("stable_baselines3")
    from stable_baselines3 import SAC
    from stable_baselines3.common.envs import BitFlippingEnv

    from her_store.integrations.sb3 import ZarrHerReplayBuffer

    env = BitFlippingEnv(n_bits=4, continuous=True, max_steps=5)
    model = SAC("MultiInputPolicy", env, learning_starts=10, batch_size=8, policy_kwargs={"net_arch": [8]},
                replay_buffer_class=ZarrHerReplayBuffer, replay_buffer_kwargs={"path": str(tmp_path / "rb")})
    model.learn(12)
    model.save(tmp_path / "model")
    model.save_replay_buffer(tmp_path / "handle")
    gc.disable()  # the dropped model stays in memory, as between two runs of the cycle collector
    try:
        del model
        openings.clear()
        model = SAC.load(tmp_path / "model", env=env)
        assert dict(openings) == RESUMED
        openings.clear()
        model.load_replay_buffer(tmp_path / "handle")
        model.learn(3, reset_num_timesteps=False)
        assert dict(openings) == RESUMED
    finally:
        gc.enable()
    model.replay_buffer.close()
