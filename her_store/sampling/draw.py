"""Which transitions a batch takes: ``(episode, step)`` drawn uniformly over a view's transitions.

The relabelled ones are marked, with the rows (or goals) their new goals come from.

All of a batch's randomness is drawn here, in batch order, with the generator it is given: a sampler resumed from
its generator's state draws the same batches.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from her_store.errors import StoreError
from her_store.sampling.drawn import Draw
from her_store.sampling.relabel import GoalChoice
from her_store.store.index import IndexView

__all__ = ["UniformDraw", "check_nonempty", "complete_draw", "replace_samples"]


class UniformDraw:
    """Samples drawn uniformly over a view's transitions (one searchsorted over cumulative lengths), with goals.

    Parameters
    ----------
    goals : GoalChoice
        Chooses the relabelled samples' goal rows (or goals) in the same pass, with the same generator.
    url : str
        The store's URL, for the error of a view with no transition.

    Examples
    --------
    >>> from her_store.sampling.relabel import GoalSelectionStrategy
    >>> view = IndexView(0, 2, np.array([0, 4]), np.array([3, 2]), np.array([3, 5]), 0)
    >>> draw = UniformDraw(GoalChoice(GoalSelectionStrategy.FUTURE, (3,), np.float32), "runs/fetch")
    >>> d = draw(view, np.array([True, True, False]), np.random.default_rng(0))
    >>> len(d.rows), len(d.goal_rows)
    (3, 2)
    """

    def __init__(self, goals: GoalChoice, url: str) -> None:
        self.goals = goals
        self.url = url

    def __call__(self, view: IndexView, her: np.ndarray, rng: np.random.Generator) -> Draw:
        """``len(her)`` samples of ``view``, those ``her`` marks relabelled.

        Raises
        ------
        StoreError
            The view has no committed transition.
        """
        check_nonempty(view, self.url)
        ids, steps = view.locate(rng.integers(0, view.num_transitions, len(her)))
        return complete_draw(self.goals, view, ids, steps, her, rng)

    def current(self, view: IndexView) -> IndexView:
        """The view a batch drawn from ``view`` is drawn from: ``view`` itself."""
        return view


def check_nonempty(view: IndexView, url: str) -> None:
    """Raise StoreError when ``view`` (of the store at ``url``) has no committed transition to draw."""
    if view.num_transitions == 0:
        raise StoreError(
            f"{url} has no committed episode to sample from yet; add at least one whole episode "
            "(and let it commit) before sampling"
        )


def complete_draw(
    goals: GoalChoice,
    view: IndexView,
    ids: np.ndarray,
    steps: np.ndarray,
    her: np.ndarray,
    rng: np.random.Generator,
    weights: np.ndarray | None = None,
) -> Draw:
    """The draw of samples at ``(ids, steps)`` of ``view``, the goals of those ``her`` marks chosen by ``goals``."""
    pos = ids - view.first
    starts, lengths = view.start_rows[pos], view.lengths[pos]
    goal_ids, goal_rows, given, given_goals = goals.choose(view, ids, starts, steps, lengths, her, rng)
    return Draw(ids, steps, starts + steps, lengths, her, goal_rows, goal_ids, given, given_goals, weights)


def replace_samples(d: Draw, sub: np.ndarray, d2: Draw) -> tuple[Draw, np.ndarray]:
    """``d`` with the samples at positions ``sub`` taken from ``d2`` (drawn for exactly those positions), and where
    those samples' goals sit among the relabelled ones."""
    fields: dict[str, Any] = {}
    for name in ("episode_ids", "steps", "rows", "lengths", "weights"):
        if getattr(d, name) is None or getattr(d2, name) is None:
            continue
        a = getattr(d, name).copy()
        a[sub] = getattr(d2, name)
        fields[name] = a
    at = (np.cumsum(d.her) - 1)[sub[d.her[sub]]]
    if d.goal_rows is not None and d.goal_ids is not None and d2.goal_rows is not None and d2.goal_ids is not None:
        fields["goal_rows"], fields["goal_ids"] = d.goal_rows.copy(), d.goal_ids.copy()
        fields["goal_rows"][at], fields["goal_ids"][at] = d2.goal_rows, d2.goal_ids
    if d.given is not None and d.given_goals is not None and d2.given is not None and d2.given_goals is not None:
        fields["given"], fields["given_goals"] = d.given.copy(), d.given_goals.copy()
        fields["given"][at], fields["given_goals"][at] = d2.given, d2.given_goals
    return d._replace(**fields), at
