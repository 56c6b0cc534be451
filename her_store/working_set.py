"""WorkingSetSampler: HER batches from a bounded in-RAM (or on-device) set of whole episodes, refilled in the background.

For a store on object storage or larger than RAM: whole episodes are copied into a ring of rows of a fixed byte
budget by large reads (runs of consecutive episodes, read through the store's ChunkReader: whole chunks, ranged blocks
or frame runs, never a request per row), a background thread replaces part of the set at each refill, and batches are
drawn from the set with :class:`~her_store.sampler.HerSampler`'s own drawing, relabelling and reward recomputation.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from her_store.errors import StoreError
from her_store.index import IndexView
from her_store.relabel import GoalStrategy
from her_store.sampler import HerBatch, HerSampler, RewardFn
from her_store.store import EpisodeStore

if TYPE_CHECKING:
    from her_store.sampler import _Draw

__all__ = ["WorkingSetSampler"]

# what HerSampler's batch assembly computes on with numpy (goals, rewards, flags; infos too): brought to the host
_HOST_FIELDS = frozenset({"achieved_goal", "desired_goal", "reward", "terminated", "truncated"})
_IDLE_WAIT = 0.05  # seconds the refill thread waits after a refill that found nothing to load


def _empty_view() -> IndexView:
    none = np.zeros(0, np.int64)
    return IndexView(0, 0, none, none, none, 0)


def _episode_rows(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Every row of each episode (``start .. start + length``, the ``T + 1`` rows it owns), concatenated."""
    r = lengths + 1
    return np.repeat(starts - (np.cumsum(r) - r), r) + np.arange(int(r.sum()), dtype=np.int64)


class WorkingSetSampler(HerSampler):
    """Hindsight Experience Replay batches from a bounded working set of whole episodes of a store.

    The set is a ring of ``budget_bytes // row_bytes`` rows (``row_bytes``: one row of every array a batch reads),
    allocated once on ``device``; each resident episode owns ``T + 1`` consecutive rows of it, so future, final and
    episode goals stay within the episode. A refill (:meth:`refill`, or a background thread) places an *arc* of
    ``refill_fraction`` of the ring's rows uniformly at random on the circle of all live episodes' rows (in id order,
    the newest followed by the oldest), takes the episodes whose first row falls inside it and are not resident yet,
    evicts the oldest-loaded resident episodes until they fit, and reads their rows (a run of consecutive episodes:
    large sequential reads of whole chunks, or ranged blocks, through the store's
    :class:`~her_store.reader.ChunkReader`) straight into the ring. The first batch fills the set. Batches are drawn
    uniformly over the transitions in the set, relabelled and rewarded exactly as :class:`HerSampler` does it.

    **How this deviates from uniform sampling over the store.** At a refill, every live episode is taken with the
    same probability, ``W / R`` (``W`` the arc's rows, ``R`` the live episodes' rows counting ``T + 1`` each),
    whatever its length or position: the arc is placed uniformly on a circle, so the store's first and last episodes
    (and the ring's wrap point) have no edge effect, and an episode is taken whole or not at all by where its first row
    falls, never cut at a window's edge. Eviction is first in, first out, so an episode stays for about
    ``1 / refill_fraction`` refills whichever episode it is. Hence, over many refills, every committed transition is
    equally likely to be in the set, and (drawn uniformly within the set) equally likely to be sampled, to within the
    spread of the set's transition count (a set holding longer episodes holds a few more transitions in its rows).
    The differences from :class:`HerSampler`'s independent uniform draws:

    - Correlation in time: batches between two refills come from the same set, which holds about
      ``1 / refill_fraction`` arcs, each a run of consecutive episodes (collected together, by similar policies).
      A transition in the set is sampled about ``k * batch_size / set transitions`` times per refill when the learner
      takes ``k`` batches per refill, and not at all while it is out of the set: the sample stream is a mixture over
      slowly changing subsets, not i.i.d. over the store. More refills per batch (a larger ``refill_fraction``, the
      refill keeping up) bring it closer.
    - New commits become eligible at the next refill with the same probability as any episode, so a new episode
      enters the batches after a geometric number of refills (mean ``R / W``), not at the next refresh.
    - Goals of the ``random`` strategy (and a :class:`~her_store.relabel.GoalMixture`'s random share) are drawn from
      the set's transitions, not the whole store's.
    - An episode the ring evicts leaves the set at the next refill. Until then it may be sampled: its rows are the
      intact copy read while it was live (a refill checks :meth:`EpisodeStore.live_first` after each read and keeps
      only episodes that were still live, so rows the writer was overwriting are never kept).
    - When the whole store fits in one arc (``R <= W``), every refill takes every live episode: the set is the store
      and sampling is exactly HerSampler's.

    Parameters
    ----------
    store : EpisodeStore
        Any store handle: local, object storage or HTTP (read-only), a writer's included.
    budget_bytes : int
        Bytes of the set: all rows of all arrays a batch reads (``nbytes`` after construction, at most this). It
        must hold at least two of the longest episode and an arc (a refill raises StoreError otherwise).
    batch_size : int
        Default batch size of :meth:`sample`.
    refill_fraction : float
        The share of the set's rows one refill loads (and so evicts, once the set is full), in ``(0, 0.5]``.
    refill_interval : float
        Seconds the background thread waits between refills (0: back to back, as fast as the reads go).
    background : bool
        Refill in a background thread, started by the first batch; with False only :meth:`refill` refills.
    device : str or torch.device
        Where the set lives and batches go. On CUDA the set is a CUDA tensor: observations and actions are gathered
        on the device (``index_select``), and only goals, rewards, flags and infos, which ``reward_fn`` computes on
        with numpy, come to the host.
    seed : int, optional
        Seeds the batches' generator (as HerSampler's) and, through ``numpy.random.SeedSequence``, the refills'.
    n_sampled_goal, goal_selection_strategy, reward_fn, copy_info_dict, relabel_terminated, success_fn
        As :class:`HerSampler` (random goals: from the set).
    io_threads : int, optional
        Threads a refill's read is split across (see :class:`~her_store.reader.ChunkReader`).
    refresh_interval : float, optional
        Seconds between looks for new commits, done by :meth:`sample` (as HerSampler); refills take the newest view.

    Attributes
    ----------
    capacity_rows : int
        Rows of the ring.
    refills, loaded_transitions : int
        Refills that loaded something, and the transitions they loaded.
    refill_seconds : float
        Time spent in refills (reading included): ``loaded_transitions / refill_seconds`` is the refill rate.

    Examples
    --------
    >>> store = EpisodeStore.open("s3://bucket/fetch", storage_options=opts)  # doctest: +SKIP
    >>> sampler = WorkingSetSampler(store, 4 << 30, 256, reward_fn=compute_reward, device="cuda")  # doctest: +SKIP
    >>> batch = sampler.sample()  # doctest: +SKIP
    """

    def __init__(
        self,
        store: EpisodeStore,
        budget_bytes: int,
        batch_size: int = 256,
        *,
        refill_fraction: float = 0.1,
        refill_interval: float = 0.0,
        background: bool = True,
        n_sampled_goal: int = 4,
        goal_selection_strategy: GoalStrategy = "future",
        reward_fn: RewardFn | None = None,
        device: str | torch.device = "cpu",
        seed: int | None = None,
        copy_info_dict: bool = False,
        relabel_terminated: bool = False,
        success_fn: RewardFn | None = None,
        io_threads: int | None = None,
        refresh_interval: float | None = None,
    ) -> None:
        if not 0.0 < refill_fraction <= 0.5:
            raise ValueError(f"refill_fraction must be in (0, 0.5], got {refill_fraction}")
        if not refill_interval >= 0.0:
            raise ValueError(f"refill_interval must be >= 0 seconds, got {refill_interval}")
        super().__init__(
            store, batch_size, n_sampled_goal=n_sampled_goal, goal_selection_strategy=goal_selection_strategy,
            reward_fn=reward_fn, device=device, seed=seed, copy_info_dict=copy_info_dict,
            relabel_terminated=relabel_terminated, success_fn=success_fn, io_threads=io_threads,
            cache_bytes=0,  # a refill reads each chunk once, in order: nothing to cache beyond the one in hand
            refresh_interval=refresh_interval,
        )
        specs = {spec.path: spec for spec in store.layout.arrays}
        self._specs = {path: specs[path] for path, *_ in self._arrays}
        self.row_bytes = sum(spec.row_nbytes for spec in self._specs.values())
        self.capacity_rows = int(budget_bytes) // self.row_bytes
        if self.capacity_rows < 2:
            raise ValueError(
                f"budget_bytes={budget_bytes} holds {self.capacity_rows} row(s) of {self.row_bytes} bytes (one row of "
                f"every array a batch reads: {', '.join(self._specs)}); a working set needs whole episodes"
            )
        self.budget_bytes = int(budget_bytes)
        self.refill_fraction = float(refill_fraction)
        self.refill_interval = float(refill_interval)
        self.background = bool(background)
        self._host_names = _HOST_FIELDS | set(self._info_keys)
        self._buffers = {
            path: torch.empty(
                (self.capacity_rows, *spec.row_shape), dtype=torch.from_numpy(np.empty(0, spec.dtype)).dtype,
                device=self.device,
            )
            for path, spec in self._specs.items()
        }
        self._refill_rng = np.random.default_rng(np.random.SeedSequence(seed).spawn(1)[0])
        # resident episodes, oldest loaded first (their ring positions increase, wrapping once at most)
        self._ids = self._lengths = self._pos = np.zeros(0, np.int64)
        self._tail = 0  # ring row where the next block goes (if it fits before the oldest resident)
        self._published: tuple[IndexView, np.ndarray] = (_empty_view(), self._ids)
        self._lock = threading.Lock()  # a batch's draw and gather, against a refill changing which rows are live
        self._refill_lock = threading.Lock()  # one refill at a time
        self._halt = threading.Event()
        self._refiller: threading.Thread | None = None
        self._error: BaseException | None = None
        self.refills = 0
        self.loaded_transitions = 0
        self.refill_seconds = 0.0

    # -- what the set holds ----------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes of the ring (every row of every array), at most ``budget_bytes``."""
        return sum(b.element_size() * b.nelement() for b in self._buffers.values())

    @property
    def resident_bytes(self) -> int:
        """Bytes of the rows the resident episodes own (``T + 1`` rows each)."""
        view = self._published[0]
        return (view.num_transitions + len(view)) * self.row_bytes

    @property
    def episode_ids(self) -> np.ndarray:
        """Ids of the episodes in the set, oldest loaded first."""
        return self._published[1].copy()

    @property
    def num_transitions(self) -> int:
        """Transitions in the set (what a batch is drawn from)."""
        return self._published[0].num_transitions

    # -- refills -------------------------------------------------------------------------------------------
    def refill(self) -> int:
        """Look for new commits (at ``refresh_interval``) and refill once now; returns the transitions loaded."""
        return self._refill(self._current_view())

    def _arc(self, view: IndexView) -> np.ndarray:
        """Positions in ``view`` of the episodes whose first row lies in an arc of ``refill_fraction`` of the ring's
        rows placed uniformly on the circle of the view's rows: each episode with probability arc / total."""
        rows = view.lengths + 1
        total = int(rows.sum())
        arc = max(1, int(self.refill_fraction * self.capacity_rows))
        if arc >= total:
            return np.arange(len(view))
        offsets = np.cumsum(rows) - rows
        u = int(self._refill_rng.integers(total))
        return np.flatnonzero((offsets - u) % total < arc)

    def _place(self, n: int) -> int | None:
        """Ring row where a block of ``n`` rows fits between the newest and the oldest resident, or None."""
        if not len(self._ids):
            return 0
        head, tail, C = int(self._pos[0]), self._tail, self.capacity_rows
        if tail > head:  # residents in [head, tail): room after them, or before them from row 0
            return tail if C - tail >= n else 0 if head >= n else None
        return tail if head - tail >= n else None  # residents in [head, C) and [0, tail)

    def _keep(self, which: Any) -> None:
        self._ids, self._lengths, self._pos = self._ids[which], self._lengths[which], self._pos[which]

    def _publish(self) -> None:
        view = IndexView(0, len(self._ids), self._pos, self._lengths, np.cumsum(self._lengths), 0)
        self._published = (view, self._ids)

    def _refill(self, view: IndexView, evict: bool = True) -> int:
        """One refill from the committed ``view``; without ``evict``, loads only what fits in the free rows."""
        with self._refill_lock:
            started = time.perf_counter()
            ring = self.store.capacity is not None
            ids = view.first + self._arc(view)
            ids = ids[~np.isin(ids, self._ids)]
            lengths = view.lengths[ids - view.first]
            starts = view.start_rows[ids - view.first]
            n = int((lengths + 1).sum())
            longest = int(view.lengths.max()) + 1 if len(view) else 0
            if n > self.capacity_rows or 2 * longest > self.capacity_rows:
                raise StoreError(
                    f"{self.store.url}: the working set holds {self.capacity_rows} rows of {self.row_bytes} bytes "
                    f"(budget_bytes={self.budget_bytes}); it must hold two of the longest episode ({longest} rows) "
                    f"and a refill's {len(ids)} new episode(s) ({n} rows): raise budget_bytes or lower refill_fraction"
                )
            with self._lock:  # batches drawn from now on see neither the evicted episodes nor the rows being read
                if ring:  # episodes the writer evicted leave the set
                    self._keep(self._ids >= max(view.first, self.store.live_first()))
                at = self._place(n) if n else None
                while at is None and n and evict and len(self._ids):
                    self._keep(slice(1, None))
                    at = self._place(n)
                self._publish()
            if at is None:
                return 0
            rows = _episode_rows(starts, lengths)
            for path, buf in self._buffers.items():
                block = buf[at : at + n]
                if block.device.type == "cpu":
                    self.reader.gather(path, rows, out=block.numpy())
                else:
                    block.copy_(torch.from_numpy(self.reader.gather(path, rows)))
            # a ring may have overwritten rows of episodes it evicted during the read: keep only those still live
            first = self.store.live_first() if ring else view.first
            live = ids >= first
            r = lengths + 1
            with self._lock:
                self._keep(self._ids >= first)  # and residents evicted meanwhile leave with them
                self._ids = np.concatenate([self._ids, ids[live]])
                self._lengths = np.concatenate([self._lengths, lengths[live]])
                self._pos = np.concatenate([self._pos, at + (np.cumsum(r) - r)[live]])
                self._tail = at + n
                self._publish()
            loaded = int(lengths[live].sum())
            self.refills += 1
            self.loaded_transitions += loaded
            self.refill_seconds += time.perf_counter() - started
            return loaded

    def _fill(self, view: IndexView) -> None:
        """Fill the free rows arc by arc (the first batch: the set starts as a full set of independent arcs)."""
        for _ in range(int(4 / self.refill_fraction) + 1):
            if self._refill(view, evict=False) == 0:
                return

    def _run(self) -> None:
        while not self._halt.is_set():
            try:
                view = self._view
                loaded = self._refill(view) if view is not None else 0
            except Exception as e:  # handed to the learner's next batch
                self._error = e
                return
            wait = self.refill_interval if loaded else max(self.refill_interval, _IDLE_WAIT)
            if wait:
                self._halt.wait(wait)

    def _ready(self, view: IndexView) -> None:
        if self._error is not None:
            raise self._error
        if not len(self._published[1]) and view.num_transitions:
            self._fill(view)
        if self.background and self._refiller is None:
            self._refiller = threading.Thread(target=self._run, name="her_store-working-set", daemon=True)
            self._refiller.start()

    # -- one batch, HerSampler's, from the set -----------------------------------------------------------------
    def _make_batch(self, view: IndexView, B: int, may_refresh: bool = True) -> HerBatch:
        for _ in range(100):
            self._ready(view)
            with self._lock:
                # a refill that had to evict the whole set to place its episodes leaves it empty until its read ends
                if self._published[0].num_transitions or not view.num_transitions:
                    return super()._make_batch(self._published[0], B, may_refresh)
        raise StoreError(f"{self.store.url}: the ring writer evicts every episode a refill reads; give the ring more room")

    def _fresh(self, view: IndexView, B: int, may_refresh: bool) -> tuple[IndexView, _Draw, dict, dict, np.ndarray | None]:
        """Draw among the set's episodes (positions in the set), gather from the ring, and name the store's ids."""
        her = np.arange(B) < int(self.her_ratio * B)
        d = self._draw(view, her)
        now, nxt, goals = self._gather(d)
        ids = self._published[1]
        d = d._replace(episode_ids=ids[d.episode_ids], goal_ids=None if d.goal_ids is None else ids[d.goal_ids])
        return view, d, now, nxt, goals

    def _gather(self, d: _Draw) -> tuple[dict[str, Any], dict[str, Any], np.ndarray | None]:
        """HerSampler's gather from the ring: one ``index_select`` per array on the set's device; the fields batch
        assembly computes on with numpy come to the host, the others stay tensors."""
        B = len(d.rows)
        now: dict[str, Any] = {}
        nxt: dict[str, Any] = {}
        goals = None
        for path, is_pack, has_next, has_goal, fields in self._arrays:
            parts = [d.rows]
            if has_next:
                parts.append(d.rows + 1)
            if has_goal and d.goal_rows is not None:
                parts.append(d.goal_rows)
            index = torch.as_tensor(np.concatenate(parts), device=self.device)
            rows = self._buffers[path].index_select(0, index)
            for name, a, b, shape, per_step in fields:
                col = rows[:, a:b] if is_pack else rows
                take = self._to_host if name in self._host_names else (lambda x: x.contiguous())
                now[name] = take(col[:B].reshape(B, *shape))
                if not per_step:
                    nxt[name] = take(col[B : 2 * B].reshape(B, *shape))
                if name == "achieved_goal" and d.goal_rows is not None:
                    goals = self._to_host(col[2 * B :].reshape(-1, *shape))
        return now, nxt, goals

    @staticmethod
    def _to_host(x: torch.Tensor) -> np.ndarray:
        return x.contiguous().cpu().numpy()

    def _to_device(self, a: Any) -> torch.Tensor:
        return a if isinstance(a, torch.Tensor) else super()._to_device(a)

    def _achieved_goals_at(self, view: IndexView) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
        """A callable strategy's reader of achieved goals: episodes by store id, which must be in the set."""
        ids = self._published[1]
        order = np.argsort(ids)
        known = ids[order]
        spec, a, b = self.store.layout.fields["achieved_goal"]
        buf = self._buffers[spec.path]

        def read(episode_ids: np.ndarray, steps: np.ndarray) -> np.ndarray:
            episode_ids, steps = np.asarray(episode_ids, np.int64), np.asarray(steps, np.int64)
            k = np.minimum(np.searchsorted(known, episode_ids), max(len(known) - 1, 0))
            if not len(known) or np.any(known[k] != episode_ids):
                raise IndexError("episode ids must be in the working set (WorkingSetSampler.episode_ids)")
            at = order[k]
            if np.any(steps < 0) or np.any(steps >= view.lengths[at]):
                raise IndexError("steps must satisfy 0 <= step < episode length")
            rows = buf.index_select(0, torch.as_tensor(view.start_rows[at] + steps + 1, device=self.device))
            return self._to_host(rows[:, a:b] if spec.is_pack else rows).reshape(-1, *self._goal_shape)

        return read

    def close(self) -> None:
        """Stop the refill thread, release the set and the reader (the store stays open)."""
        self._halt.set()
        if self._refiller is not None:
            self._refiller.join()
            self._refiller = None
        super().close()
        self._buffers = {}
