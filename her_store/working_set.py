"""WorkingSetSampler: HER batches from a bounded in-RAM (or on-device) set of whole episodes, refilled in the background.

For a store on object storage or larger than RAM: whole episodes are copied into a ring of rows of a fixed byte
budget by large reads (runs of consecutive episodes, read through the store's ChunkReader: whole chunks, ranged blocks
or frame runs, never a request per row), a background thread replaces part of the set at each refill, and batches are
drawn from the set with :class:`~her_store.sampler.HerSampler`'s own drawing, relabelling and reward recomputation.
"""

from __future__ import annotations

import math
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
from her_store.values import is_int

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
    ``W`` rows uniformly at random on the circle of all live episodes' rows (in id order, the newest followed by the
    oldest), ``W`` being ``refill_fraction`` of the ring's rows or the longest live episode's ``T + 1`` rows,
    whichever is more (so that any arc holds some episode's first row), takes the episodes whose first row falls
    inside it and are not resident yet, evicts the oldest-loaded resident episodes until they fit, and reads their
    rows (a run of consecutive episodes: large sequential reads of whole chunks, or ranged blocks, through the store's
    :class:`~her_store.reader.ChunkReader`) straight into the ring. The first batch fills the set arc by arc, until
    the next arc's episodes do not fit in the free rows or the whole store is in it. Batches are drawn uniformly over
    the transitions in the set, relabelled and rewarded exactly as :class:`HerSampler` does it.

    **How this deviates from uniform sampling over the store.** At a refill, every live episode is taken with the
    same probability, ``W / R`` (``W`` the arc's rows, ``R`` the live episodes' rows counting ``T + 1`` each),
    whatever its length or position: the arc starts at a row ``u`` drawn uniformly from the ``R`` rows of the circle
    and an episode is taken when its first row is one of the ``W`` rows from ``u`` on, which happens for exactly
    ``W`` of the ``R`` values of ``u`` whichever episode it is. ``W`` depends on the live episodes only (not on
    ``u``), so lengthening the arc to the longest episode keeps every probability equal. On a circle the store's first
    and last episodes (and the ring's wrap point) have no edge effect, and an episode is taken whole or not at all by
    where its first row falls, never cut at a window's edge. Eviction is first in, first out, so an episode stays for
    about ``capacity_rows / W`` refills (``1 / refill_fraction`` unless the longest episode sets ``W``) whichever
    episode it is. Hence, over many refills, every committed transition is equally likely to be in the set, and
    (drawn uniformly within the set) equally likely to be sampled, to within the spread of the set's transition count
    (a set holding longer episodes holds a few more transitions in its rows).
    The differences from :class:`HerSampler`'s independent uniform draws:

    - Correlation in time: batches between two refills come from the same set, which holds about
      ``capacity_rows / W`` arcs, each a run of consecutive episodes (collected together, by similar policies).
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
        Bytes of the set: all rows of all arrays a batch reads (``nbytes`` after construction, at most this), an
        int >= 1, allocated at once (MemoryError when the device cannot give it). It must hold at least two of the
        longest episode (a refill raises StoreError otherwise).
    batch_size : int
        Default batch size of :meth:`sample`.
    refill_fraction : float
        The share of the set's rows one refill's arc spans (it loads, and once the set is full evicts, about as
        many), in ``(0, 0.5]``; an arc spans at least the longest live episode's rows.
    refill_interval : float
        Seconds the background thread waits between refills (0: back to back, as fast as the reads go). The default,
        0.05 s, leaves the learner most of the interpreter for about two thirds of the refill rate (100,000
        FetchReach-shaped transitions from S3 on 2 cores: the learner at 0.88 of the warm local rate with 7.4k
        transitions loaded/s, 0.93 with 11.1k back to back, 1.12 with no refill).
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
        refill_interval: float = 0.05,
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
        if not is_int(budget_bytes):
            raise TypeError(f"budget_bytes must be an int (bytes of the working set), got {budget_bytes!r}")
        if budget_bytes < 1:
            raise ValueError(f"budget_bytes must be >= 1 (bytes of the working set), got {budget_bytes}")
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
        self._numpy_gather = self.device.type == "cpu"  # else index_select on the device
        try:
            self._buffers = {
                path: torch.empty(
                    (self.capacity_rows, *spec.row_shape), dtype=torch.from_numpy(np.empty(0, spec.dtype)).dtype,
                    device=self.device,
                )
                for path, spec in self._specs.items()
            }
        except (RuntimeError, MemoryError) as e:  # torch's allocators raise RuntimeError (CUDA's a subclass of it)
            self.reader.close()
            raise MemoryError(
                f"budget_bytes={self.budget_bytes}: the working set's {self.capacity_rows} rows of {self.row_bytes} "
                f"bytes ask {self.device} for {self.capacity_rows * self.row_bytes} bytes, which it cannot give "
                f"({e}); lower budget_bytes"
            ) from e
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
        self._closed = False
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
        """Look for new commits (at ``refresh_interval``) and refill once now; returns the transitions loaded.

        Raises
        ------
        StoreError
            The sampler is closed, or the set cannot hold two of the longest episode.
        """
        self._require_open()
        return self._refill(self._current_view()) or 0

    def _arc_rows(self, view: IndexView) -> int:
        """Rows of an arc: ``refill_fraction`` of the ring's, at least the longest episode's ``T + 1``."""
        return max(int(self.refill_fraction * self.capacity_rows), int(view.lengths.max()) + 1 if len(view) else 1)

    def _arc(self, view: IndexView) -> np.ndarray:
        """Positions in ``view`` of the episodes whose first row lies in an arc of :meth:`_arc_rows` rows placed
        uniformly on the circle of the view's rows: each episode with probability arc / total, at least one."""
        rows = view.lengths + 1
        total = int(rows.sum())
        arc = self._arc_rows(view)
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

    def _refill(self, view: IndexView, evict: bool = True) -> int | None:
        """One refill from the committed ``view``; returns the transitions loaded, or None when no arc can load
        anything: every live episode of the view is in the set, or (without ``evict``, which loads only what fits in
        the free rows) the arc's new episodes do not fit."""
        with self._refill_lock:
            self._require_open()
            started = time.perf_counter()
            ring = self.store.capacity is not None
            if ring:  # the arc goes round the episodes the writer has not evicted, and those it evicted leave the set
                view = view.since(self.store.live_first())
                with self._lock:
                    self._keep(self._ids >= view.first)
                    self._publish()
            if np.count_nonzero(self._ids < view.end) == len(view):
                return None
            ids = view.first + self._arc(view)
            ids = ids[~np.isin(ids, self._ids)]
            lengths = view.lengths[ids - view.first]
            starts = view.start_rows[ids - view.first]
            n = int((lengths + 1).sum())
            longest = int(view.lengths.max()) + 1 if len(view) else 0
            # an arc's new episodes span under W + longest <= capacity rows (W <= capacity / 2) when this holds
            if 2 * longest > self.capacity_rows:
                raise StoreError(
                    f"{self.store.url}: the working set holds {self.capacity_rows} rows of {self.row_bytes} bytes "
                    f"(budget_bytes={self.budget_bytes}); it must hold two of the longest episode ({longest} rows): "
                    f"raise budget_bytes to at least {2 * longest * self.row_bytes}"
                )
            with self._lock:  # batches drawn from now on see neither the evicted episodes nor the rows being read
                at = self._place(n) if n else None
                while at is None and n and evict and len(self._ids):
                    self._keep(slice(1, None))
                    at = self._place(n)
                self._publish()
            if at is None:
                return None if n else 0
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
        """Fill the free rows arc by arc (the first batch: the set starts as a full set of independent arcs), until
        an arc's new episodes do not fit or the whole view is in the set.

        An arc that brings only resident episodes is drawn again. Bounded: about ``max(capacity, R) / W`` arcs fill
        the set, and collecting every one of ``N`` episodes when the set holds the store takes about ``ln N`` times
        as many (a coupon collector); four times that, whatever is then in the set is the first set.
        """
        arcs = -(-max(self.capacity_rows, view.num_transitions + len(view)) // self._arc_rows(view))
        for _ in range(4 * arcs * (1 + math.ceil(math.log(len(view) + 1)))):
            if self._refill(view, evict=False) is None:
                return

    def _run(self) -> None:
        while not self._halt.is_set():
            try:
                view = self._view
                loaded = (self._refill(view) or 0) if view is not None else 0
            except Exception as e:  # handed to the learner's next batch
                self._error = e
                return
            wait = self.refill_interval if loaded else max(self.refill_interval, _IDLE_WAIT)
            if wait:
                self._halt.wait(wait)

    def _require_open(self) -> None:
        if self._closed:
            raise StoreError(f"{self.store.url}: this working set sampler is closed (close() released its set)")

    def _ready(self, view: IndexView) -> None:
        if self._error is not None:
            raise self._error
        if not len(self._published[1]) and view.num_transitions:
            self._fill(view)
        if self.background and self._refiller is None:
            self._refiller = threading.Thread(target=self._run, name="her_store-working-set", daemon=True)
            self._refiller.start()

    # -- one batch, HerSampler's, from the set -----------------------------------------------------------------
    def sample(self, batch_size: int | None = None) -> HerBatch:
        """One batch of ``batch_size`` transitions (default: the sampler's), drawn from the set.

        Raises
        ------
        StoreError
            No committed episode yet, the sampler is closed, or a refill failed (raised at the next batch).
        """
        self._require_open()
        return super().sample(batch_size)

    def _make_batch(self, view: IndexView, B: int, may_refresh: bool = True) -> HerBatch:
        tries = 100
        for _ in range(tries):
            self._ready(view)
            with self._lock:
                # a refill that had to evict the whole set to place its episodes leaves it empty until its read ends
                if self._published[0].num_transitions or not view.num_transitions:
                    return super()._make_batch(self._published[0], B, may_refresh)
        if self.store.capacity is not None:
            raise StoreError(
                f"{self.store.url}: {tries} refills in a row kept no episode: the ring writer evicted the episodes of "
                f"the view sampled from ({view.first}..{view.end - 1}; it now keeps {self.store.live_first()} on) "
                "before a refill could keep them; give the ring more capacity, or sample with a smaller "
                "refresh_interval"
            )
        raise StoreError(
            f"{self.store.url}: the set was empty at {tries} batches in a row: each background refill evicted the whole "
            f"set ({self.capacity_rows} rows) to place its arc's episodes; raise budget_bytes or lower refill_fraction"
        )

    def _fresh(
        self, view: IndexView, B: int, may_refresh: bool
    ) -> tuple[IndexView, _Draw, dict, dict, np.ndarray | None, Callable[[], None]]:
        """Draw among the set's episodes (positions in the set), gather from the ring, and name the store's ids."""
        her = np.arange(B) < int(self.her_ratio * B)
        d = self._draw(view, her)
        now, nxt, goals, finish = self._gather(d)
        ids = self._published[1]
        d = d._replace(episode_ids=ids[d.episode_ids], goal_ids=None if d.goal_ids is None else ids[d.goal_ids])
        return view, d, now, nxt, goals, finish

    def _rows(self, path: str, rows: np.ndarray) -> Any:
        """HerSampler's gather reads from the ring: ``numpy.take`` of its rows on the CPU (as the reader gathers a
        local store's rows), one ``index_select`` on another device."""
        if self._numpy_gather:
            return np.take(self._buffers[path].numpy(), rows, axis=0)
        return self._buffers[path].index_select(0, torch.as_tensor(rows, device=self.device))

    def _rows_later(self, path: str, rows: np.ndarray) -> tuple[Any, Callable[[], None]]:
        """The ring's rows are gathered at once (:meth:`_rows`)."""
        return self._rows(path, rows), lambda: None

    def _field(self, name: str, col: Any, shape: tuple[int, ...]) -> Any:
        """On a device, the fields batch assembly computes on with numpy come to the host, the others stay there."""
        if isinstance(col, np.ndarray):
            return super()._field(name, col, shape)
        col = col.reshape(len(col), *shape)
        return self._to_host(col) if name in self._host_names else col.contiguous()

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

        def read(episode_ids: np.ndarray, steps: np.ndarray) -> np.ndarray:
            episode_ids, steps = np.asarray(episode_ids, np.int64), np.asarray(steps, np.int64)
            k = np.minimum(np.searchsorted(known, episode_ids), max(len(known) - 1, 0))
            if not len(known) or np.any(known[k] != episode_ids):
                raise IndexError("episode ids must be in the working set (WorkingSetSampler.episode_ids)")
            at = order[k]
            if np.any(steps < 0) or np.any(steps >= view.lengths[at]):
                raise IndexError("steps must satisfy 0 <= step < episode length")
            rows = self._rows(spec.path, view.start_rows[at] + steps + 1)
            return self._field("achieved_goal", rows[:, a:b] if spec.is_pack else rows, self._goal_shape)

        return read

    def close(self) -> None:
        """Stop the refill thread, release the set and the reader (the store stays open); then :meth:`sample`
        and :meth:`refill` raise StoreError."""
        self._halt.set()
        if self._refiller is not None:
            self._refiller.join()
            self._refiller = None
        with self._refill_lock, self._lock:  # a refill() of another thread ends first; later ones find it closed
            self._closed = True
            self._keep(slice(0, 0))
            self._publish()
            self._buffers = {}
        super().close()
