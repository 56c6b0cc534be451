"""Episodes drawn by their priority (energy-based prioritization): the episode in proportion to a function of its
index column ``priority``, the step uniformly within it.

Zhao & Tresp (2018) draw an episode with probability ``e_i ** (1 / temperature) / sum_j e_j ** (1 / temperature)``,
``e`` its trajectory energy or that energy's rank among the stored episodes. The priorities are committed with the
episodes, so the cumulative weights are computed once per view (per refresh that brings new episodes) and a batch
costs one ``searchsorted`` over them, as a uniform draw's over cumulative lengths.
"""

from __future__ import annotations

import numpy as np

from her_store.sampling.draw import check_nonempty, complete_draw
from her_store.sampling.drawn import Draw
from her_store.sampling.relabel import GoalChoice
from her_store.store.index import IndexView

__all__ = ["EpisodePriorityDraw", "episode_weights"]


def episode_weights(priorities: np.ndarray, lengths: np.ndarray, temperature: float, rank: str | None) -> np.ndarray:
    """Each episode's draw weight, up to a common factor: ``priority ** (1 / temperature)``, or its rank's (``rank``,
    as scipy's ``rankdata`` methods: ``"average"``, ``"min"``, ``"max"``, ``"dense"``, ``"ordinal"``; ranks start at
    1). When every weight is 0 the episodes are weighted by their lengths: transitions are then uniform.

    Examples
    --------
    >>> episode_weights(np.array([0.2, 0.0, 0.2, 0.5]), np.array([5, 5, 5, 5]), 1.0, "dense") * 3
    array([2., 1., 2., 3.])
    >>> episode_weights(np.array([0.2, 0.0, 0.2, 0.5]), np.array([5, 5, 5, 5]), 0.5, None) * 0.25
    array([0.04, 0.  , 0.04, 0.25])
    """
    p = np.asarray(priorities, np.float64)
    if rank is not None:
        p = _ranks(p, rank)
    if not (p > 0).any():
        return np.asarray(lengths, np.float64)
    # in logs, scaled so that the largest weight is 1: a low temperature's powers neither overflow nor all underflow
    with np.errstate(divide="ignore"):
        log_w = np.log(p) / temperature
    return np.exp(log_w - log_w.max())


def _ranks(p: np.ndarray, method: str) -> np.ndarray:
    """Ranks of ``p`` from 1, ties as ``method`` (scipy.stats.rankdata's)."""
    if method == "ordinal":
        out = np.empty(len(p))
        out[np.argsort(p, kind="stable")] = np.arange(1, len(p) + 1)
        return out
    if method == "dense":
        return (np.unique(p, return_inverse=True)[1] + 1).astype(np.float64)
    s = np.sort(p)
    low = np.searchsorted(s, p, "left") + 1.0
    high = np.searchsorted(s, p, "right") * 1.0
    return {"min": low, "max": high}.get(method, (low + high) / 2)


class EpisodePriorityDraw:
    """Samples drawn by episode priority (:func:`episode_weights`), steps uniform within an episode, with goals.

    Parameters
    ----------
    goals : GoalChoice
        Chooses the relabelled samples' goals in the same pass, with the same generator.
    url : str
        The store's URL, for the error of a view with no transition.
    temperature : float
        The weights are ``priority ** (1 / temperature)``: below 1 sharpens, above 1 flattens.
    rank : str, optional
        Weigh ranks of priorities rather than priorities.

    Examples
    --------
    >>> from her_store.sampling.relabel import GoalSelectionStrategy
    >>> view = IndexView(0, 2, np.array([0, 4]), np.array([3, 2]), np.array([3, 5]), 0, np.array([0.0, 1.0]))
    >>> draw = EpisodePriorityDraw(GoalChoice(GoalSelectionStrategy.FUTURE, (3,), np.float32), "runs/fetch", 1.0, None)
    >>> draw(view, np.zeros(4, bool), np.random.default_rng(0)).episode_ids
    array([1, 1, 1, 1])
    """

    def __init__(self, goals: GoalChoice, url: str, temperature: float, rank: str | None) -> None:
        self.goals = goals
        self.url = url
        self.temperature = temperature
        self.rank = rank
        # of the last view drawn from, replaced whole (a prefetch thread may draw too: at worst both compute it)
        self._cdf: tuple[tuple[int, int], np.ndarray] | None = None

    def cumulative(self, view: IndexView) -> np.ndarray:
        """Cumulative weights of ``view``'s episodes (computed once per view: its priorities never change)."""
        key = (view.first, view.end)
        cached = self._cdf
        if cached is not None and cached[0] == key:
            return cached[1]
        cdf = np.cumsum(episode_weights(view.priorities, view.lengths, self.temperature, self.rank))
        self._cdf = (key, cdf)
        return cdf

    def probabilities(self, view: IndexView) -> np.ndarray:
        """Each live episode's probability of being drawn."""
        cdf = self.cumulative(view)
        return np.diff(cdf, prepend=0.0) / cdf[-1]

    def __call__(self, view: IndexView, her: np.ndarray, rng: np.random.Generator) -> Draw:
        """``len(her)`` samples of ``view``, those ``her`` marks relabelled.

        Raises
        ------
        StoreError
            The view has no committed transition.
        """
        check_nonempty(view, self.url)
        cdf = self.cumulative(view)
        # a value in [0, total) falls after the last episode whose cumulative weight is <= it: one of weight > 0
        pos = np.minimum(np.searchsorted(cdf, rng.random(len(her)) * cdf[-1], side="right"), len(cdf) - 1)
        lengths = view.lengths[pos]
        steps = np.minimum((rng.random(len(her)) * lengths).astype(np.int64), lengths - 1)
        return complete_draw(self.goals, view, pos + view.first, steps, her, rng)

    def current(self, view: IndexView) -> IndexView:
        """The view a batch drawn from ``view`` is drawn from: ``view`` itself."""
        return view
