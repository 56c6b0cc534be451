"""MixtureSampler: HER batches drawn from several stores with weights (an offline dataset mixed into online training).

One :class:`~her_store.sampling.sampler.HerSampler` per store, built from the mixture's one
:class:`~her_store.sampling.config.SamplerConfig`, does the drawing, relabelling and gathering; this module splits
each batch among the stores (two multinomial draws), checks that their spaces match, gives the samplers of a store
set one random goal source over all its stores (:class:`StoreSetGoals`), and joins the parts into one
:class:`~her_store.sampling.batch.HerBatch` whose ``source`` names each row's store.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np
import torch

from her_store.checks import check_int
from her_store.errors import SchemaMismatchError, StoreError, short_repr
from her_store.format.schema import space_to_json
from her_store.sampling.batch import HerBatch
from her_store.sampling.config import SamplerConfig, check_options
from her_store.sampling.sampler import HerSampler
from her_store.store.episode_store import EpisodeStore

__all__ = ["MixtureSampler", "StoreSet", "StoreSetGoals"]

# a store set lists its stores (one LIST on object storage): looked at this often unless refresh_interval says
_STORE_SET_INTERVAL = 1.0
# the per-store samplers' options a mixture passes on (batch_size and seed are its own arguments)
_OPTIONS = frozenset(f.name for f in dataclasses.fields(SamplerConfig)) - {"batch_size", "seed"}


@runtime_checkable
class StoreSet(Protocol):
    """Stores that may grow in number, such as a sharded dataset's read view.

    ``stores`` lists read handles in a fixed order: a store keeps its position, new ones are appended (a
    batch's ``source`` is that position). ``refresh()`` looks for new stores; what it returns is ignored.
    """

    @property
    def stores(self) -> Sequence[EpisodeStore]: ...

    def refresh(self) -> object: ...


def _fields(store: EpisodeStore, with_infos: bool) -> dict[str, tuple[str, Any]]:
    """What a batch carries of a store, by field name: (role, the field's space as JSON)."""
    schema = store.schema
    out: dict[str, tuple[str, Any]] = {
        k: ("observation", space_to_json(s)) for k, s in schema.observation_space.spaces.items()
    }
    out["action"] = ("action", space_to_json(schema.action_space))
    if with_infos:
        out.update({k: ("info", space_to_json(s)) for k, s in schema.info_spaces.items()})
    return out


def _check_same_spaces(ref: EpisodeStore, ref_pos: int, store: EpisodeStore, pos: int, with_infos: bool) -> None:
    """Raise SchemaMismatchError naming the first field (in the reference store's order) that differs."""
    want, got = _fields(ref, with_infos), _fields(store, with_infos)
    where = f"MixtureSampler: store {pos} ({store.url}) does not match store {ref_pos} ({ref.url})"
    for name in [*want, *(k for k in got if k not in want)]:
        if name not in got or name not in want:
            has, lacks = (ref_pos, pos) if name in want else (pos, ref_pos)
            raise SchemaMismatchError(f"{where}: store {has} has field {name!r}, store {lacks} has not")
        (role, a), (_, b) = want[name], got[name]
        if a != b:
            diff = next(k for k in (*a, *b) if a.get(k) != b.get(k))  # type, shape, dtype, low, high, n, ...
            raise SchemaMismatchError(
                f"{where}: {role} {name!r} has {diff} {short_repr(b.get(diff))}, expected {short_repr(a.get(diff))}"
            )


def _fixed_weights(weights: Any, n: int) -> np.ndarray:
    try:
        w = np.asarray(weights)
        if w.dtype.kind not in "biuf" or w.dtype == bool:  # numbers only: not '1', not True
            raise TypeError(f"dtype {w.dtype}")
        w = w.astype(np.float64)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"weights must be a sequence of non-negative numbers or 'transitions', got {short_repr(weights)}"
        ) from e
    if w.ndim != 1 or len(w) != n:
        raise ValueError(f"weights has {w.size} value(s) (shape {w.shape}); expected one per store, {n}")
    for bad, what in ((~np.isfinite(w), "finite numbers"), (w < 0, ">= 0")):
        if bad.any():
            first = int(np.flatnonzero(bad)[0])
            raise ValueError(f"weights must be {what}, got {short_repr(weights)} (weight {first})")
    if w.max() <= 0:
        raise ValueError(f"weights must not all be 0, got {short_repr(weights)}")
    w = w / w.max()  # scaled first: the sum of large finite weights would overflow
    return w / w.sum()


class StoreSetGoals:
    """A store set's random goals, given to each of its stores' samplers as their ``random_goals``
    (:class:`~her_store.sampling.relabel.RandomGoalSource`): the achieved goals of the next observations of ``n``
    transitions drawn uniformly, with the relabelling sampler's generator, from the committed transitions of all the
    stores, as their samplers' views hold them.

    Parameters
    ----------
    samplers : sequence of HerSampler
        The stores' samplers, read at each draw (a mixture's own list, to which stores that join are appended).
    """

    def __init__(self, samplers: Sequence[HerSampler]) -> None:
        self.samplers = samplers

    def __call__(self, rng: np.random.Generator, n: int) -> np.ndarray:
        counts = np.array([0 if s.view is None else s.view.num_transitions for s in self.samplers], np.int64)
        ends = np.cumsum(counts)
        k = rng.integers(0, int(ends[-1]), n)
        store = np.searchsorted(ends, k, side="right")
        k -= (ends - counts)[store]
        goals: np.ndarray | None = None
        for pos in np.unique(store):
            sel = store == pos
            got = self.samplers[pos].transition_goals(k[sel], rng)
            if goals is None:
                goals = np.empty((n, *got.shape[1:]), got.dtype)
            goals[sel] = got
        assert goals is not None  # the goal choice asks for n >= 1
        return goals


class MixtureSampler:
    """Hindsight Experience Replay batches drawn from several stores in set proportions.

    Each batch of ``B`` rows is split among the stores at random with probabilities ``p`` (the normalised
    weights): the ``M = int(her_ratio * B)`` relabelled rows by ``rng.multinomial(M, p)`` and the others by
    ``rng.multinomial(B - M, p)``, so each store's count is ``Multinomial(B, p)`` and each store's rows are
    relabelled at the sampler's ``her_ratio``. One :class:`~her_store.sampling.sampler.HerSampler` per store (all built
    with the same arguments) draws its rows in one call; the batch keeps HerBatch's contract: the first ``M`` rows
    are the relabelled ones (by store within them), ``is_relabeled`` marks them, and ``source`` (int64 ``(B,)``)
    is the position of each row's store, whose ids ``episode_ids`` are.

    Random goals (the ``random`` strategy and a :class:`~her_store.sampling.relabel.GoalMixture`'s random share) are the
    achieved goals of transitions drawn uniformly from one dataset's committed transitions. A :class:`StoreSet`, such
    as a sharded dataset's view, is one dataset: a row's random goal comes from any of its stores, drawn uniformly
    from all their committed transitions (each store's view as of its last refresh), whichever store the row came from.
    A sequence of stores is a mixture of separate datasets (online experience and an offline dataset, say), and a
    row's random goal comes from its own store: each store's rows are then exactly the rows a
    :class:`~her_store.sampling.sampler.HerSampler` on that store gives, whatever the other stores hold, and the
    weights set how much each dataset contributes, goals included (from all stores, a store's goals would follow its
    share of the transitions rather than its weight). To draw goals from all the stores of a list, pass them as a
    StoreSet.

    Parameters
    ----------
    stores : sequence of EpisodeStore, or StoreSet
        Local, object-storage or HTTP (read-only) handles, a writer's included. Or a :class:`StoreSet` (an object
        with ``stores`` and ``refresh()``, such as a sharded dataset's read view): :meth:`refresh` calls its
        ``refresh()`` and samples the stores that appeared too; it takes ``weights="transitions"``.
    weights : sequence of float, or "transitions"
        One non-negative weight per store, normalised (a store's share of each batch, in expectation). Or
        ``"transitions"``: each store's committed transitions as of its last refresh, which makes the mixture
        uniform over all committed transitions of all stores. A store with no committed transition gets no
        sample under ``"transitions"``; a positive fixed weight on such a store raises StoreError when sampling.
    batch_size : int
        Default batch size of :meth:`sample`.
    seed : int, optional
        Seeds the split and, through ``numpy.random.SeedSequence`` spawn keys, each store's sampler (store ``i``
        gets the same stream whenever it joins).
    **her_sampler_kwargs
        The options of every store's :class:`~her_store.sampling.sampler.HerSampler` (``n_sampled_goal``,
        ``goal_selection_strategy``, ``reward_fn``, ``device``, ``copy_info_dict``, ``refresh_interval``, ...), checked
        once as a :class:`~her_store.sampling.config.SamplerConfig`; not ``prefetch`` (each batch's split differs).
        Without ``reward_fn``, each store's sampler takes its own store's env (see HerSampler). Each store is
        refreshed at its sampler's ``refresh_interval``; a store set at ``refresh_interval``, default 1 s.

    Attributes
    ----------
    config : SamplerConfig
        The per-store samplers' options (each store's with its own seed).
    her_ratio : float
        The relabelled fraction of a batch, the per-store samplers' (``int(her_ratio * B)`` rows).
    rng : numpy.random.Generator
        The generator of the split (each store's sampler has its own).

    Raises
    ------
    SchemaMismatchError
        The stores' observation or action spaces (and info spaces with ``copy_info_dict``) differ: the message
        names the store and the first field that differs.
    ValueError
        Weights of the wrong length, negative, NaN or infinite, or all 0.

    Examples
    --------
    >>> online = EpisodeStore.create("runs/online", obs_space, action_space)  # doctest: +SKIP
    >>> offline = EpisodeStore.open("s3://bucket/fetch-expert", storage_options=opts)  # doctest: +SKIP
    >>> reward_fn = env.unwrapped.compute_reward  # doctest: +SKIP
    >>> sampler = MixtureSampler([online, offline], [0.75, 0.25], 256, reward_fn=reward_fn)  # doctest: +SKIP
    >>> batch = sampler.sample()  # doctest: +SKIP
    >>> offline_rows = batch.source == 1  # doctest: +SKIP
    """

    def __init__(
        self,
        stores: Sequence[EpisodeStore] | StoreSet,
        weights: Sequence[float] | Literal["transitions"],
        batch_size: int = 256,
        *,
        seed: int | None = None,
        **her_sampler_kwargs: Any,
    ) -> None:
        check_options(her_sampler_kwargs, _OPTIONS)
        self.config = SamplerConfig(batch_size=batch_size, **her_sampler_kwargs)
        if self.config.prioritize == "td":
            raise ValueError(
                "prioritize='td' needs the priorities updated by the one sampler that drew the batch; a MixtureSampler "
                "takes prioritize='energy' or None (sample with HerSampler(store, prioritize='td') for PER)"
            )
        if self.config.prefetch:
            raise ValueError(
                "MixtureSampler does not prefetch (each batch's split among the stores differs); drop prefetch"
            )
        seed = check_int(seed, "seed", low=0, or_none=True)
        self._set: StoreSet | None = None
        if isinstance(stores, StoreSet):
            self._set = stores
            initial = list(stores.stores)
        elif isinstance(stores, Sequence) and not isinstance(stores, str):
            initial = list(stores)
            if not initial:
                raise ValueError("MixtureSampler needs at least one store")
        else:
            raise TypeError(
                "stores must be a sequence of EpisodeStore or an object with .stores and .refresh(), "
                f"got {type(stores).__name__}"
            )
        self.batch_size = self.config.batch_size
        self._seeds = np.random.SeedSequence(seed)
        self.rng = np.random.default_rng(self._seeds)
        if isinstance(weights, str):
            if weights != "transitions":
                raise ValueError(f"weights must be a sequence of numbers or 'transitions', got {weights!r}")
            self._fixed: np.ndarray | None = None
        elif self._set is not None:
            raise ValueError("a StoreSet grows: it takes weights='transitions' (or pass its stores as a list)")
        else:
            self._fixed = _fixed_weights(weights, len(initial))
        self.her_ratio = self.config.her_ratio
        self._samplers: list[HerSampler] = []
        self._goals = StoreSetGoals(self._samplers) if self._set is not None else None  # one dataset: goals of all
        self._intervals: list[float] = []  # each store's refresh interval (its own sampler never refreshes itself)
        self._refreshed: list[float] = []
        self._counts = np.zeros(0, np.int64)  # committed transitions of each store's current view
        self._closed = False
        self._pending: dict[str, Mapping[str, Any]] = {}  # loaded states of stores not yet joined, by store URL
        interval = self.config.refresh_interval
        self._set_interval = _STORE_SET_INTERVAL if interval is None else float(interval)
        self._set_refreshed = time.monotonic()
        try:
            self._join(initial)
        except BaseException:
            self.close()
            raise

    @property
    def samplers(self) -> tuple[HerSampler, ...]:
        """One HerSampler per store, in the stores' order (read them; the mixture drives them)."""
        return tuple(self._samplers)

    @property
    def weights(self) -> np.ndarray:
        """The probabilities of the stores as of now: normalised fixed weights, or committed transitions."""
        if self._fixed is not None:
            return self._fixed.copy()
        total = int(self._counts.sum())
        return self._counts / total if total else np.zeros(len(self._counts))

    # -- the stores ----------------------------------------------------------------------------------------
    def _join(self, stores: Sequence[EpisodeStore]) -> None:
        """Check and add samplers for ``stores`` (positions ``len(self._samplers)`` on)."""
        with_infos = self.config.copy_info_dict
        for store in stores:
            pos = len(self._samplers)
            if not isinstance(store, EpisodeStore):
                raise TypeError(f"MixtureSampler: store {pos} is a {type(store).__name__}, expected an EpisodeStore")
            if self._samplers:
                _check_same_spaces(self._samplers[0].store, 0, store, pos, with_infos)
            seed = np.random.SeedSequence(self._seeds.entropy, spawn_key=(pos,)).generate_state(4)
            config = self.config.replace(seed=int.from_bytes(seed.tobytes(), "little"))
            sampler = HerSampler.from_config(store, config, random_goals=self._goals)
            if store.url in self._pending:
                sampler.load_state_dict(self._pending.pop(store.url))
            self._intervals.append(sampler.refresh_interval)
            sampler.refresh_interval = math.inf  # refreshed by the mixture, so that the weights match its view
            self._samplers.append(sampler)
            self._counts = np.append(self._counts, sampler.refresh().num_transitions)
            self._refreshed.append(time.monotonic())

    def _refresh_set(self) -> None:
        """The set's refresh, which refreshes its stores too: each sampler then takes its store's new view without
        reading its commit record again."""
        assert self._set is not None
        self._set.refresh()
        for pos in range(len(self._samplers)):
            self._refresh_store(pos, reread=False)
        stores = list(self._set.stores)
        for pos, s in enumerate(self._samplers):
            if pos >= len(stores) or stores[pos] is not s.store:
                raise StoreError(
                    f"MixtureSampler: the store set no longer lists store {pos} ({s.store.url}) at position {pos}; "
                    "a StoreSet keeps its stores in place and appends new ones"
                )
        self._join(stores[len(self._samplers) :])
        self._set_refreshed = time.monotonic()

    def _refresh_store(self, pos: int, reread: bool = True) -> None:
        self._counts[pos] = self._samplers[pos].refresh(reread=reread).num_transitions
        self._refreshed[pos] = time.monotonic()

    def refresh(self) -> np.ndarray:
        """Look for new stores (a StoreSet) and new commits in every store now; returns each store's committed
        transitions."""
        if self._set is not None:
            self._refresh_set()
        else:
            for pos in range(len(self._samplers)):
                self._refresh_store(pos)
        return self._counts.copy()

    def _refresh_due(self) -> None:
        now = time.monotonic()
        if self._set is not None and now - self._set_refreshed >= self._set_interval:
            self._refresh_set()
        for pos, (interval, at) in enumerate(zip(self._intervals, self._refreshed)):
            if now - at >= interval:
                self._refresh_store(pos)

    # -- one batch -------------------------------------------------------------------------------------------
    def _probabilities(self) -> np.ndarray:
        if self._fixed is None:
            total = int(self._counts.sum())
            if total == 0:
                urls = ", ".join(s.store.url for s in self._samplers) or "none yet"
                raise StoreError(
                    f"MixtureSampler: no store has a committed episode to sample from yet (stores: {urls}); add at "
                    "least one whole episode (and let it commit) before sampling"
                )
            return self._counts / total
        empty = np.flatnonzero((self._fixed > 0) & (self._counts == 0))
        if len(empty):
            pos = int(empty[0])
            raise StoreError(
                f"MixtureSampler: store {pos} ({self._samplers[pos].store.url}) has weight {self._fixed[pos]:.3g} and "
                "no committed episode to sample from yet; commit an episode to it first, or give it weight 0 until then"
            )
        return self._fixed

    def sample(self, batch_size: int | None = None) -> HerBatch:
        """One batch of ``batch_size`` transitions (default: the sampler's), ``source`` naming each row's store.

        Raises
        ------
        StoreError
            No store has a committed episode ("transitions"), or a store with a positive weight has none.
        """
        if self._closed:
            raise StoreError("MixtureSampler is closed")
        B = self.batch_size if batch_size is None else check_int(batch_size, "batch_size", low=1)
        self._refresh_due()
        p = self._probabilities()
        M = int(self.her_ratio * B)
        her, real = self.rng.multinomial(M, p), self.rng.multinomial(B - M, p)
        drawn = np.flatnonzero(her + real)
        parts = []
        for pos in drawn:
            sampler, n = self._samplers[pos], int(her[pos] + real[pos])
            # HerSampler relabels the first int(her_ratio * n) rows: ask for exactly her[pos] of them (the half
            # keeps float rounding of the product from losing one)
            sampler.her_ratio = (int(her[pos]) + 0.5) / n
            try:
                parts.append(sampler.sample(n))
            finally:
                sampler.her_ratio = self.her_ratio
        return _join(parts, her[drawn], drawn, real[drawn])

    def __iter__(self) -> Iterator[HerBatch]:
        """Batches forever."""
        while True:
            yield self.sample()

    # -- state ---------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The split's generator state and each store's sampler state, by store URL: a resumed run draws the same
        batches (from stores holding the same committed episodes)."""
        return {
            "rng": self.rng.bit_generator.state,
            "stores": [s.store.url for s in self._samplers],
            "samplers": [s.state_dict() for s in self._samplers],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`. Each store's state goes to the store of the same URL, wherever it now is (a
        sharded view opened again lists its shards in another order); for a store set, states of stores not joined
        yet are applied when they join. The stores of a fixed list must be the ones saved.

        Raises
        ------
        ValueError
            ``state`` is not a state of this mixture (nothing is changed then).
        """
        try:
            urls, states = list(state["stores"]), list(state["samplers"])
            np.random.default_rng().bit_generator.state = dict(state["rng"])  # checked before anything changes
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a MixtureSampler state ({short_repr(e)}); expected what state_dict() returns") from e
        have = [s.store.url for s in self._samplers]
        if len(urls) != len(states) or (self._set is None and sorted(urls) != sorted(have)):
            raise ValueError(f"the state is of stores {short_repr(urls)}; this mixture samples {short_repr(have)}")
        self.rng.bit_generator.state = dict(state["rng"])
        for url, st in zip(urls, states):
            if url in have:
                self._samplers[have.index(url)].load_state_dict(st)
            else:
                self._pending[url] = st

    def close(self) -> None:
        """Close every store's sampler (the stores stay open). Idempotent; a closed mixture samples no more."""
        self._closed = True
        for s in self._samplers:
            s.close()

    def __enter__(self) -> MixtureSampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _join(parts: list[HerBatch], her: np.ndarray, source: np.ndarray, real: np.ndarray) -> HerBatch:
    """One batch of the stores' parts: every part's relabelled rows (its first ``her[i]``), then the others."""

    def cat(xs: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([x[:h] for x, h in zip(xs, her)] + [x[h:] for x, h in zip(xs, her)])

    def field(name: str) -> list[torch.Tensor]:
        return [getattr(b, name) for b in parts]

    def mapping(name: str) -> dict[str, torch.Tensor]:
        return {k: cat([getattr(b, name)[k] for b in parts]) for k in getattr(parts[0], name)}

    src = np.concatenate([np.repeat(source, her), np.repeat(source, real)])
    return HerBatch(
        observations=mapping("observations"),
        actions=cat(field("actions")),
        rewards=cat(field("rewards")),
        next_observations=mapping("next_observations"),
        terminated=cat(field("terminated")),
        truncated=cat(field("truncated")),
        dones=cat(field("dones")),
        is_relabeled=cat(field("is_relabeled")),
        episode_ids=cat(field("episode_ids")),
        steps=cat(field("steps")),
        infos=mapping("infos"),
        source=torch.from_numpy(src.astype(np.int64)).to(parts[0].actions.device),
    )
