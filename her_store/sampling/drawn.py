"""What a draw chose for a batch (:class:`Draw`): episodes, steps, rows and the goal rows of relabelled samples.

It is made by :mod:`~her_store.sampling.draw` and read by the goal choice, the gather and the batch assembly.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["Draw"]


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
