"""her_store: a persistent, disk-backed episode store for Hindsight Experience Replay on Zarr.

The public API, in one list:

- Stores: :func:`open_store` (create or resume a store for writing; ``shard=`` for one writer of many),
  :class:`EpisodeStore` (``EpisodeStore.open(path)`` reads one), :func:`open_dataset` (reads a dataset of many
  writers: a :class:`ShardedView`), :class:`StepWriter` (episodes from per-step adds), :class:`Episode`.
- Sampling: :class:`HerSampler` (HER batches, :class:`HerBatch`), :class:`MixtureSampler` (several stores, or a
  dataset of many writers), :class:`WorkingSetSampler` (through a bounded set in RAM or on the device),
  :class:`HerIterableDataset` (a torch DataLoader's dataset); goal choices :class:`GoalSelectionStrategy`,
  :class:`GoalMixture`, :class:`GoalContext` (a strategy of your own).
- Errors: :class:`StoreError`, the base of every error in :mod:`her_store.errors`.

Integrations (``her_store.integrations``), conversions (``her_store.interop``) and tools (``her_store.ops``) are
subpackages of their own, imported where used.
"""

from her_store.datasets.opening import open_dataset, open_store
from her_store.datasets.view import ShardedView
from her_store.envs import register as _register_envs
from her_store.errors import StoreError
from her_store.sampling.relabel import GoalContext, GoalMixture, GoalSelectionStrategy
from her_store.store.episode import Episode
from her_store.store.episode_store import EpisodeStore
from her_store.store.step_writer import StepWriter

__version__ = "0.1.0"

_SAMPLING = {
    "HerSampler": "her_store.sampling.sampler",
    "HerBatch": "her_store.sampling.batch",
    "MixtureSampler": "her_store.sampling.mixture",
    "WorkingSetSampler": "her_store.sampling.working_set",
    "HerIterableDataset": "her_store.sampling.loader",
}


def __getattr__(name: str) -> object:
    # the samplers import torch (seconds): writers, readers and tools that never sample do not pay for it
    if name in _SAMPLING:
        import importlib

        return getattr(importlib.import_module(_SAMPLING[name]), name)
    raise AttributeError(f"module 'her_store' has no attribute {name!r}")


_register_envs()

__all__ = [
    "open_store",
    "open_dataset",
    "EpisodeStore",
    "ShardedView",
    "StepWriter",
    "Episode",
    "HerSampler",
    "HerBatch",
    "MixtureSampler",
    "WorkingSetSampler",
    "HerIterableDataset",
    "GoalSelectionStrategy",
    "GoalMixture",
    "GoalContext",
    "StoreError",
]
