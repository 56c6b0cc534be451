"""The documented ways to a store or a dataset: :func:`open_store` for writers, :func:`open_dataset` for readers.

:func:`open_store` opens one store for appending (a store, or one writer's shard of a dataset of many);
:func:`open_dataset` reads a dataset of many writers.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from gymnasium import spaces

from her_store.datasets.marker import is_sharded
from her_store.datasets.shards import open_shard
from her_store.datasets.view import ShardedView
from her_store.errors import StoreError
from her_store.storage import Backend, open_backend
from her_store.store.episode_store import EpisodeStore
from her_store.store.opening import open_or_create

__all__ = ["open_dataset", "open_store"]


def open_store(
    path_or_url: str | os.PathLike[str] | Backend,
    observation_space: spaces.Dict | None = None,
    action_space: spaces.Space | None = None,
    *,
    shard: str | None = None,
    **kwargs: Any,
) -> EpisodeStore:
    """Open a store for appending if it exists (checking its spaces), else create it: what a training script calls.

    Parameters
    ----------
    path_or_url : str, PathLike or Backend
        Local path or fsspec URL (``s3://``, ``gs://``, ``memory://``; ``http(s)://`` and packed stores are
        read-only).
    observation_space, action_space : gymnasium spaces, optional
        Required to create; when the store exists they must equal the stored ones (SchemaMismatchError otherwise).
    shard : str, optional
        Append to shard ``shard`` of the dataset of many writers at ``path_or_url``, one shard per writer: the shard
        (and the dataset, if there is none yet) is created on first use and resumed after, and the spaces are
        checked against the dataset's (:func:`her_store.datasets.shards.open_shard`).
    **kwargs
        Passed to :meth:`EpisodeStore.create` (capacity, info_keys, metadata, ...) or, for an existing store,
        the ones :meth:`EpisodeStore.open` takes (storage_options, durability, commit_interval, lease_ttl,
        priority_fn).

    Returns
    -------
    EpisodeStore
        The store (or shard), opened with ``mode="a"``.

    Raises
    ------
    StoreError
        ``path_or_url`` is a dataset of many writers and no ``shard`` was named (:func:`open_dataset` reads it).

    Examples
    --------
    >>> store = open_store("runs/fetch", env.observation_space, env.action_space, capacity=1_000_000)  # doctest: +SKIP
    >>> actor = open_store(  # doctest: +SKIP
    ...     "s3://bucket/fetch", env.observation_space, env.action_space, shard="actor-7"
    ... )
    """
    if shard is not None:
        return open_shard(path_or_url, observation_space, action_space, shard, **kwargs)
    backend = open_backend(path_or_url, kwargs.get("storage_options"))
    if is_sharded(backend):
        raise StoreError(
            f"{backend} is a dataset of many writers: a writer appends to its own shard, open_store(root, "
            "observation_space, action_space, shard='actor-7', ...); her_store.open_dataset(root) reads every shard"
        )
    return open_or_create(backend, observation_space, action_space, **kwargs)


def open_dataset(
    path_or_url: str | os.PathLike[str] | Backend, storage_options: Mapping[str, Any] | None = None
) -> ShardedView:
    """Every committed episode of every shard of a dataset of many writers, read-only (no lock taken).

    Parameters
    ----------
    path_or_url : str, PathLike or Backend
        The dataset's root (local path or fsspec URL; plain HTTP offers no listing of its shards).
    storage_options : mapping, optional
        Passed to fsspec for URLs, for the root and every shard.

    Examples
    --------
    >>> view = open_dataset("s3://bucket/fetch", storage_options=opts)  # doctest: +SKIP
    >>> sampler = MixtureSampler(view, weights="transitions", batch_size=256, reward_fn=reward_fn)  # doctest: +SKIP
    """
    return ShardedView(path_or_url, storage_options)
