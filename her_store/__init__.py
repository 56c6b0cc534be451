"""her_store: a persistent, disk-backed episode store for Hindsight Experience Replay on Zarr.

Public API: :class:`EpisodeStore`, :func:`open_store`, :class:`ShardedView`, :class:`StepWriter`, :class:`HerSampler`,
:class:`HerBatch`, :class:`MixtureSampler`, :class:`WorkingSetSampler`, :class:`HerIterableDataset`,
:class:`GoalSelectionStrategy`, :class:`GoalMixture`, :class:`Episode` and the errors in :mod:`her_store.errors`.
"""

from her_store.datasets.sharded import ShardedView
from her_store.envs import register as _register_envs
from her_store.errors import (
    CorruptStoreError,
    EpisodeNotFoundError,
    EpisodeValidationError,
    FormatVersionError,
    NotAStoreError,
    ReadOnlyStoreError,
    SchemaMismatchError,
    StoreError,
    StoreExistsError,
    StoreLockedError,
    StoreTimeoutError,
)
from her_store.format.layout import FORMAT_VERSION
from her_store.sampling.relabel import GoalContext, GoalMixture, GoalSelectionStrategy
from her_store.store.episode import Episode
from her_store.store.episode_store import EpisodeStore, open_store
from her_store.store.rows import ChunkReader
from her_store.store.step_writer import StepWriter

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # The samplers import torch (seconds); writers, readers and tools that never sample should not pay for it.
    if name in ("HerSampler", "HerBatch"):
        from her_store.sampling import sampler

        return getattr(sampler, name)
    if name == "MixtureSampler":
        from her_store.sampling.mixture import MixtureSampler

        return MixtureSampler
    if name == "WorkingSetSampler":
        from her_store.sampling.working_set import WorkingSetSampler

        return WorkingSetSampler
    if name == "HerIterableDataset":
        from her_store.sampling.loader import HerIterableDataset

        return HerIterableDataset
    raise AttributeError(f"module 'her_store' has no attribute {name!r}")

_register_envs()

__all__ = [
    "EpisodeStore",
    "open_store",
    "ShardedView",
    "HerSampler",
    "HerBatch",
    "MixtureSampler",
    "WorkingSetSampler",
    "HerIterableDataset",
    "GoalSelectionStrategy",
    "GoalContext",
    "GoalMixture",
    "ChunkReader",
    "StepWriter",
    "Episode",
    "FORMAT_VERSION",
    "StoreError",
    "NotAStoreError",
    "StoreExistsError",
    "FormatVersionError",
    "CorruptStoreError",
    "SchemaMismatchError",
    "EpisodeValidationError",
    "ReadOnlyStoreError",
    "StoreLockedError",
    "StoreTimeoutError",
    "EpisodeNotFoundError",
]
