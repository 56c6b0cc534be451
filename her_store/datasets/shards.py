"""One writer's store in a dataset of many writers: :func:`open_shard`.

It creates the shard on first use (with the dataset's root, if there is none yet) and resumes it after.
"""

from __future__ import annotations

import os
from typing import Any

from gymnasium import spaces

from her_store.datasets.marker import check_shard_name, root_schema, shard_backend
from her_store.errors import ReadOnlyStoreError
from her_store.format.keys import MARKER_KEY
from her_store.format.schema import Schema
from her_store.storage import Backend, open_backend
from her_store.store.episode_store import EpisodeStore
from her_store.store.opening import open_or_create

__all__ = ["open_shard"]


def open_shard(
    path_or_url: str | os.PathLike[str] | Backend,
    observation_space: spaces.Dict | None,
    action_space: spaces.Space | None,
    shard: str,
    **kwargs: Any,
) -> EpisodeStore:
    """Open shard ``shard`` of the sharded dataset at ``path_or_url`` for appending: created on first use (with the
    dataset's root, if there is none yet), resumed after. What ``her_store.open_store(root, ..., shard=...)`` calls.

    Parameters
    ----------
    path_or_url : str or PathLike
        The dataset's root: a local directory or an fsspec URL.
    observation_space, action_space : gymnasium spaces, optional
        Needed to create the dataset; otherwise the dataset's own are used, and given ones must equal them.
    shard : str
        The shard's name (:func:`check_shard_name`), one per writer: ``"actor-7"``, ``f"{host}-{pid}"``, ...
    **kwargs
        As for :func:`her_store.open_store`: the shard's creation options (``capacity``, ``metadata``, ...; its own,
        not the dataset's), ``info_keys`` (default: the dataset's), ``storage_options``, ``commit_interval``,
        ``durability``, ``lease_ttl``.

    Returns
    -------
    EpisodeStore
        The shard, an ordinary store opened with ``mode="a"``: it holds the shard's writer lock (lease) until closed.

    Raises
    ------
    ValueError
        ``shard`` is not a shard name; nothing is written.
    SchemaMismatchError
        The spaces or info keys differ from the dataset's (or from the shard's).
    StoreLockedError
        A live writer holds the shard; one writer per shard, as per store.
    StoreExistsError
        ``path_or_url`` holds a plain store.
    NotAStoreError, CorruptStoreError, FormatVersionError
        No dataset there and no spaces given; a damaged root marker or shard.

    Examples
    --------
    >>> import tempfile
    >>> from gymnasium import spaces
    >>> obs = spaces.Dict({k: spaces.Box(-1, 1, (3,)) for k in ("observation", "achieved_goal", "desired_goal")})
    >>> root = tempfile.mkdtemp() + "/dataset"
    >>> with open_shard(root, obs, spaces.Box(-1, 1, (2,)), "actor-0") as store:
    ...     store.url.endswith("dataset/shards/actor-0")
    True
    """
    name = check_shard_name(shard)
    location = open_backend(path_or_url, kwargs.get("storage_options"))
    if location.read_only is not None:
        raise ReadOnlyStoreError(location.read_only)
    target = shard_backend(location, name)
    given = None
    if observation_space is not None and action_space is not None:
        given = Schema(observation_space, action_space, kwargs.get("info_keys", ()))
    schema = root_schema(location, given)
    info = kwargs.get("info_keys", schema.info_spaces)
    obs = schema.observation_space if observation_space is None else observation_space
    act = schema.action_space if action_space is None else action_space
    Schema(obs, act, info).check_same(schema, location.key_path(MARKER_KEY))
    return open_or_create(target, obs, act, **{**kwargs, "info_keys": info})


