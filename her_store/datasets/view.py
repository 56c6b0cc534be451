"""The read view over a dataset of many writers: :class:`ShardedView`, every committed episode of every shard."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np
from gymnasium import spaces

from her_store.checks import is_int
from her_store.datasets.marker import list_shards, read_marker, shard_backend
from her_store.errors import (
    CorruptStoreError,
    EpisodeNotFoundError,
    NotAStoreError,
    SchemaMismatchError,
    StoreError,
    short_repr,
)
from her_store.format.keys import MARKER_KEY, SHARDS_DIR
from her_store.format.layout import INDEX_COLUMNS
from her_store.storage import Backend, open_backend
from her_store.store.episode import Episode
from her_store.store.episode_store import EpisodeStore

__all__ = ["ShardedView"]


class ShardedView:
    """Every committed episode of every shard of a sharded dataset, read-only: what ``open_dataset(root)`` returns.

    Each shard is an ordinary store opened with ``mode="r"`` (:attr:`stores`, in the order of :attr:`shards`), so a
    view takes no lock and any number of them read while the writers append. An episode is named by its shard and
    its id in that shard: ``view.episode("actor-7", 12)``, or ``view.episode(2, 12)`` with the shard's position in
    :attr:`shards` (the ``shard`` column of :attr:`episodes`, the ``source`` of a batch of
    :class:`~her_store.sampling.mixture.MixtureSampler`, which samples a view). :meth:`refresh`
    picks up new commits and new shards; a shard whose create has not written its commit record yet is left out
    until it has one.

    Parameters
    ----------
    path_or_url : str or PathLike
        The dataset's root.
    storage_options : mapping, optional
        Passed to fsspec for URLs, for the root and every shard.

    Raises
    ------
    NotAStoreError
        No root marker there (not a sharded dataset).
    CorruptStoreError, FormatVersionError
        A damaged root marker, or a shard whose spaces differ from the dataset's, or any damage a shard's own open
        finds.

    Examples
    --------
    >>> import tempfile, numpy as np
    >>> from gymnasium import spaces
    >>> obs = spaces.Dict({k: spaces.Box(-1, 1, (3,)) for k in ("observation", "achieved_goal", "desired_goal")})
    >>> root = tempfile.mkdtemp() + "/dataset"
    >>> from her_store.datasets.shards import open_shard
    >>> for name in ("actor-0", "actor-1"):
    ...     with open_shard(root, obs, spaces.Box(-1, 1, (2,)), name) as store:
    ...         ep = {k: np.zeros((4, 3), np.float32) for k in obs}
    ...         ep.update(action=np.zeros((3, 2), np.float32), reward=np.zeros(3, np.float32),
    ...                   terminated=np.zeros(3, bool), truncated=np.array([False, False, True]))
    ...         _ = store.append_episode(ep)
    >>> with ShardedView(root) as view:
    ...     view.shards, view.num_episodes, len(view), view.episodes["shard"].tolist()
    (('actor-0', 'actor-1'), 2, 6, [0, 1])
    """

    def __init__(
        self, path_or_url: str | os.PathLike[str] | Backend, storage_options: Mapping[str, Any] | None = None
    ) -> None:
        self._loc = open_backend(path_or_url, storage_options)
        if not self._loc.lists:
            raise StoreError(
                f"{self._loc}: shards are found by listing {SHARDS_DIR}/, which plain HTTP does not offer; open one "
                f"shard as a store ({self._loc.url}/{SHARDS_DIR}/<name>), or the dataset over object storage"
            )
        schema = read_marker(self._loc)
        if schema is None:
            raise NotAStoreError(f"{self._loc} is not a sharded dataset (no {MARKER_KEY})")
        self.schema = schema
        self._stores: dict[str, EpisodeStore] = {}
        self._closed = False
        try:
            self._discover()
        except BaseException:
            self.close()
            raise

    def _discover(self) -> int:
        """Open the shards not yet in the view that have a commit record; returns their committed episodes."""
        found = 0
        for name in list_shards(self._loc):
            if name in self._stores:
                continue
            store = EpisodeStore.open(shard_backend(self._loc, name), mode="r")
            try:
                store.schema.check_same(self.schema, store.url)
            except SchemaMismatchError as e:
                store.close()
                raise CorruptStoreError(
                    f"shard {name!r} does not hold the dataset's spaces ({self._loc.key_path(MARKER_KEY)}): {e}"
                ) from e
            self._stores[name] = store
            found += store.num_episodes
        return found

    def _require_open(self) -> None:
        if self._closed:
            raise StoreError(f"{self.url} is closed")

    @property
    def url(self) -> str:
        """The dataset root's local path or URL."""
        return self._loc.url

    @property
    def observation_space(self) -> spaces.Dict:
        return self.schema.observation_space

    @property
    def action_space(self) -> spaces.Space:
        return self.schema.action_space

    @property
    def info_keys(self) -> tuple[str, ...]:
        return self.schema.info_keys

    @property
    def shards(self) -> tuple[str, ...]:
        """The shard names, in the order found: sorted at open, shards found by a later :meth:`refresh` after them
        (a shard keeps its position for the life of the view)."""
        return tuple(self._stores)

    @property
    def stores(self) -> tuple[EpisodeStore, ...]:
        """The shards' read-only store handles, in the order of :attr:`shards`."""
        self._require_open()
        return tuple(self._stores.values())

    @property
    def num_episodes(self) -> int:
        """Committed episodes of every shard (evicted ones excluded), as of the last :meth:`refresh`."""
        return sum(s.num_episodes for s in self.stores)

    @property
    def num_transitions(self) -> int:
        """Committed transitions of every shard (``len(view)``)."""
        return sum(s.num_transitions for s in self.stores)

    def __len__(self) -> int:
        return self.num_transitions

    @property
    def episodes(self) -> dict[str, np.ndarray]:
        """The episode index of every shard, concatenated in the order of :attr:`shards`: each store's columns
        (:attr:`EpisodeStore.episodes`; ``episode_id`` is the id within its shard) and ``shard``, the position of the
        episode's shard in :attr:`shards` (int32)."""
        tables = [s.episodes for s in self.stores]
        counts = [len(t["episode_id"]) for t in tables]
        out = {k: np.concatenate([np.zeros(0, dt), *(t[k] for t in tables)]) for k, dt in INDEX_COLUMNS.items()}
        out["shard"] = np.repeat(np.arange(len(tables), dtype=np.int32), counts)
        return out

    def _store(self, shard: str | int) -> EpisodeStore:
        self._require_open()
        names = self.shards
        if is_int(shard) and 0 <= shard < len(names):
            return self._stores[names[int(shard)]]
        if isinstance(shard, str) and shard in self._stores:
            return self._stores[shard]
        raise EpisodeNotFoundError(
            f"{self.url} has no shard {short_repr(shard)}; its shards are {list(names)} (a name, or a position from 0 "
            f"to {len(names) - 1}); refresh() finds shards created since"
        )

    def episode(self, shard: str | int, episode_id: int, *, verify: bool = True) -> Episode:
        """Read one committed episode of one shard.

        Parameters
        ----------
        shard : str or int
            The shard's name, or its position in :attr:`shards` (a batch's ``source``, the ``shard`` column).
        episode_id : int
            The episode's id in that shard (``episode_id`` column, a batch's ``episode_ids``).
        verify : bool
            Check the rows against their crc32, as :meth:`EpisodeStore.episode`.

        Raises
        ------
        EpisodeNotFoundError
            No such shard in the view, or the episode is not committed there (or was evicted).
        CorruptStoreError
            The rows do not match their checksum.
        """
        return self._store(shard).episode(episode_id, verify=verify)

    def refresh(self) -> int:
        """Pick up episodes committed since the last look, in every shard, and shards created since; returns how many
        episodes were added (those of new shards included)."""
        self._require_open()
        return sum(s.refresh() for s in self._stores.values()) + self._discover()

    def close(self) -> None:
        """Close every shard's handle. Idempotent."""
        stores, self._stores = list(self._stores.values()), {}
        self._closed = True
        for s in stores:
            s.close()

    def __enter__(self) -> ShardedView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        if self._closed:
            return f"ShardedView({self.url!r}, closed)"
        return (
            f"ShardedView({self.url!r}, {len(self._stores)} shards, {self.num_episodes} episodes, "
            f"{len(self)} transitions)"
        )
