"""The commit protocol: staging appended episodes, placing them in the capacity ring, and committing them.

A commit is the only moment a store changes for a reader: data rows, then index rows, then the commit record
(``commit.json``, replaced atomically). Episodes appended in between are staged in memory and committed as a group
(``commit_interval``), which is what makes appends cheap; a crash (even kill -9) loses at most the staged episodes.
An append that raises leaves no trace: its episode is unstaged before the error propagates, so a retry does not
store it twice.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import Any, cast

import numpy as np
import zarr

from her_store import _kernels
from her_store.errors import EpisodeValidationError, StoreError, StoreLockedError, short_repr
from her_store.format.commit_record import Commit
from her_store.format.keys import COMMIT_KEY
from her_store.format.layout import INDEX_COLUMNS, ArraySpec, Layout
from her_store.format.schema import Schema
from her_store.storage import Backend
from her_store.storage.lock import WriterLock
from her_store.store.chunk_io import RawChunkFile, ZarrChunks
from her_store.store.energy import PriorityFn
from her_store.store.frame_writer import Encoded, FrameWriter
from her_store.store.index import EpisodeIndex

__all__ = ["Committer", "round_up", "COMMIT_ROWS"]

COMMIT_ROWS = 1 << 16  # staged rows that force a commit (bounds the staging memory)

ChunkIO = RawChunkFile | ZarrChunks | FrameWriter


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= ``n``."""
    return -(-n // multiple) * multiple


class Committer:
    """The writing side of a store opened with ``mode="a"``: staging, ring placement and the commit protocol.

    The store facade (:class:`~her_store.store.episode_store.EpisodeStore`) validates episodes and hands them here;
    readers only ever see what :meth:`commit` published.

    Parameters
    ----------
    backend, root : Backend, zarr.Group
        Where the store lives.
    schema, layout : Schema, Layout
        Its fields and arrays.
    index : EpisodeIndex
        The episode index, loaded with the committed episodes; appends extend it.
    arrays, index_io : mapping of path to chunk I/O
        Row access to the data arrays and to the index columns (``episodes/<column>``).
    commit : Commit
        The commit record the store was opened at.
    index_rows : int
        Rows the index arrays are sized to.
    capacity : int or None
        The ring's capacity in transitions (None: unbounded).
    durability : {"flush", "fsync"}
    commit_interval : float
        Seconds between group commits.
    lock : WriterLock
        Checked (and renewed) before every commit.
    priority_fn : callable
        An episode's priority (its index column ``priority``), computed as it is appended.
    """

    def __init__(
        self,
        backend: Backend,
        root: zarr.Group,
        schema: Schema,
        layout: Layout,
        index: EpisodeIndex,
        arrays: Mapping[str, ChunkIO],
        index_io: Mapping[str, ChunkIO],
        commit: Commit,
        index_rows: int,
        capacity: int | None,
        durability: str,
        commit_interval: float,
        lock: WriterLock,
        priority_fn: PriorityFn,
    ) -> None:
        self.backend = backend
        self.priority_fn = priority_fn
        self.root = root
        self.schema = schema
        self.layout = layout
        self.index = index
        self.arrays = arrays
        self.index_io = index_io
        self.commit_record = commit
        self.capacity = capacity
        self.fsync = durability == "fsync"
        self.commit_interval = commit_interval
        self.lock = lock
        self.head = commit.write_row  # where the next episode starts
        self.array_rows = commit.array_rows
        self.index_rows = index_rows
        # sharded arrays stage their rows encoded (encoding happens as episodes arrive, not all at the commit), and an
        # episode's crc32 covers those stored bytes
        self._sharded = {p: io for p, io in arrays.items() if isinstance(io, FrameWriter)}
        self._frames: dict[str, list[bytes]] = {p: [] for p in self._sharded}  # one per staged row
        self._stage: dict[str, np.ndarray] = {
            spec.path: np.zeros((1024, *spec.row_shape), spec.dtype)
            for spec in layout.arrays
            if spec.path not in self._sharded
        }
        self._plan = [_staging_plan(spec, schema) for spec in layout.arrays]
        self._plan_of = {path: members for path, members, _ in self._plan}
        self._commit_rows = min(COMMIT_ROWS, layout.arrays[0].chunk_rows)
        self._stage_row0 = self.head
        self._stage_n = 0  # staged rows, a contiguous run from _stage_row0
        self._last_commit = time.monotonic()
        # object storage with a fenced lease: commit records are PUT conditionally on the ETag of our last one
        self._record_etag = backend.etag(COMMIT_KEY) if lock.fences_writes else None
        self._broken: str | None = None  # why this handle can no longer tell what is committed

    # -- state ----------------------------------------------------------------------------------------------
    @property
    def pending(self) -> bool:
        """Whether anything (staged episodes, in-memory evictions) is not committed yet."""
        c = self.commit_record
        return bool(self._stage_n) or self.index.first != c.first_episode or self.index.end != c.end_episode

    @property
    def due(self) -> bool:
        """Whether the group commit is due: ``commit_interval`` has passed, or a chunk's worth of rows is staged."""
        return self._stage_n >= self._commit_rows or time.monotonic() - self._last_commit >= self.commit_interval

    # -- appending ------------------------------------------------------------------------------------------
    def append(self, T: int, data: Mapping[str, np.ndarray], env_index: int, priority: float | None = None) -> int:
        """Stage an episode already in the schema's shapes and dtypes, with ``priority`` (default: ``priority_fn``'s);
        commit if due. Returns its id.

        If anything raises (a refused episode, a failed commit), the episode is unstaged and any in-memory
        eviction it caused is undone, so the store is as before the call; episodes staged by earlier calls stay
        staged for the next commit.
        """
        if self.capacity is not None and T > self.capacity:
            raise EpisodeValidationError(
                f"episode of {T} transitions is longer than the store's capacity {self.capacity}"
            )
        idx = self.index
        first, end, head = idx.first, idx.end, self.head
        if "priority" not in self.index_io:  # format version 3
            priority = 0.0
        else:
            priority = self._priority(idx.end, data, priority)
        staged = None
        try:
            start = self._place(T + 1)
            staged = self._stage_n
            crc = self._stage_rows(start, T, data)
            info = self.schema.info_keys
            episode_id = idx.append(
                {
                    "start_row": start,
                    "length": T,
                    "terminated": bool(data["terminated"][-1]),
                    "truncated": bool(data["truncated"][-1]),
                    "return": float(data["reward"].sum(dtype=np.float64)),
                    "success": int(data["is_success"][-1] > 0.5) if "is_success" in info else -1,
                    "env_index": env_index,
                    "created_at": time.time(),
                    "crc32": crc,
                    "priority": priority,
                }
            )
            self.head = start + T + 1
            if self.due:
                self.commit()
        except BaseException:
            if self.commit_record.end_episode <= end:
                # nothing of this episode was committed (a commit record is the last write of a commit), so undo
                # all of it; evictions already committed stay, and so must those whose index rows were dropped
                idx.truncate(end)
                if staged is not None:
                    self._unstage(staged)
                self.head = head
                idx.first = max(first, self.commit_record.first_episode, idx.base)
            raise  # (an interrupt after the record was in place: the episode is committed, and the interrupt goes on)
        return episode_id

    def _priority(self, episode_id: int, data: Mapping[str, np.ndarray], given: float | None) -> float:
        """The priority of the episode about to be appended (``given``, else ``priority_fn``'s): a finite number >= 0
        (EpisodeValidationError)."""
        value = self.priority_fn(data) if given is None else given
        try:
            priority = float(value)
        except (TypeError, ValueError):
            priority = math.nan
        if not (math.isfinite(priority) and priority >= 0) or isinstance(value, bool):
            raise EpisodeValidationError(
                f"priority_fn {short_repr(self.priority_fn)} returned {short_repr(value)} for episode {episode_id}; "
                "expected a finite number >= 0"
            )
        return priority

    def _place(self, rows: int) -> int:
        """Row where an episode of ``rows`` rows goes; evicts (FIFO) what it would overwrite or exceed capacity with."""
        idx, w = self.index, self.head
        if self.capacity is None:
            self._ensure_rows(w + rows)
            return w
        if self._stage_n and self._stage_n + rows > max(1, self.capacity // 2):
            # staged rows stay within half the ring: the eviction record of their commit, which a crash can leave in
            # place of its commit record, then keeps the other half's committed episodes (past the whole ring, it
            # kept none: a store killed there reopened empty)
            self.commit()
            w = self.head
        if w + rows > self.array_rows:
            if self._stage_n:
                self.commit()  # staged rows form one contiguous run; the wrap starts another
            # episodes between the head and the end of the ring are the oldest: FIFO evicts them before row 0's
            while len(idx) and idx.rows_of(idx.first)[0] >= w:
                idx.first += 1
            w = 0
        while len(idx) and (
            idx.num_transitions + rows - 1 > self.capacity or w <= idx.rows_of(idx.first)[0] < w + rows
        ):
            idx.first += 1
        return w

    def _ensure_rows(self, rows: int) -> None:
        """Grow the arrays of an unbounded store (metadata only: readers trust the commit record, not the shape)."""
        if rows <= self.array_rows:
            return
        self.lock.ensure_held()  # a writer that lost its lease must not resize (zarr drops chunks past a new shape)
        grain = math.lcm(*(a.chunk_rows for a in self.layout.arrays))
        new = round_up(max(rows, 2 * self.array_rows), grain)
        for spec in self.layout.arrays:
            self._zarr_array(spec.path, self.arrays[spec.path]).resize((new, *spec.row_shape))
            self._fsync_metadata(spec.path)
        self.array_rows = new

    def _stage_rows(self, start: int, T: int, data: Mapping[str, np.ndarray]) -> int:
        """Copy an episode's rows into the staging buffers, or encode them for a sharded array (one contiguous run of
        rows per commit); returns the episode's crc32 (FORMAT.md, Checksums)."""
        if self._stage_n == 0:
            self._stage_row0 = start
        at = self._stage_n
        if start != self._stage_row0 + at:
            raise AssertionError("staged rows must be contiguous")
        need, crc = at + T + 1, 0
        if not self._sharded:  # low-dimensional arrays alone: staged and checksummed in one pass
            for path, members, step_cols in self._plan:
                crc = _kernels.crc32(self._stage_array(path, members, step_cols, at, T, data)[at:need].data, crc)
            self._stage_n = need
            return crc
        # the encoder threads read the episode's frames in place while its other fields are staged here
        encoding: dict[str, Encoded] = {}
        try:
            for path, io in self._sharded.items():
                encoding[path] = io.encode(self._episode_rows(path, T, data))
            for path, members, step_cols in self._plan:
                if path not in encoding:
                    self._stage_array(path, members, step_cols, at, T, data)
            encoded = {path: e.frames() for path, e in encoding.items()}
        finally:
            for e in encoding.values():
                e.wait()  # no thread reads the caller's rows past this call (after frames(): nothing to wait for)
        for path, _, _ in self._plan:
            if path in encoded:  # one field, T + 1 rows: its frames as they will be stored
                crc = _kernels.crc32_all(encoded[path], crc)
            else:
                crc = _kernels.crc32(self._stage[path][at:need].data, crc)
        for path, frames in encoded.items():
            self._frames[path].extend(frames)
        self._stage_n = need
        return crc

    def _stage_array(
        self,
        path: str,
        members: list[tuple[str, Any, bool]],
        step_cols: Any,
        at: int,
        T: int,
        data: Mapping[str, np.ndarray],
    ) -> np.ndarray:
        """Copy an episode's fields into the staging buffer of their unsharded array from staged row ``at`` (grown
        when needed); returns the buffer."""
        buf = self._stage[path]
        need = at + T + 1
        if len(buf) < need:
            grown = np.zeros((max(need, 2 * len(buf)), *buf.shape[1:]), buf.dtype)
            grown[:at] = buf[:at]
            self._stage[path] = buf = grown
        for name, cols, flat in members:
            d = data[name]
            buf[at : at + len(d), cols] = d.reshape(len(d), -1) if flat else d
        buf[at + T, step_cols] = 0  # the unused last row of per-step fields
        return buf

    def _episode_rows(self, path: str, T: int, data: Mapping[str, np.ndarray]) -> np.ndarray:
        """The T + 1 rows of the one field of a sharded array (a per-step field's last row is zeros)."""
        d = data[self._plan_of[path][0][0]]
        return d if len(d) == T + 1 else np.concatenate([d, np.zeros((1, *d.shape[1:]), d.dtype)])

    def _unstage(self, n: int) -> None:
        """Keep only the first ``n`` staged rows."""
        self._stage_n = n
        for frames in self._frames.values():
            del frames[n:]

    # -- the commit -----------------------------------------------------------------------------------------
    def commit(self) -> None:
        """The commit protocol: [eviction record] -> data rows -> index rows -> commit record.

        Each step completes or raises; a failure leaves the last commit record describing complete,
        checksummed episodes, and what was staged stays staged.
        """
        idx, old = self.index, self.commit_record
        if self._broken is not None:
            raise StoreError(self._broken)
        if not self.pending:
            return  # the record on disk is current
        self.lock.ensure_held()
        gen = old.generation
        if idx.first > old.first_episode:
            # evicted rows may be overwritten below: readers must stop trusting them first
            first = min(idx.first, old.end_episode)
            gen += 1
            evicted = Commit(
                gen,
                first,
                old.end_episode,
                old.write_row,
                idx.transitions_between(first, old.end_episode),
                old.array_rows,
            )
            self._publish(evicted)  # a sampler of this process checks it after reading rows (live_first)
        if self._stage_n:
            for path, w in self.arrays.items():
                if isinstance(w, FrameWriter):
                    w.put(self._stage_row0, self._frames[path])
                else:
                    w.write(self._stage_row0, self._stage[path][: self._stage_n])
        for w in self.arrays.values():
            w.flush(self.fsync)
        if idx.end > old.end_episode:
            # again before the index: a writer frozen past its lease while writing data rows must not also
            # replace index chunks that a writer which took over has committed (the record itself is fenced)
            self.lock.ensure_held()
            self._ensure_index_rows(idx.end)
            idx.write(self.index_io, old.end_episode, idx.end)
            for w in self.index_io.values():
                w.flush(self.fsync)
        new = Commit(gen + 1, idx.first, idx.end, self.head, idx.num_transitions, self.array_rows)
        try:
            self._publish(new)
        finally:
            if self.commit_record is new:  # also when an interrupt arrived after the record was in place
                self._unstage(0)
                self._stage_row0 = self.head
                self._last_commit = time.monotonic()

    def _publish(self, record: Commit) -> None:
        """Replace the commit record. A write that raised may still have happened (a reply lost on the way back,
        an interrupt just after the rename): the record is read back, and if it is in place the commit counts, so
        that no generation or episode id is ever used twice. If that cannot be told, this handle stops writing."""
        raw = record.to_bytes(self.layout.version)
        try:
            etag = self.backend.write_atomic(COMMIT_KEY, raw, self.fsync, if_match=self._record_etag)
        except BaseException as e:
            try:
                found = self.backend.read_bytes(COMMIT_KEY)
            except BaseException as unknown:
                self._broken = (
                    f"{self.backend}: a commit record write failed ({e!r}) and reading it back failed too "
                    f"({unknown!r}), so whether generation {record.generation} was committed is unknown; reopen the "
                    "store to continue"
                )
                raise StoreError(self._broken) from e
            if found != raw:
                theirs = None if found is None else Commit.from_bytes(found, str(self.backend))
                if self._record_etag is not None and theirs is not None and theirs != self.commit_record:
                    raise StoreLockedError(
                        f"{self.backend}: another writer committed since this one's last commit (its lease was "
                        "lost); this handle commits nothing more"
                    ) from e
                raise
            self.commit_record = record
            self._record_etag = self.backend.etag(COMMIT_KEY) if self._record_etag is not None else None
            if not isinstance(e, Exception):
                raise  # an interrupt: the commit happened, and the interrupt goes on
            return
        self.commit_record = record
        if self._record_etag is not None:
            self._record_etag = etag or self.backend.etag(COMMIT_KEY)

    # -- repair -------------------------------------------------------------------------------------------
    def keep_only(self, first: int, end: int) -> Commit:
        """Repair: commit a record keeping only the committed episodes ``first <= id < end`` (within the current ones).

        Episodes dropped at the start are evicted, as by the ring; the next episode goes where episode ``end`` started
        (or at ``write_row`` when none is dropped at the end) and takes id ``end``, so its rows overwrite those of the
        episodes dropped there. Nothing may be staged.

        Raises
        ------
        StoreError
            Episodes are staged.
        ValueError
            ``first, end`` is not a sub-range of the committed episodes.

        Examples
        --------
        >>> store.committer.keep_only(store.first_episode, store.end_episode - 1)  # doctest: +SKIP
        """
        old, idx = self.commit_record, self.index
        if self.pending:
            raise StoreError(f"{self.backend}: commit the staged episodes before dropping committed ones")
        if not old.first_episode <= first <= end <= old.end_episode:
            raise ValueError(
                f"episodes {first}..{end - 1} are not within the committed {old.first_episode}..{old.end_episode - 1}"
            )
        self.lock.ensure_held()
        head = idx.rows_of(end)[0] if end < old.end_episode else old.write_row
        record = Commit(old.generation + 1, first, end, head, idx.transitions_between(first, end), self.array_rows)
        self._publish(record)
        idx.truncate(end)
        idx.first = first
        self.head = self._stage_row0 = head
        return record

    def clear_uncommitted(
        self,
        index_positions: Sequence[int],
        chunks: Mapping[str, Sequence[int]],
        unreadable: Mapping[str, Sequence[int]] | None = None,
    ) -> None:
        """Repair: empty what a commit that never completed left past the commit record. The index rows at
        ``index_positions`` become zeros; in each array's listed chunks (shards) every row from ``write_row`` on
        becomes zeros (a row never written; a chunk wholly past it is removed). Only for rows that no committed
        episode owns: an unbounded store's rows past ``write_row``, index positions of ids never committed. The
        ``unreadable`` chunks (shards), which hold no committed row, are removed whatever is in their place.

        Examples
        --------
        >>> store.committer.clear_uncommitted([store.end_episode], {})  # doctest: +SKIP
        """
        if self.pending:
            raise StoreError(f"{self.backend}: commit the staged episodes before clearing past the commit")
        self.lock.ensure_held()
        w = self.commit_record.write_row
        for path, listed in (unreadable or {}).items():
            io = self.arrays[path]
            for c in listed:
                io.discard(c)
            io.flush(self.fsync)
        for path, listed in chunks.items():
            io, spec = self.arrays[path], next(a for a in self.layout.arrays if a.path == path)
            for c in listed:
                r0, r1 = max(w, c * spec.chunk_rows), (c + 1) * spec.chunk_rows
                if r0 >= r1:
                    continue
                if r0 == c * spec.chunk_rows:
                    io.discard(c)  # no committed row in it: removed (a chunk never written reads as zeros)
                elif isinstance(io, FrameWriter):
                    io.put(r0, [None] * (r1 - r0))  # type: ignore[list-item]
                else:
                    io.write(r0, np.zeros((r1 - r0, *spec.row_shape), spec.dtype))
                io.flush(self.fsync)
        for name, io in self.index_io.items():
            for pos in index_positions:
                io.write(pos, np.zeros(1, INDEX_COLUMNS[name]))
            io.flush(self.fsync)

    def _ensure_index_rows(self, end: int) -> None:
        if self.index.slots is not None or end <= self.index_rows:
            return
        chunk = int(self._zarr_array("episodes/episode_id", self.index_io["episode_id"]).chunks[0])
        new = round_up(max(end, 2 * self.index_rows), chunk)
        for name in self.index_io:
            self._zarr_array(f"episodes/{name}", self.index_io[name]).resize((new,))
            self._fsync_metadata(f"episodes/{name}")
        self.index_rows = new

    def _zarr_array(self, path: str, io: ChunkIO) -> zarr.Array:
        """The zarr.Array behind an array's row access (resized in place, so a ZarrChunks sees the new shape)."""
        return io.array if isinstance(io, (ZarrChunks, FrameWriter)) else cast(zarr.Array, self.root[path])

    def _fsync_metadata(self, path: str) -> None:
        """zarr writes zarr.json without fsync; with durability='fsync' a resized array's shape must survive too."""
        if self.fsync:
            self.backend.fsync([f"{path}/zarr.json"])


def _staging_plan(spec: ArraySpec, schema: Schema) -> tuple[str, list[tuple[str, Any, bool]], Any]:
    """How an episode's fields land in one array's rows: (field, column selector, needs flattening) and the
    columns of per-step fields, whose last row of each episode is unused (schema order puts them last)."""
    members: list[tuple[str, Any, bool]] = []
    step_from = None
    for name, a, b in spec.columns:
        f = schema.by_name[name]
        if spec.is_pack:
            members.append((name, slice(a, b), f.shape != (b - a,)))
        else:
            members.append((name, Ellipsis, False))
        if f.per_step and step_from is None:
            step_from = a if spec.is_pack else 0
    step_cols: Any
    if step_from is None:
        step_cols = slice(0, 0)
    else:
        step_cols = slice(step_from, None) if spec.is_pack else Ellipsis
    return spec.path, members, step_cols
