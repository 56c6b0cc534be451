"""Transitions drawn by TD error (proportional prioritized replay, Schaul et al. 2016), over a store's rows.

A :class:`~her_store.sampling.sum_tree.PriorityTree` holds ``priority ** alpha`` for every store row that is a live
transition (0 elsewhere: an episode's last row, evicted rows). It follows the committed episodes: episodes new to
the view enter with the largest priority seen so far, evicted ones leave. A batch draws ``B`` rows, each with
probability ``P(i) = p_i ** alpha / sum_k p_k ** alpha``, and its importance weights ``(N * P(i)) ** -beta`` divided
by their largest possible value ``(N * min_k P(k)) ** -beta``, ``N`` the live transitions. The tree is checkpointed
to the store (:mod:`~her_store.sampling.priority_checkpoint`) at an interval and at close; a sampler made on the
store again starts from the last checkpoint.

A sample's key (``HerBatch.indices``) is ``episode_id * 2**32 + step``: an update for an episode evicted since its
batch was drawn is dropped, not applied to whatever transition took its row.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from her_store.errors import StoreError
from her_store.forks import reset_in_child
from her_store.sampling.draw import check_nonempty, complete_draw
from her_store.sampling.drawn import Draw, split_keys
from her_store.sampling.priority_checkpoint import (
    CHUNK_BITS,
    CHUNK_ROWS,
    MAX_VALUE,
    PriorityCheckpoint,
    SavedPriorities,
)
from her_store.sampling.relabel import GoalChoice
from her_store.sampling.sum_tree import PriorityTree
from her_store.store.index import IndexView

__all__ = ["TransitionPriorities", "TransitionPriorityDraw"]

def _episode_rows(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The transition rows ``start .. start + length - 1`` of each episode, concatenated."""
    total = int(lengths.sum())
    offsets = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.repeat(starts, lengths) + (np.arange(total) - offsets)


class TransitionPriorities:
    """The prioritized-replay state of one sampler: the tree over the store's rows, the view it follows, the largest
    priority, and the checkpoint.

    Memory: 32 bytes per store row (:class:`PriorityTree`), rows being the transitions plus one per episode (its
    last observation) up to the highest row in use.

    Parameters
    ----------
    alpha : float
        Priorities are raised to ``alpha`` (0: uniform).
    eps : float
        Added to ``|td_error|``, so that no transition's probability is 0.
    checkpoint : PriorityCheckpoint, optional
        Where the tree is saved and resumed from.
    interval : float, optional
        Seconds between checkpoints taken by :meth:`update` (None: only by :meth:`save`).
    store_rows : callable
        The rows the store's arrays hold now: the tree grows to no more, and a checkpoint claiming more is not used.
    """

    def __init__(
        self,
        alpha: float,
        eps: float,
        checkpoint: PriorityCheckpoint | None,
        interval: float | None,
        store_rows: Callable[[], int],
    ) -> None:
        self.alpha, self.eps = float(alpha), float(eps)
        self.tree = PriorityTree(1)
        self.view: IndexView | None = None
        self.max_priority = 1.0
        self.checkpoint = checkpoint
        self.interval = interval
        self.store_rows = store_rows
        self._stale_tree = False  # forked while another thread updated the tree: its inner nodes are rebuilt
        self._dirty = np.zeros(0, bool)  # per chunk: changed since the last checkpoint
        self._last_save = time.monotonic()
        self._sorted: tuple[np.ndarray, np.ndarray] = (np.zeros(0, np.int64), np.zeros(0, np.int64))
        self._lock = threading.Lock()
        reset_in_child(self)

    def after_fork(self) -> None:
        self._lock = threading.Lock()
        self._stale_tree = True  # a thread of the parent may have been between a leaf and its sums

    def _fresh_tree(self) -> PriorityTree:
        """The tree, its sums rebuilt from its leaves first in a forked child (under the lock)."""
        if self._stale_tree:
            self.tree.set(np.arange(self.tree.size), self.tree.leaves.copy())  # every level from the leaves
            self._stale_tree = False
        return self.tree

    @property
    def nbytes(self) -> int:
        """Bytes held in RAM (the tree)."""
        return self.tree.nbytes

    # -- following the committed episodes -------------------------------------------------------------------
    def sync(self, view: IndexView) -> IndexView:
        """Follow ``view`` if it is newer than the one followed; returns the one followed (drawn from)."""
        with self._lock:
            self._fresh_tree()
            old = self.view
            if old is None or view.end > old.end or view.first > old.first:
                self._follow(view)
            assert self.view is not None
            return self.view

    def _follow(self, new: IndexView) -> None:
        old = self.view
        need = _rows_in_use(new)
        if need > self.tree.size:  # twice as many, within the store's rows (which a writer also doubles)
            self.tree.grow(max(need, min(2 * self.tree.size, self.store_rows())))
        if old is None:
            saved = None
            if self.checkpoint is not None:
                saved = self.checkpoint.load(-(-max(self.store_rows(), 1) // CHUNK_ROWS) * CHUNK_ROWS)
            self._enter(new, new.first, new.end, saved)
        else:
            gone = min(new.first, old.end) - old.first
            if gone > 0:
                rows = _episode_rows(old.start_rows[:gone], old.lengths[:gone])
                self.tree.set(rows, 0.0)
                self._touch(rows)
            self._enter(new, max(old.end, new.first), new.end, None)
        self.view = new
        order = _row_order(new.start_rows)
        self._sorted = (new.start_rows[order], order)

    def _enter(self, view: IndexView, first: int, end: int, saved: SavedPriorities | None) -> None:
        """Put episodes ``[first, end)`` of ``view`` in the tree: with their saved values where ``saved`` holds them,
        else the largest priority."""
        if end <= first:
            return
        a, b = first - view.first, end - view.first
        rows = _episode_rows(view.start_rows[a:b], view.lengths[a:b])
        values = np.full(len(rows), self.max_priority**self.alpha)
        if saved is not None:
            self.max_priority = max(self.max_priority, saved.max_priority)
            values[:] = self.max_priority**self.alpha
            ids = np.repeat(np.arange(first, end), view.lengths[a:b])
            kept = (ids >= saved.first) & (ids < saved.end) & (rows < len(saved.values))
            old = saved.values[rows[kept]]
            if saved.alpha != self.alpha:  # p ** alpha' from p ** alpha (alpha 0 kept no priority: the largest)
                with np.errstate(over="ignore"):
                    old = old ** (self.alpha / saved.alpha) if saved.alpha > 0 else np.full(len(old), values[0])
            # a live transition saved as 0 takes the largest; values too large to sum are not used
            values[kept] = np.where((old > 0) & (old <= MAX_VALUE), old, values[0])
        self.tree.set(rows, values)
        self._touch(rows)

    def _touch(self, rows: np.ndarray) -> None:
        if self.checkpoint is None or not rows.size:
            return
        chunks = -(-self.tree.size // CHUNK_ROWS)
        if len(self._dirty) < chunks:
            self._dirty = np.concatenate([self._dirty, np.zeros(chunks - len(self._dirty), bool)])
        self._dirty[rows >> CHUNK_BITS] = True

    # -- drawing and updating ---------------------------------------------------------------------------------
    def draw(self, view: IndexView, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """``(episode_ids, steps)`` of ``n`` transitions of episodes of ``view`` drawn from the tree.

        The tree follows the newest view any thread gave it; transitions of episodes outside an older ``view`` are
        drawn again (what is left is the same law over the episodes of both).

        Raises
        ------
        StoreError
            ``view`` and the tree's view share too little: the ring writer evicted the episodes drawn from.
        """
        ids, steps = np.zeros(n, np.int64), np.zeros(n, np.int64)
        todo = np.arange(n)
        with self._lock:
            tree = self._fresh_tree()
            followed = self.view
            assert followed is not None
            starts, order = self._sorted
            for _ in range(100):
                rows = tree.find(rng.random(len(todo)) * tree.total)
                pos = order[np.searchsorted(starts, rows, side="right") - 1]
                got = pos + followed.first
                ok = (got >= view.first) & (got < view.end)
                at = todo[ok]
                ids[at], steps[at] = got[ok], rows[ok] - followed.start_rows[pos[ok]]
                todo = todo[~ok]
                if not todo.size:
                    return ids, steps
        raise StoreError(f"the episodes of the batch's view ({view.first}..{view.end - 1}) were evicted; sample "
                         "from a larger ring")

    def weights(self, rows: np.ndarray, beta: float) -> np.ndarray:
        """The importance weights of samples at store ``rows`` (all live): ``(N * P(i)) ** -beta`` over its largest
        value among the live transitions, ``(leaf / min leaf) ** -beta``; one tree for the whole batch."""
        with self._lock:
            tree = self._fresh_tree()
            return (tree.get(rows) / tree.min) ** -beta

    def update(self, keys: Any, td_errors: Any) -> int:
        """Set the priorities of the transitions ``keys`` (a batch's ``indices``) to ``|td_errors| + eps``; returns
        how many were set (those of episodes evicted since are dropped). Takes a checkpoint when one is due.

        Raises
        ------
        ValueError
            ``keys`` and ``td_errors`` differ in length, or a TD error is not finite, or a key is not one a batch of
            this sampler handed out.
        """
        keys = _keys(keys)
        td = _numpy(td_errors, "td_errors").astype(np.float64, copy=False).reshape(-1)
        if keys.shape != td.shape:
            raise ValueError(f"update_priorities: {len(keys)} indices and {len(td)} td_errors; expected one each")
        if not np.isfinite(td).all():
            raise ValueError(f"update_priorities: td_errors must be finite, got {td[~np.isfinite(td)][:3]} among them")
        with np.errstate(over="ignore"):
            p = np.abs(td) + self.eps
            q = p**self.alpha
        if len(q) and not q.max() <= MAX_VALUE:
            raise ValueError(f"update_priorities: td_errors up to {np.abs(td).max():.3g} give priorities ** alpha "
                             f"above {MAX_VALUE:.0e}, which a tree cannot sum; scale the TD errors down")
        ids, steps = split_keys(keys)
        with self._lock:
            view = self.view
            if view is None:
                raise ValueError("update_priorities before any batch was drawn: indices come from a batch")
            tree = self._fresh_tree()
            pos = ids - view.first
            live = pos >= 0
            if not live.all():
                pos, steps, p, q = pos[live], steps[live], p[live], q[live]
            # an id below the live ones was evicted; one past them, or a step past its episode, is no key of ours
            if pos.size and (pos.max() >= len(view) or (steps >= view.lengths[pos]).any()):
                raise ValueError("update_priorities: indices must be those of batches of this sampler")
            rows = view.start_rows[pos] + steps
            if pos.size:
                tree.set(rows, q)
                self.max_priority = max(self.max_priority, float(p.max()))
                self._touch(rows)
        if self.interval is not None and time.monotonic() - self._last_save >= self.interval:
            self.save()
        return len(pos)

    # -- checkpoints --------------------------------------------------------------------------------------------
    def save(self) -> bool:
        """Checkpoint the tree to the store if anything changed since the last checkpoint; returns whether one was
        written. Nothing is written for a read-only store or without a checkpoint."""
        self._last_save = time.monotonic()
        cp = self.checkpoint
        if cp is None or not cp.writable:
            return False
        whole = not cp.is_current()  # another sampler wrote the store's checkpoint since: this one's, whole
        with self._lock:
            view = self.view
            if view is None or not (whole or self._dirty.any()):
                return False
            leaves = self._fresh_tree().leaves
            rows = -(-_rows_in_use(view) // CHUNK_ROWS) * CHUNK_ROWS  # live rows lie below (evicted ones are 0)
            chunks = {}
            written = np.ones(rows // CHUNK_ROWS, bool) if whole else self._dirty[: rows // CHUNK_ROWS]
            for c in np.flatnonzero(written).tolist():
                part = np.zeros(CHUNK_ROWS)
                got = leaves[c * CHUNK_ROWS : (c + 1) * CHUNK_ROWS]
                part[: len(got)] = got
                chunks[c] = part
            dirty, self._dirty = self._dirty, np.zeros(len(self._dirty), bool)
            first, end, max_priority = view.first, view.end, self.max_priority
        try:
            cp.save(chunks, rows, first, end, self.alpha, max_priority)
        except BaseException:
            with self._lock:
                self._dirty[: len(dirty)] |= dirty  # written again by the next checkpoint
            raise
        return True


def _row_order(starts: np.ndarray) -> np.ndarray:
    """The positions of episodes starting at rows ``starts`` (each its own rows), by start row: in id order they
    rise but where a ring wrapped to row 0, so one rotation sorts them (a sort only for anything else)."""
    n = len(starts)
    drops = np.flatnonzero(starts[1:] < starts[:-1])
    if not len(drops):
        return np.arange(n)
    if len(drops) == 1 and (n < 2 or starts[-1] < starts[0]):
        k = int(drops[0]) + 1
        return np.concatenate([np.arange(k, n), np.arange(k)])
    return np.argsort(starts, kind="stable")


def _rows_in_use(view: IndexView) -> int:
    """One past the highest row of ``view``'s episodes (1 for none)."""
    return int((view.start_rows + view.lengths).max()) + 1 if len(view) else 1


def _keys(x: Any) -> np.ndarray:
    """Keys a batch handed out (``indices``) as int64, or a ValueError: integers >= 0, no bool, float or text."""
    k = _numpy(x, "indices").reshape(-1)
    if k.dtype.kind not in "iu" or (k.size and (k.min() < 0 or k.max() > np.iinfo(np.int64).max)):
        raise ValueError(f"update_priorities: indices must be those of batches of this sampler (int64 >= 0), got "
                         f"{k.dtype} {k[:3]}")
    return k.astype(np.int64)


def _numpy(x: Any, name: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    try:
        return np.asarray(x)
    except (TypeError, ValueError) as e:
        raise ValueError(f"update_priorities: {name} must be an array or tensor ({e})") from e


class TransitionPriorityDraw:
    """Samples drawn by :class:`TransitionPriorities`, with their importance weights, and goals.

    Parameters
    ----------
    goals : GoalChoice
        Chooses the relabelled samples' goals in the same pass, with the same generator.
    url : str
        The store's URL, for the error of a view with no transition.
    priorities : TransitionPriorities
        The tree drawn from.
    beta : float
        The importance-sampling exponent (the caller anneals it: ``draw.beta = ...``).
    """

    def __init__(self, goals: GoalChoice, url: str, priorities: TransitionPriorities, beta: float) -> None:
        self.goals = goals
        self.url = url
        self.priorities = priorities
        self.beta = beta

    def current(self, view: IndexView) -> IndexView:
        """The view a batch drawn from ``view`` is drawn from: the newest the tree has followed, ``view`` or a
        later one (another thread's)."""
        return self.priorities.sync(view)

    def __call__(self, view: IndexView, her: np.ndarray, rng: np.random.Generator) -> Draw:
        """``len(her)`` samples of ``view``, those ``her`` marks relabelled; their ``weights`` are those of the
        batch's final rows (:meth:`weighted`), set once every sample is drawn.

        Raises
        ------
        StoreError
            The view has no committed transition.
        """
        check_nonempty(view, self.url)
        self.priorities.sync(view)
        ids, steps = self.priorities.draw(view, len(her), rng)
        return complete_draw(self.goals, view, ids, steps, her, rng, np.ones(len(her)))

    def weighted(self, d: Draw) -> Draw:
        """``d`` with the importance weights of its rows, from one state of the tree (a ring's evicted samples drawn
        again change its minimum: every weight of a batch is over the same one)."""
        return d._replace(weights=self.priorities.weights(d.rows, self.beta))
