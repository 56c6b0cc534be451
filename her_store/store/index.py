"""The episode-index table: one row per episode (start row, length, flags, return, checksum), ring slots, cumulative
lengths.

This module answers every question about which rows hold which episode; the store and the sampler ask it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

import numpy as np

from her_store.errors import CorruptStoreError
from her_store.format.commit_record import Commit
from her_store.format.keys import COMMIT_KEY
from her_store.format.layout import INDEX_COLUMNS
from her_store.store.chunk_io import read_rows

__all__ = ["INDEX_PIECE_ROWS", "ColumnIO", "EpisodeIndex", "IndexView", "check_index", "chunks_holding", "read_index"]

INDEX_PIECE_ROWS = 1 << 16  # index rows read at a time at open and refresh, each piece checked before the next


class ColumnIO(Protocol):
    """Row access to one persisted index column (a 1-D Zarr array)."""

    def write(self, row0: int, rows: np.ndarray) -> None: ...

    def read(self, row0: int, row1: int) -> np.ndarray: ...

    def flush(self, fsync: bool) -> None: ...

    def close(self) -> None: ...


class IndexView:
    """The live episodes of an index at one moment: what a sampler draws from.

    Attributes
    ----------
    first, end : int
        Live ids are ``first <= id < end``.
    start_rows, lengths, priorities : numpy.ndarray
        Per live episode (position ``id - first``); ``priorities`` is the index column ``priority`` (zeros when not
        given).
    num_transitions : int
    """

    __slots__ = ("first", "end", "start_rows", "lengths", "priorities", "_cum", "_before", "num_transitions")

    def __init__(
        self,
        first: int,
        end: int,
        start_rows: np.ndarray,
        lengths: np.ndarray,
        cum: np.ndarray,
        before: int,
        priorities: np.ndarray | None = None,
    ) -> None:
        self.first, self.end = first, end
        self.start_rows, self.lengths = start_rows, lengths
        self.priorities = np.zeros(len(lengths)) if priorities is None else priorities
        self._cum, self._before = cum, before
        self.num_transitions = int(cum[-1]) - before if len(cum) else 0

    def __len__(self) -> int:
        return self.end - self.first

    def since(self, first: int) -> IndexView:
        """The episodes of this view with ids >= ``first`` (what is left after evictions), without copying."""
        k = min(max(first - self.first, 0), len(self))
        if k == 0:
            return self
        before = int(self._cum[k - 1])
        return IndexView(
            self.first + k, self.end, self.start_rows[k:], self.lengths[k:], self._cum[k:], before, self.priorities[k:]
        )

    def locate(self, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Episode ids and steps of transitions ``k`` (0 <= k < num_transitions), oldest first: one searchsorted."""
        offset = np.asarray(k, np.int64) + self._before
        i = np.searchsorted(self._cum, offset, side="right")
        prev = np.where(i > 0, self._cum[np.maximum(i - 1, 0)], self._before)
        return i + self.first, offset - prev


class EpisodeIndex:
    """In-memory window ``[first, end)`` of the episode table, persisted to ``episodes/<column>`` arrays.

    Episode ids are consecutive from 0 and never reused. On disk an episode's row is at position ``id``
    (unbounded store) or ``id % slots`` (ring store, ``slots`` >= the most episodes a ring can hold).
    ``cum`` holds cumulative lengths so that transition ``k`` is located with one ``searchsorted``.

    Parameters
    ----------
    slots : int or None
        Positions of the on-disk ring of index rows; None for an unbounded store.

    Examples
    --------
    >>> idx = EpisodeIndex(slots=None)
    >>> idx.append(dict(start_row=0, length=5)); idx.append(dict(start_row=6, length=3))
    0
    1
    >>> idx.locate(np.array([0, 4, 5, 7]))
    (array([0, 0, 1, 1]), array([0, 4, 0, 2]))
    """

    def __init__(self, slots: int | None) -> None:
        self.slots = slots
        self.base = 0  # id of row 0 of the in-memory arrays
        self.first = 0
        self.end = 0
        self._n = 0  # used rows of the in-memory arrays (= end - base)
        self._cols = {name: np.zeros(1024, dt) for name, dt in INDEX_COLUMNS.items()}
        self._cum = np.zeros(1024, np.int64)  # _cum[i] = transitions of ids base..base+i inclusive
        self._cum_before_base = 0

    # -- the live table ---------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.end - self.first

    @property
    def num_transitions(self) -> int:
        return self.transitions_between(self.first, self.end)

    def _cum_at(self, episode_id: int) -> int:
        """Transitions in ids base..episode_id-1 plus everything before base."""
        i = episode_id - self.base
        return self._cum_before_base + (int(self._cum[i - 1]) if i > 0 else 0)

    def column(self, name: str) -> np.ndarray:
        """Read-only view of one column over the live episodes ``[first, end)``."""
        view = self._cols[name][self.first - self.base : self.end - self.base]
        view.flags.writeable = False
        return view

    def table(self) -> dict[str, np.ndarray]:
        """All columns over the live episodes, as a dict of read-only numpy arrays."""
        return {name: self.column(name) for name in self._cols}

    def row(self, episode_id: int) -> dict[str, int | float | bool]:
        i = episode_id - self.base
        return {name: col[i].item() for name, col in self._cols.items()}

    def rows_of(self, episode_id: int) -> tuple[int, int]:
        """``(start_row, length)`` of a live episode."""
        i = episode_id - self.base
        return int(self._cols["start_row"][i]), int(self._cols["length"][i])

    def locate(self, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Episode ids and steps of live transitions ``k`` (0 <= k < num_transitions), in oldest-first order."""
        return self.snapshot().locate(k)

    def snapshot(self, end: int | None = None) -> IndexView:
        """A frozen, zero-copy view of the live episodes below ``end`` (default: all), valid while this index keeps
        appending."""
        end = self.end if end is None else min(max(end, self.first), self.end)
        lo, hi = self.first - self.base, end - self.base
        before = int(self._cum[lo - 1]) if lo > 0 else 0
        return IndexView(
            self.first,
            end,
            self._cols["start_row"][lo:hi],
            self._cols["length"][lo:hi],
            self._cum[lo:hi],
            before,
            self._cols["priority"][lo:hi],
        )

    # -- changes ----------------------------------------------------------------------------------------
    def _grow(self, need: int) -> None:
        if need <= len(self._cum):
            return
        # New arrays rather than an in-place shift: snapshots handed out earlier keep viewing the old ones.
        # The evicted prefix is dropped, so a long-running ring keeps memory bounded by its live episodes.
        drop = self.first - self.base
        if drop:
            self._cum_before_base += int(self._cum[drop - 1])
        live = self._n - drop
        size = max(need - drop, 2 * live, 1024)
        for name, col in self._cols.items():
            grown = np.zeros(size, col.dtype)
            grown[:live] = col[drop : self._n]
            self._cols[name] = grown
        cum = np.zeros(size, np.int64)
        cum[:live] = self._cum[drop : self._n] - (self._cum[drop - 1] if drop else 0)
        self._cum = cum
        self.base, self._n = self.first, live

    def append(self, values: Mapping[str, object]) -> int:
        """Add one episode row (missing columns are zero); returns its id."""
        if self._n >= len(self._cum):
            self._grow(self._n + 1)
        i = self._n
        cols = self._cols
        for name in values:
            cols[name][i] = values[name]
        episode_id = self.base + i
        cols["episode_id"][i] = episode_id
        self._cum[i] = (self._cum[i - 1] if i else 0) + int(values["length"])  # type: ignore[call-overload]
        self._n += 1
        self.end = episode_id + 1
        return episode_id

    def truncate(self, end: int) -> None:
        """Forget the rows of ids ``>= end`` (an append that failed before it was committed)."""
        if end < self.end:
            self._n = end - self.base
            self.end = end

    def transitions_between(self, first: int, end: int) -> int:
        """Transitions of ids ``[first, end)`` (both within the in-memory window)."""
        return self._cum_at(end) - self._cum_at(first)

    def extend(self, columns: Mapping[str, np.ndarray]) -> None:
        """Append rows read from disk (a reader's refresh), vectorised."""
        n = len(columns["length"])
        self._grow(self._n + n)
        i = self._n
        for name, col in self._cols.items():
            col[i : i + n] = columns[name]
        self._cum[i : i + n] = np.cumsum(columns["length"]) + (self._cum[i - 1] if i else 0)
        self._n += n
        self.end += n

    def load(self, columns: Mapping[str, np.ndarray], first: int, end: int) -> None:
        """Replace the window with rows read from disk for ids ``[first, end)``."""
        n = end - first
        # new arrays, never an overwrite: snapshots handed out earlier (a prefetch thread's) keep theirs intact; the
        # columns read are taken as they are (the caller hands them over), an append grows them
        self._cols = {name: np.ascontiguousarray(columns[name][:n], dt) for name, dt in INDEX_COLUMNS.items()}
        self._cum = np.cumsum(self._cols["length"], dtype=np.int64)
        self.base, self.first, self.end, self._n = first, first, end, n
        self._cum_before_base = 0

    def positions(self, first: int, end: int) -> list[tuple[int, int, int]]:
        """On-disk positions of ids ``[first, end)`` as ``(position, id_from, id_to)`` contiguous segments."""
        if self.slots is None:
            return [(first, first, end)] if end > first else []
        out = []
        at = first
        while at < end:
            pos = at % self.slots
            take = min(end - at, self.slots - pos)
            out.append((pos, at, at + take))
            at += take
        return out

    def write(self, io: Mapping[str, ColumnIO], first: int, end: int) -> None:
        """Persist rows of ids ``[first, end)`` to the index arrays the store has (not yet committed)."""
        for pos, a, b in self.positions(first, end):
            for name in io:
                io[name].write(pos, self._cols[name][a - self.base : b - self.base])

    @staticmethod
    def read(io: Mapping[str, ColumnIO], segments: list[tuple[int, int, int]]) -> dict[str, np.ndarray]:
        """Read the index rows at the given segments (from :meth:`positions`), concatenated per column: every column's
        rows at once (:func:`~her_store.store.chunk_io.read_rows`: one round of requests on object storage). A column
        the store's format version does not persist reads as zeros."""
        names = [name for name in INDEX_COLUMNS if name in io]
        reads = [(io[name], pos, pos + (b - a)) for name in names for pos, a, b in segments]
        got = read_rows(reads)  # type: ignore[arg-type]
        n, rows = len(segments), sum(b - a for _, a, b in segments)
        out = {name: np.zeros(rows, dt) for name, dt in INDEX_COLUMNS.items() if name not in io}
        for k, name in enumerate(names):
            parts = got[k * n : (k + 1) * n]
            if len(parts) == 1:
                out[name] = parts[0]
            else:
                out[name] = np.concatenate(parts) if parts else np.zeros(0, INDEX_COLUMNS[name])
        return out


def chunks_holding(starts: np.ndarray, ends: np.ndarray, chunk_rows: int) -> list[int]:
    """The chunks (shards) of ``chunk_rows`` rows that hold any row of the runs ``starts[i] .. ends[i] - 1`` (each
    non-empty: an episode's rows), in order.

    Examples
    --------
    >>> chunks_holding(np.array([0, 40]), np.array([5, 70]), 16)
    [0, 2, 3, 4]
    """
    if not len(starts):
        return []
    c0, c1 = starts // chunk_rows, (ends - 1) // chunk_rows
    marks = np.zeros(int(c1.max()) + 2, np.int64)
    np.add.at(marks, c0, 1)
    np.add.at(marks, c1 + 1, -1)
    return np.flatnonzero(np.cumsum(marks) > 0).tolist()


def read_index(
    columns: Mapping[str, ColumnIO], positions: Callable[[int, int], list[tuple[int, int, int]]], first: int, end: int,
    where: str,
) -> dict[str, np.ndarray]:
    """Index rows of ids ``[first, end)``, read in pieces whose episode ids must be the expected ones before the
    next piece is read: a record claiming more episodes than were written fails at the first piece that was
    never written, rather than allocating for all of them."""
    pieces = range(first, end, INDEX_PIECE_ROWS)  # each checked before the next is read
    if len(pieces) <= 1:
        return _index_piece(columns, positions, first, end, first, end, where)
    parts = [_index_piece(columns, positions, a, min(a + INDEX_PIECE_ROWS, end), first, end, where) for a in pieces]
    return {name: np.concatenate([p[name] for p in parts]) for name in INDEX_COLUMNS}

def _index_piece(
    columns: Mapping[str, ColumnIO], positions: Callable[[int, int], list[tuple[int, int, int]]], a: int, b: int,
    first: int, end: int, where: str,
) -> dict[str, np.ndarray]:
    """Index rows of ids ``[a, b)``, each holding its own episode id."""
    piece = EpisodeIndex.read(columns, positions(a, b))
    wrong = np.flatnonzero(piece["episode_id"] != np.arange(a, b))
    if wrong.size:
        i = int(wrong[0])
        raise CorruptStoreError(
            f"{where}: the index row of episode {a + i} holds episode_id {int(piece['episode_id'][i])}; "
            f"{COMMIT_KEY} records episodes {first}..{end - 1}"
        )
    return piece

def check_index(
    commit: Commit, capacity: int | None, first: int, columns: Mapping[str, np.ndarray], transitions: int, where: str
) -> None:
    """Check the index rows of ids ``first, first + 1, ...`` against ``commit`` before they are used: each episode
    owns ``length + 1`` rows of its own within the committed rows, and their lengths plus ``transitions`` (of
    the live episodes before ``first``) sum to the record's num_transitions."""
    starts, lengths = columns["start_row"], columns["length"]
    # an unbounded store's rows end at write_row; a ring's lie anywhere in its array_rows
    limit = commit.write_row if capacity is None else commit.array_rows
    ends = starts + lengths + 1
    bad = np.flatnonzero((lengths < 1) | (starts < 0) | (starts > limit) | (lengths > limit) | (ends > limit))
    if not bad.size:  # with every row in range, the checks below cannot overflow
        order = np.argsort(starts, kind="stable")
        bad = np.sort(order[1:][starts[order[1:]] < ends[order[:-1]]])
    if bad.size:
        i = int(bad[0])
        raise CorruptStoreError(
            f"{where}: the index row of episode {first + i} (start_row={int(starts[i])}, "
            f"length={int(lengths[i])}) does not fit {COMMIT_KEY}: expected rows of its own below row {limit}"
        )
    total = transitions + int(lengths.sum())
    if total != commit.num_transitions:
        raise CorruptStoreError(
            f"{where}: index lengths sum to {total} transitions, {COMMIT_KEY} says {commit.num_transitions}"
        )
