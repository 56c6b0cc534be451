"""WorkingSetSampler: HER batches from a bounded set of whole episodes in RAM or on a device, refilled as it samples.

For a store on object storage or larger than RAM: whole episodes are copied into a ring of rows of a fixed byte
budget (:class:`~her_store.sampling.ring_rows.RingRows`) by large reads (runs of consecutive episodes, read through
the store's ChunkReader: whole chunks, ranged blocks or frame runs, never a request per row), a background thread
replaces part of the set at each refill, and batches are drawn from the set, with weights that give every transition
of the store the same long-run share, by the same parts as :class:`~her_store.sampling.sampler.HerSampler`'s (draw,
goal choice, gather, reward recomputation, assembly), the set's rows their row source.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from her_store.checks import check_bool, check_bounds, check_int, check_number
from her_store.errors import StoreError
from her_store.forks import reset_in_child
from her_store.sampling.batch import DeviceTransfer, HerBatch, assemble_batch
from her_store.sampling.committed import CommittedView
from her_store.sampling.config import ConfiguredSampler, SamplerConfig, reward_recompute, rng_state
from her_store.sampling.draw import UniformDraw
from her_store.sampling.gather import Gather, ReadPlan
from her_store.sampling.relabel import GoalChoice, GoalStrategy
from her_store.sampling.rewards import RewardFn
from her_store.sampling.ring_rows import HOST_FIELDS, RingRows
from her_store.store.episode_store import EpisodeStore
from her_store.store.index import IndexView
from her_store.store.rows import ChunkReader

__all__ = ["WorkingSetSampler"]

_IDLE_WAIT = 0.05  # seconds the refill thread waits after a refill that found nothing to load


class _SetView(IndexView):
    """The set's episodes as a batch draws from them (positions in the set, ring rows as start rows).

    ``locate(k)`` takes episode ``i`` for the ``k`` in its share of ``weights`` (the transitions of it that its arc
    covers), and the step uniformly among all the episode's steps, with ``rng`` (the batches' generator): episode
    ``i`` with probability ``weights[i] / sum(weights)``, each of its ``T`` steps alike.
    """

    __slots__ = ("_rng",)

    def __init__(self, starts: np.ndarray, lengths: np.ndarray, weights: np.ndarray, rng: np.random.Generator) -> None:
        super().__init__(0, len(starts), starts, lengths, np.cumsum(weights), 0)
        self._rng = rng

    def locate(self, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        i, _ = super().locate(k)
        return i, (self._rng.random(len(i)) * self.lengths[i]).astype(np.int64)


def _episode_rows(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Every row of each episode (``start .. start + length``, the ``T + 1`` rows it owns), concatenated."""
    r = lengths + 1
    return np.repeat(starts - (np.cumsum(r) - r), r) + np.arange(int(r.sum()), dtype=np.int64)


class WorkingSetSampler(ConfiguredSampler):
    """Hindsight Experience Replay batches from a bounded working set of whole episodes of a store.

    The set is a ring of ``budget_bytes // row_bytes`` rows (``row_bytes``: one row of every array a batch reads),
    allocated once on ``device``; each episode in it owns ``T + 1`` consecutive rows (past the ring's last row, on
    from its first), so future, final and episode goals stay within the episode. When the live episodes' rows
    (``T + 1`` each, ``R`` in all) fit in the ring, the set is the store: the first batch loads every episode, a
    refill loads the new ones, and sampling is exactly :class:`~her_store.sampling.sampler.HerSampler`'s.

    Otherwise the set holds ``K`` *arcs*. An arc is ``A`` consecutive transitions placed uniformly at random on the
    circle of all ``N`` live transitions (in id order, the newest followed by the oldest); the set holds the episodes
    it reaches, whole, even the two it covers only in part at its ends. A refill (:meth:`refill`, or a background
    thread) places a new arc, evicts the oldest arc and reads the new arc's episodes (a run of consecutive episodes:
    large sequential reads of whole chunks, or ranged blocks, through the store's
    :class:`~her_store.store.rows.ChunkReader`) straight into the ring; the first batch fills the set arc by arc. ``K =
    capacity_rows // max(refill_fraction * capacity_rows, 4 * longest)``, at least 1 (``longest``: the longest live
    episode's ``T + 1`` rows), and ``A`` is the most transitions whose episodes always fit in ``capacity_rows // K``
    rows (at the arc's ends two episodes of at most ``longest`` rows, between them whole episodes of at least the
    shortest length), so that the ring always holds ``K`` arcs. A batch draws an episode of the set with
    probability proportional to the transitions of it that its arc covers (:attr:`episode_shares`; an episode that
    two arcs reached is in the set twice, with each one's share) and the step uniformly among all the episode's
    ``T`` steps, then relabels and rewards exactly as :class:`~her_store.sampling.sampler.HerSampler` does.

    **Every committed transition has the same long-run share of the batches, 1 / N, whatever the episode lengths.**
    A batch takes one of the ``K`` arcs with probability ``1 / K``, within it episode ``e`` with probability
    ``c / A`` (``c``: the transitions of ``e`` the arc covers) and each of its steps with probability ``1 / T_e``. An
    arc placed uniformly covers on average ``A T_e / N`` transitions of ``e``, so each arc gives every transition
    of ``e`` an expected ``1 / (K N)``, and the ``K`` arcs ``1 / N``: exactly, for a given set of live episodes. The
    number of arcs never depends on which episodes they hold (the ring is sized for the worst arc), and during a
    refill's read the set holds the ``K - 1`` others, under the same law. Drawing uniformly over the set's
    transitions instead would favour short episodes: a set holding many of them holds fewer transitions, each then
    drawn more often. The differences from :class:`~her_store.sampling.sampler.HerSampler`'s independent uniform draws:

    - Correlation in time: batches between two refills come from the same ``K`` arcs, each a run of consecutive
      episodes (collected together, by similar policies), and each refill replaces one of them: the sample stream is
      a mixture over slowly changing subsets, not i.i.d. over the store. More refills per batch (a larger
      ``refill_fraction``, the refill keeping up) bring it closer.
    - The set holds ``K A`` covered transitions, fewer than its rows could hold: an arc's episodes are sized for the
      worst arc, and its two end episodes are loaded whole for their covered part's weight. With episodes of one
      length ``L`` much shorter than an arc, ``A`` is about ``(capacity_rows / K - 2 (L + 1)) L / (L + 1)``; with
      very unequal lengths (1 and 300 steps), far fewer. With ``K = 1`` (a set smaller than eight of the longest
      episode) a batch waits for each refill's read.
    - New commits become eligible at the next refill, covered by each arc with probability ``A / N`` per transition,
      so a new episode enters the batches after a geometric number of refills, not at the next refresh.
    - Goals of the ``random`` strategy (and a :class:`~her_store.sampling.relabel.GoalMixture`'s random share) are
      drawn from the set, by the same law as the batch's transitions.
    - An episode the ring evicts leaves the set at the next refill. Until then it may be sampled: its rows are the
      intact copy read while it was live (a refill checks :meth:`EpisodeStore.live_first` after each read and keeps
      only episodes that were still live, so rows the writer was overwriting are never kept).

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
        The share of the set one refill replaces, in ``(0, 0.5]``: the set holds ``capacity_rows //
        max(refill_fraction * capacity_rows, 4 * longest)`` arcs (at least one), and a refill replaces the oldest.
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
        As :class:`~her_store.sampling.sampler.HerSampler` (random goals: from the set).
    io_threads : int, optional
        Threads a refill's read is split across (see :class:`~her_store.store.rows.ChunkReader`).
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
        budget_bytes = check_bounds(check_int(budget_bytes, "budget_bytes"), "budget_bytes", low=1)
        self.refill_fraction = check_number(refill_fraction, "refill_fraction", low=0, high=0.5, low_open=True)
        self.refill_interval = check_number(refill_interval, "refill_interval", low=0, finite=True)
        self.background = check_bool(background, "background")
        self.config = config = SamplerConfig(
            batch_size=batch_size, n_sampled_goal=n_sampled_goal, goal_selection_strategy=goal_selection_strategy,
            reward_fn=reward_fn, device=device, seed=seed, copy_info_dict=copy_info_dict,
            relabel_terminated=relabel_terminated, success_fn=success_fn, io_threads=io_threads,
            cache_bytes=0,  # a refill reads each chunk once, in order: nothing to cache beyond the one in hand
            refresh_interval=refresh_interval,
        )
        self.store = store
        self.her_ratio = config.her_ratio
        self.rng = np.random.default_rng(config.seed)
        self.plan = ReadPlan(store, config.copy_info_dict)
        specs = {spec.path: spec for spec in store.layout.arrays}
        specs = {a.path: specs[a.path] for a in self.plan.arrays}
        self.row_bytes = sum(spec.row_nbytes for spec in specs.values())
        self.capacity_rows = budget_bytes // self.row_bytes
        if self.capacity_rows < 2:
            raise ValueError(
                f"budget_bytes={budget_bytes} holds {self.capacity_rows} row(s) of {self.row_bytes} bytes (one row of "
                f"every array a batch reads: {', '.join(specs)}); a working set needs whole episodes"
            )
        self.budget_bytes = budget_bytes
        try:
            self.set_rows = RingRows(specs, self.capacity_rows, config.device, HOST_FIELDS | set(self.plan.info_keys))
        except (RuntimeError, MemoryError) as e:  # torch's allocators raise RuntimeError (CUDA's a subclass of it)
            raise MemoryError(
                f"budget_bytes={self.budget_bytes}: the working set's {self.capacity_rows} rows of {self.row_bytes} "
                f"bytes ask {config.device} for {self.capacity_rows * self.row_bytes} bytes, which it cannot give "
                f"({e}); lower budget_bytes"
            ) from e
        self.reader = ChunkReader(store, io_threads=config.io_threads, cache_bytes=config.cache_bytes)
        self.committed = CommittedView(store, self.reader, config.refresh_interval)
        self.goal_choice = GoalChoice(config.strategy, self.plan.goal_shape, self.plan.goal_dtype)  # random: the set's
        self.draw = UniformDraw(self.goal_choice, store.url)
        self.gather = Gather(self.plan, self.set_rows)
        self.rewards = reward_recompute(store, config, self.plan.info_keys)
        self.to_device = DeviceTransfer(config.device, config.pin_memory)
        self._state_after = self.rng.bit_generator.state  # RNG state after the last batch handed out
        self._refill_rng = np.random.default_rng(np.random.SeedSequence(config.seed).spawn(1)[0])
        # the set's episodes, oldest loaded first: store id, steps, first ring row (rows run on past the ring's end at
        # its start), the transitions of it its arc covers (its weight), and its arc (-1: loaded whole, the store
        # fitting in the set); one arc's episodes follow each other, in the ring as in this order
        self._ids = self._lengths = self._pos = self._weights = self._arcs = np.zeros(0, np.int64)
        self._tail = 0  # ring row where the next arc's rows go: after the newest episode's rows
        self._next_arc = 0
        self._published: tuple[_SetView, np.ndarray, np.ndarray] = (
            _SetView(self._pos, self._lengths, self._weights, self.rng), self._ids, self._weights
        )
        self._lock = threading.Lock()  # a batch's draw and gather, against a refill changing which rows are live
        self._refill_lock = threading.Lock()  # one refill at a time
        self._halt = threading.Event()
        self._refiller: threading.Thread | None = None
        self._error: BaseException | None = None
        self._closed = False
        reset_in_child(self)
        self.refills = 0
        self.loaded_transitions = 0
        self.refill_seconds = 0.0

    # -- what the set holds ----------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes of the ring (every row of every array), at most ``budget_bytes``."""
        return self.set_rows.nbytes

    @property
    def resident_bytes(self) -> int:
        """Bytes of the rows the set's episodes own (``T + 1`` rows each)."""
        return int((self._published[0].lengths + 1).sum()) * self.row_bytes

    @property
    def episode_ids(self) -> np.ndarray:
        """Ids of the episodes in the set, oldest loaded first (an episode that two arcs reached is in it twice)."""
        return self._published[1].copy()

    @property
    def episode_shares(self) -> np.ndarray:
        """Each of the set's episodes' share of a batch (in the order of :attr:`episode_ids`): the transitions of it
        that its arc covers, over all the set's arcs' transitions; its steps are drawn uniformly."""
        weights = self._published[2]
        return weights / weights.sum() if len(weights) else np.zeros(0)

    @property
    def num_transitions(self) -> int:
        """Transitions of the set's episodes (what a batch is drawn from; an episode in it twice counts twice)."""
        return int(self._published[0].lengths.sum())

    # -- refills -------------------------------------------------------------------------------------------
    def refill(self) -> int:
        """Look for new commits (at ``refresh_interval``) and refill once now; returns the transitions loaded.

        Raises
        ------
        StoreError
            The sampler is closed, or the set cannot hold two of the longest episode.
        """
        self._require_open()
        return self._refill(self.committed.current()) or 0

    def _shape(self, view: IndexView) -> tuple[int, int]:
        """``(K, A)`` for a view whose rows the set cannot hold all at once: the set holds ``K`` arcs of ``A``
        transitions each, in slots of ``S = capacity // K`` rows, ``K = capacity // max(refill_fraction * capacity,
        4 * longest)``, at least 1 (``longest``: the longest episode's ``T + 1`` rows). ``A`` is the most transitions
        whose episodes always fit in a slot: an arc reaches at most two episodes it does not cover whole (``longest``
        rows each) and, between them, whole episodes of at least ``shortest`` steps holding at most ``A - 2`` of its
        transitions, on at most ``(A - 2) (1 + 1 / shortest)`` rows. Slots of four of the longest episode, where the
        set can give ``K >= 2`` of them, keep those two ends to half a slot at most."""
        longest, shortest = int(view.lengths.max()) + 1, int(view.lengths.min())
        C = self.capacity_rows
        arcs = max(1, C // max(int(self.refill_fraction * C), 4 * longest))
        return arcs, 2 + (C // arcs - 2 * longest) * shortest // (shortest + 1)

    def _arc(self, view: IndexView, A: int) -> tuple[np.ndarray, np.ndarray]:
        """An arc of ``A`` transitions placed uniformly on the circle of the view's transitions (in id order, the
        newest followed by the oldest): positions in ``view`` of the episodes it reaches, in circle order, and how
        many of each one's transitions it covers (``A`` in all)."""
        N = view.num_transitions
        u = int(self._refill_rng.integers(N))
        (s, e), (first, last) = view.locate(np.array([u, (u + A - 1) % N]))
        s, e = int(s) - view.first, int(e) - view.first
        pos = np.arange(s, e + 1) if e >= s else np.concatenate([np.arange(s, len(view)), np.arange(e + 1)])
        covered = view.lengths[pos].copy()
        covered[0] -= first
        covered[-1] -= view.lengths[pos[-1]] - 1 - last
        return pos, covered

    def _free(self) -> int:
        """Ring rows from the end of the newest episode's rows to the first row of the oldest one."""
        if not len(self._ids):
            return self.capacity_rows
        return self.capacity_rows - ((self._tail - int(self._pos[0]) - 1) % self.capacity_rows + 1)

    def after_fork(self) -> None:
        """In a forked child: locks anew, no refill thread (the next batch starts one), and the set emptied, to be
        loaded again by the next batch (a refill of the parent's thread may have been half done at the fork)."""
        self._lock, self._refill_lock, self._halt = threading.Lock(), threading.Lock(), threading.Event()
        self._refiller = None
        self._keep(slice(0, 0))
        self._tail = 0
        self._publish()

    def _keep(self, which: Any) -> None:
        self._ids, self._lengths, self._pos = self._ids[which], self._lengths[which], self._pos[which]
        self._weights, self._arcs = self._weights[which], self._arcs[which]

    def _publish(self) -> None:
        self._published = (_SetView(self._pos, self._lengths, self._weights, self.rng), self._ids, self._weights)

    def _refill(self, view: IndexView, evict: bool = True) -> int | None:
        """One refill from the committed ``view``; returns the transitions loaded, or None when it loads nothing: the
        whole view fits in the set and is in it, or (without ``evict``, which keeps the arcs in the set) the set holds
        its arcs."""
        with self._refill_lock:
            self._require_open()
            started = time.perf_counter()
            C = self.capacity_rows
            ring = self.store.capacity is not None
            if ring:  # arcs go round the episodes the writer has not evicted, and those it evicted leave the set
                view = view.since(self.store.live_first())
                with self._lock:
                    self._keep(self._ids >= view.first)
                    self._publish()
            if not len(view):
                return None
            longest = int(view.lengths.max()) + 1
            if 2 * longest > C:
                raise StoreError(
                    f"{self.store.url}: the working set holds {C} rows of {self.row_bytes} bytes "
                    f"(budget_bytes={self.budget_bytes}); it must hold two of the longest episode ({longest} rows): "
                    f"raise budget_bytes to at least {2 * longest * self.row_bytes}"
                )
            with self._lock:  # batches drawn from now on see neither the evicted episodes nor the rows being read
                if view.num_transitions + len(view) <= C:  # the store fits: the set is the store, loaded whole
                    if (self._arcs >= 0).any():  # arcs of a time the store did not fit (a ring's episodes vary)
                        self._keep(slice(0, 0))
                    pos = np.flatnonzero(~np.isin(np.arange(view.first, view.end), self._ids))
                    n = int((view.lengths[pos] + 1).sum())
                    if n > self._free():  # rows of evicted episodes lie between: load the whole store afresh
                        self._keep(slice(0, 0))
                        pos, n = np.arange(len(view)), view.num_transitions + len(view)
                    covered, arc = view.lengths[pos], -1
                else:
                    arcs, A = self._shape(view)
                    pos, covered = self._arc(view, A)
                    n, arc = int((view.lengths[pos] + 1).sum()), self._next_arc
                    while len(self._ids) and (len(np.unique(self._arcs[self._arcs >= 0])) >= arcs or self._free() < n):
                        if not evict:
                            return None
                        self._keep(self._arcs != self._arcs[0])  # the oldest arc (or the store loaded whole)
                    self._next_arc += 1
                self._publish()
                at = self._tail if len(self._ids) else 0
            if not len(pos):
                return None
            ids, starts, lengths = view.first + pos, view.start_rows[pos], view.lengths[pos]
            self.set_rows.load(self.reader, at, _episode_rows(starts, lengths))  # past the ring's end: at its start
            # a ring may have overwritten rows of episodes it evicted during the read: keep only those still live
            first = self.store.live_first() if ring else view.first
            live = ids >= first
            r = lengths + 1
            with self._lock:
                self._keep(self._ids >= first)  # and episodes of the set evicted meanwhile leave with them
                self._ids = np.concatenate([self._ids, ids[live]])
                self._lengths = np.concatenate([self._lengths, lengths[live]])
                self._pos = np.concatenate([self._pos, ((at + np.cumsum(r) - r) % C)[live]])
                self._weights = np.concatenate([self._weights, covered[live]])
                self._arcs = np.concatenate([self._arcs, np.full(int(live.sum()), arc, np.int64)])
                self._tail = (at + n) % C
                self._publish()
            loaded = int(lengths[live].sum())
            self.refills += 1
            self.loaded_transitions += loaded
            self.refill_seconds += time.perf_counter() - started
            return loaded

    def _fill(self, view: IndexView) -> None:
        """Fill the set (the first batch): with the whole view when it fits, else arc by arc until it holds its
        arcs (bounded: each refill adds rows to the ring, two at least, or returns None)."""
        for _ in range(self.capacity_rows):
            if self._refill(view, evict=False) is None:
                return

    def _run(self) -> None:
        while not self._halt.is_set():
            try:
                view = self.committed.view
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

    # -- one batch, from the set ------------------------------------------------------------------------------
    def sample(self, batch_size: int | None = None) -> HerBatch:
        """One batch of ``batch_size`` transitions (default: the sampler's), an int >= 1, drawn from the set.

        Raises
        ------
        StoreError
            No committed episode yet, the sampler is closed, or a refill failed (raised at the next batch).
        """
        self._require_open()
        B = self.batch_size if batch_size is None else check_int(batch_size, "batch_size", low=1)
        batch = self._make_batch(self.committed.current(), B)
        self._state_after = self.rng.bit_generator.state
        return batch

    def __iter__(self) -> Iterator[HerBatch]:
        """Batches forever."""
        while True:
            yield self.sample()

    def _make_batch(self, view: IndexView, B: int) -> HerBatch:
        tries = 100
        for _ in range(tries):
            self._ready(view)
            with self._lock:
                if self._published[0].num_transitions or not view.num_transitions:
                    return self._batch_of_set(B)
            with self._refill_lock:  # a refill that evicted the set's only arc leaves it empty until its read ends
                pass
        if self.store.capacity is not None:
            raise StoreError(
                f"{self.store.url}: {tries} refills in a row kept no episode: the ring writer evicted the episodes of "
                f"the view sampled from ({view.first}..{view.end - 1}; it now keeps {self.store.live_first()} on) "
                "before a refill could keep them; give the ring more capacity, or sample with a smaller "
                "refresh_interval"
            )
        raise StoreError(
            f"{self.store.url}: the set was empty at {tries} batches in a row: each background refill evicted the "
            f"whole set ({self.capacity_rows} rows) to place its arc's episodes; raise budget_bytes or lower "
            "refill_fraction"
        )

    def _batch_of_set(self, B: int) -> HerBatch:
        """Draw among the set's episodes (positions in the set), gather from the ring, name the store's ids, and
        assemble; under ``_lock``."""
        set_view, ids = self._published[0], self._published[1]
        her = np.arange(B) < int(self.her_ratio * B)
        d = self.draw(set_view, her, self.rng)
        now, nxt, goals, finish = self.gather(d.rows, d.goal_rows)
        d = d._replace(episode_ids=ids[d.episode_ids], goal_ids=None if d.goal_ids is None else ids[d.goal_ids])
        return assemble_batch(
            d, now, nxt, goals, finish, goal_choice=self.goal_choice, rewards=self.rewards,
            goals_at=lambda: self._achieved_goals_at(set_view), rng=self.rng, obs_keys=self.plan.obs_keys,
            to_device=self.to_device,
        )

    def _achieved_goals_at(self, view: IndexView) -> Any:
        """A callable strategy's reader of achieved goals: episodes by store id, which must be in the set."""
        ids = self._published[1]
        order = np.argsort(ids)
        known = ids[order]

        def read(episode_ids: np.ndarray, steps: np.ndarray) -> np.ndarray:
            episode_ids, steps = np.asarray(episode_ids, np.int64), np.asarray(steps, np.int64)
            k = np.minimum(np.searchsorted(known, episode_ids), max(len(known) - 1, 0))
            if not len(known) or np.any(known[k] != episode_ids):
                raise IndexError("episode ids must be in the working set (WorkingSetSampler.episode_ids)")
            at = order[k]
            if np.any(steps < 0) or np.any(steps >= view.lengths[at]):
                raise IndexError("steps must satisfy 0 <= step < episode length")
            return self.gather.achieved_goals(view.start_rows[at] + steps + 1)

        return read

    # -- state ---------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The batches' generator state after the last batch handed out (as HerSampler's)."""
        return {"rng": self._state_after}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.rng.bit_generator.state = rng_state(state, self.rng)
        self._state_after = self.rng.bit_generator.state

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
            self.set_rows.release()
        self.reader.close()

    def __enter__(self) -> WorkingSetSampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
