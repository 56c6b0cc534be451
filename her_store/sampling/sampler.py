"""HerSampler: uniform transitions from the committed episodes, hindsight goals, recomputed rewards, torch batches.

One batch is the composition of the sampling package's parts: the draw (transitions uniform over the committed
episodes, one searchsorted over cumulative lengths; the first ``int(her_ratio * B)`` marked for relabelling, SB3's
split, with their goal rows), the gather (rows ``t``, ``t + 1`` and the goal rows, one read per array through the
store's ChunkReader), the goal choice and reward recomputation of the relabelled rows, and the transfer to the
device. From a ring, samples whose episode the writer evicted during the read are drawn again among the live ones.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from her_store.checks import check_callable, check_int, check_number
from her_store.errors import StoreError
from her_store.format.layout import PRIORITY_SINCE
from her_store.sampling.batch import DeviceTransfer, HerBatch, assemble_batch
from her_store.sampling.committed import CommittedView
from her_store.sampling.config import ConfiguredSampler, SamplerConfig, reward_recompute, rng_state
from her_store.sampling.draw import UniformDraw, replace_samples
from her_store.sampling.drawn import Draw
from her_store.sampling.episode_priority import EpisodePriorityDraw
from her_store.sampling.gather import Gather, ReadPlan, StoreRows
from her_store.sampling.prefetch import Prefetcher
from her_store.sampling.priority_checkpoint import PriorityCheckpoint
from her_store.sampling.relabel import GoalChoice, GoalStrategy, RandomGoalSource, random_transition_rows
from her_store.sampling.rewards import RewardFn
from her_store.sampling.transition_priority import TransitionPriorities, TransitionPriorityDraw
from her_store.store.episode_store import EpisodeStore
from her_store.store.index import IndexView
from her_store.store.rows import ChunkReader

__all__ = ["HerBatch", "HerSampler", "RewardFn"]


class _Lapped(Exception):
    """The ring evicted every episode of the view a prefetched batch was drawn from."""


class HerSampler(ConfiguredSampler):
    """Hindsight Experience Replay batches straight from an :class:`EpisodeStore`.

    Parameters
    ----------
    store : EpisodeStore
        Any store handle: a writer's (sees its own commits) or a reader's (refreshes to see another process's).
    batch_size : int
        Default batch size of :meth:`sample`.
    n_sampled_goal : int
        Virtual transitions per real one: ``her_ratio = 1 - 1 / (n_sampled_goal + 1)``, as SB3; 0 disables
        relabelling. A :class:`~her_store.sampling.relabel.GoalMixture` relabels every transition (``her_ratio = 1``)
        unless this is 0.
    goal_selection_strategy : {"future", "final", "episode", "random"}, GoalSelectionStrategy, GoalMixture or callable
        future/final/episode follow SB3; random takes the next achieved goal of a transition drawn uniformly
        from the whole store (SB2, TorchRL). A :class:`~her_store.sampling.relabel.GoalMixture` (offline
        goal-conditioned RL, OGBench's GCDataset) relabels every transition with the current, a future or a random
        state's goal. A callable receives a :class:`~her_store.sampling.relabel.GoalContext` and returns the new goals
        ``(n, *goal shape)``.
    reward_fn : callable, optional
        ``reward_fn(achieved_goal, desired_goal, infos)`` -> rewards ``(n,)``, vectorised (gymnasium-robotics /
        SB3 ``compute_reward``). Default: ``compute_reward`` of the env named by the store's ``env_id`` metadata,
        if that id is registered in this process's gymnasium registry (a store never makes the sampler import a
        module: an id of the form ``"module:Env"`` or an unregistered one raises StoreError).
    device : str or torch.device
        Where batches go. On CUDA, host tensors are pinned and copied with ``non_blocking=True``.
    seed : int, optional
        Seed of the sampler's generator (see :meth:`state_dict`).
    copy_info_dict : bool
        Pass the stored info keys of the sampled transitions to ``reward_fn`` (as SB3: one dict per
        transition) and return them in ``HerBatch.infos``; otherwise ``reward_fn`` gets empty dicts.
    prefetch : int
        Batches prepared ahead in a background thread (0: none); a forked child starts a thread of its own.
    pin_memory : bool, optional
        Default: True when the device is CUDA.
    relabel_terminated : bool
        Mark a relabelled transition terminated when its next achieved goal reaches the new goal (SB3 issue
        #627); the stored flag is kept as well (OR). Default False keeps SB3's behaviour.
    success_fn : callable, optional
        ``success_fn(achieved_goal, desired_goal, infos)`` -> bool ``(n,)`` for ``relabel_terminated``; default:
        the recomputed reward equals the reward of reaching the goal, ``reward_fn(ag, ag, infos)``.
    io_threads : int, optional
        Threads a gather is split across; 8-32 for a store larger than RAM. Default: one per core for a store with
        compressed images (their frames are decoded in these threads), else 0 (see :class:`ChunkReader`).
    cache_bytes : int
        Cache per compressed or remote array (decoded chunks, or fetched shards on object storage).
    refresh_interval : float, optional
        Seconds between looks for new commits (0: before every batch). Default: 0 for a writing handle (its
        commits are in memory), 0.1 s for a reader on local disk, 1 s on object storage (a GET each).
    random_goals : RandomGoalSource, optional
        Where the goals of relabelled samples that take a random transition's goal (``random``, a GoalMixture's
        random share) come from: ``random_goals(rng, n)`` with the sampler's generator. Default: transitions drawn
        uniformly from this store (a :class:`~her_store.sampling.mixture.MixtureSampler` over a sharded dataset
        passes one drawing from every shard).
    prioritize : {None, "energy", "td"}
        None draws transitions uniformly. "energy" draws episodes by their committed ``priority`` (by default their
        trajectory energy, :class:`~her_store.store.energy.EnergyPriority`), shaped by ``temperature`` and
        ``rank`` (:func:`~her_store.sampling.episode_priority.episode_weights`), and steps uniformly within them.
        "td" is proportional prioritized replay: batches carry ``weights`` and ``indices``, and
        :meth:`update_priorities` sets priorities from TD errors
        (:class:`~her_store.sampling.transition_priority.TransitionPriorities`). Relabelling is the same in every
        mode.
    alpha, beta, priority_eps : float
        "td": probabilities ``(|td| + priority_eps) ** alpha`` normalised; importance weights with exponent ``beta``
        (anneal it with ``sampler.beta = ...``).
    temperature : float
        "energy": weights ``priority ** (1 / temperature)``.
    rank : str, optional
        "energy": weigh the ranks of the priorities (``"dense"``, ``"min"``, ...) rather than the priorities.
    priority_checkpoint : float, optional
        "td": seconds between checkpoints of the priorities to the store, taken by :meth:`update_priorities`, and
        one at :meth:`close`; a sampler made on the store again resumes from the last. None: no checkpoint.

    Every option but ``random_goals`` is checked by :class:`~her_store.sampling.config.SamplerConfig` (ValueError
    or TypeError naming it); :meth:`from_config` builds a sampler from one.

    Attributes
    ----------
    config : SamplerConfig
        The options.
    store : EpisodeStore
        The store sampled.
    reader : ChunkReader
        Reads the store's rows (its chunk files, mapped or fetched).
    committed : CommittedView
        The committed episodes drawn from, refreshed every ``refresh_interval`` seconds.
    plan : ReadPlan
        The arrays and fields a batch reads.
    goal_choice : GoalChoice
        Chooses the relabelled samples' goals (the strategy, and ``random_goals``).
    draw : UniformDraw
        Draws a batch's transitions and goal rows.
    gather : Gather
        Gathers their rows from the store (:class:`~her_store.sampling.gather.StoreRows` over ``reader``).
    rewards : RewardRecompute
        Recomputes the relabelled rows' rewards (and terminations).
    to_device : DeviceTransfer
        Hands the batch's fields to ``device``.
    her_ratio : float
        The relabelled share of a batch (the first ``int(her_ratio * B)`` rows).
    rng : numpy.random.Generator
        The generator every draw takes (see :meth:`state_dict`).
    priorities : TransitionPriorities or None
        With ``prioritize="td"``: the priorities drawn by, in RAM, and their checkpoint.

    Examples
    --------
    >>> sampler = HerSampler(store, batch_size=256, goal_selection_strategy="future", device="cuda")  # doctest: +SKIP
    >>> batch = sampler.sample()  # doctest: +SKIP
    >>> q = critic(batch.observations, batch.actions)  # doctest: +SKIP
    """

    def __init__(
        self,
        store: EpisodeStore,
        batch_size: int = 256,
        *,
        n_sampled_goal: int = 4,
        goal_selection_strategy: GoalStrategy = "future",
        reward_fn: RewardFn | None = None,
        device: str | torch.device = "cpu",
        seed: int | None = None,
        copy_info_dict: bool = False,
        prefetch: int = 0,
        pin_memory: bool | None = None,
        relabel_terminated: bool = False,
        success_fn: RewardFn | None = None,
        io_threads: int | None = None,
        cache_bytes: int = 32 << 20,
        refresh_interval: float | None = None,
        random_goals: RandomGoalSource | None = None,
        prioritize: str | None = None,
        alpha: float = 0.6,
        beta: float = 0.4,
        priority_eps: float = 1e-6,
        temperature: float = 1.0,
        rank: str | None = None,
        priority_checkpoint: float | None = 60.0,
    ) -> None:
        config = SamplerConfig(
            batch_size=batch_size, n_sampled_goal=n_sampled_goal, goal_selection_strategy=goal_selection_strategy,
            reward_fn=reward_fn, device=device, seed=seed, copy_info_dict=copy_info_dict, prefetch=prefetch,
            pin_memory=pin_memory, relabel_terminated=relabel_terminated, success_fn=success_fn,
            io_threads=io_threads, cache_bytes=cache_bytes, refresh_interval=refresh_interval, prioritize=prioritize,
            alpha=alpha, beta=beta, priority_eps=priority_eps, temperature=temperature, rank=rank,
            priority_checkpoint=priority_checkpoint,
        )
        self._compose(store, config, random_goals)

    @classmethod
    def from_config(
        cls, store: EpisodeStore, config: SamplerConfig, *, random_goals: RandomGoalSource | None = None
    ) -> HerSampler:
        """A sampler of ``store`` with the options of ``config`` (checked when it was made)."""
        sampler = cls.__new__(cls)
        sampler._compose(store, config, random_goals)
        return sampler

    def _compose(self, store: EpisodeStore, config: SamplerConfig, random_goals: RandomGoalSource | None) -> None:
        self.config = config
        self.store = store
        self.her_ratio = config.her_ratio
        self.rng = np.random.default_rng(config.seed)
        self.reader = ChunkReader(store, io_threads=config.io_threads, cache_bytes=config.cache_bytes)
        self.committed = CommittedView(store, self.reader, config.refresh_interval)
        self.plan = ReadPlan(store, config.copy_info_dict)
        random_goals = check_callable(random_goals, "random_goals", or_none=True)
        self.goal_choice = GoalChoice(config.strategy, self.plan.goal_shape, self.plan.goal_dtype, random_goals)
        self.priorities: TransitionPriorities | None = None
        self.draw = self._draw_of(store, config)
        self.gather = Gather(self.plan, StoreRows(self.reader))
        self.rewards = reward_recompute(store, config, self.plan.info_keys)
        self.to_device = DeviceTransfer(config.device, config.pin_memory)
        self._prefetcher = Prefetcher(config.prefetch, self._produce)
        self._state_after = self.rng.bit_generator.state  # RNG state after the last batch handed out

    def _draw_of(
        self, store: EpisodeStore, config: SamplerConfig
    ) -> UniformDraw | EpisodePriorityDraw | TransitionPriorityDraw:
        """The draw ``config.prioritize`` names."""
        if config.prioritize is None:
            return UniformDraw(self.goal_choice, store.url)
        if config.prioritize == "energy":
            if store.layout.version < PRIORITY_SINCE:
                raise StoreError(
                    f"{store.url} has format version {store.layout.version}, whose episodes have no priority; "
                    f"prioritize='energy' needs a store of version {PRIORITY_SINCE} or later (append its episodes to "
                    "a new store)"
                )
            return EpisodePriorityDraw(self.goal_choice, store.url, config.temperature, config.rank)
        checkpoint = None
        if config.priority_checkpoint is not None:
            checkpoint = PriorityCheckpoint(store.backend, store.attrs["created_at"], store.durability == "fsync")
        self.priorities = TransitionPriorities(
            config.alpha, config.priority_eps, checkpoint, config.priority_checkpoint,
            lambda: store.commit_record.array_rows,
        )
        return TransitionPriorityDraw(self.goal_choice, store.url, self.priorities, config.beta)

    def transition_goals(self, k: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """The achieved goals of the next observations of transitions ``k`` of the view sampled from (``0 <= k <
        num_transitions``): random goals of another sampler, when a mixture draws them from all its stores. From a
        ring, those whose episode the writer evicted meanwhile are drawn again, with ``rng``, among the live ones."""
        view = self.committed.view if self.committed.view is not None else self.refresh()
        ids, steps = view.locate(k)
        goals = self.gather.achieved_goals(view.start_rows[ids - view.first] + steps + 1)
        if self.store.capacity is None:
            return goals
        for _ in range(100):
            first = self.store.live_first()
            stale = ids < first
            if not stale.any():
                return goals
            view = view.since(first)
            if view.num_transitions == 0:
                view = self.refresh()
                continue
            ids[stale], rows = random_transition_rows(view, rng, int(stale.sum()))
            goals[stale] = self.gather.achieved_goals(rows)
        raise StoreError(f"{self.store.url}: the ring writer overtakes the sampler; sample from a larger ring")

    # -- one batch -----------------------------------------------------------------------------------------
    def _achieved_goals_at(self, view: IndexView) -> Any:
        """A callable strategy's reader of achieved goals (``GoalContext.achieved_goals``) of ``view``'s episodes."""

        def read(episode_ids: np.ndarray, steps: np.ndarray) -> np.ndarray:
            episode_ids, steps = np.asarray(episode_ids, np.int64), np.asarray(steps, np.int64)
            if np.any(episode_ids < view.first) or np.any(episode_ids >= view.end):
                raise IndexError(f"episode ids must be live ({view.first}..{view.end - 1})")
            lengths = view.lengths[episode_ids - view.first]
            if np.any(steps < 0) or np.any(steps >= lengths):
                raise IndexError("steps must satisfy 0 <= step < episode length")
            return self.gather.achieved_goals(view.start_rows[episode_ids - view.first] + steps + 1)

        return read

    def _fresh(self, view: IndexView, B: int, may_refresh: bool) -> tuple[IndexView, Draw, dict, dict, Any, Any]:
        """Draw and gather a batch, and the function completing its fields gathered later (:class:`Gather`). From a
        ring, the rows are complete, and samples whose episode (or goal's episode) the writer evicted meanwhile,
        whose rows may have been overwritten while we read, are drawn again among the live ones; when the writer
        evicted the whole view, among those of a fresh snapshot (``may_refresh``; the prefetch thread may not touch
        the store and raises _Lapped instead)."""
        her = np.arange(B) < int(self.her_ratio * B)
        view = self.draw.current(view)
        d = self.draw(view, her, self.rng)
        now, nxt, goals, finish = self.gather(d.rows, d.goal_rows)
        if self.store.capacity is None:
            return view, self._weighted(d), now, nxt, goals, finish
        finish()  # the eviction checks below follow the reads
        for _ in range(100):
            first = self.store.live_first()
            stale = d.episode_ids < first
            if d.goal_ids is not None:
                stale[np.flatnonzero(d.her)[d.goal_ids < first]] = True
            if not stale.any():
                return view, self._weighted(d), now, nxt, goals, lambda: None  # complete
            view = view.since(first)
            if view.num_transitions == 0:
                if not may_refresh:
                    raise _Lapped
                view = self.refresh()
                if view.num_transitions == 0:  # caught between an eviction record and its commit: look again
                    continue
            sub = np.flatnonzero(stale)
            d2 = self.draw(view, d.her[sub], self.rng)
            now2, nxt2, goals2, finish = self.gather(d2.rows, d2.goal_rows)
            finish()
            for k in now:
                now[k][sub] = now2[k]
            for k in nxt:
                nxt[k][sub] = nxt2[k]
            d, at = replace_samples(d, sub, d2)
            if goals is not None and goals2 is not None:
                goals[at] = goals2
        raise StoreError(f"{self.store.url}: the ring writer overtakes the sampler; sample from a larger ring")

    def _weighted(self, d: Draw) -> Draw:
        """``d`` with its importance weights (``prioritize="td"``), over one state of the tree for the whole batch."""
        return self.draw.weighted(d) if isinstance(self.draw, TransitionPriorityDraw) else d

    def _make_batch(self, view: IndexView, B: int, may_refresh: bool = True) -> HerBatch:
        view, d, now, nxt, goals, finish = self._fresh(view, B, may_refresh)
        return assemble_batch(
            d, now, nxt, goals, finish, goal_choice=self.goal_choice, rewards=self.rewards,
            goals_at=lambda: self._achieved_goals_at(view), rng=self.rng, obs_keys=self.plan.obs_keys,
            to_device=self.to_device,
        )

    # -- public sampling -----------------------------------------------------------------------------------
    def sample(self, batch_size: int | None = None) -> HerBatch:
        """One batch of ``batch_size`` transitions (default: the sampler's), an int >= 1.

        Raises
        ------
        StoreError
            No committed episode yet (as SB3 raises before its buffer holds one).
        """
        B = self.batch_size if batch_size is None else check_int(batch_size, "batch_size", low=1)
        view = self.committed.current()
        if self.config.prefetch and B == self.batch_size:
            try:
                return self._take_prefetched()
            except _Lapped:  # the ring evicted the producer's whole view: this batch is drawn here, afresh
                view = self.refresh()
        self._stop_prefetch()
        batch = self._make_batch(view, B)
        self._state_after = self.rng.bit_generator.state
        return batch

    def __iter__(self) -> Iterator[HerBatch]:
        """Batches forever."""
        while True:
            yield self.sample()

    # -- prefetch ------------------------------------------------------------------------------------------
    def _produce(self) -> tuple[HerBatch, dict[str, Any]]:
        """One batch made ahead (in the producer thread), and the generator's state after it."""
        view = self.committed.view
        assert view is not None
        return self._make_batch(view, self.batch_size, may_refresh=False), self.rng.bit_generator.state

    def _take_prefetched(self) -> HerBatch:
        if self._prefetcher.inherited:
            self._stop_prefetch()
        batch, state = self._prefetcher.take()
        if state is None:  # the producer has stopped: rewind the generator to the last batch handed out
            self._stop_prefetch()
            raise batch
        self._state_after = state
        return batch

    def _stop_prefetch(self) -> None:
        """Stop the producer and rewind the generator to just after the last batch handed out.

        In a forked child the producer is the parent's and may have held the generator's lock at the fork: the
        generator is replaced unused (the prefetcher replaces its own queue and stop event), and the child's next
        prefetched batch starts a producer of its own, which draws what the parent draws after the batches it handed
        out.
        """
        how = self._prefetcher.stop()
        if how == "idle":
            return
        if how == "inherited":
            self.rng = np.random.Generator(type(self.rng.bit_generator)(0))
        self.rng.bit_generator.state = self._state_after

    # -- prioritized replay ----------------------------------------------------------------------------------
    @property
    def beta(self) -> float:
        """The importance-sampling exponent of ``prioritize="td"`` (anneal it toward 1 as training goes)."""
        return self._td_draw("beta").beta

    @beta.setter
    def beta(self, value: float) -> None:
        self._td_draw("beta").beta = check_number(value, "beta", low=0)

    def update_priorities(self, indices: Any, td_errors: Any) -> int:
        """Set the priorities of a batch's transitions from their TD errors (``prioritize="td"``).

        Parameters
        ----------
        indices : torch.Tensor or numpy.ndarray
            ``batch.indices`` of a batch of this sampler.
        td_errors : torch.Tensor or numpy.ndarray
            One per index; the priority is ``|td_error| + priority_eps``.

        Returns
        -------
        int
            How many were set: transitions of episodes the ring evicted since the batch are dropped.

        Raises
        ------
        ValueError
            The sampler does not prioritize by TD error, or the arguments are not one finite error per index of
            its batches.

        Examples
        --------
        >>> batch = sampler.sample()  # doctest: +SKIP
        >>> td = (q(batch) - target(batch)).detach()  # doctest: +SKIP
        >>> loss = (batch.weights * td**2).mean()  # doctest: +SKIP
        >>> sampler.update_priorities(batch.indices, td)  # doctest: +SKIP
        """
        self._td_draw("update_priorities")
        assert self.priorities is not None
        return self.priorities.update(indices, td_errors)

    def checkpoint_priorities(self) -> bool:
        """Write the priorities to the store now (``prioritize="td"`` with ``priority_checkpoint``); returns whether
        anything changed since the last checkpoint and was written."""
        self._td_draw("checkpoint_priorities")
        assert self.priorities is not None
        return self.priorities.save()

    def _td_draw(self, what: str) -> TransitionPriorityDraw:
        if not isinstance(self.draw, TransitionPriorityDraw):
            raise ValueError(f"{what} is for prioritize='td'; this sampler has prioritize={self.config.prioritize!r}")
        return self.draw

    # -- state ---------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The generator state after the last batch handed out: a resumed run draws the same batches."""
        return {"rng": self._state_after}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._stop_prefetch()
        self.rng.bit_generator.state = rng_state(state, self.rng)
        self._state_after = self.rng.bit_generator.state

    def close(self) -> None:
        """Stop prefetching, checkpoint the priorities (``prioritize="td"``) and release the reader's maps and threads
        (the store stays open)."""
        self._stop_prefetch()
        try:
            if self.priorities is not None:
                self.priorities.save()
        finally:
            self.reader.close()

    def __enter__(self) -> HerSampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
