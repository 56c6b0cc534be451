"""HerSampler: uniform transitions from the committed episodes, hindsight goals, recomputed rewards, torch batches.

One batch: draw transitions uniformly (one searchsorted over cumulative episode lengths), choose new goals for
the first ``int(her_ratio * B)`` (SB3's split), gather rows ``t``, ``t + 1`` and the goal rows with one gather
per array (ChunkReader, past zarr), recompute rewards of the relabelled rows, and hand tensors to the device.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import numpy as np
import torch

from her_store.errors import StoreError
from her_store.sampling.relabel import (
    GoalContext,
    GoalMixture,
    GoalSelectionStrategy,
    GoalStrategy,
    her_ratio,
    parse_strategy,
    select_goal_steps,
)
from her_store.store.episode_store import EpisodeStore
from her_store.store.index import IndexView
from her_store.store.rows import ChunkReader

__all__ = ["HerSampler", "HerBatch", "RewardFn"]

RewardFn = Callable[[np.ndarray, np.ndarray, Any], Any]


class HerBatch(NamedTuple):
    """One sampled batch, as torch tensors on the sampler's device.

    Observations keep their stored dtype; rewards and flags are float32 with shape ``(B, 1)``. The first
    ``int(her_ratio * B)`` rows are the relabelled ones (``is_relabeled``). ``source`` is None from a
    :class:`HerSampler`; from a :class:`~her_store.sampling.mixture.MixtureSampler` it is int64 ``(B,)``, the position of
    the store each row came from (``episode_ids`` are that store's ids).
    """

    observations: dict[str, torch.Tensor]
    actions: torch.Tensor
    rewards: torch.Tensor
    next_observations: dict[str, torch.Tensor]
    terminated: torch.Tensor
    truncated: torch.Tensor
    dones: torch.Tensor
    is_relabeled: torch.Tensor
    episode_ids: torch.Tensor
    steps: torch.Tensor
    infos: dict[str, torch.Tensor]
    source: torch.Tensor | None = None


class _Draw(NamedTuple):
    """The random part of a batch (all the sampler's RNG use happens in _draw, in batch order)."""

    episode_ids: np.ndarray
    steps: np.ndarray
    rows: np.ndarray
    lengths: np.ndarray
    her: np.ndarray  # which samples are relabelled
    goal_rows: np.ndarray | None  # rows whose achieved_goal is the new goal of each relabelled sample (built-ins)
    goal_ids: np.ndarray | None  # the episodes those rows belong to
    # relabelled samples whose goal was read at the draw (random goals from other stores, HerSampler._random_goals),
    # and those goals, (relabelled samples, *goal shape), valid where ``given``; their goal rows are the samples' own
    given: np.ndarray | None = None
    given_goals: np.ndarray | None = None


def _finish_all(pending: list[Callable[[], None]]) -> None:
    """Complete every pending gather: each is waited for, whatever the ones before it raised."""
    if pending:
        try:
            pending[0]()
        finally:
            _finish_all(pending[1:])


def _replace_samples(d: _Draw, sub: np.ndarray, d2: _Draw) -> tuple[_Draw, np.ndarray]:
    """``d`` with the samples at positions ``sub`` taken from ``d2`` (drawn for exactly those positions), and
    where those samples' goals sit among the relabelled ones."""
    fields: dict[str, Any] = {}
    for name in ("episode_ids", "steps", "rows", "lengths"):
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


def _random_goal_rows(view: IndexView, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Episodes and next-observation rows of ``n`` transitions drawn uniformly from the view (random goals)."""
    ids, steps = view.locate(rng.integers(0, view.num_transitions, n))
    return ids, view.start_rows[ids - view.first] + steps + 1


class _Lapped(Exception):
    """The ring evicted every episode of the view a prefetched batch was drawn from."""


def _env_reward_fn(store: EpisodeStore) -> RewardFn:
    env_id = store.metadata.get("env_id")
    if not env_id:
        raise StoreError(
            f"{store.url}: HerSampler needs reward_fn(achieved_goal, desired_goal, infos) to recompute rewards of "
            "relabelled transitions, and the store's metadata names no env_id to take compute_reward from; pass "
            "reward_fn=env.unwrapped.compute_reward (or store.update_metadata(env_id=...))"
        )
    import gymnasium as gym

    # "module:Env" makes gymnasium import module, and an unregistered id may name a package to import: a store
    # (perhaps downloaded) must never make this process run code, so only envs this process registered are made
    if not isinstance(env_id, str) or ":" in env_id or env_id not in gym.registry:
        raise StoreError(
            f"{store.url}: the store's metadata names env_id {env_id!r}, which is not an id registered in this "
            "process's gymnasium registry (an id naming a module to import is never resolved); pass "
            "reward_fn=env.unwrapped.compute_reward to HerSampler, or register the env first (import its package)"
        )
    try:
        env = gym.make(env_id)
    except Exception as e:  # a registered env that fails to build: say how to get past it
        raise StoreError(
            f"{store.url}: cannot make env {env_id!r} from the store's metadata to get compute_reward ({e}); "
            "pass reward_fn=... to HerSampler"
        ) from e
    fn = getattr(env.unwrapped, "compute_reward", None)
    if fn is None:
        raise StoreError(f"env {env_id!r} has no compute_reward; pass reward_fn=... to HerSampler")
    return fn


class HerSampler:
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
        from the whole store (SB2, TorchRL). A :class:`~her_store.sampling.relabel.GoalMixture` (offline goal-conditioned
        RL, OGBench's GCDataset) relabels every transition with the current, a future or a random state's goal.
        A callable receives a :class:`~her_store.sampling.relabel.GoalContext` and returns the new goals
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

    Examples
    --------
    >>> sampler = HerSampler(store, batch_size=256, goal_selection_strategy="future", device="cuda")  # doctest: +SKIP
    >>> batch = sampler.sample()  # doctest: +SKIP
    >>> q = critic(batch.observations, batch.actions)  # doctest: +SKIP
    """

    # the goals of relabelled samples that take a random transition's goal (``random``, a GoalMixture's random share):
    # when set, ``_random_goals(rng, n)`` reads ``n`` of them, drawn with the sampler's generator, instead of the
    # sampler drawing them from its own store (a MixtureSampler over a store set draws them from all its stores)
    _random_goals: Callable[[np.random.Generator, int], np.ndarray] | None = None

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
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if n_sampled_goal < 0:
            raise ValueError(f"n_sampled_goal must be >= 0, got {n_sampled_goal}")
        self.store = store
        self.batch_size = int(batch_size)
        self.n_sampled_goal = int(n_sampled_goal)
        self.strategy = parse_strategy(goal_selection_strategy)
        self.her_ratio = her_ratio(self.strategy, self.n_sampled_goal)
        self.reward_fn = reward_fn if reward_fn is not None or self.n_sampled_goal == 0 else _env_reward_fn(store)
        self.device = torch.device(device)
        self.pin_memory = self.device.type == "cuda" if pin_memory is None else bool(pin_memory)
        self.copy_info_dict = copy_info_dict
        self.relabel_terminated = relabel_terminated
        self.success_fn = success_fn
        if refresh_interval is None:  # a writer's own commits are in memory; a reader re-reads commit.json
            refresh_interval = 0.0 if store.mode == "a" else store.backend.defaults.refresh_interval
        self.refresh_interval = float(refresh_interval)
        self.rng = np.random.default_rng(seed)
        self.reader = ChunkReader(store, io_threads=io_threads, cache_bytes=cache_bytes)
        self._plan()
        self._view: IndexView | None = None
        self._refreshed = -np.inf
        self._prefetch = int(prefetch)
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._thread_pid = -1  # the process the producer runs in
        self._stop = threading.Event()
        self._state_after = self.rng.bit_generator.state  # RNG state after the last batch handed out

    # -- layout knowledge, looked up once ----------------------------------------------------------------
    def _plan(self) -> None:
        schema, layout = self.store.schema, self.store.layout
        self._obs_keys = schema.observation_keys
        self._info_keys = schema.info_keys if self.copy_info_dict else ()
        needed = set(self._obs_keys) | {"action", "reward", "terminated", "truncated", *self._info_keys}
        self._arrays = []  # (path, needs next rows, holds achieved_goal, [(field, a, b, shape, per_step)])
        for spec in layout.arrays:
            cols = [(n, a, b) for n, a, b in spec.columns if n in needed]
            if not cols:
                continue
            fields = [(n, a, b, schema.by_name[n].shape, schema.by_name[n].per_step) for n, a, b in cols]
            has_next = any(not per_step for *_, per_step in fields)
            self._arrays.append((spec.path, spec.is_pack, has_next, any(n == "achieved_goal" for n, *_ in fields), fields))
        # observations that relabelling and rewards do not read (image frames): gathered first, and finished once the
        # rest of the batch is assembled, their decoding meanwhile under way on the reader's threads
        computed_on = {"achieved_goal", "desired_goal", *self._info_keys}
        self._later = {
            path for path, is_pack, _, _, fields in self._arrays if not is_pack and not computed_on & {n for n, *_ in fields}
        }
        self._arrays.sort(key=lambda a: a[0] not in self._later)
        self._goal_shape = schema.by_name["achieved_goal"].shape
        self._goal_dtype = schema.by_name["achieved_goal"].dtype

    # -- the committed episodes ----------------------------------------------------------------------------
    def refresh(self, *, reread: bool = True) -> IndexView:
        """Look for new commits now; returns the episodes sampled from. ``reread=False`` takes what the store's
        handle already holds (its owner, a sharded dataset's view, has just refreshed it)."""
        if self.store.mode == "r" and reread:
            self.store.refresh()
        view = self.store.snapshot()
        self.reader.observe(view)  # before the view is published: a gather under it must find its episodes recorded
        self._view = view
        self._refreshed = time.monotonic()
        return view

    def _current_view(self) -> IndexView:
        if self._view is None or time.monotonic() - self._refreshed >= self.refresh_interval:
            self.refresh()
        assert self._view is not None
        return self._view

    # -- one batch ---------------------------------------------------------------------------------------
    def _draw(self, view: IndexView, her: np.ndarray) -> _Draw:
        if view.num_transitions == 0:
            raise StoreError(
                f"{self.store.url} has no committed episode to sample from yet; add at least one whole episode "
                "(and let it commit) before sampling"
            )
        rng = self.rng
        ids, steps = view.locate(rng.integers(0, view.num_transitions, len(her)))
        pos = ids - view.first
        starts, lengths = view.start_rows[pos], view.lengths[pos]
        goal_rows = goal_ids = anywhere = given = given_goals = None
        n_her = int(her.sum())
        if n_her and isinstance(self.strategy, GoalMixture):
            j, anywhere = self.strategy.select(steps[her], lengths[her], rng)
            goal_ids, goal_rows = ids[her], starts[her] + j + 1
        elif n_her and self.strategy is GoalSelectionStrategy.RANDOM:
            anywhere = np.ones(n_her, bool)
            goal_ids, goal_rows = ids[her], starts[her] + steps[her] + 1
        elif n_her and isinstance(self.strategy, GoalSelectionStrategy):
            goal_ids = ids[her]
            goal_rows = starts[her] + select_goal_steps(self.strategy, steps[her], lengths[her], rng) + 1
        if anywhere is not None and goal_ids is not None and goal_rows is not None:
            if self._random_goals is None:
                goal_ids[anywhere], goal_rows[anywhere] = _random_goal_rows(view, rng, int(anywhere.sum()))
            else:  # read elsewhere; the samples' own next rows (gathered anyway) stand in for them until relabelling
                given, given_goals = anywhere, np.zeros((n_her, *self._goal_shape), self._goal_dtype)
                given_goals[anywhere] = self._random_goals(rng, int(anywhere.sum()))
        return _Draw(ids, steps, starts + steps, lengths, her, goal_rows, goal_ids, given, given_goals)

    def _gather(
        self, d: _Draw
    ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], np.ndarray | None, Callable[[], None]]:
        """Fields at rows t, observation fields at rows t + 1, the goal rows' achieved goals (relabelled samples, in
        order), and the function that completes the fields gathered later (``_later``: call it before reading them)."""
        B = len(d.rows)
        now, nxt, goals = {}, {}, None
        field = self._field
        pending: list[Callable[[], None]] = []
        for path, is_pack, has_next, has_goal, fields in self._arrays:
            parts = [d.rows]
            if has_next:
                parts.append(d.rows + 1)
            if has_goal and d.goal_rows is not None:
                parts.append(d.goal_rows)
            at = np.concatenate(parts) if len(parts) > 1 else d.rows
            if path in self._later:
                rows, finish = self._rows_later(path, at)
                pending.append(finish)
            else:
                rows = self._rows(path, at)
            for name, a, b, shape, per_step in fields:
                col = rows[:, a:b] if is_pack else rows
                now[name] = field(name, col[:B], shape)
                if not per_step:
                    nxt[name] = field(name, col[B : 2 * B], shape)
                if name == "achieved_goal" and d.goal_rows is not None:
                    goals = field(name, col[2 * B :], shape)
        return now, nxt, goals, lambda: _finish_all(pending)

    def _rows(self, path: str, rows: np.ndarray) -> np.ndarray:
        """Rows ``rows`` of array ``path``, where :meth:`_gather` reads them: the store's chunks, through the reader."""
        return self.reader.gather(path, rows)

    def _rows_later(self, path: str, rows: np.ndarray) -> tuple[Any, Callable[[], None]]:
        """:meth:`_rows`, started (:meth:`ChunkReader.gather_later`): the rows, and the function that completes them."""
        return self.reader.gather_later(path, rows)

    @staticmethod
    def _field(name: str, col: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        """One field of gathered rows, as batch assembly takes it: ``(len(col), *shape)``, contiguous (a view of
        contiguous rows)."""
        return np.ascontiguousarray(col).reshape(len(col), *shape)

    def _achieved_goals_at(self, view: IndexView) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
        spec, a, b = self.store.layout.fields["achieved_goal"]

        def read(episode_ids: np.ndarray, steps: np.ndarray) -> np.ndarray:
            episode_ids, steps = np.asarray(episode_ids, np.int64), np.asarray(steps, np.int64)
            if np.any(episode_ids < view.first) or np.any(episode_ids >= view.end):
                raise IndexError(f"episode ids must be live ({view.first}..{view.end - 1})")
            lengths = view.lengths[episode_ids - view.first]
            if np.any(steps < 0) or np.any(steps >= lengths):
                raise IndexError("steps must satisfy 0 <= step < episode length")
            rows = self._rows(spec.path, view.start_rows[episode_ids - view.first] + steps + 1)
            return self._field("achieved_goal", rows[:, a:b] if spec.is_pack else rows, self._goal_shape)

        return read

    def _transition_goals(self, k: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """The achieved goals of the next observations of transitions ``k`` of the view sampled from (``0 <= k <
        num_transitions``): another store's random goals, when a mixture draws them from all its stores. From a ring,
        those whose episode the writer evicted meanwhile are drawn again, with ``rng``, among the live ones."""
        view = self._view if self._view is not None else self.refresh()
        spec, a, b = self.store.layout.fields["achieved_goal"]

        def read(rows: np.ndarray) -> np.ndarray:
            got = self._rows(spec.path, rows)
            return self._field("achieved_goal", got[:, a:b] if spec.is_pack else got, self._goal_shape)

        ids, steps = view.locate(k)
        goals = read(view.start_rows[ids - view.first] + steps + 1)
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
            ids[stale], rows = _random_goal_rows(view, rng, int(stale.sum()))
            goals[stale] = read(rows)
        raise StoreError(f"{self.store.url}: the ring writer overtakes the sampler; sample from a larger ring")

    def _rewards(self, achieved: np.ndarray, desired: np.ndarray, infos: Any) -> np.ndarray:
        assert self.reward_fn is not None  # set whenever n_sampled_goal > 0
        r = np.asarray(self.reward_fn(achieved, desired, infos), dtype=np.float32)
        if r.size != len(achieved):
            raise ValueError(
                f"reward_fn returned {r.size} values (shape {r.shape}) for {len(achieved)} transitions; expected "
                "shape (n,) or (n, 1)"
            )
        return r.reshape(-1)

    def _fresh(
        self, view: IndexView, B: int, may_refresh: bool
    ) -> tuple[IndexView, _Draw, dict, dict, np.ndarray | None, Callable[[], None]]:
        """Draw and gather a batch, and the function completing its fields gathered later (:meth:`_gather`). From a
        ring, the rows are complete, and samples whose episode (or goal's episode) the writer evicted meanwhile,
        whose rows may have been overwritten while we read, are drawn again among the live ones; when the writer
        evicted the whole view, among those of a fresh snapshot (``may_refresh``; the prefetch thread may not touch
        the store and raises _Lapped instead)."""
        her = np.arange(B) < int(self.her_ratio * B)
        d = self._draw(view, her)
        now, nxt, goals, finish = self._gather(d)
        if self.store.capacity is None:
            return view, d, now, nxt, goals, finish
        finish()  # the eviction checks below follow the reads
        for _ in range(100):
            first = self.store.live_first()
            stale = d.episode_ids < first
            if d.goal_ids is not None:
                stale[np.flatnonzero(d.her)[d.goal_ids < first]] = True
            if not stale.any():
                return view, d, now, nxt, goals, lambda: None  # complete
            view = view.since(first)
            if view.num_transitions == 0:
                if not may_refresh:
                    raise _Lapped
                view = self.refresh()
                if view.num_transitions == 0:  # caught between an eviction record and its commit: look again
                    continue
            sub = np.flatnonzero(stale)
            d2 = self._draw(view, d.her[sub])
            now2, nxt2, goals2, finish = self._gather(d2)
            finish()
            for k in now:
                now[k][sub] = now2[k]
            for k in nxt:
                nxt[k][sub] = nxt2[k]
            d, at = _replace_samples(d, sub, d2)
            if goals is not None and goals2 is not None:
                goals[at] = goals2
        raise StoreError(f"{self.store.url}: the ring writer overtakes the sampler; sample from a larger ring")

    def _make_batch(self, view: IndexView, B: int, may_refresh: bool = True) -> HerBatch:
        view, d, now, nxt, goals, finish = self._fresh(view, B, may_refresh)
        try:  # while the frames gathered later are decoded
            n, rewards, terminated, infos_np = self._relabel(view, d, now, nxt, goals)
        finally:
            finish()
        relabeled = np.zeros(B, bool)
        relabeled[:n] = True
        t = self._to_device
        return HerBatch(
            observations={k: t(now[k]) for k in self._obs_keys},
            actions=t(now["action"]),
            rewards=t(rewards.reshape(B, 1)),
            next_observations={k: t(nxt[k]) for k in self._obs_keys},
            terminated=t(terminated.reshape(B, 1)),
            truncated=t(now["truncated"].astype(np.float32).reshape(B, 1)),
            dones=t(terminated.reshape(B, 1)),  # a timeout does not stop bootstrapping
            is_relabeled=t(relabeled),
            episode_ids=t(d.episode_ids),
            steps=t(d.steps),
            infos={k: t(v) for k, v in infos_np.items()},
        )

    def _relabel(
        self, view: IndexView, d: _Draw, now: dict, nxt: dict, goals: np.ndarray | None
    ) -> tuple[int, np.ndarray, np.ndarray, dict[str, np.ndarray]]:
        """Relabel the first samples' desired goals (in place, ``now`` and ``nxt``) and recompute their rewards and
        terminations: (relabelled samples, rewards, terminated, info fields)."""
        n = int(d.her.sum())  # the relabelled samples are the first n
        rewards = now["reward"].astype(np.float32, copy=True)
        terminated = now["terminated"].astype(np.float32)
        infos_np = {k: now[k] for k in self._info_keys}
        if n:
            desired = now["desired_goal"]
            if goals is None:  # a callable strategy
                ctx = GoalContext(
                    d.episode_ids[:n], d.steps[:n], d.lengths[:n], desired[:n].copy(), nxt["achieved_goal"][:n],
                    self._achieved_goals_at(view), self.rng,
                )
                assert not isinstance(self.strategy, GoalSelectionStrategy)
                goals = np.asarray(self.strategy(ctx), dtype=self._goal_dtype)
                if goals.shape != (n, *self._goal_shape):
                    raise ValueError(f"goal strategy returned shape {goals.shape}, expected {(n, *self._goal_shape)}")
            if d.given is not None and d.given_goals is not None:
                goals[d.given] = d.given_goals[d.given]
            desired[:n] = goals
            nxt["desired_goal"][:n] = goals
            info_arg = (
                [{k: v[i] for k, v in infos_np.items()} for i in range(n)] if self.copy_info_dict else [{}] * n
            )
            achieved = nxt["achieved_goal"][:n]
            rewards[:n] = self._rewards(achieved, goals, info_arg)
            if self.relabel_terminated:
                if self.success_fn is not None:
                    success = np.asarray(self.success_fn(achieved, goals, info_arg), bool).reshape(-1)
                else:
                    success = rewards[:n] >= self._rewards(achieved, achieved, info_arg)
                terminated[:n] = np.maximum(terminated[:n], success)
        return n, rewards, terminated, infos_np

    def _to_device(self, a: np.ndarray) -> torch.Tensor:
        x = torch.from_numpy(a)
        if self.device.type == "cpu":
            return x
        if self.pin_memory:  # pragma: no cover - page-locked memory needs a CUDA build and GPU, which CI lacks
            x = x.pin_memory()
        return x.to(self.device, non_blocking=self.pin_memory)

    # -- public sampling -----------------------------------------------------------------------------------
    def sample(self, batch_size: int | None = None) -> HerBatch:
        """One batch of ``batch_size`` transitions (default: the sampler's).

        Raises
        ------
        StoreError
            No committed episode yet (as SB3 raises before its buffer holds one).
        """
        B = self.batch_size if batch_size is None else int(batch_size)
        if B < 1:
            raise ValueError(f"batch_size must be >= 1, got {B}")
        view = self._current_view()
        if self._prefetch and B == self.batch_size:
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
    def _producer(self) -> None:
        assert self._queue is not None
        while not self._stop.is_set():
            try:
                view = self._view
                assert view is not None
                batch = self._make_batch(view, self.batch_size, may_refresh=False)
                item: tuple[Any, Any] = (batch, self.rng.bit_generator.state)
            except BaseException as e:  # handed to the consumer, raised there
                item = (e, None)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item[1] is None:
                return

    def _take_prefetched(self) -> HerBatch:
        if self._thread is not None and self._thread_pid != os.getpid():
            self._stop_prefetch()
        if self._thread is None:
            self._queue = queue.Queue(maxsize=self._prefetch)
            self._stop.clear()
            self._thread = threading.Thread(target=self._producer, name="her_store-prefetch", daemon=True)
            self._thread.start()
            self._thread_pid = os.getpid()
        q = self._queue
        assert q is not None
        while True:
            try:
                batch, state = q.get(timeout=0.1)
                break
            except queue.Empty:
                if self._queue is not q:  # stopped meanwhile by another thread: no batch will come
                    raise StoreError(
                        "the sampler's prefetching was stopped (close() or load_state_dict() in another thread) while "
                        "sample() waited for a batch"
                    ) from None
        if state is None:  # the producer has stopped: rewind the generator to the last batch handed out
            self._stop_prefetch()
            raise batch
        self._state_after = state
        return batch

    def _stop_prefetch(self) -> None:
        """Stop the producer and rewind the generator to just after the last batch handed out.

        In a forked child the producer is the parent's: the child has no such thread, and the producer may have held
        the locks of the queue, the stop event and the generator at the fork, so all three are replaced unused; the
        child's next prefetched batch starts a producer of its own, which draws what the parent draws after the
        batches it handed out.
        """
        if self._thread is None:
            return
        if self._thread_pid == os.getpid():
            self._stop.set()
            self._thread.join()
        else:
            self._stop = threading.Event()
            self.rng = np.random.Generator(type(self.rng.bit_generator)(0))
        self._thread = None
        self._queue = None
        self.rng.bit_generator.state = self._state_after

    # -- state ---------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The generator state after the last batch handed out: a resumed run draws the same batches."""
        return {"rng": self._state_after}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._stop_prefetch()
        self.rng.bit_generator.state = dict(state["rng"])
        self._state_after = self.rng.bit_generator.state

    def close(self) -> None:
        """Stop prefetching and release the reader's maps and threads (the store stays open)."""
        self._stop_prefetch()
        self.reader.close()

    def __enter__(self) -> HerSampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
