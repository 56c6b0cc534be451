"""Goal-selection strategies for hindsight relabelling: future, final, episode, random, or a user's callable.

Index maths only (vectorised): given sampled transitions ``(episode, t)`` with episode lengths ``L``, choose
the step ``j`` whose next achieved goal becomes the new desired goal. The formulas are SB3's
(stable_baselines3/her/her_replay_buffer.py): future ``j ~ U[t, L-1]``, final ``j = L-1``, episode
``j ~ U[0, L-1]``; the goal is the achieved goal of the next observation at step ``j``, i.e. row
``start + j + 1``. ``random`` (SB2, TorchRL) takes the next achieved goal of a transition drawn uniformly
from the whole store.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Union

import numpy as np

__all__ = ["GoalSelectionStrategy", "GoalContext", "GoalStrategy", "select_goal_steps", "parse_strategy"]


class GoalSelectionStrategy(Enum):
    """The built-in strategies (names as in SB3 and stable-baselines)."""

    FUTURE = "future"
    FINAL = "final"
    EPISODE = "episode"
    RANDOM = "random"


@dataclass(frozen=True)
class GoalContext:
    """What a callable strategy is given for the transitions it relabels.

    Attributes
    ----------
    episode_ids, steps, lengths : numpy.ndarray
        Episode id, step ``t`` and episode length ``L`` of each transition.
    desired_goals : numpy.ndarray
        The transitions' current desired goals, ``(n, *goal shape)``.
    next_achieved_goals : numpy.ndarray
        The achieved goal of each transition's next observation.
    achieved_goals : callable
        ``achieved_goals(episode_ids, steps)`` reads the achieved goal of the next observation at step ``steps``
        of the given episodes (``0 <= steps < L``), vectorised: any strategy over episode steps can be built on it.
    rng : numpy.random.Generator
        The sampler's generator (use it, and a resumed run draws the same goals).

    Examples
    --------
    Relabel with the goal reached two steps later (clipped to the episode):

    >>> def two_ahead(ctx: GoalContext) -> np.ndarray:
    ...     return ctx.achieved_goals(ctx.episode_ids, np.minimum(ctx.steps + 2, ctx.lengths - 1))
    """

    episode_ids: np.ndarray
    steps: np.ndarray
    lengths: np.ndarray
    desired_goals: np.ndarray
    next_achieved_goals: np.ndarray
    achieved_goals: Callable[[np.ndarray, np.ndarray], np.ndarray]
    rng: np.random.Generator


GoalStrategy = Union[str, GoalSelectionStrategy, Callable[[GoalContext], np.ndarray]]


def parse_strategy(strategy: GoalStrategy) -> GoalSelectionStrategy | Callable[[GoalContext], np.ndarray]:
    """A strategy name, enum member or callable, checked.

    Examples
    --------
    >>> parse_strategy("future")
    <GoalSelectionStrategy.FUTURE: 'future'>
    """
    if isinstance(strategy, GoalSelectionStrategy):
        return strategy
    if isinstance(strategy, str):
        try:
            return GoalSelectionStrategy(strategy.lower())
        except ValueError:
            names = [s.value for s in GoalSelectionStrategy]
            raise ValueError(f"goal_selection_strategy {strategy!r} is not one of {names} or a callable") from None
    if callable(strategy):
        return strategy
    raise TypeError(f"goal_selection_strategy must be a name, a GoalSelectionStrategy or a callable, got {strategy!r}")


def select_goal_steps(
    strategy: GoalSelectionStrategy, steps: np.ndarray, lengths: np.ndarray, rng: np.random.Generator
) -> np.ndarray:
    """Step ``j`` (within each episode) whose next achieved goal is the new goal, for future/final/episode.

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> select_goal_steps(GoalSelectionStrategy.FINAL, np.array([0, 3]), np.array([5, 4]), rng)
    array([4, 3])
    """
    if strategy is GoalSelectionStrategy.FUTURE:
        # SB3: np.random.randint(t, L) -> j in [t, L-1], the current step included
        return steps + (rng.random(len(steps)) * (lengths - steps)).astype(np.int64)
    if strategy is GoalSelectionStrategy.FINAL:
        return lengths - 1
    if strategy is GoalSelectionStrategy.EPISODE:
        return (rng.random(len(steps)) * lengths).astype(np.int64)
    raise ValueError(f"{strategy} draws from the whole store, not from the episode")
