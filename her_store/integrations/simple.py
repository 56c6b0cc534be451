"""The simple HER API (store_transition / sample / len over flat state vectors) with real hindsight relabelling.

Flat states become the store's goal-style observations: ``observation`` is the state, ``achieved_goal`` its first
``goal_dim`` entries, ``desired_goal`` the goal. Episodes are delimited by ``done`` (and cut into segments of at
most ``segment_steps``) and kept in a store on disk (through
:class:`~her_store.integrations.rllte.HerReplayStorage`); batches are relabelled with the future strategy by
:class:`~her_store.sampling.sampler.HerSampler`, the unfinished segment in the same way.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from typing import Any, Self

import numpy as np
import torch
from gymnasium import spaces

from her_store.checks import check_bounds, check_callable, check_int, check_number
from her_store.datasets.opening import open_store
from her_store.errors import NotAStoreError, SchemaMismatchError, StoreError
from her_store.integrations.inputs import as_flags, as_numpy, checked_device
from her_store.integrations.rllte import HerReplayStorage
from her_store.sampling.config import SamplerConfig
from her_store.sampling.relabel import GoalSelectionStrategy, select_goal_steps
from her_store.sampling.sampler import RewardFn
from her_store.storage import Backend, open_backend
from her_store.store.creation import MAX_CAPACITY
from her_store.store.episode_store import EpisodeStore

__all__ = ["MAX_SEGMENT_STEPS", "HindsightExperienceReplay", "goal_reached_reward"]

MAX_SEGMENT_STEPS = 1000  # the default segment: at most this many steps, and at most a quarter of buffer_size

_NOT_TRUNCATED = np.zeros(1, bool)  # the simple API has no time limits: done is termination

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
# with prioritize="td": the batch, its importance weights and its indices
PrioritizedBatch = tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor
]


def goal_reached_reward(achieved_goal: Any, desired_goal: Any, info: Any = None, *, tolerance: float = 0.05) -> Any:
    """0 where ``achieved_goal`` is within ``tolerance`` (Euclidean) of ``desired_goal``, else -1; vectorised.

    Examples
    --------
    >>> goal_reached_reward(np.array([[0.0, 0.0], [1.0, 0.0]]), np.zeros((2, 2)))
    array([ 0., -1.], dtype=float32)
    """
    d = np.linalg.norm(np.asarray(achieved_goal) - np.asarray(desired_goal), axis=-1)
    return (d <= tolerance).astype(np.float32) - 1


def _vector(x: Any, size: int, name: str, expected: str) -> np.ndarray:
    """A flat vector of ``size`` entries (a ``(1, size)`` row, or a scalar for size 1, is accepted too)."""
    a = as_numpy(x)
    if a.shape not in ((size,), (1, size)) and not (size == 1 and a.ndim == 0):
        raise ValueError(f"{name} has shape {a.shape}, expected {expected}")
    if a.dtype.kind not in "fiub":
        raise TypeError(f"{name} has dtype {a.dtype}, expected numbers")
    return _float32(a.reshape(1, size))


def _float32(a: np.ndarray) -> np.ndarray:
    """``a`` as float32, the stored dtype, which takes the writer's fast path; a value float32 cannot hold is
    left as it is for the writer to refuse."""
    if a.dtype == np.float32 or a.dtype.kind not in "fiu":
        return a
    with np.errstate(over="ignore"):
        narrowed = a.astype(np.float32)
    return narrowed if np.isfinite(narrowed).all() else a


def _scalar(x: Any, name: str) -> np.ndarray:
    a = as_numpy(x)
    if a.size != 1:
        raise ValueError(f"{name} must be a single value per transition, got shape {a.shape}")
    return a.reshape(1)


def _checked_rewards(r: Any, n: int) -> np.ndarray:
    r = np.asarray(r, dtype=np.float32)
    if r.size != n:
        raise ValueError(f"reward_fn returned {r.size} values (shape {r.shape}) for {n} transitions; expected (n,)")
    return r.reshape(n)


class HindsightExperienceReplay:
    """A HER replay buffer over flat state vectors, with the episodes on disk.

    Transitions are grouped into episodes by ``done`` (the step with ``done`` true is an episode's last; its
    ``next_state`` the episode's final state). A ``state`` that is not the previous transition's ``next_state``
    also starts a new episode (the one before is stored as truncated): a reset without ``done`` (a time limit)
    does not merge two episodes. An episode without ``done`` (a continuing task) is cut every ``segment_steps``
    steps: the segment is stored as truncated and the next transition, which starts at its final state, begins a
    new one. The trajectory goes on seamlessly, but relabelled goals are drawn within a segment. So the steps held
    in memory, what a kill -9 loses and what :meth:`sample` copies are bounded, and no episode is ever too long for
    the store. :meth:`sample` draws transitions uniformly from the stored ones, the unfinished segment included;
    ``her_ratio = 1 - 1 / (n_sampled_goal + 1)`` of them get as goal the achieved goal of a state reached later in
    the same episode (the future strategy, SB3's formulas) and a reward recomputed with ``reward_fn``.
    ``goal_sampling_strategy`` is then applied to the goals; where it changes a goal the reward is recomputed for the
    goal returned.

    Parameters
    ----------
    state_dim, action_dim : int
        Sizes of the flat state and action vectors.
    buffer_size : int
        Capacity in transitions, >= 2: the store keeps ``buffer_size - segment_steps`` of the ended episodes' (the
        oldest whole episodes are evicted first), the unfinished segment the rest, so ``len()`` never exceeds it.
    batch_size : int
        Transitions per :meth:`sample`.
    goal_sampling_strategy : callable, optional
        ``goals -> goals`` on the batch's ``(batch_size, goal_dim)`` float32 tensor of goals on ``device`` (after
        relabelling).
    path : str or PathLike, optional
        Where the store lives; an existing store there is resumed (its episodes are sampled). None: a temporary
        directory removed by :meth:`close` or garbage collection.
    reward_fn : callable, optional
        ``reward_fn(achieved_goal, desired_goal, info)`` -> rewards ``(n,)``, vectorised over ``(n, goal_dim)``
        arrays (``info`` is a list of empty dicts; an env's ``compute_reward`` fits). Default
        :func:`goal_reached_reward` with ``tolerance``: 0 when the achieved goal is within ``tolerance`` of the
        goal, else -1.
    goal_dim : int, optional
        Size of the goal. The achieved goal of a state is its first ``goal_dim`` entries (order your state so).
        Default: the goal's size at the first :meth:`store_transition` (or the size stored at ``path``); the
        store is then created (or opened) at that first transition.
    n_sampled_goal : int
        Relabelled transitions per real one (4: 80 % of a batch).
    tolerance : float
        Success radius of the default ``reward_fn``.
    device : str or torch.device
        Where sampled tensors go; one that is not available here (e.g. ``"cuda"`` without CUDA) is refused with a
        ValueError at construction.
    seed : int, optional
        Seed of the sampling generators.
    storage_options : mapping, optional
        fsspec options for a URL ``path``.
    prioritize : {None, "energy", "td"}
        As :class:`her_store.HerSampler`'s. With "td" a batch has two more members, ``weights`` and ``indices``
        (importance weights and the keys :meth:`update_priorities` takes), and is drawn from the committed episodes
        only: the unfinished segment's transitions enter the draw when it is committed.
    alpha, beta : float
        With ``prioritize="td"``: the exponents of priorities and of importance weights.
    segment_steps : int, optional
        Longest segment of an episode without ``done``; default ``min(MAX_SEGMENT_STEPS, buffer_size // 4)``
        (at least 1). At most ``buffer_size - 1``. Resuming a store needs the same ``buffer_size`` and
        ``segment_steps``.

    Raises
    ------
    ArgumentTypeError
        An option of the wrong type (a bool, float or str where an int belongs, numpy integers being ints; not a
        real number as ``tolerance``; not a callable where one belongs), named with what it must be and what was
        given; a TypeError and a ValueError. Checked, with the ranges, before anything is created on disk.
    SchemaMismatchError
        A store at ``path`` with other sizes, or kept with another ``buffer_size - segment_steps``.

    Examples
    --------
    >>> her = HindsightExperienceReplay(state_dim=10, action_dim=2, buffer_size=10_000, batch_size=64,
    ...                                 goal_dim=3)  # doctest: +SKIP
    >>> her.store_transition(state, action, reward, next_state, done, goal)  # doctest: +SKIP
    >>> batch = her.sample()  # None until 64 transitions are stored  # doctest: +SKIP
    >>> states, actions, rewards, next_states, dones, goals = batch  # doctest: +SKIP
    """

    def __init__(
        self,
        state_dim: int,
        action_dim: int,
        buffer_size: int,
        batch_size: int,
        goal_sampling_strategy: Callable[[torch.Tensor], Any] | None = None,
        path: str | os.PathLike[str] | None = None,
        reward_fn: RewardFn | None = None,
        goal_dim: int | None = None,
        *,
        n_sampled_goal: int = 4,
        tolerance: float = 0.05,
        device: str | torch.device = "cpu",
        seed: int | None = None,
        storage_options: Mapping[str, Any] | None = None,
        segment_steps: int | None = None,
        prioritize: str | None = None,
        alpha: float = 0.6,
        beta: float = 0.4,
    ) -> None:
        self._priority = SamplerConfig(prioritize=prioritize, alpha=alpha, beta=beta)
        self.state_dim = check_int(state_dim, "state_dim", low=1)
        self.action_dim = check_int(action_dim, "action_dim", low=1)
        self.batch_size = check_int(batch_size, "batch_size", low=1)
        # a ring of ended episodes and an unfinished segment
        self.buffer_size = check_bounds(
            check_int(buffer_size, "buffer_size", low=2), "buffer_size", high=MAX_CAPACITY, kind="an int"
        )
        if segment_steps is None:
            segment_steps = max(1, min(MAX_SEGMENT_STEPS, self.buffer_size // 4))
        self.segment_steps = check_int(segment_steps, "segment_steps", low=1)
        if self.segment_steps >= self.buffer_size:
            raise ValueError(
                f"segment_steps={segment_steps} must be less than buffer_size={buffer_size}: the store keeps "
                "buffer_size - segment_steps transitions of ended episodes"
            )
        goal_dim = check_int(goal_dim, "goal_dim", low=1, or_none=True)
        self.n_sampled_goal = check_int(n_sampled_goal, "n_sampled_goal", low=0)
        tolerance = check_number(tolerance, "tolerance", low=0)
        self.goal_sampling_strategy = check_callable(goal_sampling_strategy, "goal_sampling_strategy", or_none=True)
        check_callable(reward_fn, "reward_fn", or_none=True)
        self._seed = check_int(seed, "seed", low=0, or_none=True)
        self.device = checked_device(device)
        self.reward_fn: RewardFn = reward_fn or functools.partial(goal_reached_reward, tolerance=tolerance)
        self.path = path
        self.her_ratio = 1.0 - 1.0 / (self.n_sampled_goal + 1)
        self._rng = np.random.default_rng(self._seed)
        self.storage: HerReplayStorage | None = None
        self._closed = False
        self._last_next = np.empty(0, np.float32)  # the next_state of the last transition stored
        # the store's place, built once: a store there is resumed now, else one is created there once the goal size
        # is known (given, or at the first transition)
        self._place = None if path is None else open_backend(path, storage_options)
        store = None if self._place is None else _resumed(self._place)
        if store is not None:
            try:
                self._open(self._stored_goal_dim(store, goal_dim), store)
            except BaseException:
                store.close()
                raise
        elif goal_dim is not None:
            self._open(goal_dim)

    @property
    def goal_dim(self) -> int | None:
        """Size of the goal (None until the first transition when it was not given)."""
        return None if self.storage is None else self.storage.store.observation_space["desired_goal"].shape[0]

    def _stored_goal_dim(self, store: EpisodeStore, goal_dim: int | None) -> int:
        """The goal size of the resumed ``store``, checked against ``goal_dim`` and its capacity against
        ``buffer_size - segment_steps``."""
        shape = store.observation_space["desired_goal"].shape
        if shape is None or len(shape) != 1:
            raise SchemaMismatchError(f"{self.path} holds goals of shape {shape}; this API stores flat goal vectors")
        stored_goal_dim, capacity = int(shape[0]), store.capacity
        if goal_dim is not None and goal_dim != stored_goal_dim:
            raise SchemaMismatchError(f"{self.path} holds goals of size {stored_goal_dim}, got goal_dim={goal_dim}")
        if capacity != self.buffer_size - self.segment_steps:
            kept = "an unbounded number of" if capacity is None else capacity
            raise SchemaMismatchError(
                f"{self.path} keeps {kept} transitions of ended episodes (its capacity); buffer_size="
                f"{self.buffer_size} with segment_steps={self.segment_steps} keeps "
                f"{self.buffer_size - self.segment_steps}: resume with the buffer_size and segment_steps it was made "
                "with"
            )
        return stored_goal_dim

    def _open(self, goal_dim: int, store: EpisodeStore | None = None) -> None:
        """The storage, on ``store`` (resumed) or on a store created at the place (or in a temporary directory)."""
        goal_dim = check_int(goal_dim, "goal_dim", low=1)
        if goal_dim > self.state_dim:
            raise ValueError(
                f"goal_dim={goal_dim} exceeds state_dim={self.state_dim}: the achieved goal of a state is its first "
                "goal_dim entries"
            )
        box = functools.partial(spaces.Box, -np.inf, np.inf, dtype=np.float32)
        obs = spaces.Dict({"observation": box((self.state_dim,)), "achieved_goal": box((goal_dim,)),
                           "desired_goal": box((goal_dim,))})
        self.storage = HerReplayStorage(
            obs, box((self.action_dim,)), storage_size=self.buffer_size - self.segment_steps,
            batch_size=self.batch_size, num_goals=self.n_sampled_goal, reward_fn=self.reward_fn,
            path=self._place if store is None else store, seed=self._seed, segment_steps=self.segment_steps,
            prioritize=self._priority.prioritize, alpha=self._priority.alpha, beta=self._priority.beta,
        )

    def store_transition(self, state: Any, action: Any, reward: Any, next_state: Any, done: Any, goal: Any) -> None:
        """Store one transition; ``done`` ends the episode (it is then appended to the store).

        Vectors may be numpy arrays, torch tensors or lists of shape ``(dim,)`` (or ``(1, dim)``).

        Raises
        ------
        ValueError, TypeError
            A wrong shape or dtype, named; nothing is stored.
        StoreError
            This replay was closed.

        Examples
        --------
        >>> her.store_transition(np.zeros(10), np.zeros(2), -1.0, np.ones(10), False, np.ones(3))  # doctest: +SKIP
        """
        self._require_open()
        if self.storage is None:
            self._open(as_numpy(goal).size)
        assert self.storage is not None
        gd = self.goal_dim
        sd = f"({self.state_dim},) (state_dim)"
        s = _vector(state, self.state_dim, "state", sd)
        ns = _vector(next_state, self.state_dim, "next_state", sd)
        g = _vector(goal, gd, "goal", f"({gd},) (goal_dim)")
        a = _vector(action, self.action_dim, "action", f"({self.action_dim},) (action_dim)")
        r, d = _float32(_scalar(reward, "reward")), as_flags(_scalar(done, "done"), "done")
        writer = self.storage.writer
        if writer.pending_steps[0] and not np.array_equal(s.astype(np.float32), self._last_next, equal_nan=True):
            writer.flush_partial()  # a jump (a reset without done): the episode so far ends, truncated
        self.storage.add(  # which cuts the episode at segment_steps
            {"observation": s, "achieved_goal": s[:, :gd], "desired_goal": g}, a, r, d, _NOT_TRUNCATED, None,
            {"observation": ns, "achieved_goal": ns[:, :gd], "desired_goal": g},
        )
        self._last_next = ns.astype(np.float32)

    def __len__(self) -> int:
        """Transitions stored: the ended episodes' and the unfinished segment's (at most ``buffer_size``).

        Like :meth:`sample`, it commits the episodes ended since the last commit (one commit, about a millisecond).
        """
        self._require_open()
        if self.storage is None:
            return 0
        return self.storage.store.num_transitions + int(self.storage.writer.pending_steps[0])  # commits what ended

    def sample(self) -> Batch | PrioritizedBatch | None:
        """``(states, actions, rewards, next_states, dones, goals)`` of ``batch_size`` transitions, or None.

        float32 tensors on the device: states and next states ``(B, state_dim)``, actions ``(B, action_dim)``,
        rewards and dones ``(B, 1)``, goals ``(B, goal_dim)``. None until ``batch_size`` transitions are stored.
        ``dones`` are the stored ``done`` flags, also for relabelled goals (as SB3: reaching a relabelled goal does
        not end the episode). Each call commits the episodes ended since the last commit (so every ended episode
        is drawn from, as in SB3; episodes are otherwise committed in groups) and copies the unfinished segment's
        steps once (at most ``segment_steps``).

        Raises
        ------
        ValueError
            ``reward_fn`` or ``goal_sampling_strategy`` returned the wrong number of values or shape.

        Examples
        --------
        >>> states, actions, rewards, next_states, dones, goals = her.sample()  # doctest: +SKIP
        """
        self._require_open()
        if self.storage is None:
            return None
        self.storage.store.flush()  # every ended episode is drawn from, as SB3's buffer does: commit them
        committed = self.storage.store.snapshot().num_transitions
        pending = int(self.storage.writer.pending_steps[0])
        B = self.batch_size
        if committed + pending < B:
            return None
        if self._priority.prioritize == "td":
            return self._sample_prioritized() if committed else None
        n_pending = int(self._rng.binomial(B, pending / (committed + pending)))
        parts = []
        if n_pending < B:
            b = self.storage.sampler.sample(B - n_pending)
            parts.append((b.observations["observation"].numpy(), b.actions.numpy(), b.rewards.numpy().reshape(-1),
                          b.next_observations["observation"].numpy(), b.dones.numpy().reshape(-1),
                          b.observations["desired_goal"].numpy()))
        if n_pending:
            parts.append(self._sample_pending(n_pending))
        states, actions, rewards, next_states, dones, goals = (np.concatenate(c) for c in zip(*parts, strict=True))
        t = functools.partial(torch.as_tensor, device=self.device)
        goals_t = t(goals)
        if self.goal_sampling_strategy is not None:
            goals_t = self._apply_strategy(goals_t, next_states, rewards)
        return t(states), t(actions), t(rewards.reshape(B, 1)), t(next_states), t(dones.reshape(B, 1)), goals_t

    def _sample_prioritized(self) -> PrioritizedBatch:
        """A batch of committed transitions drawn by TD error, with its weights and indices."""
        assert self.storage is not None
        b = self.storage.sampler.sample(self.batch_size)
        goals = b.observations["desired_goal"].to(self.device)
        if self.goal_sampling_strategy is not None:
            rewards = b.rewards.numpy().reshape(-1).copy()
            goals = self._apply_strategy(goals, b.next_observations["observation"].numpy(), rewards)
            b = b._replace(rewards=torch.as_tensor(rewards).reshape(-1, 1))
        t = functools.partial(torch.as_tensor, device=self.device)
        return (t(b.observations["observation"]), t(b.actions), t(b.rewards), t(b.next_observations["observation"]),
                t(b.dones), goals, t(b.weights), t(b.indices))

    def update_priorities(self, indices: Any, td_errors: Any) -> int:
        """Set the priorities of a batch's transitions from their TD errors (``prioritize="td"``; see
        :meth:`her_store.HerSampler.update_priorities`): ``indices`` is the batch's last member.

        Examples
        --------
        >>> *batch, weights, indices = her.sample()  # doctest: +SKIP
        >>> her.update_priorities(indices, td_errors)  # doctest: +SKIP
        """
        self._require_open()
        if self.storage is None:
            raise ValueError("update_priorities before any transition was stored: indices come from a batch")
        return self.storage.update_priorities(indices, td_errors)

    def _sample_pending(self, n: int) -> tuple[np.ndarray, ...]:
        """``n`` transitions of the unfinished episode, the first ``int(her_ratio * n)`` relabelled (future)."""
        assert self.storage is not None
        ep = self.storage.writer.pending(0)
        P = len(ep["action"])
        t = self._rng.integers(0, P, n)
        goals = ep["desired_goal"][t]
        rewards = ep["reward"][t].astype(np.float32)
        k = int(self.her_ratio * n)
        if k:
            j = select_goal_steps(GoalSelectionStrategy.FUTURE, t[:k], np.full(k, P), self._rng)
            goals[:k] = ep["achieved_goal"][j + 1]
            rewards[:k] = _checked_rewards(self.reward_fn(ep["achieved_goal"][t[:k] + 1], goals[:k], [{}] * k), k)
        return (ep["observation"][t], ep["action"][t], rewards, ep["observation"][t + 1],
                ep["terminated"][t].astype(np.float32), goals)

    def _apply_strategy(self, goals: torch.Tensor, next_states: np.ndarray, rewards: np.ndarray) -> torch.Tensor:
        """The user's goals -> goals, checked; rewards recomputed (in place) where a goal changed."""
        assert self.goal_sampling_strategy is not None
        out = self.goal_sampling_strategy(goals.clone())
        new = torch.as_tensor(out, dtype=torch.float32, device=goals.device)
        if new.shape != goals.shape:
            raise ValueError(f"goal_sampling_strategy returned shape {tuple(new.shape)}, expected {tuple(goals.shape)}")
        changed = (new != goals).any(dim=1).cpu().numpy()
        if changed.any():
            n = int(changed.sum())
            achieved = next_states[changed, : goals.shape[1]]
            rewards[changed] = _checked_rewards(self.reward_fn(achieved, new.cpu().numpy()[changed], [{}] * n), n)
        return new

    def close(self) -> None:
        """Store the unfinished episode as truncated (a persistent store), commit, release the store. Idempotent.

        Examples
        --------
        >>> her.close()  # doctest: +SKIP
        """
        self._closed = True
        if self.storage is not None:
            self.storage.close()

    def _require_open(self) -> None:
        if self._closed:
            raise StoreError(f"this HindsightExperienceReplay ({self.path}) is closed")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _resumed(place: Backend) -> EpisodeStore | None:
    """The store at ``place`` opened for appending, or None when there is none there (which ``open_store`` asks of
    ``place`` without opening anything)."""
    try:
        return open_store(place)
    except NotAStoreError:
        return None
