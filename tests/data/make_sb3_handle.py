"""Makes tests/data/sb3_handle_v1.pkl: a ZarrHerReplayBuffer handle (handle version 1) as SB3's save_replay_buffer
pickles it, the class named ``her_store.integrations.sb3.ZarrHerReplayBuffer``. It was made once by the code of git
commit e968064 and committed; tests/integrations/test_sb3.py checks that today's code loads it.

The handle names its store by the relative path ``store`` and holds the unfinished episodes of two envs (steps of
:func:`steps`, added by :func:`fill`), the counters and the sampler's generator after one batch. The store itself is
not kept: a test makes it again with :func:`fill` (the ended episodes are the same) in its working directory.

    cd <an empty directory> && PYTHONPATH=<a checkout of that commit> python <repo>/tests/data/make_sb3_handle.py \\
        <repo>/tests/data/sb3_handle_v1.pkl
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import numpy as np

N_ENVS = 2
BUFFER_SIZE = 100
# steps of each env's episodes: (length, ended); the last of each is unfinished when the handle is saved
EPISODES = {0: [(3, True), (4, True), (2, False)], 1: [(5, True), (4, False)]}
CALLS = 9  # add() calls: every env's steps
CONFIG: dict[str, Any] = {
    "n_sampled_goal": 2,
    "goal_selection_strategy": "future",
    "copy_info_dict": True,
    "info_keys": ["is_success"],
}


def state(env: int, episode: int, k: int) -> dict[str, np.ndarray]:
    """The observation of ``env`` at step ``k`` of its episode ``episode``: PointGoal's spaces, values a formula."""
    return {
        "observation": np.array([env, episode, k, 0.5], np.float32),
        "achieved_goal": np.array([k / 10, env / 10], np.float32),
        "desired_goal": np.array([episode / 10, 0.5], np.float32),
    }


def schedule(env: int) -> list[tuple[int, int, int, bool]]:
    """(episode, step, length, ended) of each add() call for ``env``."""
    return [(i, k, length, ended) for i, (length, ended) in enumerate(EPISODES[env]) for k in range(length)]


def steps() -> Iterator[tuple[Any, ...]]:
    """The arguments of each add() call: obs, next_obs, action, reward, done, infos (SB3's, for ``N_ENVS`` envs)."""
    plans = [schedule(e) for e in range(N_ENVS)]
    for call in range(CALLS):
        rows = [plans[e][call] for e in range(N_ENVS)]
        obs = [state(e, i, k) for e, (i, k, _, _) in enumerate(rows)]
        nxt = [state(e, i, k + 1) for e, (i, k, _, _) in enumerate(rows)]
        done = np.array([ended and k + 1 == length for i, k, length, ended in rows])
        infos = [
            {"is_success": float(d and e == 0), **({"TimeLimit.truncated": True} if d and e == 1 else {})}
            for e, d in enumerate(done)
        ]
        yield (
            {key: np.stack([o[key] for o in obs]) for key in obs[0]},
            {key: np.stack([o[key] for o in nxt]) for key in nxt[0]},
            np.array([[call / 10, -e / 10] for e in range(N_ENVS)], np.float32),
            np.array([-1.0, -1.0], np.float32),
            done,
            infos,
        )


def fill(buffer: Any) -> None:
    """Add every step of :func:`steps` to ``buffer``."""
    for args in steps():
        buffer.add(*args)


def venv() -> Any:
    """The VecEnv whose compute_reward relabels (PointGoal: the spaces of :func:`state`)."""
    from stable_baselines3.common.vec_env import DummyVecEnv

    from her_store.envs import PointGoalEnv

    return DummyVecEnv([lambda: PointGoalEnv(max_episode_steps=5) for _ in range(N_ENVS)])


def buffer(env: Any) -> Any:
    """A buffer on the store at the relative path ``store``, configured as the saved one."""
    from her_store.integrations.sb3 import ZarrHerReplayBuffer

    return ZarrHerReplayBuffer(
        BUFFER_SIZE, env.observation_space, env.action_space, env=env, n_envs=N_ENVS, path="store", **CONFIG
    )


if __name__ == "__main__":
    import pickle
    import shutil

    np.random.seed(0)  # the sampler's seed is drawn from numpy's global generator, as SB3 seeds it
    env = venv()
    rb = buffer(env)
    fill(rb)
    rb.sample(4)
    with open(sys.argv[1], "wb") as f:
        pickle.dump(rb, f, pickle.HIGHEST_PROTOCOL)
    rb.close()
    shutil.rmtree("store")
