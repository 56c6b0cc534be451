"""PointGoal: a tiny goal-conditioned gymnasium env (a point reaching a goal on a plane) for demos and tests.

It has the gymnasium-robotics shape that HER needs: Dict observations with ``observation``, ``achieved_goal``,
``desired_goal`` and a vectorised ``compute_reward(achieved_goal, desired_goal, info)``. Registered as
``her_store/PointGoal-v0`` when her_store is imported.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

__all__ = ["PointGoalEnv", "ENV_ID"]

ENV_ID = "her_store/PointGoal-v0"


class PointGoalEnv(gym.Env):
    """Move a point in [-1, 1]^2 with velocity actions; reward 0 within ``distance_threshold`` of the goal, else -1.

    Parameters
    ----------
    max_episode_steps : int
        Episodes are truncated after this many steps (also set by the registration).
    distance_threshold : float
        Success radius.

    Examples
    --------
    >>> env = PointGoalEnv()
    >>> obs, info = env.reset(seed=0)
    >>> sorted(obs)
    ['achieved_goal', 'desired_goal', 'observation']
    >>> bool(env.compute_reward(obs["achieved_goal"], obs["achieved_goal"], info) == 0.0)  # the goal reached
    True
    """

    metadata = {"render_modes": []}

    def __init__(self, max_episode_steps: int = 50, distance_threshold: float = 0.1) -> None:
        goal = spaces.Box(-1.0, 1.0, (2,), np.float32)
        self.observation_space = spaces.Dict(
            {"observation": spaces.Box(-np.inf, np.inf, (4,), np.float32), "achieved_goal": goal, "desired_goal": goal}
        )
        self.action_space = spaces.Box(-1.0, 1.0, (2,), np.float32)
        self.max_episode_steps = max_episode_steps
        self.distance_threshold = distance_threshold
        self._pos = np.zeros(2, np.float32)
        self._vel = np.zeros(2, np.float32)
        self._goal = np.zeros(2, np.float32)
        self._t = 0

    def compute_reward(self, achieved_goal: Any, desired_goal: Any, info: Any) -> np.ndarray:
        """0 where the goals are within ``distance_threshold``, -1 elsewhere; vectorised over leading axes."""
        d = np.linalg.norm(np.asarray(achieved_goal) - np.asarray(desired_goal), axis=-1)
        return -(d > self.distance_threshold).astype(np.float32)

    def _obs(self) -> dict[str, np.ndarray]:
        return {
            "observation": np.concatenate([self._pos, self._vel]).astype(np.float32),
            "achieved_goal": self._pos.copy(),
            "desired_goal": self._goal.copy(),
        }

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[dict[str, np.ndarray], dict]:
        super().reset(seed=seed)
        self._pos = self.np_random.uniform(-1, 1, 2).astype(np.float32)
        self._vel[:] = 0
        self._goal = self.np_random.uniform(-1, 1, 2).astype(np.float32)
        self._t = 0
        return self._obs(), {"is_success": 0.0}

    def step(self, action: Any) -> tuple[dict[str, np.ndarray], float, bool, bool, dict]:
        a = np.clip(np.asarray(action, np.float32), -1, 1)
        self._vel = (0.5 * self._vel + 0.1 * a).astype(np.float32)
        self._pos = np.clip(self._pos + self._vel, -1, 1).astype(np.float32)
        self._t += 1
        obs = self._obs()
        reward = float(self.compute_reward(obs["achieved_goal"], obs["desired_goal"], None))
        success = reward == 0.0
        return obs, reward, False, self._t >= self.max_episode_steps, {"is_success": float(success)}


def register() -> None:
    if ENV_ID not in gym.registry:
        gym.register(ENV_ID, entry_point="her_store.envs:PointGoalEnv")
