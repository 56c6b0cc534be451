"""HerIterableDataset: HER batches of a store or sharded dataset for a torch DataLoader, one handle per worker.

The dataset object holds only where the data is and how to sample it (picklable, so ``spawn`` workers get it);
each worker opens its own read-only handle (:func:`open_source`) and sampler when its iteration starts, after the
fork or spawn, so no file descriptor, map or thread of the parent is ever shared. Every
``(seed, rank, worker, epoch, pass)`` seeds its own generator through numpy's SeedSequence, so no two workers of
any rank draw the same batch stream and a run draws the same streams again.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed
from torch.utils.data import IterableDataset, get_worker_info

from her_store.checks import check_int, is_int
from her_store.datasets.marker import is_sharded
from her_store.datasets.view import ShardedView
from her_store.sampling.batch import HerBatch
from her_store.sampling.config import SamplerConfig, check_options
from her_store.sampling.mixture import MixtureSampler
from her_store.sampling.sampler import HerSampler
from her_store.storage import open_backend
from her_store.store.episode_store import EpisodeStore

__all__ = ["HerIterableDataset", "StoreSource", "open_source"]

StoreSource = str | os.PathLike | Callable[[], Any]

# HerSampler arguments the dataset sets itself, or that cannot work in a worker process
_RESERVED = {
    "store": "the dataset opens it in each worker",
    "batch_size": "pass it to HerIterableDataset",
    "seed": "pass it to HerIterableDataset",
    "device": "workers sample on the CPU; move each batch in the training loop (DataLoader(..., pin_memory=True) "
    "pins it for a fast copy to CUDA)",
}
_OPTIONS = frozenset(f.name for f in dataclasses.fields(SamplerConfig)) - set(_RESERVED)


def open_source(source: StoreSource, storage_options: Mapping[str, Any] | None = None) -> Any:
    """Open what a worker samples from: the one place a :class:`HerIterableDataset` opens data.

    Parameters
    ----------
    source : str, PathLike or callable
        A store's path or URL, opened read-only (``EpisodeStore.open(source, "r", storage_options)``), or a sharded
        dataset's root, opened as a read view over every shard (:class:`~her_store.datasets.view.ShardedView`). Or a
        picklable callable taking no arguments that returns a read-only :class:`EpisodeStore` or a view of many stores
        with ``stores``, ``refresh()`` and ``close()`` (as ShardedView has, sampled by a MixtureSampler): this is how
        other views plug in, e.g. ``functools.partial(EpisodeStore.open, url, "r", storage_options=opts)``.
    storage_options : mapping, optional
        fsspec options of a path or URL (a callable carries its own).

    Returns
    -------
    EpisodeStore or view
        A new handle, owned by the caller, who closes it.

    Examples
    --------
    >>> store = open_source("runs/fetch")  # doctest: +SKIP
    """
    if callable(source):
        opened = source()
        if not isinstance(opened, EpisodeStore) and not all(
            callable(getattr(opened, m, None)) for m in ("refresh", "close")
        ):
            close = getattr(opened, "close", None)
            if callable(close):
                close()
            raise TypeError(
                f"the source {source!r} returned a {type(opened).__name__}; expected an EpisodeStore or a view of many "
                "stores with stores, refresh() and close(), such as her_store.datasets.view.ShardedView"
            )
        return opened
    if is_sharded(open_backend(source, storage_options)):
        return ShardedView(source, storage_options)
    return EpisodeStore.open(source, "r", storage_options)


def _sampler_of(
    opened: Any, config: SamplerConfig, seed: int, kwargs: Mapping[str, Any]
) -> HerSampler | MixtureSampler:
    """A store's HerSampler (``config`` with ``seed``), or a view's MixtureSampler with the options given (``kwargs``,
    which ``config`` checked): uniform over every shard's transitions."""
    if isinstance(opened, EpisodeStore):
        return HerSampler.from_config(opened, config.replace(seed=seed))
    return MixtureSampler(opened, weights="transitions", batch_size=config.batch_size, seed=seed, **kwargs)


def _distributed(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """``(rank, world_size)``: the given ones, else torch.distributed's when it is initialised, else (0, 1)."""
    live = torch.distributed.is_available() and torch.distributed.is_initialized()
    if world_size is None:
        world_size = torch.distributed.get_world_size() if live else 1
    if rank is None:
        rank = torch.distributed.get_rank() if live else 0
    if not (is_int(rank) and is_int(world_size)):
        raise ValueError(f"rank and world_size must be ints, got {rank!r} and {world_size!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must satisfy 0 <= rank < world_size ({world_size}), got {rank}")
    return int(rank), int(world_size)


class HerIterableDataset(IterableDataset[HerBatch]):
    """HER batches of a store for ``torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=N)``.

    Each DataLoader worker (and the main process with ``num_workers=0``) opens its own read-only handle when its
    iteration starts (fork or spawn alike) and yields :class:`~her_store.sampling.batch.HerBatch` objects of CPU
    tensors, ``batch_size`` transitions each; the handle is closed when the iteration ends, is closed or is garbage
    collected. Batches are drawn as :class:`~her_store.sampling.sampler.HerSampler` draws them, uniformly from the
    committed transitions, which a worker picks up as they are committed; from a sharded dataset, uniformly over
    every shard's (the view's :class:`~her_store.sampling.mixture.MixtureSampler`; ``batch.source`` is the shard).

    Worker ``w`` of rank ``r`` seeds its generator with ``SeedSequence(seed, spawn_key=(r, w, epoch, pass))``
    (numpy's spawn mixing), where ``pass`` counts the iterations this copy of the dataset has started: streams
    of different workers or ranks are independent, and the same arguments draw the same streams run after run
    (on a store that does not change meanwhile). A DataLoader without ``persistent_workers`` copies the dataset
    into fresh workers each epoch: call :meth:`set_epoch` before each epoch (as with ``DistributedSampler``), or
    every epoch draws the same batches.

    Parameters
    ----------
    source : str, PathLike or callable
        A store's or a sharded dataset's path or URL, or a picklable callable returning a read-only store or view
        (see :func:`open_source`, the one place data is opened).
    batch_size : int
        Transitions per batch.
    seed : int, optional
        Base seed of every worker's generator; None draws one now (in this process), so workers still differ.
    rank, world_size : int, optional
        This learner's rank and the number of learners (``torch.distributed`` conventions). Default:
        ``torch.distributed``'s when it is initialised, else 0 and 1.
    storage_options : mapping, optional
        fsspec options (object storage) of a path or URL.
    batches_per_epoch : int, optional
        Batches of one epoch over all ranks and workers together, each rank yielding
        ``batches_per_epoch // world_size`` of them (so it must divide evenly: ranks of a distributed run step
        together) split across its workers. None: endless (stop the loop yourself).
    **her_sampler_kwargs
        Passed to :class:`~her_store.sampling.sampler.HerSampler` (a view's sampler) in each worker
        (``n_sampled_goal``, ``goal_selection_strategy``, ``reward_fn``, ...), checked here as a
        :class:`~her_store.sampling.config.SamplerConfig` (:attr:`config`); with spawn workers they are pickled, so a
        ``reward_fn`` must be a module-level function. ``device`` is not taken: batches stay on the CPU
        (``DataLoader(..., pin_memory=True)`` and ``.to("cuda", non_blocking=True)`` in the loop).

    Raises
    ------
    ValueError, TypeError
        Bad arguments, here; a store that cannot be opened raises its error in the worker, which the DataLoader
        raises in this process (with a note naming the rank, worker and source).

    Examples
    --------
    >>> from torch.utils.data import DataLoader
    >>> ds = HerIterableDataset("runs/fetch", batch_size=256, seed=0, batches_per_epoch=1000,
    ...                         n_sampled_goal=4, goal_selection_strategy="future")  # doctest: +SKIP
    >>> loader = DataLoader(ds, batch_size=None, num_workers=4, pin_memory=True)  # doctest: +SKIP
    >>> for epoch in range(10):  # doctest: +SKIP
    ...     ds.set_epoch(epoch)
    ...     for batch in loader:
    ...         loss = critic_loss(batch.observations, batch.actions, batch.rewards, batch.next_observations)
    """

    def __init__(
        self,
        source: StoreSource,
        *,
        batch_size: int = 256,
        seed: int | None = 0,
        rank: int | None = None,
        world_size: int | None = None,
        storage_options: Mapping[str, Any] | None = None,
        batches_per_epoch: int | None = None,
        **her_sampler_kwargs: Any,
    ) -> None:
        if not (callable(source) or isinstance(source, (str, os.PathLike))):
            raise TypeError(
                "source must be a store's path or URL, or a callable returning a store or view; "
                f"got {type(source).__name__}"
            )
        if callable(source) and storage_options is not None:
            raise ValueError("storage_options apply to a path or URL; a callable source opens with its own")
        batches_per_epoch = check_int(batches_per_epoch, "batches_per_epoch", low=0, or_none=True)
        for name, why in _RESERVED.items():
            if name in her_sampler_kwargs:
                raise TypeError(f"HerIterableDataset does not pass {name!r} to HerSampler: {why}")
        check_options(her_sampler_kwargs, _OPTIONS)
        self.config = SamplerConfig(batch_size=batch_size, **her_sampler_kwargs)
        if self.config.prioritize == "td":
            raise ValueError(
                "prioritize='td' needs the priorities updated by the one sampler that drew the batch; a "
                "HerIterableDataset takes prioritize='energy' or None (for PER, sample with HerSampler(store, "
                "prioritize='td'))"
            )
        self.rank, self.world_size = _distributed(rank, world_size)
        if batches_per_epoch is not None and batches_per_epoch % self.world_size:
            raise ValueError(
                f"batches_per_epoch ({batches_per_epoch}) must be a multiple of world_size ({self.world_size}): every "
                "rank of a distributed run takes the same number of steps"
            )
        self.source = source
        self.storage_options = None if storage_options is None else dict(storage_options)
        self.batch_size = self.config.batch_size
        self.seed = int(np.random.SeedSequence(check_int(seed, "seed", low=0, or_none=True)).entropy)
        self.batches_per_epoch = batches_per_epoch
        self.her_sampler_kwargs = her_sampler_kwargs
        self.epoch = 0
        self._passes = 0

    def set_epoch(self, epoch: int) -> None:
        """Draw this epoch's streams (call before each epoch when DataLoader workers are not persistent)."""
        self.epoch = check_int(epoch, "epoch", low=0)

    def __len__(self) -> int:
        """Batches this rank yields per epoch (``len(DataLoader(ds, batch_size=None))``); TypeError when endless."""
        if self.batches_per_epoch is None:
            raise TypeError("an endless HerIterableDataset (batches_per_epoch=None) has no length")
        return self.batches_per_epoch // self.world_size

    def __iter__(self) -> Iterator[HerBatch]:
        """This worker's share of the epoch (endless when ``batches_per_epoch`` is None), opened on first use."""
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        count = None
        if self.batches_per_epoch is not None:
            per_rank = self.batches_per_epoch // self.world_size
            count = per_rank // workers + (worker < per_rank % workers)
        key = (self.rank, worker, self.epoch, self._passes)
        self._passes += 1
        state = np.random.SeedSequence(self.seed, spawn_key=key).generate_state(4, np.uint64)
        return self._batches(worker, count, int.from_bytes(state.tobytes(), "little"))

    def _batches(self, worker: int, count: int | None, seed: int) -> Iterator[HerBatch]:
        # a generator: nothing is opened until the first batch is asked for, in the process that asks, and its
        # finally closes the handles at the end, on close() and when it is garbage collected unfinished
        if count == 0:
            return
        try:
            store = open_source(self.source, self.storage_options)
        except Exception as e:
            e.add_note(f"HerIterableDataset (rank {self.rank}, worker {worker}) opening {self.source!r}")
            raise
        try:
            with _sampler_of(store, self.config, seed, self.her_sampler_kwargs) as sampler:
                for _ in itertools.repeat(None) if count is None else range(count):
                    yield sampler.sample()
        finally:
            store.close()
