"""How a training run measures its policy: the success rate of the deterministic policy over evaluation episodes.

An episode succeeded when its last info says ``is_success``; an env whose infos have no ``is_success`` is judged by
its reward (:data:`SUCCESS_BY_REWARD`), as the sampler's default ``success_fn`` decides.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["SUCCESS_BY_REWARD", "evaluate", "evaluate_with_rule"]


SUCCESS_BY_REWARD = "reward of reaching the goal"
"""The success rule of an env whose infos have no ``is_success`` (the sampler's default ``success_fn`` rule): the
``compute_reward(ag, g, info)`` of the last achieved goal ``ag`` and the desired goal ``g`` is the reward of reaching
the goal, ``compute_reward(ag, ag, info)``."""


def _episode_succeeded(env: Any, obs: dict[str, Any], info: dict[str, Any]) -> tuple[bool, str]:
    """Whether an episode ending with ``obs`` and ``info`` reached its goal, and the rule that said so.

    ``info["is_success"]`` when the env reports it; otherwise the reward of the last achieved goal for the desired
    goal is that of reaching it (:data:`SUCCESS_BY_REWARD`), as the sampler's default ``success_fn`` decides.
    """
    if "is_success" in info:
        return bool(info["is_success"]), "is_success"
    compute_reward = env.unwrapped.compute_reward
    achieved, desired = np.asarray(obs["achieved_goal"]), np.asarray(obs["desired_goal"])
    reward = np.asarray(compute_reward(achieved, desired, info), np.float64)
    reached = np.asarray(compute_reward(achieved, achieved, info), np.float64)
    return bool(np.all(reward >= reached)), SUCCESS_BY_REWARD


def evaluate_with_rule(model: Any, make_env: Callable[[], Any], episodes: int, seed: int) -> tuple[float, str | None]:
    """:func:`evaluate`, and the success rule it used (None when no episode ran)."""
    if episodes == 0:
        return float("nan"), None
    env = make_env()
    successes, rules = [], set()
    try:
        for i in range(episodes):
            obs, info = env.reset(seed=seed + i)
            done = False
            while not done:
                action, _ = model.predict(obs, deterministic=True)
                obs, _, terminated, truncated, info = env.step(action)
                done = terminated or truncated
            success, rule = _episode_succeeded(env, obs, info)
            successes.append(float(success))
            rules.add(rule)
    finally:
        env.close()
    return float(np.mean(successes)), " / ".join(sorted(rules))


def evaluate(model: Any, make_env: Callable[[], Any], episodes: int, seed: int) -> float:
    """Success rate of the deterministic policy over ``episodes`` episodes (NaN when ``episodes`` is 0).

    An episode succeeded when its last info says ``is_success``; an env whose infos have no ``is_success`` is judged
    by its reward instead: the episode succeeded when ``compute_reward`` of the last achieved goal and the desired
    goal is the reward of reaching the goal, ``compute_reward(ag, ag, info)`` (the sampler's default success rule).

    Examples
    --------
    >>> evaluate(model, lambda: gym.make("her_store/PointGoal-v0"), 20, seed=0)  # doctest: +SKIP
    0.95
    """
    return evaluate_with_rule(model, make_env, episodes, seed)[0]
