"""Reward recomputation of relabelled rows: the reward function, rewards for the new goals, the terminated flag.

The reward function is the one given, or the env's that the store names; a reached goal sets the terminated flag.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from her_store.errors import StoreError

if TYPE_CHECKING:
    from her_store.store.episode_store import EpisodeStore

__all__ = ["RewardFn", "RewardRecompute", "env_reward_fn"]

RewardFn = Callable[[np.ndarray, np.ndarray, Any], Any]


def env_reward_fn(store: EpisodeStore) -> RewardFn:
    """``compute_reward`` of the env named by the store's ``env_id`` metadata, if this process registered that id.

    Raises
    ------
    StoreError
        The metadata names no env, or an id that is not registered in this process's gymnasium registry (an id
        naming a module to import is never resolved: a store never makes this process run code), or the env
        cannot be made or has no ``compute_reward``; each message says to pass ``reward_fn``.
    """
    env_id = store.metadata.get("env_id")
    if not env_id:
        raise StoreError(
            f"{store.url}: HerSampler needs reward_fn(achieved_goal, desired_goal, infos) to recompute rewards of "
            "relabelled transitions, and the store's metadata names no env_id to take compute_reward from; pass "
            "reward_fn=env.unwrapped.compute_reward (or store.update_metadata(env_id=...))"
        )
    import gymnasium as gym

    # "module:Env" makes gymnasium import module, and an unregistered id may name a package to import: a store
    # (perhaps downloaded) must never make this process run code, so only envs this process registered are made
    if not isinstance(env_id, str) or ":" in env_id or env_id not in gym.registry:
        raise StoreError(
            f"{store.url}: the store's metadata names env_id {env_id!r}, which is not an id registered in this "
            "process's gymnasium registry (an id naming a module to import is never resolved); pass "
            "reward_fn=env.unwrapped.compute_reward to HerSampler, or register the env first (import its package)"
        )
    try:
        env = gym.make(env_id)
    except Exception as e:  # a registered env that fails to build: say how to get past it
        raise StoreError(
            f"{store.url}: cannot make env {env_id!r} from the store's metadata to get compute_reward ({e}); "
            "pass reward_fn=... to HerSampler"
        ) from e
    fn = getattr(env.unwrapped, "compute_reward", None)
    if fn is None:
        raise StoreError(f"env {env_id!r} has no compute_reward; pass reward_fn=... to HerSampler")
    return fn


class RewardRecompute:
    """The rewards and terminated flags of a batch, the first ``n`` rows' recomputed for their new goals.

    Parameters
    ----------
    reward_fn : callable, optional
        ``reward_fn(achieved_goal, desired_goal, infos)`` -> ``(n,)`` or ``(n, 1)``; needed whenever a row is
        relabelled.
    relabel_terminated : bool
        A relabelled row whose next achieved goal reaches its new goal is terminated as well (its stored flag kept:
        OR).
    success_fn : callable, optional
        ``success_fn(achieved_goal, desired_goal, infos)`` -> bool ``(n,)`` for ``relabel_terminated``; default:
        the recomputed reward equals the reward of reaching the goal, ``reward_fn(ag, ag, infos)``.
    info_keys : tuple of str
        Info fields handed to ``reward_fn`` (one dict per row, as SB3) and returned; empty: empty dicts.

    Examples
    --------
    >>> recompute = RewardRecompute(lambda ag, g, info: (ag == g).all(axis=-1) - 1.0, relabel_terminated=True)
    >>> now = {"reward": np.array([-1.0, -1.0]), "terminated": np.array([False, False])}
    >>> nxt = {"achieved_goal": np.array([[1.0], [2.0]])}
    >>> rewards, terminated, _ = recompute(1, now, nxt, np.array([[1.0]]))
    >>> rewards.tolist(), terminated.tolist()
    ([0.0, -1.0], [1.0, 0.0])
    """

    def __init__(
        self,
        reward_fn: RewardFn | None,
        *,
        relabel_terminated: bool = False,
        success_fn: RewardFn | None = None,
        info_keys: tuple[str, ...] = (),
    ) -> None:
        self.reward_fn = reward_fn
        self.relabel_terminated = relabel_terminated
        self.success_fn = success_fn
        self.info_keys = info_keys

    def rewards(self, achieved: np.ndarray, desired: np.ndarray, infos: Any) -> np.ndarray:
        """``reward_fn`` of ``n`` rows as float32 ``(n,)``; ValueError when it returns another number of values."""
        assert self.reward_fn is not None  # a sampler that relabels has one
        r = np.asarray(self.reward_fn(achieved, desired, infos), dtype=np.float32)
        if r.size != len(achieved):
            raise ValueError(
                f"reward_fn returned {r.size} values (shape {r.shape}) for {len(achieved)} transitions; expected "
                "shape (n,) or (n, 1)"
            )
        return r.reshape(-1)

    def __call__(
        self, n: int, now: dict[str, Any], nxt: dict[str, Any], goals: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
        """Rewards and terminated flags (float32 ``(B,)``) of a batch whose first ``n`` rows take ``goals``, and its
        info fields."""
        rewards = now["reward"].astype(np.float32, copy=True)
        terminated = now["terminated"].astype(np.float32)
        infos = {k: now[k] for k in self.info_keys}
        if n:
            assert goals is not None
            info_arg = [{k: v[i] for k, v in infos.items()} for i in range(n)] if self.info_keys else [{}] * n
            achieved = nxt["achieved_goal"][:n]
            rewards[:n] = self.rewards(achieved, goals, info_arg)
            if self.relabel_terminated:
                if self.success_fn is not None:
                    success = np.asarray(self.success_fn(achieved, goals, info_arg), bool).reshape(-1)
                else:
                    success = rewards[:n] >= self.rewards(achieved, achieved, info_arg)
                terminated[:n] = np.maximum(terminated[:n], success)
        return rewards, terminated, infos
