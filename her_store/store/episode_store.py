"""EpisodeStore: create, open and resume a store; append episodes; the commit protocol and the capacity ring.

A commit is the only moment the store changes for a reader: data rows, then index rows, then the commit record
(``commit.json``, replaced atomically). Episodes appended in between are staged in memory and committed as a group
(see ``commit_interval``), which is what makes appends cheap; a crash loses at most the staged episodes.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
import zlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, cast

import numpy as np
import zarr
import zarr.api.asynchronous
from gymnasium import spaces
from zarr.core.sync import sync as zarr_sync

from her_store.checks import is_int, is_number
from her_store.errors import (
    CorruptStoreError,
    EpisodeNotFoundError,
    EpisodeValidationError,
    NotAStoreError,
    ReadOnlyStoreError,
    SchemaMismatchError,
    StoreError,
    StoreExistsError,
    short_repr,
)
from her_store.format.card import card_problems, check_card
from her_store.format.frames import ShardWriter, frame_codecs, lz4_codec
from her_store.format.layout import (
    ATTRS_KEY,
    COMMIT_KEY,
    FORMAT_VERSION,
    INDEX_COLUMNS,
    LOCK_KEY,
    MAX_COUNT,
    ArraySpec,
    Commit,
    Layout,
    check_array,
    check_attrs,
    parse_attrs,
)
from her_store.format.schema import Schema, conform
from her_store.storage.location import (
    DEFAULT_LEASE_TTL,
    ZARR_CONFIG,
    Location,
    RawChunkFile,
    WriterLock,
    ZarrChunks,
    chunk_io,
)
from her_store.store.commit import Committer, round_up
from her_store.store.episode import Episode
from her_store.store.index import EpisodeIndex, IndexView
from her_store.store.step_writer import StepWriter

if TYPE_CHECKING:
    from her_store.datasets.sharded import ShardedView

__all__ = ["EpisodeStore", "open_store"]

Durability = Literal["flush", "fsync"]
# Local packs are memory-mapped whole: one large chunk file per ~1M rows keeps gathers to one or two maps.
LOCAL_CHUNK_ROWS = 1 << 20
REMOTE_CHUNK_ROWS = 1 << 13
INDEX_CHUNK_ROWS = 1 << 16
INDEX_PIECE_ROWS = 1 << 16  # index rows read at a time at open and refresh, each piece checked before the next
LOCAL_COMMIT_INTERVAL = 0.1
REMOTE_COMMIT_INTERVAL = 2.0
# a ring holds row space for capacity transitions plus one extra row per episode of >= 4 steps on average
RING_ROW_SLACK = 4
MAX_CAPACITY = MAX_COUNT // 2  # the ring's rows, capacity * 5/4 rounded up to a chunk, stay a count


def _to_zarr_codecs(codecs: Any) -> Any:
    """Accept zarr v3 codecs and plain numcodecs codecs (mapped to zarr's own Zstd/Blosc, else the numcodecs wrapper)."""
    import numcodecs.abc
    import zarr.codecs

    if codecs is None:
        return None
    items = list(codecs) if isinstance(codecs, (list, tuple)) else [codecs]
    out = []
    for c in items:
        if isinstance(c, str):
            c = _named_codec(c)
        elif isinstance(c, numcodecs.abc.Codec):
            cfg = c.get_config()
            kind = cfg.pop("id")
            if kind == "lz4":
                c = lz4_codec(cfg.get("acceleration", 1))
            elif kind == "zstd":
                c = zarr.codecs.ZstdCodec(level=cfg.get("level", 0), checksum=cfg.get("checksum", False))
            elif kind == "blosc":
                shuffle: Any = {0: "noshuffle", 1: "shuffle", 2: "bitshuffle", -1: "shuffle"}[cfg.get("shuffle", 1)]
                c = zarr.codecs.BloscCodec(cname=cfg["cname"], clevel=cfg["clevel"], shuffle=shuffle)
            else:
                import zarr.codecs.numcodecs as zn

                cls = getattr(zn, type(c).__name__, None)
                if cls is None:
                    raise StoreError(f"compressor {c!r} has no Zarr v3 form; use a zarr.codecs or numcodecs Zstd/Blosc codec")
                c = cls(**cfg)
        out.append(c)
    return out


def _named_codec(name: str) -> Any:
    """The codec a name in ``compressors`` stands for: 'lz4' (the default for images), 'zstd', 'jpeg' (lossy)."""
    import zarr.codecs

    if name == "lz4":
        return lz4_codec()
    if name == "zstd":
        return zarr.codecs.ZstdCodec(level=3)
    if name == "jpeg":
        from her_store.format.jpeg import jpeg_codec

        return jpeg_codec()
    raise StoreError(f"compressor name {name!r} is not one of 'lz4', 'zstd', 'jpeg' (or pass a codec, or None)")


class EpisodeStore:
    """A persistent store of goal-conditioned episodes on local disk or object storage.

    Create one with :meth:`create`, reopen it with :meth:`open`, or do either with :func:`open_store`. A store
    opened for writing (``mode="a"``) holds the store's single-writer lock until :meth:`close`; any number of
    processes may open it with ``mode="r"`` and call :meth:`refresh` to see new commits.

    Appended episodes are committed in groups: on the first append ``commit_interval`` seconds after the last
    commit, when the staged rows reach a chunk, and on :meth:`flush`, :meth:`close` or any read through the
    writing handle (``num_episodes``, ``episodes``, ``episode()``, ...). A crash (even kill -9) loses at most
    the episodes staged since the last commit.

    Not thread-safe: use one handle per thread.

    Examples
    --------
    >>> import numpy as np, tempfile
    >>> from gymnasium import spaces
    >>> obs = spaces.Dict({k: spaces.Box(-1, 1, (3,)) for k in ("observation", "achieved_goal", "desired_goal")})
    >>> path = tempfile.mkdtemp() + "/run"
    >>> with EpisodeStore.create(path, obs, spaces.Box(-1, 1, (2,)), metadata={"env_id": "Demo-v0"}) as store:
    ...     T = 5
    ...     ep = {k: np.zeros((T + 1, 3), np.float32) for k in ("observation", "achieved_goal", "desired_goal")}
    ...     ep.update(action=np.zeros((T, 2), np.float32), reward=np.full(T, -1.0, np.float32),
    ...               terminated=np.zeros(T, bool), truncated=np.eye(1, T, T - 1, dtype=bool)[0])
    ...     store.append_episode(ep)
    0
    >>> with EpisodeStore.open(path) as store:
    ...     len(store), store.episode(0)["observation"].shape, store.metadata["env_id"]
    (5, (6, 3), 'Demo-v0')
    """

    # -- construction ----------------------------------------------------------------------------------
    def __init__(self, location: Location, mode: str, durability: Durability, commit_interval: float | None) -> None:
        if mode not in ("r", "a"):
            raise ValueError(f"mode must be 'r' (read) or 'a' (append), got {mode!r}")
        if durability not in ("flush", "fsync"):
            raise ValueError(f"durability must be 'flush' or 'fsync', got {durability!r}")
        if mode == "a" and location.read_only:
            raise ReadOnlyStoreError(location.read_only)
        if location.archive is not None and mode != "r":
            raise ReadOnlyStoreError(
                f"{location} is a packed store (one zip file), which is read in place and never written: extract it "
                "(any unzip tool gives the store directory) to append to it"
            )
        if location.archive is None and location.is_local and os.path.lexists(location.root) and not os.path.isdir(location.root):
            raise NotAStoreError(f"{location} is a file, not a store directory")
        self._loc = location
        self.mode = mode
        self.durability: Durability = durability
        self._committer: Committer | None = None
        self._version = FORMAT_VERSION  # the store's, from its attributes once opened
        self.commit_interval = LOCAL_COMMIT_INTERVAL if location.is_local else REMOTE_COMMIT_INTERVAL
        if commit_interval is not None:
            self.commit_interval = commit_interval
        self._lock: WriterLock | None = None
        self._pid = os.getpid()
        self._closed = False
        self._arrays: dict[str, RawChunkFile | ZarrChunks] = {}
        self._index_io: dict[str, RawChunkFile | ZarrChunks] = {}

    @classmethod
    def create(
        cls,
        path_or_url: str | os.PathLike[str],
        observation_space: spaces.Dict,
        action_space: spaces.Space,
        *,
        capacity: int | None = None,
        chunk_rows: int | None = None,
        compressors: Mapping[str, Any] | None = None,
        info_keys: Sequence[str] | Mapping[str, spaces.Space] = (),
        metadata: Mapping[str, Any] | None = None,
        durability: Durability = "flush",
        storage_options: Mapping[str, Any] | None = None,
        commit_interval: float | None = None,
        lease_ttl: float = DEFAULT_LEASE_TTL,
    ) -> EpisodeStore:
        """Create a new, empty store and open it for appending.

        Parameters
        ----------
        path_or_url : str or PathLike
            A local directory or an fsspec URL (``s3://bucket/run``, ``gs://...``, ``memory://...``, ``file://...``).
        observation_space : gymnasium.spaces.Dict
            With ``observation``, ``achieved_goal`` and ``desired_goal`` (other keys are stored too).
            Sub-spaces: Box (float or uint8 images), Discrete, MultiBinary, MultiDiscrete.
        action_space : gymnasium.spaces.Space
            Box, Discrete, MultiBinary or MultiDiscrete.
        capacity : int, optional
            The most transitions kept; the oldest whole episodes are evicted first (a FIFO ring, like SB3's
            ``buffer_size``). None grows without bound. Row space is ``capacity * 5/4`` rows rounded up to a
            chunk, so episodes shorter than about 4 steps may be evicted before ``capacity`` is reached.
        chunk_rows : int, optional
            Rows per chunk of the packed arrays (default 1,048,576 on local disk, where chunks are memory-mapped,
            or the ring's size if smaller; 8,192 on object storage).
        compressors : mapping of field name to codec(s), optional
            Per-field compression (zarr v3 codecs or numcodecs Zstd/Blosc); None for a field means uncompressed.
            Default: none for low-dimensional fields (memory-mapped by the sampler), Blosc-LZ4 (bit-shuffle) for
            uint8 images.
        info_keys : sequence of str or mapping of str to Space
            Numeric info entries stored per step, e.g. ``["is_success"]`` (a float32 scalar each).
        metadata : mapping, optional
            A dataset card saved in the store: env_id, algorithm, author, description, ... (JSON values).
        durability : {"flush", "fsync"}
            "flush" hands every commit to the OS (survives a crash of the process); "fsync" also fsyncs data,
            index, commit record and directory at each commit (survives power loss).
        storage_options : mapping, optional
            Passed to fsspec for URLs (credentials, ``client_kwargs={"endpoint_url": ...}``).
        commit_interval : float, optional
            Seconds between group commits (default 0.1 on local disk, 2.0 on object storage; 0 commits every
            episode).
        lease_ttl : float
            Object storage only: seconds after which the writer's lease, unless renewed, may be taken over by
            another writer (default 300). A live writer renews it in the background and before every commit.

        Returns
        -------
        EpisodeStore
            Opened with ``mode="a"``.

        Raises
        ------
        StoreExistsError
            If a store (or any Zarr node) already exists there; use :func:`open_store` to create-or-resume.
        """
        card = check_card(metadata or {}, "metadata")  # a new card starts valid (ValueError naming the field)
        loc = Location(path_or_url, storage_options)
        schema = Schema(observation_space, action_space, info_keys)
        layout, codecs = _plan_arrays(loc, schema, capacity, chunk_rows, compressors)
        capacity = None if capacity is None else int(capacity)  # a numpy integer: its rows and slots go into JSON
        grain = math.lcm(*(a.chunk_rows for a in layout.arrays))
        index_chunk = INDEX_CHUNK_ROWS if loc.is_local else REMOTE_CHUNK_ROWS
        if capacity is None:
            array_rows, slots, index_rows = grain, None, index_chunk
        else:
            array_rows = round_up(capacity + capacity // RING_ROW_SLACK + 1, grain)
            slots = round_up(int(capacity), min(index_chunk, int(capacity)))
            index_rows = slots
            index_chunk = min(index_chunk, slots)

        self = cls(loc, "a", durability, commit_interval)
        if loc.is_local:
            os.makedirs(loc.root, exist_ok=True)
        else:
            loc.fs.makedirs(loc.root, exist_ok=True)
        self._lock = WriterLock(loc, LOCK_KEY, lease_ttl)
        self._lock.acquire()
        try:
            from her_store.datasets.sharded import MARKER_KEY  # sharded builds on this module

            if loc.exists(MARKER_KEY):
                raise StoreExistsError(
                    f"{loc} is a sharded dataset's root: a writer appends to its own shard, "
                    "her_store.open_store(root, observation_space, action_space, shard='actor-7')"
                )
            if loc.exists("zarr.json"):
                if loc.exists(COMMIT_KEY):
                    raise StoreExistsError(
                        f"{loc} already holds a store; open it with EpisodeStore.open({str(loc)!r}, mode='a') or "
                        "her_store.open_store(...) to resume"
                    )
                if not _unfinished_create(loc):
                    check_attrs(_open_root(loc, read_only=True).attrs.asdict(), str(loc))  # someone else's node?
                    raise CorruptStoreError(
                        f"{loc} holds her_store arrays with rows but no commit record {COMMIT_KEY}; it is damaged "
                        "(nothing there was removed)"
                    )
                loc.clear(keep=LOCK_KEY)  # nothing was ever committed there: finish the create from scratch
            attrs: dict[str, Any] = {
                "format_version": FORMAT_VERSION,
                "schema": schema.to_json(),
                "layout": layout.to_json(),
                "capacity": None if capacity is None else int(capacity),
                "index_slots": slots,
                "metadata": card,
                "created_at": time.time(),
            }
            # zarr plans the nodes in memory; each node's metadata is then written once (zarr writing straight to
            # the store rewrites every parent group's zarr.json at each array: 96 writes, not 20, for a store)
            nodes: dict[str, Any] = {}
            plan = zarr.open_group(
                zarr.storage.MemoryStore(nodes), mode="w", zarr_format=3, attributes={ATTRS_KEY: attrs}
            )
            for spec in layout.arrays:
                shape = (array_rows, *spec.row_shape)
                plan.create_array(
                    spec.path,
                    shape=shape,
                    chunks=(1, *spec.row_shape) if spec.sharded else (spec.chunk_rows, *spec.row_shape),
                    shards=(spec.chunk_rows, *spec.row_shape) if spec.sharded else None,
                    dtype=spec.dtype,
                    compressors=codecs.get(spec.columns[0][0]) if spec.compressed else None,
                    fill_value=0,
                    chunk_key_encoding={"name": "default", "separator": spec.separator},
                    config=ZARR_CONFIG,
                )
            for name, dt in INDEX_COLUMNS.items():
                plan.create_array(
                    f"episodes/{name}", shape=(index_rows,), chunks=(index_chunk,), dtype=dt, compressors=None,
                    fill_value=0, config=ZARR_CONFIG,
                )
            _write_nodes(loc, {key: buf.to_bytes() for key, buf in nodes.items()}, durability == "fsync")
            root = _open_root(loc, read_only=False)
            commit = Commit(array_rows=array_rows)
            loc.write_atomic(COMMIT_KEY, commit.to_bytes(), fsync=durability == "fsync")
            self._attach(root, attrs, commit)
        except BaseException:
            self._lock.release()
            raise
        return self

    @classmethod
    def open(
        cls,
        path_or_url: str | os.PathLike[str],
        mode: Literal["r", "a"] = "r",
        storage_options: Mapping[str, Any] | None = None,
        *,
        durability: Durability = "flush",
        commit_interval: float | None = None,
        lease_ttl: float = DEFAULT_LEASE_TTL,
    ) -> EpisodeStore:
        """Open an existing store.

        Parameters
        ----------
        path_or_url : str or PathLike
            As in :meth:`create`.
        mode : {"r", "a"}
            "r" reads (no lock; :meth:`refresh` sees new commits); "a" takes the writer lock and resumes appending
            after the last committed episode (rows written past it by a crashed writer are overwritten).
        storage_options, durability, commit_interval, lease_ttl
            As in :meth:`create`. Over http(s), ``storage_options["request_deadline"]`` is the seconds any one
            request may take in all (default 300), the others are fsspec's HTTP filesystem's.

        Raises
        ------
        NotAStoreError, FormatVersionError, CorruptStoreError, StoreLockedError
        StoreTimeoutError
            Over HTTP, a request not ended within its deadline, or a server silent for 60 s.

        Examples
        --------
        >>> store = EpisodeStore.open("runs/fetch", mode="a")  # doctest: +SKIP
        """
        loc = Location(path_or_url, storage_options)
        self = cls(loc, mode, durability, commit_interval)
        root = _open_root(loc, read_only=mode == "r")
        attrs = check_attrs(root.attrs.asdict(), str(loc))
        if mode == "a":
            self._lock = WriterLock(loc, LOCK_KEY, lease_ttl)
            self._lock.acquire()
        try:
            if mode == "a":
                loc.remove_temp_files()  # what a writer killed in an atomic write left (a shard, a commit record)
            self._version = attrs["format_version"]
            self._attach(root, attrs, self._read_commit())
        except BaseException:
            if self._lock is not None:
                self._lock.release()
            raise
        return self

    def _read_commit(self) -> Commit:
        raw = self._loc.read_bytes(COMMIT_KEY)
        if raw is None and _unfinished_create(self._loc):
            raise NotAStoreError(
                f"{self._loc} holds an unfinished create (its creator stopped before the first commit record, so "
                "nothing was stored); her_store.open_store(path, observation_space, action_space, ...) creates it anew"
            )
        if raw is None:
            raise CorruptStoreError(
                f"{self._loc} has no commit record {COMMIT_KEY}, which every store has (FORMAT.md): the store was removed "
                "or is damaged"
            )
        return Commit.from_bytes(raw, str(self._loc), self._version)

    def _attach(self, root: zarr.Group, attrs: dict[str, Any], commit: Commit) -> None:
        self._root = root
        self._attrs = attrs
        self._root_stamp = self._read_root_stamp()
        # every name and number below becomes a file path, an allocation or an index: all are checked first
        self.schema, self.layout, self.capacity, slots = parse_attrs(attrs, f"{self._loc}/zarr.json")
        self._index = EpisodeIndex(slots)
        self._open_io()
        self._load_committed(commit)
        self._array_rows = self._commit.array_rows
        if self.mode == "a":
            assert self._lock is not None
            self._committer = Committer(
                self._loc, root, self.schema, self.layout, self._index, self._arrays, self._index_io, self._commit,
                self._index_rows, self.capacity, self.durability, self.commit_interval, self._lock,
            )

    def _open_io(self) -> None:
        """Row access to every array, each checked against the layout first; a reader calls it again when the
        writer has grown the arrays."""
        for w in (*self._arrays.values(), *self._index_io.values()):
            w.close()
        wanted = [
            (s.path, s.dtype, s.row_shape, s.chunk_rows, not s.compressed, s.sharded, s.separator)
            for s in self.layout.arrays
        ]
        wanted += [(f"episodes/{name}", np.dtype(dt), (), None, True, False, "/") for name, dt in INDEX_COLUMNS.items()]
        arrays = self._checked_arrays(wanted)
        for spec, array in zip(self.layout.arrays, arrays):
            self._arrays[spec.path] = (
                ShardWriter(array, self._loc) if spec.sharded else chunk_io(self._loc, array, spec.compressed)
            )
        for name, array in zip(INDEX_COLUMNS, arrays[len(self.layout.arrays) :]):
            self._index_io[name] = chunk_io(self._loc, array, False)
        self._data_rows = min(a.shape[0] for a in arrays[: len(self.layout.arrays)])
        self._index_rows = min(a.shape[0] for a in arrays[len(self.layout.arrays) :])

    def _checked_arrays(
        self, wanted: Sequence[tuple[str, np.dtype, tuple[int, ...], int | None, bool, bool, str]]
    ) -> list[zarr.Array]:
        """The arrays at ``(path, dtype, row_shape, chunk_rows, raw, sharded, separator)``, each checked against what
        the layout says it is. Their metadata is read concurrently: on object storage an open waits one request, not
        one per array."""
        for path, *_ in wanted:
            self._loc.check_file(f"{path}/zarr.json")  # zarr reads it whole: a regular file of bounded size
        opened = _open_arrays(self._root, [path for path, *_ in wanted])
        arrays = []
        for (path, dtype, row_shape, chunk_rows, raw, sharded, separator), array in zip(wanted, opened):
            where = f"{self._loc}/{path}/zarr.json"
            if isinstance(array, zarr.errors.NodeTypeValidationError):
                raise CorruptStoreError(f"{where} is not an array's metadata: {str(array)[:200]}") from array
            if isinstance(
                array, (KeyError, ValueError, TypeError, AttributeError, OverflowError, RecursionError, NotADirectoryError)
            ):
                raise CorruptStoreError(  # zarr's parse
                    f"{where} is missing or unreadable ({short_repr(array)}); expected the array FORMAT.md describes"
                ) from array
            if isinstance(array, BaseException):
                raise array
            check_array(array, dtype, row_shape, chunk_rows, raw, where, sharded, separator)
            arrays.append(array)
        return arrays

    def _load_committed(self, commit: Commit) -> None:
        """Load the index window of a commit, checked against the arrays and the record; on error the handle keeps
        what it had. A reader racing a ring writer may read slots the writer reused after that commit: it then
        retries with the newer commit rather than reporting corruption."""
        for attempt in range(8):
            index = EpisodeIndex(self._index.slots)
            try:
                self._check_fits(commit)
                columns = self._read_index(commit.first_episode, commit.end_episode)
                self._check_index(commit, commit.first_episode, columns, 0)
            except CorruptStoreError:
                newer = self._read_commit() if self.mode == "r" else commit
                if attempt == 7 or newer.generation == commit.generation:
                    raise
                commit = newer
            else:
                index.load(columns, commit.first_episode, commit.end_episode)
                self._index, self._commit = index, commit
                return

    def _check_fits(self, commit: Commit) -> None:
        where = f"{self._loc}/{COMMIT_KEY}"
        commit.check_fits(self.capacity, self._index.slots, self._data_rows, self._index_rows, where)

    def _read_index(self, first: int, end: int) -> dict[str, np.ndarray]:
        """Index rows of ids ``[first, end)``, read in pieces whose episode ids must be the expected ones before the
        next piece is read: a record claiming more episodes than were written fails at the first piece that was
        never written, rather than allocating for all of them."""
        pieces = range(first, end, INDEX_PIECE_ROWS)  # each checked before the next is read
        if len(pieces) <= 1:
            return self._index_piece(first, end, first, end)
        parts = [self._index_piece(a, min(a + INDEX_PIECE_ROWS, end), first, end) for a in pieces]
        return {name: np.concatenate([p[name] for p in parts]) for name in INDEX_COLUMNS}

    def _index_piece(self, a: int, b: int, first: int, end: int) -> dict[str, np.ndarray]:
        """Index rows of ids ``[a, b)``, each holding its own episode id."""
        piece = EpisodeIndex.read(self._index_io, self._index.positions(a, b))
        wrong = np.flatnonzero(piece["episode_id"] != np.arange(a, b))
        if wrong.size:
            i = int(wrong[0])
            raise CorruptStoreError(
                f"{self._loc}: the index row of episode {a + i} holds episode_id {int(piece['episode_id'][i])}; "
                f"{COMMIT_KEY} records episodes {first}..{end - 1}"
            )
        return piece

    def _check_index(self, commit: Commit, first: int, columns: Mapping[str, np.ndarray], transitions: int) -> None:
        """Check the index rows of ids ``first, first + 1, ...`` against ``commit`` before they are used: each episode
        owns ``length + 1`` rows of its own within the committed rows, and their lengths plus ``transitions`` (of
        the live episodes before ``first``) sum to the record's num_transitions."""
        starts, lengths = columns["start_row"], columns["length"]
        # an unbounded store's rows end at write_row; a ring's lie anywhere in its array_rows
        limit = commit.write_row if self.capacity is None else commit.array_rows
        ends = starts + lengths + 1
        bad = np.flatnonzero((lengths < 1) | (starts < 0) | (starts > limit) | (lengths > limit) | (ends > limit))
        if not bad.size:  # with every row in range, the checks below cannot overflow
            order = np.argsort(starts, kind="stable")
            bad = np.sort(order[1:][starts[order[1:]] < ends[order[:-1]]])
        if bad.size:
            i = int(bad[0])
            raise CorruptStoreError(
                f"{self._loc}: the index row of episode {first + i} (start_row={int(starts[i])}, "
                f"length={int(lengths[i])}) does not fit {COMMIT_KEY}: expected rows of its own below row {limit}"
            )
        total = transitions + int(lengths.sum())
        if total != commit.num_transitions:
            raise CorruptStoreError(
                f"{self._loc}: index lengths sum to {total} transitions, {COMMIT_KEY} says {commit.num_transitions}"
            )

    # -- properties --------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        """The store's local path or URL."""
        return self._loc.url

    @property
    def commit_interval(self) -> float:
        """Seconds between group commits of a writing handle (0: every append commits); may be changed any time."""
        return self._commit_interval

    @commit_interval.setter
    def commit_interval(self, seconds: float) -> None:
        if not is_number(seconds) or not 0 <= seconds < math.inf:
            raise ValueError(f"commit_interval must be a finite number of seconds >= 0, got {seconds!r}")
        self._commit_interval = float(seconds)
        if self._committer is not None:
            self._committer.commit_interval = self._commit_interval

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
    def metadata(self) -> dict[str, Any]:
        """The dataset card (:mod:`her_store.format.card`: env_id, algorithm_name, author, ...) as stored, a deep copy.

        Shown as it is, never judged: a card with odd values (a field of the wrong kind, a huge string) does not
        stop a store from opening; :func:`her_store.format.card.card_problems` lists them, and :meth:`update_metadata`
        writes only a card that :func:`her_store.format.card.check_card` accepts.
        """
        import copy

        return copy.deepcopy(dict(self._attrs["metadata"]))

    def update_metadata(self, **entries: Any) -> None:
        """Add, replace or (with the value None) remove entries of the dataset card.

        The new card is checked first (:func:`her_store.format.card.check_card`: known fields of the right kind, JSON
        values, at most 1 MiB), then the root ``zarr.json`` is replaced whole under the writer lock (temp file +
        rename locally, one PUT on object storage): a reader, or a crash, finds the old card or the new one, never
        a torn file. The commit record is not touched.

        Raises
        ------
        ValueError
            The card would not pass :func:`her_store.format.card.check_card`; nothing is written.
        ReadOnlyStoreError
            The store is open read-only.

        Examples
        --------
        >>> store.update_metadata(algorithm_name="SAC+HER", author="lab", license=None)  # doctest: +SKIP
        """
        self._writing()
        card = {k: v for k, v in {**self._attrs["metadata"], **entries}.items() if v is not None}
        problems = card_problems(card)  # every one at once: a card read from elsewhere may have several
        if problems:
            raise ValueError(f"{self.url}: {'; '.join(problems)}; the card was not changed")
        attrs = {**self._attrs, "metadata": check_card(card)}
        # the root zarr.json as it is on disk (checked at open, and only the lock holder writes it), only the
        # her_store attribute replaced: written by her_store rather than zarr, so that it is one atomic replacement
        # whose temp file a later writer's open removes
        doc = json.loads(self._loc.read_bytes("zarr.json") or b"null")
        if not isinstance(doc, dict) or not isinstance(doc.get("attributes"), dict):
            raise CorruptStoreError(f"{self._loc}/zarr.json changed since the store was opened; expected a Zarr group")
        doc["attributes"][ATTRS_KEY] = attrs
        assert self._lock is not None
        self._lock.ensure_held()
        self._loc.write_atomic("zarr.json", json.dumps(doc, indent=2).encode(), fsync=self.durability == "fsync")
        self._attrs = attrs

    def _visible(self) -> EpisodeIndex:
        """The index as this handle should report it: a writer commits what it staged first."""
        self._require_open()
        if self._committer is not None:
            self._writing().commit()
        return self._index

    @property
    def num_episodes(self) -> int:
        """Committed episodes still in the store (evicted ones excluded)."""
        return len(self._visible())

    @property
    def num_transitions(self) -> int:
        """Committed transitions still in the store (``len(store)``)."""
        return self._visible().num_transitions

    def __len__(self) -> int:
        return self.num_transitions

    @property
    def first_episode(self) -> int:
        """Id of the oldest episode still in the store (ids below were evicted)."""
        return self._visible().first

    @property
    def end_episode(self) -> int:
        """One past the newest committed episode id."""
        return self._visible().end

    @property
    def episodes(self) -> dict[str, np.ndarray]:
        """The episode-index table over the live episodes: a dict of read-only numpy columns.

        Columns: episode_id, start_row, length, terminated, truncated, return, success (-1 unknown, 0, 1),
        env_index (-1 for whole appended episodes), created_at (unix seconds), crc32.
        """
        return self._visible().table()

    @property
    def commit_record(self) -> Commit:
        """The last commit this handle made or saw (generation, live episode ids, rows, array size)."""
        self._visible()
        return self._committed

    def snapshot(self) -> IndexView:
        """The committed episodes as a frozen view (what a sampler draws from), without forcing a commit.

        On a writing handle, staged episodes are committed first only when the group commit is due anyway
        (``commit_interval`` has passed) or nothing is committed yet; otherwise they are not in the view, nor are
        episodes the ring has evicted in memory (their rows stay intact until the commit that evicts them on
        disk). A reading handle returns what its last :meth:`refresh` saw.
        """
        self._require_open()
        w = self._committer
        if w is not None and w.pending and (w.due or w.commit_record.end_episode == w.commit_record.first_episode):
            self._writing().commit()
        return self._index.snapshot(self._committed.end_episode)

    @property
    def _committed(self) -> Commit:
        """The newest commit record this handle knows: its own last commit, or the one a reader last loaded."""
        return self._committer.commit_record if self._committer is not None else self._commit

    @property
    def index(self) -> EpisodeIndex:
        """The committed episode index (what the sampler asks about rows and lengths)."""
        return self._visible()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.num_episodes} episodes, {self.num_transitions} transitions"
        cap = "unbounded" if self.capacity is None else f"capacity={self.capacity}"
        return f"EpisodeStore({self.url!r}, mode={self.mode!r}, {cap}, {state})"

    # -- reading -----------------------------------------------------------------------------------------
    def _split(self, spec: ArraySpec, rows: np.ndarray, length: int) -> dict[str, np.ndarray]:
        """The fields of one array's ``length + 1`` episode rows (per-step fields drop the unused last row)."""
        out = {}
        for name, a, b in spec.columns:
            f = self.schema.by_name[name]
            part = rows[:, a:b] if spec.is_pack else rows
            out[name] = part[: length if f.per_step else length + 1].reshape(-1, *f.shape)
        return out

    def episode(self, episode_id: int, *, verify: bool = True) -> Episode:
        """Read one committed episode.

        Parameters
        ----------
        episode_id : int
            Between :attr:`first_episode` and :attr:`end_episode`.
        verify : bool
            Check the rows against the crc32 recorded at write time. A reader racing a ring writer that
            overwrote the episode meanwhile gets EpisodeNotFoundError rather than mixed rows.

        Raises
        ------
        EpisodeNotFoundError
            Never committed, or evicted by the ring.
        CorruptStoreError
            The rows do not match their checksum.
        """
        idx = self._visible()
        episode_id = int(episode_id)
        if not idx.first <= episode_id < idx.end:
            what = "was evicted by the capacity ring" if 0 <= episode_id < idx.first else "is not committed"
            raise EpisodeNotFoundError(
                f"episode {episode_id} {what}; {self.url} holds episodes {idx.first}..{idx.end - 1}"
            )
        start, length = idx.rows_of(episode_id)
        crc, data = 0, {}
        for spec in self.layout.arrays:
            io = self._arrays[spec.path]
            if isinstance(io, ShardWriter):  # the checksum covers a sharded array's rows as stored
                frames = io.read_encoded(start, start + length + 1)
                crc = zlib.crc32(b"".join(f or b"" for f in frames), crc)
                rows = io.decode(frames, start)
            else:
                rows = io.read(start, start + length + 1)
                crc = zlib.crc32(np.ascontiguousarray(rows).data, crc)
            data.update(self._split(spec, rows, length))
        data = {f.name: data[f.name] for f in self.schema.fields}
        if verify and crc != int(idx.column("crc32")[episode_id - idx.first]):
            if self.mode == "r":
                self.refresh()
                if episode_id < self._index.first:
                    raise EpisodeNotFoundError(f"episode {episode_id} was evicted by the writer while being read")
            raise CorruptStoreError(
                f"{self.url}: rows {start}..{start + length} of episode {episode_id} do not match the crc32 "
                "recorded when they were written"
            )
        return Episode(episode_id, data)

    def refresh(self) -> int:
        """Pick up episodes committed since this handle last looked (another process's writer); returns how many.

        Cost is proportional to the new episodes, not to the store.

        Raises
        ------
        CorruptStoreError
            The new commit record, or the index rows it names, do not fit the store; the handle keeps what it saw.
        """
        self._require_open()
        if self.mode == "a":
            return 0
        # the root is checked after the commit record is read, and again after the index rows it names: a store
        # created again before either read is seen before this handle takes anything of it
        commit = self._read_commit()
        self._check_same_store()
        if commit.generation == self._commit.generation:
            return 0
        if commit.array_rows != self._array_rows or (self._index.slots is None and commit.end_episode > self._index_rows):
            self._root = _open_root(self._loc, read_only=True)
            self._open_io()
        idx = self._index
        old_end = idx.end
        new = None
        if idx.first <= commit.first_episode <= idx.end <= commit.end_episode:
            self._check_fits(commit)
            try:
                new = self._read_index(idx.end, commit.end_episode)
                self._check_index(commit, old_end, new, idx.transitions_between(commit.first_episode, old_end))
            except CorruptStoreError:
                new = None  # the ring reused those slots while they were read: reload the window below
        self._check_same_store()
        if new is not None:
            idx.extend(new)
            idx.first = commit.first_episode
            self._commit = commit
        else:  # fell a whole ring behind (or the slots moved on meanwhile): reload the window
            self._load_committed(commit)
        self._array_rows = self._commit.array_rows
        return max(0, commit.end_episode - old_end)

    def _read_root_stamp(self) -> tuple[int, int] | str | None:
        """What tells this store from one created again at its place (see :meth:`_check_same_store`): a directory's
        root file's (inode, mtime), an object store's root object ETag (None where the server reports none, and for a
        packed store, which never changes)."""
        if self._loc.archive is not None:
            return None
        if self._loc.is_local:
            st = os.stat(self._loc.key_path("zarr.json"))
            return (st.st_ino, st.st_mtime_ns)
        return self._loc.etag("zarr.json")

    def _check_same_store(self) -> None:
        """A store deleted and created again under this handle (a shard wiped and restarted, say) is another store:
        its rows are not the ones this handle mapped or cached. Its root ``zarr.json`` is then a new file (object) with
        another ``created_at`` (a card edit replaces it too, keeping ``created_at``). Object storage: one HEAD of the
        root object per look, its ETag against the one seen before."""
        if self._root_stamp is None:
            return
        try:
            stamp = self._read_root_stamp()
        except OSError as e:
            if not self._loc.is_local:
                raise
            raise CorruptStoreError(f"{self._loc}/zarr.json is gone ({e.strerror}); the store was removed") from e
        if stamp is None:  # no answer, or none with an ETag (an outage, say): nothing to tell by; a store that is
            return  # gone fails the commit record's read
        if stamp == self._root_stamp:
            return
        try:
            created = json.loads(self._loc.read_bytes("zarr.json") or b"null")["attributes"][ATTRS_KEY]["created_at"]
        except (ValueError, TypeError, KeyError, RecursionError):
            created = None
        if created != self._attrs.get("created_at"):
            raise CorruptStoreError(
                f"{self._loc} was created again since this handle opened it (its zarr.json holds another store); "
                "open it again"
            )
        self._root_stamp = stamp

    def live_first(self) -> int:
        """The oldest episode id the ring has not evicted, as of now (episodes below may be being overwritten).

        A writing handle knows its own commits; a reading handle re-reads the commit record. Eviction is
        committed before any row is overwritten, so rows of an episode read before this call returns a value
        at or below its id are intact.
        """
        return self._committed.first_episode if self._committer is not None else self._read_commit().first_episode

    # -- writing -----------------------------------------------------------------------------------------
    def _require_open(self) -> None:
        if self._closed:
            raise StoreError(f"{self.url} is closed")

    def _writing(self) -> Committer:
        """The committer of a handle opened for appending (ReadOnlyStoreError otherwise)."""
        self._require_open()
        if self._pid != os.getpid():
            raise StoreError(
                f"{self.url} was opened for appending by process {self._pid}; a forked child cannot write through "
                "its handle (two processes would write one store): open the store in the child instead"
            )
        if self._committer is None:
            raise ReadOnlyStoreError(f"{self.url} is open read-only (mode='r'); open it with mode='a' to append")
        return self._committer

    def validate_episode(self, episode: Mapping[str, Any]) -> tuple[int, dict[str, np.ndarray]]:
        """Check an episode against the schema; return ``(T, arrays in stored dtypes)`` or raise EpisodeValidationError."""
        if not isinstance(episode, Mapping):
            raise EpisodeValidationError(f"an episode is a mapping of field name -> array, got {type(episode).__name__}")
        names = self.schema.by_name
        if episode.keys() != names.keys():
            missing = [n for n in names if n not in episode]
            extra = sorted(set(episode) - set(names))
            raise EpisodeValidationError(
                f"episode keys do not match the store: missing {missing}, unexpected {extra}; expected {list(names)}"
            )
        action = np.asarray(episode["action"])
        T = len(action) if action.ndim else 0
        if T < 1:
            raise EpisodeValidationError(f"an episode needs at least one step; 'action' has shape {action.shape}")
        out = {}
        for f in self.schema.fields:
            a = np.asarray(episode[f.name])
            rows = T if f.per_step else T + 1
            if a.shape[:1] != (rows,) or a.shape[1:] != f.shape:
                what = "T" if f.per_step else "T + 1"
                raise EpisodeValidationError(
                    f"field {f.name!r} has shape {a.shape}, expected {(rows, *f.shape)} ({what} rows with T={T} from 'action')"
                )
            a = conform(a, f, self.schema.value_ranges.get(f.name), f"field {f.name!r}")
            out[f.name] = a if a.flags.c_contiguous else np.ascontiguousarray(a)
        return T, out

    def append_episode(self, episode: Mapping[str, Any], *, env_index: int = -1) -> int:
        """Append one whole episode; returns its id (consecutive from 0, never reused).

        Parameters
        ----------
        episode : mapping of str to array
            Every observation key with ``T + 1`` rows (the last is the final next-observation), ``action``,
            ``reward``, ``terminated``, ``truncated`` and each info key with ``T`` rows (Minari's episode shape).
            Values are cast to the stored dtype when that is safe (float64 -> float32), refused otherwise.
        env_index : int
            Which vectorised environment produced it (recorded in the index; -1 when unknown).

        Raises
        ------
        EpisodeValidationError
            Missing/extra keys, wrong shapes or dtypes, T mismatches, an episode longer than the capacity.
            Nothing is written.
        """
        self._writing()
        T, data = self.validate_episode(episode)
        return self._append_checked(T, data, env_index)

    def _append_checked(self, T: int, data: Mapping[str, np.ndarray], env_index: int) -> int:
        """Append an episode already in the schema's shapes and dtypes (validated, or built by a StepWriter)."""
        return self._writing().append(T, data, env_index)

    def writer(self, n_envs: int = 1) -> StepWriter:
        """A :class:`~her_store.store.step_writer.StepWriter` that assembles episodes from per-step adds of ``n_envs`` envs.

        Examples
        --------
        >>> w = store.writer(n_envs=4)  # doctest: +SKIP
        >>> w.add(obs, next_obs, action, reward, terminated, truncated)  # doctest: +SKIP
        """
        self._writing()
        return StepWriter(self, n_envs)

    def flush(self) -> None:
        """Commit every staged episode now (and fsync with durability='fsync')."""
        self._require_open()
        if self._committer is not None:
            self._writing().commit()

    def close(self) -> None:
        """Commit what is staged, release the writer lock and file handles. Idempotent."""
        if self._closed:
            return
        try:
            if self._committer is not None and self._pid == os.getpid():  # a forked child leaves the parent's alone
                self._committer.commit()
        finally:
            for w in (*self._arrays.values(), *self._index_io.values()):
                w.close()
            if self._lock is not None:
                self._lock.release()
            if self._loc.archive is not None:
                self._loc.archive.close()
            self._closed = True

    def __enter__(self) -> EpisodeStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _plan_arrays(
    loc: Location, schema: Schema, capacity: Any, chunk_rows: int | None, compressors: Mapping[str, Any] | None
) -> tuple[Layout, dict[str, Any]]:
    """The arrays a store of these creation options gets: its Layout and the zarr codecs of compressed fields."""
    if capacity is not None and (not is_int(capacity) or not 1 <= capacity <= MAX_CAPACITY):
        raise ValueError(f"capacity must be an int from 1 to {MAX_CAPACITY:,} or None, got {capacity!r}")
    if chunk_rows is None:
        chunk_rows = LOCAL_CHUNK_ROWS if loc.is_local else REMOTE_CHUNK_ROWS
        if capacity is not None:  # a small ring needs no chunk larger than itself
            chunk_rows = min(chunk_rows, 1 << int(capacity + capacity // RING_ROW_SLACK).bit_length())
    if not is_int(chunk_rows) or chunk_rows < 1:
        raise ValueError(f"chunk_rows must be a positive int, got {chunk_rows!r}")
    compressors = dict(compressors or {})
    unknown = sorted(set(compressors) - set(schema.by_name))
    if unknown:
        raise SchemaMismatchError(f"compressors name unknown fields {unknown}; fields are {list(schema.by_name)}")
    codecs = {f.name: _to_zarr_codecs(compressors.get(f.name, _default_codec(f))) for f in schema.fields}
    codecs = {k: frame_codecs(v, schema.by_name[k]) for k, v in codecs.items() if v}
    if "zarr.json" in codecs:  # its array's directory, steps/zarr.json/, would be the steps group's metadata file
        raise SchemaMismatchError(
            "a compressed field cannot be named 'zarr.json' (its array steps/zarr.json would take the place of the "
            "steps group's metadata); rename the observation key, or store it uncompressed (compressors={'zarr.json': "
            "None})"
        )
    return Layout.build(schema, set(codecs), int(chunk_rows)), codecs


def _open_arrays(root: zarr.Group, paths: Sequence[str]) -> list[zarr.Array | BaseException]:
    """The arrays at ``paths`` under ``root``, opened concurrently on zarr's event loop; a path that failed to open
    gives its exception."""

    async def open_all() -> list[Any]:
        return await asyncio.gather(
            *(zarr.api.asynchronous.open_array(store=root.store, path=p, zarr_format=3) for p in paths),
            return_exceptions=True,
        )

    return [a if isinstance(a, BaseException) else zarr.Array(a) for a in zarr_sync(open_all())]


def _write_nodes(loc: Location, files: Mapping[str, bytes], fsync: bool) -> None:
    """Write a new store's Zarr metadata documents, the root's first: from then on a create cut short is recognised
    as unfinished (:func:`_unfinished_create`) and started again.

    Raises
    ------
    StoreExistsError
        Something is already where a document goes (another Zarr node there, say): nothing is written.
    """
    if loc.is_local:
        for key in files:  # a link on the way is refused before anything is made, or removed
            loc.make_parents(key, create=False)
        taken = [k for k in files if os.path.lexists(loc.key_path(k))]
    else:
        found = set(loc.fs.find(loc.root, withdirs=True))
        taken = [k for k in files if loc.key_path(k) in found]
    if taken:
        raise StoreExistsError(
            f"{loc} already holds {', '.join(taken[:3])}{', ...' if len(taken) > 3 else ''} where a new store's Zarr "
            "metadata goes (a Zarr node her_store did not create); the create was refused and left it as it was: "
            "create the store somewhere empty"
        )
    if loc.is_local:  # every directory before any file, so fsync'ing a file's directory makes the tree durable
        for key in files:
            loc.make_parents(key)
    loc.remove_temp_files(list(files))  # what a create killed mid-write left
    for key in sorted(files, key=lambda k: (k != "zarr.json", k)):
        loc.write_atomic(key, files[key], fsync=fsync)


def _unfinished_create(loc: Location) -> bool:
    """Whether ``loc`` holds what a create killed before its commit record leaves: her_store's root attributes,
    no commit record and no chunk of data (a commit record is the last thing a create writes, and no row is
    written before one exists). Anything else is a store, someone else's Zarr node, or damage: never removed."""
    if loc.exists(COMMIT_KEY):
        return False
    try:
        attrs = json.loads(loc.read_bytes("zarr.json") or b"").get("attributes", {})
    except (ValueError, AttributeError):
        return False
    return isinstance(attrs, dict) and isinstance(attrs.get(ATTRS_KEY), dict) and not loc.holds_chunks()


def _check_creation_options(store: EpisodeStore, options: Mapping[str, Any]) -> None:
    """open_store on an existing store: creation options given again must be the ones it was created with."""
    if "capacity" in options and options["capacity"] != store.capacity:
        raise SchemaMismatchError(
            f"{store.url} was created with capacity={store.capacity}, got capacity={options['capacity']!r}; a store's "
            "capacity is fixed at creation (copy its episodes into a new store to change it)"
        )
    if "chunk_rows" in options or "compressors" in options:
        layout, codecs = _plan_arrays(
            store._loc, store.schema, store.capacity, options.get("chunk_rows"), options.get("compressors")
        )
        stored = {spec.columns[0][0]: spec for spec in store.layout.arrays if spec.compressed}
        if "compressors" in options and set(codecs) != set(stored):
            raise SchemaMismatchError(
                f"{store.url} stores fields {sorted(stored)} compressed, the compressors given compress "
                f"{sorted(codecs)}; compressors are fixed at creation"
            )
        if options.get("chunk_rows") is not None:
            want = Layout.build(store.schema, set(stored), int(options["chunk_rows"]))
            if want.to_json() != store.layout.to_json():
                raise SchemaMismatchError(
                    f"{store.url} was created with arrays {store.layout.describe()}, chunk_rows="
                    f"{options['chunk_rows']} makes {want.describe()}; chunk_rows is fixed at creation"
                )
        for name, spec in stored.items():
            if "compressors" in options:
                have = [cast(Any, c).to_dict() for c in cast(zarr.Array, store._root[spec.path]).compressors]
                want_codecs = [c.to_dict() for c in codecs[name]]
                if have != want_codecs:
                    raise SchemaMismatchError(
                        f"{store.url}: field {name!r} is stored with {have}, got compressors {want_codecs}; "
                        "compressors are fixed at creation"
                    )
    given = options.get("metadata")
    if given:
        card = store.metadata
        differ = sorted(k for k in given if card.get(k, object()) != given[k])
        if differ:
            raise SchemaMismatchError(
                f"{store.url}: metadata {differ} differ from the store's card ({ {k: card.get(k) for k in differ} } "
                f"stored, { {k: given[k] for k in differ} } given); change the card with store.update_metadata(...)"
            )


def _default_codec(field: Any) -> Any:
    """LZ4 for uint8 images (a rendered frame compresses 4-8x and decodes in a few microseconds, about 3x faster
    than with Blosc's bit-shuffle or with Zstd); None (raw, memory-mapped) otherwise."""
    return lz4_codec() if field.is_image else None


def _open_root(loc: Location, read_only: bool) -> zarr.Group:
    """The store's root group. A path holding anything else is not a store; a zarr.json zarr cannot parse is a
    damaged one."""
    loc.check_file("zarr.json")  # zarr reads it whole: a regular file of bounded size
    try:
        return zarr.open_group(loc.zarr_store(read_only=read_only), mode="r" if read_only else "r+", zarr_format=3)
    except zarr.errors.ContainsArrayError as e:
        raise NotAStoreError(f"{loc} holds a Zarr array, not a her_store store (a Zarr group)") from e
    except (
        FileNotFoundError,
        NotADirectoryError,
        FileExistsError,
        zarr.errors.GroupNotFoundError,
        zarr.errors.NodeTypeValidationError,
    ) as e:
        from her_store.datasets.sharded import MARKER_KEY  # sharded builds on this module

        if loc.exists(MARKER_KEY):
            raise NotAStoreError(
                f"{loc} is a sharded dataset's root: her_store.open_store(root) reads every shard; "
                f"EpisodeStore.open(root + '/shards/<name>') opens one"
            ) from e
        if loc.is_local and not os.path.lexists(loc.root):
            raise NotAStoreError(f"{loc} does not exist") from e
        if not loc.is_local and isinstance(e, zarr.errors.GroupNotFoundError):  # its root object is missing
            raise NotAStoreError(f"there is no store at {loc} (no Zarr group: {loc}/zarr.json does not exist)") from e
        raise NotAStoreError(f"{loc} is not a her_store store (no Zarr group there)") from e
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError, RecursionError) as e:  # zarr's parse
        raise CorruptStoreError(f"{loc}/zarr.json is not Zarr v3 group metadata ({short_repr(e)})") from e


def open_store(
    path_or_url: str | os.PathLike[str],
    observation_space: spaces.Dict | None = None,
    action_space: spaces.Space | None = None,
    *,
    shard: str | None = None,
    **kwargs: Any,
) -> EpisodeStore | ShardedView:
    """Open a store for appending if it exists (checking its spaces), else create it: what a training script calls.

    Parameters
    ----------
    path_or_url : str or PathLike
        Local path or fsspec URL.
    observation_space, action_space : gymnasium spaces, optional
        Required to create; when the store exists they must equal the stored ones (SchemaMismatchError otherwise).
    shard : str, optional
        Append to shard ``shard`` of the sharded dataset at ``path_or_url``, one shard per writer: the shard (and
        the dataset, if there is none yet) is created on first use and resumed after, and the spaces are checked
        against the dataset's (:func:`her_store.datasets.sharded.open_shard`).
    **kwargs
        Passed to :meth:`EpisodeStore.create` (capacity, info_keys, metadata, ...) or, for an existing store,
        the ones :meth:`EpisodeStore.open` takes (storage_options, durability, commit_interval, lease_ttl).

    Returns
    -------
    EpisodeStore or ShardedView
        The store, opened with ``mode="a"``. A sharded dataset's root opened with no shard and no spaces (only
        ``storage_options``) gives a read view over every shard, :class:`her_store.datasets.sharded.ShardedView`.

    Examples
    --------
    >>> store = open_store("runs/fetch", env.observation_space, env.action_space, capacity=1_000_000)  # doctest: +SKIP
    >>> actor = open_store("s3://bucket/fetch", env.observation_space, env.action_space, shard="actor-7")  # doctest: +SKIP
    >>> view = open_store("s3://bucket/fetch")  # every shard, read-only  # doctest: +SKIP
    """
    from her_store.datasets import sharded

    if shard is not None:
        return sharded.open_shard(path_or_url, observation_space, action_space, shard, **kwargs)
    loc = Location(path_or_url, kwargs.get("storage_options"))
    if not loc.exists(COMMIT_KEY):
        if sharded.is_sharded(loc):
            return sharded.open_view(loc, observation_space, action_space, kwargs)
        if observation_space is None or action_space is None:
            missing = loc.is_local and not os.path.lexists(loc.root)
            where = f"{loc} does not exist" if missing else f"{loc} holds no store"
            raise NotAStoreError(f"{where}; pass observation_space and action_space to create one")
        try:
            return EpisodeStore.create(path_or_url, observation_space, action_space, **kwargs)
        except StoreExistsError:  # created meanwhile by another process: resume it
            pass
    open_kw = {k: kwargs[k] for k in ("storage_options", "durability", "commit_interval", "lease_ttl") if k in kwargs}
    store = EpisodeStore.open(path_or_url, mode="a", **open_kw)
    try:
        if observation_space is not None or action_space is not None:
            given = Schema(
                observation_space if observation_space is not None else store.observation_space,
                action_space if action_space is not None else store.action_space,
                kwargs.get("info_keys", store.schema.info_spaces),
            )
            given.check_same(store.schema, store.url)
        _check_creation_options(store, kwargs)
    except BaseException:
        store.close()
        raise
    return store
