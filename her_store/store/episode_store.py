"""EpisodeStore: create, open and resume a store; append episodes; the commit protocol and the capacity ring.

A commit is the only moment the store changes for a reader: data rows, then index rows, then the commit record
(``commit.json``, replaced atomically). Episodes appended in between are staged in memory and committed as a group
(see ``commit_interval``), which is what makes appends cheap; a crash loses at most the staged episodes.
"""

from __future__ import annotations

import copy
import json
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal, cast

import numpy as np
import zarr
import zarr.api.asynchronous
from gymnasium import spaces

from her_store.checks import check_bool, check_callable, check_int, check_number
from her_store.errors import (
    CorruptStoreError,
    EpisodeNotFoundError,
    NotAStoreError,
    ReadOnlyStoreError,
    StoreError,
)
from her_store.format.card import card_problems, check_card
from her_store.format.commit_record import Commit
from her_store.format.keys import ATTRS_KEY, LOCK_KEY
from her_store.format.layout import FORMAT_VERSION, INDEX_COLUMNS, check_attrs, index_columns, parse_attrs
from her_store.format.schema import Schema, validate_episode
from her_store.storage import Backend, open_backend
from her_store.storage.lock import DEFAULT_LEASE_TTL, WriterLock
from her_store.store.chunk_io import RawChunkFile, ZarrChunks, chunk_io, episode_rows
from her_store.store.commit import Committer
from her_store.store.creation import (
    checked_arrays,
    make_store,
    open_root,
    plan_arrays,
    plan_nodes,
    ring_sizes,
)
from her_store.store.energy import EnergyPriority, PriorityFn
from her_store.store.episode import Episode
from her_store.store.following import CommitFollower, RowSpace, read_commit
from her_store.store.frame_writer import FrameWriter
from her_store.store.index import EpisodeIndex, IndexView
from her_store.store.step_writer import StepWriter

__all__ = ["EpisodeStore"]

Durability = Literal["flush", "fsync"]


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
    def __init__(
        self,
        backend: Backend,
        mode: str,
        durability: Durability,
        commit_interval: float | None,
        priority_fn: PriorityFn | None = None,
    ) -> None:
        if mode not in ("r", "a"):
            raise ValueError(f"mode must be 'r' (read) or 'a' (append), got {mode!r}")
        if durability not in ("flush", "fsync"):
            raise ValueError(f"durability must be 'flush' or 'fsync', got {durability!r}")
        if mode == "a" and backend.read_only:
            raise ReadOnlyStoreError(backend.read_only)
        problem = backend.place_problem()
        if problem is not None:
            raise NotAStoreError(problem)
        self._backend = backend
        priority_fn = check_callable(priority_fn, "priority_fn", or_none=True)
        self.priority_fn: PriorityFn = EnergyPriority() if priority_fn is None else priority_fn
        self.mode = mode
        self.durability: Durability = durability
        self._committer: Committer | None = None
        self.commit_interval = backend.defaults.commit_interval
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
        path_or_url: str | os.PathLike[str] | Backend,
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
        priority_fn: PriorityFn | None = None,
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
        priority_fn : callable, optional
            ``priority_fn(episode) -> float`` (a finite number >= 0; ``episode`` maps each field to its rows, as
            :meth:`append_episode` takes them): each appended episode's priority, committed in its index row and
            drawn by ``HerSampler(prioritize="energy")``. Default: :class:`~her_store.store.energy.EnergyPriority`,
            the energy of its achieved-goal path.

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
        loc = open_backend(path_or_url, storage_options)
        schema = Schema(observation_space, action_space, info_keys)
        layout, codecs = plan_arrays(loc, schema, capacity, chunk_rows, compressors)
        capacity = None if capacity is None else int(capacity)  # a numpy integer: its rows and slots go into JSON
        array_rows, slots, index_rows, index_chunk = ring_sizes(layout, capacity, loc.defaults.index_chunk_rows)

        self = cls(loc, "a", durability, commit_interval, priority_fn)
        loc.make_root()
        self._lock = loc.writer_lock(LOCK_KEY, lease_ttl)
        self._lock.acquire()
        try:
            attrs: dict[str, Any] = {
                "format_version": FORMAT_VERSION,
                "schema": schema.to_json(),
                "layout": layout.to_json(),
                "capacity": capacity,
                "index_slots": slots,
                "metadata": card,
                "created_at": time.time(),
            }
            nodes = plan_nodes(attrs, layout, codecs, array_rows, index_rows, index_chunk)
            root, commit = make_store(loc, nodes, array_rows, durability == "fsync")
            self._attach(root, attrs, commit)
        except BaseException:
            self._lock.release()
            raise
        return self

    @classmethod
    def open(
        cls,
        path_or_url: str | os.PathLike[str] | Backend,
        mode: Literal["r", "a"] = "r",
        storage_options: Mapping[str, Any] | None = None,
        *,
        durability: Durability = "flush",
        commit_interval: float | None = None,
        lease_ttl: float = DEFAULT_LEASE_TTL,
        priority_fn: PriorityFn | None = None,
    ) -> EpisodeStore:
        """Open an existing store.

        Parameters
        ----------
        path_or_url : str or PathLike
            As in :meth:`create`.
        mode : {"r", "a"}
            "r" reads (no lock; :meth:`refresh` sees new commits); "a" takes the writer lock and resumes appending
            after the last committed episode (rows written past it by a crashed writer are overwritten).
        storage_options, durability, commit_interval, lease_ttl, priority_fn
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
        loc = open_backend(path_or_url, storage_options)
        self = cls(loc, mode, durability, commit_interval, priority_fn)
        try:
            root = open_root(loc, read_only=mode == "r")
            attrs = check_attrs(root.attrs.asdict(), str(loc))
            if mode == "a":
                lock = loc.writer_lock(LOCK_KEY, lease_ttl)
                lock.acquire()
                self._lock = lock
                loc.remove_temp_files()  # what a writer killed in an atomic write left (a shard, a commit record)
            self._attach(root, attrs, read_commit(loc, attrs["format_version"]))
        except BaseException:  # the store owns its backend, as close() does: what it opened is let go
            if self._lock is not None:
                self._lock.release()
            loc.close()
            raise
        return self

    def _attach(self, root: zarr.Group, attrs: dict[str, Any], commit: Commit) -> None:
        self._root, self._root_pid = root, os.getpid()
        self._attrs = attrs
        # every name and number below becomes a file path, an allocation or an index: all are checked first
        self.schema, self.layout, self.capacity, slots = parse_attrs(attrs, f"{self._backend}/zarr.json")
        self._follower = CommitFollower(
            self._backend, attrs["format_version"], self.capacity, slots, attrs["created_at"], retry=self.mode == "r"
        )
        self._follower.load(commit, self._open_io())
        if self.mode == "a":
            assert self._lock is not None
            self._committer = Committer(
                self._backend, root, self.schema, self.layout, self._follower.index, self._arrays, self._index_io,
                self._follower.commit, self._index_rows, self.capacity, self.durability, self.commit_interval,
                self._lock, self.priority_fn,
            )

    @property
    def _index(self) -> EpisodeIndex:
        return self._follower.index

    def _open_io(self) -> RowSpace:
        """Row access to every array, each checked against the layout first; a reader calls it again when the
        writer has grown the arrays."""
        for w in (*self._arrays.values(), *self._index_io.values()):
            w.close()
        wanted = [
            (s.path, s.dtype, s.row_shape, s.chunk_rows, not s.compressed, s.sharded, s.separator)
            for s in self.layout.arrays
        ]
        columns = index_columns(self.layout.version)
        wanted += [(f"episodes/{name}", np.dtype(dt), (), None, True, False, "/") for name, dt in columns.items()]
        arrays = checked_arrays(self._backend, self._root, wanted)
        for spec, array in zip(self.layout.arrays, arrays):
            self._arrays[spec.path] = (
                FrameWriter(array, self._backend) if spec.sharded else chunk_io(self._backend, array, spec.compressed)
            )
        for name, array in zip(columns, arrays[len(self.layout.arrays) :]):
            self._index_io[name] = chunk_io(self._backend, array, False)
        self._data_rows = min(a.shape[0] for a in arrays[: len(self.layout.arrays)])
        self._index_rows = min(a.shape[0] for a in arrays[len(self.layout.arrays) :])
        return RowSpace(self._index_io, self._data_rows, self._index_rows)

    # -- properties --------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        """The store's local path or URL."""
        return self._backend.url

    @property
    def backend(self) -> Backend:
        """Where the store lives: every byte of it is read and written through this
        (:class:`~her_store.storage.Backend`)."""
        return self._backend

    def zarr_array(self, path: str) -> zarr.Array:
        """The Zarr array at ``path`` (an array of :attr:`layout`, or ``episodes/<column>``), its metadata checked
        against the layout when the store was opened."""
        if self._root_pid != os.getpid():  # a forked child: the root's reads went through the parent's event loop
            self._root, self._root_pid = open_root(self._backend, read_only=True), os.getpid()
        return cast(zarr.Array, self._root[path])

    @property
    def attrs(self) -> dict[str, Any]:
        """The store's attributes in its root ``zarr.json`` (format_version, schema, layout, capacity, index_slots,
        metadata, created_at: FORMAT.md), a deep copy."""
        return copy.deepcopy(self._attrs)

    @property
    def index_columns(self) -> Mapping[str, RawChunkFile | ZarrChunks]:
        """Row access to the index columns (``episodes/<column>``), past the committed ones too: for tools that
        check or copy what lies there (:meth:`EpisodeIndex.read`)."""
        return dict(self._index_io)

    @property
    def index_rows(self) -> int:
        """Rows the index columns are sized to (an unbounded store's grow; a ring's are its slots)."""
        return self._committer.index_rows if self._committer is not None else self._index_rows

    @property
    def committer(self) -> Committer:
        """The commit protocol of a handle opened for appending (:class:`~her_store.store.commit.Committer`): what a
        repair drops or clears committed rows with (``keep_only``, ``clear_uncommitted``).

        Raises
        ------
        ReadOnlyStoreError
            The store is open read-only.
        """
        return self._writing()

    @property
    def commit_interval(self) -> float:
        """Seconds between group commits of a writing handle (0: every append commits); may be changed any time."""
        return self._commit_interval

    @commit_interval.setter
    def commit_interval(self, seconds: float) -> None:
        self._commit_interval = check_number(seconds, "commit_interval", low=0, finite=True)
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
        doc = json.loads(self._backend.read_bytes("zarr.json") or b"null")
        if not isinstance(doc, dict) or not isinstance(doc.get("attributes"), dict):
            raise CorruptStoreError(
                f"{self._backend}/zarr.json changed since the store was opened; expected a Zarr group"
            )
        doc["attributes"][ATTRS_KEY] = attrs
        assert self._lock is not None
        self._lock.ensure_held()
        self._backend.write_atomic("zarr.json", json.dumps(doc, indent=2).encode(), fsync=self.durability == "fsync")
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
        disk). A reading handle returns what its last :meth:`refresh` saw; so does a writing handle in a forked child
        (the parent commits, the child reads).
        """
        self._require_open()
        w = self._committer
        due = w is not None and w.pending and (w.due or w.commit_record.end_episode == w.commit_record.first_episode)
        if due and self._pid == os.getpid():
            self._writing().commit()
        return self._index.snapshot(self._committed.end_episode)

    @property
    def _committed(self) -> Commit:
        """The newest commit record this handle knows: its own last commit, or the one a reader last loaded."""
        return self._committer.commit_record if self._committer is not None else self._follower.commit

    @property
    def index(self) -> EpisodeIndex:
        """The committed episode index (what the sampler asks about rows and lengths)."""
        return self._visible()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.num_episodes} episodes, {self.num_transitions} transitions"
        cap = "unbounded" if self.capacity is None else f"capacity={self.capacity}"
        return f"EpisodeStore({self.url!r}, mode={self.mode!r}, {cap}, {state})"

    # -- reading -----------------------------------------------------------------------------------------
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
        episode_id = check_int(episode_id, "episode_id")
        verify = check_bool(verify, "verify")
        idx = self._visible()
        if not idx.first <= episode_id < idx.end:
            what = "was evicted by the capacity ring" if 0 <= episode_id < idx.first else "is not committed"
            raise EpisodeNotFoundError(
                f"episode {episode_id} {what}; {self.url} holds episodes {idx.first}..{idx.end - 1}"
            )
        start, length = idx.rows_of(episode_id)
        data, crc = episode_rows(self._arrays, self.layout, self.schema, start, length)
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
        return self._follower.refresh(RowSpace(self._index_io, self._data_rows, self._index_rows), self._reopen)

    def _reopen(self) -> RowSpace:
        """Open the arrays again, the writer having grown them: their metadata read anew."""
        self._root, self._root_pid = open_root(self._backend, read_only=True), os.getpid()
        return self._open_io()

    def live_first(self) -> int:
        """The oldest episode id the ring has not evicted, as of now (episodes below may be being overwritten).

        A writing handle knows its own commits; a reading handle re-reads the commit record. Eviction is
        committed before any row is overwritten, so rows of an episode read before this call returns a value
        at or below its id are intact.
        """
        if self._committer is not None:
            return self._committed.first_episode
        return self._follower.read_commit().first_episode

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
        """Check an episode against the schema; return ``(T, arrays in stored dtypes)`` or raise EpisodeValidationError
        (:func:`~her_store.format.schema.validate_episode`)."""
        return validate_episode(self.schema, episode)

    def append_episode(
        self, episode: Mapping[str, Any], *, env_index: int = -1, priority: float | None = None
    ) -> int:
        """Append one whole episode; returns its id (consecutive from 0, never reused).

        Parameters
        ----------
        episode : mapping of str to array
            Every observation key with ``T + 1`` rows (the last is the final next-observation), ``action``,
            ``reward``, ``terminated``, ``truncated`` and each info key with ``T`` rows (Minari's episode shape).
            Values are cast to the stored dtype when that is safe (float64 -> float32), refused otherwise.
        env_index : int
            Which vectorised environment produced it (recorded in the index; -1 when unknown).
        priority : float, optional
            Its priority (a finite number >= 0), where it is known already (an episode copied from another store);
            default: ``priority_fn(episode)``.

        Raises
        ------
        EpisodeValidationError
            Missing/extra keys, wrong shapes or dtypes, T mismatches, an episode longer than the capacity, a
            priority that is not a finite number >= 0. Nothing is written.
        """
        self._writing()
        env_index = check_int(env_index, "env_index", low=-1, high=int(np.iinfo(INDEX_COLUMNS["env_index"]).max))
        T, data = self.validate_episode(episode)
        return self.append_validated(T, data, env_index, priority)

    def append_validated(
        self, T: int, data: Mapping[str, np.ndarray], env_index: int = -1, priority: float | None = None
    ) -> int:
        """Append an episode already in the schema's shapes and dtypes (what :meth:`validate_episode` returns, or
        what a :class:`~her_store.store.step_writer.StepWriter` assembles); returns its id."""
        return self._writing().append(T, data, env_index, priority)

    def writer(self, n_envs: int = 1) -> StepWriter:
        """A :class:`~her_store.store.step_writer.StepWriter` that assembles episodes from per-step adds of ``n_envs``
        envs.

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
            self._backend.close()
            self._closed = True

    def __enter__(self) -> EpisodeStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


