"""What a draw chose for a batch (:class:`Draw`): episodes, steps, rows and the goal rows of relabelled samples.

It is made by :mod:`~her_store.sampling.draw` and read by the goal choice, the gather and the batch assembly. A
sample's key (a batch's ``indices`` under prioritized replay) is ``episode_id << 32 | step``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["Draw", "split_keys", "transition_keys"]


class Draw(NamedTuple):
    """The random part of a batch of ``B`` samples.

    Attributes
    ----------
    episode_ids, steps, rows, lengths : numpy.ndarray
        Each sample's episode, step, row (``start + step``) and episode length, ``(B,)``.
    her : numpy.ndarray
        bool ``(B,)``: the relabelled samples (the first ones).
    goal_rows, goal_ids : numpy.ndarray or None
        One per relabelled sample: the row whose achieved goal is its new goal, and that row's episode (None for a
        callable strategy, which chooses at relabelling).
    given, given_goals : numpy.ndarray or None
        With a random goal source: the relabelled samples whose goal was read from it, and those goals ``(n, *goal
        shape)``, valid where ``given``; their goal rows are the samples' own next rows.
    weights : numpy.ndarray or None
        float ``(B,)``: each sample's importance weight, where the draw is prioritized by TD error.
    """

    episode_ids: np.ndarray
    steps: np.ndarray
    rows: np.ndarray
    lengths: np.ndarray
    her: np.ndarray
    goal_rows: np.ndarray | None
    goal_ids: np.ndarray | None
    given: np.ndarray | None = None
    given_goals: np.ndarray | None = None
    weights: np.ndarray | None = None


STEP_BITS = 32  # a key is episode_id << STEP_BITS | step


def transition_keys(episode_ids: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """The keys of transitions ``(episode_ids, steps)``, int64.

    Examples
    --------
    >>> split_keys(transition_keys(np.array([7]), np.array([3])))
    (array([7]), array([3]))
    """
    return (np.asarray(episode_ids, np.int64) << STEP_BITS) | np.asarray(steps, np.int64)


def split_keys(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(episode_ids, steps)`` of transition keys."""
    keys = np.asarray(keys, np.int64)
    return keys >> STEP_BITS, keys & ((1 << STEP_BITS) - 1)
