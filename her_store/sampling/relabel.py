"""Where goals are chosen: the goal-selection strategies and the goal choice every sampler uses.

The strategies are future, final, episode, random, a GoalMixture or a user's callable; the goal choice turns a
batch's sampled transitions into the rows, or the goals, its relabelled samples take.

Index maths only (vectorised): given sampled transitions ``(episode, t)`` with episode lengths ``L``, choose
the step ``j`` whose next achieved goal becomes the new desired goal. The formulas are SB3's
(stable_baselines3/her/her_replay_buffer.py): future ``j ~ U[t, L-1]``, final ``j = L-1``, episode
``j ~ U[0, L-1]``; the goal is the achieved goal of the next observation at step ``j``, i.e. row
``start + j + 1``. ``random`` (SB2, TorchRL) takes the next achieved goal of a transition drawn uniformly
from the whole store, or from a :class:`RandomGoalSource` given to the goal choice (a sharded dataset's sampler
draws over every shard; see :class:`~her_store.sampling.mixture.MixtureSampler`). :class:`GoalMixture` is offline
goal-conditioned RL's mixture (OGBench's GCDataset): the current step, a future step (uniform or geometric) or a
random transition of the store.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from her_store.checks import check_bounds, check_number

if TYPE_CHECKING:
    from her_store.sampling.drawn import Draw
    from her_store.store.index import IndexView

__all__ = [
    "GoalChoice",
    "GoalContext",
    "GoalMixture",
    "GoalSelectionStrategy",
    "GoalStrategy",
    "RandomGoalSource",
    "her_ratio",
    "parse_strategy",
    "random_transition_rows",
    "select_goal_steps",
]


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


@dataclass(frozen=True)
class GoalMixture:
    """Offline goal-conditioned RL's goal distribution: the current state, a future one, or any in the store.

    Each relabelled transition ``(episode, t)`` of an episode of length ``L`` gets, independently: with
    probability ``p_current`` step ``j = t``; with ``p_future`` a later step, ``j ~ U[t+1, L-1]`` when
    ``discount`` is None, else ``j = min(t + k, L-1)`` with ``k ~ Geometric(1 - discount)`` on ``{1, 2, ...}``
    (truncated at the episode's end, as OGBench does, so the final step takes the rest of the mass); at the last
    step, where no later one exists, ``j = t``; with ``p_random`` the step of a transition drawn uniformly from
    the committed transitions of the live episodes (the ``random`` strategy's draw: of every shard, for a sharded
    dataset's sampler). The new goal is the achieved goal of the next observation at step ``j`` (row
    ``start + j + 1``), as for every strategy here.

    This is OGBench's ``GCDataset.sample_goals`` (``value_p_curgoal``, ``value_p_trajgoal``,
    ``value_p_randomgoal``, ``value_geom_sample``, ``discount``) with OGBench's state index read as the step
    ``j``: OGBench rewards a transition when its goal index equals its own index, and HER's reward
    ``reward_fn(next achieved goal, goal)`` is, likewise, that of success exactly when ``j = t`` (a current goal
    is the transition's own next achieved goal), and a future goal lies ``j - t`` steps past the state the reward
    is computed on. Two differences: OGBench's uniform future index is ``round`` of a continuous draw, which
    gives its two end points half weight (here each step of ``[t+1, L-1]`` is equally likely), and the three
    shares are drawn exactly in proportion to the probabilities.

    The mixture is the whole goal distribution: :class:`~her_store.sampling.sampler.HerSampler` relabels every sampled
    transition with it (``her_ratio = 1``, every row of a batch ``is_relabeled``) unless ``n_sampled_goal=0``,
    which turns relabelling off; other values of ``n_sampled_goal`` do not matter.

    Parameters
    ----------
    p_current, p_future, p_random : float
        Probabilities of the three sources, each >= 0, summing to 1 (within 1e-6).
    discount : float, optional
        ``None``: future steps are uniform; in ``[0, 1)``: geometric with success probability ``1 - discount``
        (mean offset ``1 / (1 - discount)`` before truncation).

    Examples
    --------
    OGBench agents' default value goals (0.2 current, 0.5 future, geometric with discount 0.99, 0.3 random),
    and their actor goals (GCBC's: uniform future):

    >>> value_goals = GoalMixture(0.2, 0.5, 0.3, discount=0.99)
    >>> actor_goals = GoalMixture(0.0, 1.0, 0.0)
    >>> sampler = HerSampler(store, 256, goal_selection_strategy=value_goals)  # doctest: +SKIP
    """

    p_current: float
    p_future: float
    p_random: float
    discount: float | None = None

    def __post_init__(self) -> None:
        for name in ("p_current", "p_future", "p_random"):
            p = check_number(getattr(self, name), f"GoalMixture {name}", finite=True)
            object.__setattr__(self, name, check_bounds(p, f"GoalMixture {name}", low=0))
        total = self.p_current + self.p_future + self.p_random
        if abs(total - 1.0) > 1e-6:
            raise ValueError(
                f"GoalMixture probabilities must sum to 1, got p_current={self.p_current} + p_future={self.p_future}"
                f" + p_random={self.p_random} = {total}"
            )
        if self.discount is not None:
            d = check_number(self.discount, "GoalMixture discount", finite=True, or_none=True)
            d = check_bounds(d, "GoalMixture discount", low=0, high=1, high_open=True, or_none=True)
            object.__setattr__(self, "discount", d)

    def select(self, steps: np.ndarray, lengths: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """Step ``j`` within each transition's episode (current or future), and which transitions take a random
        transition's goal instead (their ``j`` is meaningless).

        Examples
        --------
        >>> rng = np.random.default_rng(0)
        >>> j, anywhere = GoalMixture(0.0, 1.0, 0.0).select(np.array([0, 4]), np.array([2, 5]), rng)
        >>> j, anywhere
        (array([1, 4]), array([False, False]))
        """
        steps, lengths = np.asarray(steps, np.int64), np.asarray(lengths, np.int64)
        # thresholds on one uniform draw; dividing by the exact sum keeps a zero probability's share empty
        total = self.p_current + self.p_future + self.p_random
        u = rng.random(len(steps))
        anywhere = u >= (self.p_current + self.p_future) / total
        future = (u >= self.p_current / total) & ~anywhere
        j = steps.copy()
        t, last = steps[future], lengths[future] - 1
        if self.discount is None:
            later = t + 1 + (rng.random(len(t)) * (last - t)).astype(np.int64)
        else:
            later = t + rng.geometric(1.0 - self.discount, len(t))
        j[future] = np.minimum(later, last)
        return j, anywhere


GoalStrategy = str | GoalSelectionStrategy | GoalMixture | Callable[[GoalContext], np.ndarray]


def her_ratio(strategy: GoalStrategy, n_sampled_goal: int) -> float:
    """The share of a batch's transitions that are relabelled: ``1 - 1 / (n_sampled_goal + 1)`` as SB3, 1 for a
    :class:`GoalMixture` (offline GCRL's whole goal distribution), 0 when ``n_sampled_goal`` is 0.

    Examples
    --------
    >>> her_ratio("future", 4), her_ratio(GoalMixture(0.0, 1.0, 0.0), 4), her_ratio(GoalMixture(0.0, 1.0, 0.0), 0)
    (0.8, 1.0, 0.0)
    """
    if isinstance(strategy, GoalMixture) and n_sampled_goal > 0:
        return 1.0
    return 1.0 - 1.0 / (int(n_sampled_goal) + 1)


def parse_strategy(
    strategy: GoalStrategy,
) -> GoalSelectionStrategy | GoalMixture | Callable[[GoalContext], np.ndarray]:
    """A strategy name, enum member, :class:`GoalMixture` or callable, checked.

    Examples
    --------
    >>> parse_strategy("future")
    <GoalSelectionStrategy.FUTURE: 'future'>
    """
    if isinstance(strategy, (GoalSelectionStrategy, GoalMixture)):
        return strategy
    if isinstance(strategy, str):
        try:
            return GoalSelectionStrategy(strategy.lower())
        except ValueError:
            names = [s.value for s in GoalSelectionStrategy]
            raise ValueError(
                f"goal_selection_strategy {strategy!r} is not one of {names}, a GoalMixture or a callable"
            ) from None
    if callable(strategy):
        return strategy
    raise TypeError(
        "goal_selection_strategy must be a name, a GoalSelectionStrategy, a GoalMixture or a callable, "
        f"got {strategy!r}"
    )


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


def random_transition_rows(view: IndexView, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Episodes and next-observation rows of ``n`` transitions drawn uniformly from ``view``: random goals' rows.

    Examples
    --------
    >>> from her_store.store.index import IndexView
    >>> view = IndexView(0, 2, np.array([0, 4]), np.array([3, 2]), np.array([3, 5]), 0)  # two episodes, 5 steps
    >>> ids, rows = random_transition_rows(view, np.random.default_rng(0), 4)
    >>> bool(((rows > np.array([0, 4])[ids]) & (rows <= np.array([3, 6])[ids])).all())
    True
    """
    ids, steps = view.locate(rng.integers(0, view.num_transitions, n))
    return ids, view.start_rows[ids - view.first] + steps + 1


class RandomGoalSource(Protocol):
    """Where the random goals of relabelled samples come from when not from the view sampled: ``source(rng, n)``
    returns ``n`` goals ``(n, *goal shape)``, drawn with ``rng`` (the relabelling sampler's generator, so a resumed
    run draws the same). A :class:`~her_store.sampling.mixture.MixtureSampler` over a sharded dataset gives one
    drawing from every shard to each shard's sampler."""

    def __call__(self, rng: np.random.Generator, n: int) -> np.ndarray: ...


class GoalChoice:
    """Which goal each relabelled sample of a batch takes, by the strategy.

    At the draw (:meth:`choose`), the built-in strategies and a :class:`GoalMixture` name a row whose achieved goal
    is the new goal: a step of the sample's own episode, or the next row of a transition drawn uniformly from the
    view sampled (``random``, a mixture's random share) or, given a ``random_goals`` source, a goal read from it.
    At relabelling (:meth:`relabel`), a callable strategy computes the goals from a :class:`GoalContext`, and the
    goals are written into the batch's desired goals.

    Parameters
    ----------
    strategy : GoalSelectionStrategy, GoalMixture or callable
        Parsed (:func:`parse_strategy`).
    goal_shape : tuple of int
        Shape of one goal (the store's ``achieved_goal``).
    goal_dtype : numpy.dtype
        Its dtype.
    random_goals : RandomGoalSource, optional
        Where random goals come from; default: the view sampled.

    Examples
    --------
    >>> from her_store.store.index import IndexView
    >>> view = IndexView(0, 1, np.array([0]), np.array([5]), np.array([5]), 0)  # one episode of 5 steps, rows 0..5
    >>> choice = GoalChoice(GoalSelectionStrategy.FINAL, (3,), np.float32)
    >>> ids, rows, given, _ = choice.choose(view, np.zeros(2, np.int64), np.zeros(2, np.int64), np.array([1, 3]),
    ...                                     np.full(2, 5), np.array([True, False]), np.random.default_rng(0))
    >>> ids, rows, given
    (array([0]), array([5]), None)
    """

    def __init__(
        self,
        strategy: GoalSelectionStrategy | GoalMixture | Callable[[GoalContext], np.ndarray],
        goal_shape: tuple[int, ...],
        goal_dtype: Any,
        random_goals: RandomGoalSource | None = None,
    ) -> None:
        self.strategy = strategy
        self.goal_shape = tuple(goal_shape)
        self.goal_dtype = np.dtype(goal_dtype)
        self.random_goals = random_goals

    def choose(
        self,
        view: IndexView,
        ids: np.ndarray,
        starts: np.ndarray,
        steps: np.ndarray,
        lengths: np.ndarray,
        her: np.ndarray,
        rng: np.random.Generator,
    ) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None, np.ndarray | None]:
        """The goals of the samples ``her`` marks, among samples of episodes ``ids`` (first rows ``starts``, lengths
        ``lengths``) at ``steps``: ``(goal_ids, goal_rows, given, given_goals)``, one entry per relabelled sample.

        ``goal_rows`` hold the achieved goal that becomes each one's goal, of episode ``goal_ids``. With a
        ``random_goals`` source, the samples ``given`` marks took their goal from it, ``given_goals`` (their goal
        rows are their own next rows, gathered anyway, standing in until :meth:`relabel`). All None for a callable
        strategy, or when no sample is relabelled.
        """
        n = int(her.sum())
        strategy = self.strategy
        if not n or not isinstance(strategy, (GoalMixture, GoalSelectionStrategy)):
            return None, None, None, None
        if isinstance(strategy, GoalMixture):
            j, anywhere = strategy.select(steps[her], lengths[her], rng)
            goal_ids, goal_rows = ids[her], starts[her] + j + 1
        elif strategy is GoalSelectionStrategy.RANDOM:
            anywhere = np.ones(n, bool)
            goal_ids, goal_rows = ids[her], starts[her] + steps[her] + 1
        else:
            return ids[her], starts[her] + select_goal_steps(strategy, steps[her], lengths[her], rng) + 1, None, None
        if self.random_goals is None:
            goal_ids[anywhere], goal_rows[anywhere] = random_transition_rows(view, rng, int(anywhere.sum()))
            return goal_ids, goal_rows, None, None
        given_goals = np.zeros((n, *self.goal_shape), self.goal_dtype)
        if anywhere.any():  # a draw of no goals takes nothing from the generator: skipping it keeps the stream
            given_goals[anywhere] = self.random_goals(rng, int(anywhere.sum()))
        return goal_ids, goal_rows, anywhere, given_goals

    def relabel(
        self,
        d: Draw,
        n: int,
        now: dict[str, Any],
        nxt: dict[str, Any],
        goals: np.ndarray | None,
        goals_at: Callable[[], Callable[[np.ndarray, np.ndarray], np.ndarray]],
        rng: np.random.Generator,
    ) -> np.ndarray:
        """Write the new goals of the first ``n`` samples of a batch (those ``d.her`` marks, ``n >= 1``) into its
        desired goals (``now`` and ``nxt``, in place) and return them.

        ``goals`` are the achieved goals gathered at the draw's goal rows, or None for a callable strategy, which
        is called here with a :class:`GoalContext` whose ``achieved_goals`` is ``goals_at()``.
        """
        desired = now["desired_goal"]
        if goals is None:
            ctx = GoalContext(
                d.episode_ids[:n], d.steps[:n], d.lengths[:n], desired[:n].copy(), nxt["achieved_goal"][:n],
                goals_at(), rng,
            )
            assert not isinstance(self.strategy, (GoalSelectionStrategy, GoalMixture))
            goals = np.asarray(self.strategy(ctx), dtype=self.goal_dtype)
            if goals.shape != (n, *self.goal_shape):
                raise ValueError(f"goal strategy returned shape {goals.shape}, expected {(n, *self.goal_shape)}")
        if d.given is not None and d.given_goals is not None:
            goals[d.given] = d.given_goals[d.given]
        desired[:n] = goals
        nxt["desired_goal"][:n] = goals
        return goals
