"""Sharded datasets: one root, one shard (an ordinary store) per writer, and a read view over every shard.

A dataset root holds a root marker, ``sharded.json``, written once by whichever writer comes first (create-if-absent:
a hard link locally, a conditional PUT on object storage) and never rewritten, and ``shards/<name>/``, each a full
store with its own commit record and writer lock. Writers never share a file: a writer appends to its own shard, and
readers find shards by listing ``shards/``. FORMAT.md (Sharded datasets) is the on-disk contract.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
from gymnasium import spaces

from her_store.checks import is_int, is_number
from her_store.errors import (
    CorruptStoreError,
    EpisodeNotFoundError,
    FormatVersionError,
    NotAStoreError,
    ReadOnlyStoreError,
    SchemaMismatchError,
    StoreError,
    StoreExistsError,
    short_repr,
)
from her_store.format.layout import COMMIT_KEY, INDEX_COLUMNS
from her_store.format.schema import Schema
from her_store.storage.location import Location, fsync_file, write_all
from her_store.store.episode import Episode
from her_store.store.episode_store import EpisodeStore, open_store

if TYPE_CHECKING:
    from her_store.sampling.mixture import MixtureSampler

__all__ = ["MARKER_KEY", "SHARDS_DIR", "ShardedView", "check_shard_name", "is_sharded", "open_shard", "open_view"]

MARKER_KEY = "sharded.json"
SHARDS_DIR = "shards"
MARKER_FORMAT = "her_store.sharded"
MARKER_VERSION = 1
MARKER_LIMIT = 64 << 20  # bytes the root marker may hold: its spaces may carry per-pixel bounds, as zarr.json does
# a shard name is one path component everywhere (local directory, S3 key part): no separators, no dots at all
SHARD_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")
_READ_OPTIONS = ("storage_options",)


def check_shard_name(name: Any) -> str:
    """Return ``name`` if it may name a shard, else raise ValueError saying what a shard name is.

    A shard name is 1 to 128 ASCII letters, digits, ``-`` and ``_``, starting with a letter or digit: it is a
    directory name locally and a key part on object storage, so it holds no path separator and no dot.

    Examples
    --------
    >>> check_shard_name("actor-7")
    'actor-7'
    >>> check_shard_name("../x")
    Traceback (most recent call last):
    ...
    ValueError: shard name '../x' is not allowed: expected 1 to 128 ASCII letters, digits, '-' and '_', starting with a letter or digit (no path separators, no dots)
    """
    if not isinstance(name, str) or SHARD_NAME.fullmatch(name) is None:
        raise ValueError(
            f"shard name {short_repr(name)} is not allowed: expected 1 to 128 ASCII letters, digits, '-' and '_', "
            "starting with a letter or digit (no path separators, no dots)"
        )
    return name


def is_sharded(location: Location) -> bool:
    """Whether ``location`` is the root of a sharded dataset (it holds the root marker)."""
    return location.exists(MARKER_KEY)


def _shard_url(location: Location, name: str) -> str:
    return os.path.join(location.root, SHARDS_DIR, name) if location.is_local else f"{location.url}/{SHARDS_DIR}/{name}"


def _parse_marker(raw: bytes, where: str) -> Schema:
    """The dataset's schema from the bytes of its root marker; anything but the marker of FORMAT.md raises
    CorruptStoreError naming the key, the value found and what was expected (FormatVersionError for a newer one).
    The spaces are built from JSON only: nothing in a marker is imported or run."""
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise CorruptStoreError(
            f"{where} is not JSON ({short_repr(e)}); expected the root marker of a sharded dataset (FORMAT.md)"
        ) from e
    keys = {"format", "version", "schema", "created_at"}
    if not isinstance(doc, dict) or doc.keys() != keys:
        got = sorted(doc) if isinstance(doc, dict) else short_repr(doc)
        raise CorruptStoreError(f"{where} has keys {short_repr(got)}, expected an object with keys {sorted(keys)}")
    if doc["format"] != MARKER_FORMAT:
        raise CorruptStoreError(f"{where}: format is {short_repr(doc['format'])}, expected {MARKER_FORMAT!r}")
    version = doc["version"]
    if not is_int(version) or version < 1:
        raise CorruptStoreError(f"{where}: version is {short_repr(version)}, expected an integer >= 1")
    if version > MARKER_VERSION:
        raise FormatVersionError(
            f"{where} is a sharded dataset of version {version}; this her_store reads version {MARKER_VERSION}: "
            "upgrade her_store (pip install -U her_store)"
        )
    if not is_number(doc["created_at"], finite=True):
        raise CorruptStoreError(f"{where}: created_at is {short_repr(doc['created_at'])}, expected unix seconds")
    try:
        return Schema.from_json(doc["schema"])
    except SchemaMismatchError as e:
        raise CorruptStoreError(f"{where}: schema is invalid: {e}") from e


def _read_marker(location: Location) -> Schema | None:
    """The dataset's schema, or None when ``location`` holds no root marker."""
    raw = location.read_bytes(MARKER_KEY, limit=MARKER_LIMIT)
    return None if raw is None else _parse_marker(raw, location.key_path(MARKER_KEY))


def _create_once(location: Location, key: str, data: bytes) -> bool:
    """Write ``key`` whole if nothing is there yet, atomically; False (nothing written) if it exists.

    Local: a temp file, fsync'ed, then hard-linked to ``key`` (``link`` fails when ``key`` exists, and a reader sees no
    file or the whole one). Object storage: one PUT with ``If-None-Match: *``.
    """
    if not location.is_local:
        try:
            location.fs.pipe_file(location.key_path(key), data, mode="create")
        except FileExistsError:
            return False
        return True
    os.makedirs(location.root, exist_ok=True)
    path = location.key_path(key)
    fd, tmp = tempfile.mkstemp(prefix=f".{key}.", suffix=".tmp", dir=location.root)
    try:
        try:
            write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    fsync_file(location.root)
    return True


def _root_schema(location: Location, given: Schema | None) -> Schema:
    """The schema of the dataset at ``location``: read from its root marker, or (with ``given``) the root created
    with ``given`` when there is none yet. Of two writers creating one root, the first marker written stays and the
    other writer is checked against it."""
    schema = _read_marker(location)
    if schema is not None:
        return schema
    if given is None:
        raise NotAStoreError(
            f"{location} holds no sharded dataset (no {MARKER_KEY}); pass observation_space and action_space to "
            "create it"
        )
    if location.exists("zarr.json") or location.exists(COMMIT_KEY):
        raise StoreExistsError(
            f"{location} holds a plain store, not a sharded dataset; open it without shard=, or choose another "
            "root for the sharded dataset"
        )
    marker = {"format": MARKER_FORMAT, "version": MARKER_VERSION, "schema": given.to_json(), "created_at": time.time()}
    if _create_once(location, MARKER_KEY, json.dumps(marker, indent=1, sort_keys=True).encode()):
        return given
    schema = _read_marker(location)  # another writer created the root first
    if schema is None:
        raise CorruptStoreError(
            f"{location.key_path(MARKER_KEY)} existed a moment ago and is gone; it is never removed"
        )
    return schema


def _writable(location: Location) -> None:
    if location.read_only:
        raise ReadOnlyStoreError(location.read_only)
    if location.archive is not None:
        raise ReadOnlyStoreError(f"{location} is a packed store (one zip file), not a sharded dataset's root")


def open_shard(
    path_or_url: str | os.PathLike[str],
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
    location = Location(path_or_url, kwargs.get("storage_options"))
    _writable(location)
    _no_links(location, SHARDS_DIR, f"{SHARDS_DIR}/{name}")
    given = None
    if observation_space is not None and action_space is not None:
        given = Schema(observation_space, action_space, kwargs.get("info_keys", ()))
    schema = _root_schema(location, given)
    info = kwargs.get("info_keys", schema.info_spaces)
    obs = schema.observation_space if observation_space is None else observation_space
    act = schema.action_space if action_space is None else action_space
    Schema(obs, act, info).check_same(schema, location.key_path(MARKER_KEY))
    store = open_store(_shard_url(location, name), obs, act, **{**kwargs, "info_keys": info})
    assert isinstance(store, EpisodeStore)  # given spaces, open_store returns a store or raises
    return store


def open_view(
    location: Location,
    observation_space: spaces.Dict | None,
    action_space: spaces.Space | None,
    options: Mapping[str, Any],
) -> ShardedView:
    """``her_store.open_store(root)`` on a sharded root: the read view, when nothing asks for a writer."""
    writer_options = sorted(k for k in options if k not in _READ_OPTIONS)
    if observation_space is not None or action_space is not None or writer_options:
        given = ["spaces"] * (observation_space is not None or action_space is not None) + writer_options
        raise StoreError(
            f"{location} is a sharded dataset: a writer appends to its own shard, open_store(root, observation_space, "
            f"action_space, shard='actor-7', ...); open_store(root) alone reads every shard (got {', '.join(given)} "
            "and no shard)"
        )
    return ShardedView(location.url, options.get("storage_options"))


def _no_links(location: Location, *keys: str) -> None:
    """Refuse a symbolic link at any of ``keys`` of a local root: a shard is a directory of its dataset (one reached
    through a link would be written to where no view of the dataset reads it)."""
    if not location.is_local:
        return
    for key in keys:
        if os.path.islink(location.key_path(key)):
            raise CorruptStoreError(
                f"{location.key_path(key)} is a symbolic link; expected the dataset's own directory (FORMAT.md)"
            )


def _list_shards(location: Location) -> list[str]:
    """The shard names under ``shards/``, sorted; entries that are not directories with a shard name are not shards
    (no writer makes them) and are left out."""
    path = location.key_path(SHARDS_DIR)
    if location.is_local:
        _no_links(location, SHARDS_DIR)
        try:
            with os.scandir(path) as entries:
                names = [e.name for e in entries if e.is_dir(follow_symlinks=False)]
        except (FileNotFoundError, NotADirectoryError):
            return []
    else:
        location.fs.invalidate_cache(path)  # listings are cached by s3fs and others: a refresh must see new shards
        try:
            listed = location.fs.ls(path, detail=True)
        except FileNotFoundError:
            return []
        names = [e["name"].rstrip("/").rsplit("/", 1)[-1] for e in listed if e.get("type") == "directory"]
    return sorted(n for n in names if SHARD_NAME.fullmatch(n))


class ShardedView:
    """Every committed episode of every shard of a sharded dataset, read-only: what ``open_store(root)`` returns.

    Each shard is an ordinary store opened with ``mode="r"`` (:attr:`stores`, in the order of :attr:`shards`), so a
    view takes no lock and any number of them read while the writers append. An episode is named by its shard and
    its id in that shard: ``view.episode("actor-7", 12)``, or ``view.episode(2, 12)`` with the shard's position in
    :attr:`shards` (the ``shard`` column of :attr:`episodes`, the ``source`` of a mixture batch). :meth:`refresh`
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

    def __init__(self, path_or_url: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> None:
        self._loc = Location(path_or_url, storage_options)
        if self._loc.is_http:
            raise StoreError(
                f"{self._loc}: shards are found by listing {SHARDS_DIR}/, which plain HTTP does not offer; open one "
                f"shard as a store ({self._loc.url}/{SHARDS_DIR}/<name>), or the dataset over object storage"
            )
        schema = _read_marker(self._loc)
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
        for name in _list_shards(self._loc):
            if name in self._stores or self._loc.read_bytes(f"{SHARDS_DIR}/{name}/{COMMIT_KEY}") is None:
                continue
            store = EpisodeStore.open(_shard_url(self._loc, name), mode="r", storage_options=self._loc.storage_options)
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

    def sampler(self, batch_size: int, **kwargs: Any) -> MixtureSampler:
        """A sampler of HER batches drawn uniformly from every committed transition of every shard: a
        :class:`her_store.sampling.mixture.MixtureSampler` over this view weighted by transitions, which calls :meth:`refresh`
        and so follows new episodes and new shards. A batch's ``source`` is the shard's position in :attr:`shards`.
        The shards are one dataset: a random goal (``random``, a GoalMixture's random share) is the next achieved goal
        of a transition drawn uniformly from every shard's committed transitions, whichever shard the row came from.

        Parameters
        ----------
        batch_size : int
            Default batch size.
        **kwargs
            The mixture sampler's other options (``n_sampled_goal``, ``goal_selection_strategy``, ``reward_fn``,
            ``device``, ``seed``, ...).
        """
        from her_store.sampling.mixture import MixtureSampler  # imports torch: only when a view samples

        return MixtureSampler(self, weights="transitions", batch_size=batch_size, **kwargs)

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
        return f"ShardedView({self.url!r}, {len(self._stores)} shards, {self.num_episodes} episodes, {len(self)} transitions)"
