"""How a ZarrHerReplayBuffer relabels: SB3's goal strategies, and its VecEnv's compute_reward as the sampler's reward.

The sampler of a buffer calls the ``compute_reward`` (and, with ``relabel_terminated``, ``compute_terminated``) of
the buffer's env 0 through SB3's ``env_method``, once per batch, with goals in SB3's shapes. A background thread
may prepare batches (``prefetch``) only when the envs step in this process (a DummyVecEnv): a SubprocVecEnv's worker
pipes carry one caller's request at a time.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from her_store.integrations import require
from her_store.sampling.relabel import GoalSelectionStrategy, GoalStrategy, parse_strategy
from her_store.sampling.sampler import HerSampler
from her_store.store.episode_store import EpisodeStore

_her = require("stable_baselines3.her", "sb3")
_vec_env = require("stable_baselines3.common.vec_env", "sb3")

__all__ = ["buffer_sampler", "her_strategy", "sb3_strategy"]


def her_strategy(strategy: Any) -> GoalStrategy:
    """SB3's GoalSelectionStrategy members by name; names, her_store members and callables as the sampler takes.

    Examples
    --------
    >>> her_strategy(_her.GoalSelectionStrategy.FINAL)
    <GoalSelectionStrategy.FINAL: 'final'>
    """
    if isinstance(strategy, _her.GoalSelectionStrategy):
        return GoalSelectionStrategy(strategy.name.lower())
    return parse_strategy(strategy)


def sb3_strategy(strategy: GoalStrategy) -> Any:
    """SB3's GoalSelectionStrategy member of a named strategy SB3 has (future, final, episode); others as they are.

    Examples
    --------
    >>> sb3_strategy(GoalSelectionStrategy.FUTURE), sb3_strategy(GoalSelectionStrategy.RANDOM)
    (<GoalSelectionStrategy.FUTURE: 0>, <GoalSelectionStrategy.RANDOM: 'random'>)
    """
    if isinstance(strategy, GoalSelectionStrategy) and strategy.name in _her.GoalSelectionStrategy.__members__:
        return _her.GoalSelectionStrategy[strategy.name]
    return strategy


def buffer_sampler(
    buffer: Any, store: EpisodeStore, batch_size: int, goal_strategy: GoalStrategy, seed: int
) -> HerSampler:
    """The sampler of ``buffer`` (a ZarrHerReplayBuffer) on its open ``store``, relabelling through ``buffer.env``.

    The env is read when a batch is relabelled (SB3 sets it after loading a handle) through a weak reference, so
    the sampler does not keep the buffer alive. ``buffer.prefetch`` is ignored, with a warning, when the env steps
    its envs in other processes.
    """
    ref = weakref.ref(buffer)
    env = buffer.env
    success_fn = None
    if buffer.relabel_terminated and env is not None and env.has_attr("compute_terminated"):
        success_fn = _terminated_fn(_env_method(ref, "compute_terminated"))
    prefetch = buffer.prefetch
    if prefetch and env is not None and not _in_process(env):
        warnings.warn(
            f"ZarrHerReplayBuffer(prefetch={prefetch}) does not prefetch with {_describe_venv(env)}: "
            "relabelled rewards come from compute_reward through the env's worker pipes, which env.step() of "
            "the training loop uses too, and only one thread may use them at a time; batches are prepared "
            "when sampled (prefetch works with a DummyVecEnv)",
            stacklevel=4,
        )
        prefetch = 0
    return HerSampler(
        store,
        batch_size,
        n_sampled_goal=buffer.n_sampled_goal,
        goal_selection_strategy=goal_strategy,
        reward_fn=_env_method(ref, "compute_reward"),
        seed=seed,
        copy_info_dict=buffer.copy_info_dict,
        prefetch=prefetch,
        relabel_terminated=buffer.relabel_terminated,
        success_fn=success_fn,
        io_threads=buffer.io_threads,
        prioritize=buffer.prioritize,
    )


def _env_method(ref: weakref.ref, method: str) -> Callable[[np.ndarray, np.ndarray, Any], np.ndarray]:
    """``fn(achieved, desired, infos)`` calling ``method`` of the buffer's env 0 as SB3 does (one call per batch,
    goals in SB3's shapes).

    Reads the env at call time (SB3 sets it after loading) through a weak reference, so the sampler holding the
    function does not keep the buffer alive.
    """

    def call(achieved: np.ndarray, desired: np.ndarray, infos: Any) -> np.ndarray:
        buffer = ref()
        env = None if buffer is None else buffer.env
        if env is None:
            raise ValueError(
                f"ZarrHerReplayBuffer needs a VecEnv to call {method}() for relabelled transitions; pass env=... or "
                "call set_env(env) (SB3 does both)"
            )
        shape = buffer.obs_shape["desired_goal"]  # SB3's: (1,) for a Discrete goal, which the store keeps as ()
        achieved, desired = achieved.reshape(len(achieved), *shape), desired.reshape(len(desired), *shape)
        return np.asarray(env.env_method(method, achieved, desired, infos, indices=[0])[0])

    return call


def _terminated_fn(call: Callable[[np.ndarray, np.ndarray, Any], np.ndarray]) -> Callable[..., np.ndarray]:
    """``compute_terminated`` as the sampler's ``success_fn``: one bool per transition (a non-vectorised one that
    answers once for the batch is broadcast)."""

    def success(achieved: np.ndarray, desired: np.ndarray, infos: Any) -> np.ndarray:
        out = np.asarray(call(achieved, desired, infos), bool)
        if out.size == 1:
            return np.broadcast_to(out.reshape(()), (len(achieved),))
        if out.size != len(achieved):
            raise ValueError(
                f"compute_terminated returned {out.size} values (shape {out.shape}) for {len(achieved)} transitions; "
                "expected one per transition (or one for all)"
            )
        return out.reshape(-1)

    return success


def _in_process(env: Any) -> bool:
    """Whether ``env`` (a VecEnv, maybe wrapped) steps its envs in this process (a DummyVecEnv): then a
    background thread may call their ``compute_reward`` while the training loop steps them; worker pipes (a
    SubprocVecEnv) carry one caller's request and reply at a time."""
    while isinstance(env, _vec_env.VecEnvWrapper):
        env = env.venv
    return isinstance(env, _vec_env.DummyVecEnv)


def _describe_venv(env: Any) -> str:
    """``VecNormalize(SubprocVecEnv)``: the VecEnv and the ones it wraps."""
    names = [type(env).__name__]
    while isinstance(env, _vec_env.VecEnvWrapper):
        env = env.venv
        names.append(type(env).__name__)
    return "(".join(names) + ")" * (len(names) - 1)
