"""Following a store's commits: the commit record a handle loaded, the index rows it names, refreshes to newer ones.

The index rows are read in checked pieces; a refresh tells a store created again at its place apart.

A reader trusts only the commit record: every index row it names is checked against it (ids, row ranges within the
arrays, no two live episodes sharing a row, lengths summing to ``num_transitions``) before it is used, and a reader
racing a ring writer that reused slots after that commit retries with the newer commit rather than reporting
corruption.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import NamedTuple

import numpy as np

from her_store.errors import CorruptStoreError, NotAStoreError
from her_store.format.commit_record import Commit
from her_store.format.keys import ATTRS_KEY, COMMIT_KEY
from her_store.storage import Backend
from her_store.store.creation import unfinished_create
from her_store.store.index import ColumnIO, EpisodeIndex, check_index, read_index

__all__ = ["CommitFollower", "RowSpace", "read_commit"]

RETRIES = 8  # commits tried while a ring writer keeps reusing the slots a reader reads


def read_commit(backend: Backend, version: int) -> Commit:
    """The commit record of the store at ``backend`` (of format ``version``) as it holds it now.

    Raises
    ------
    NotAStoreError
        An unfinished create (its creator stopped before the first record).
    CorruptStoreError
        No record, or one that fails its checks.
    """
    raw = backend.read_bytes(COMMIT_KEY)
    if raw is None and unfinished_create(backend):
        raise NotAStoreError(
            f"{backend} holds an unfinished create (its creator stopped before the first commit record, so nothing "
            "was stored); her_store.open_store(path, observation_space, action_space, ...) creates it anew"
        )
    if raw is None:
        raise CorruptStoreError(
            f"{backend} has no commit record {COMMIT_KEY}, which every store has (FORMAT.md): the store was removed or "
            "is damaged"
        )
    return Commit.from_bytes(raw, str(backend), version)


class RowSpace(NamedTuple):
    """Where a handle reads index rows, and how many rows its arrays and index columns are sized to."""

    columns: Mapping[str, ColumnIO]
    data_rows: int
    index_rows: int


class CommitFollower:
    """The committed episodes one handle of a store knows.

    Parameters
    ----------
    backend : Backend
        Where the store lives.
    version : int
        The store's format version (its commit records').
    capacity, slots : int or None
        The ring's capacity and index slots (None: unbounded).
    created_at : float
        The store's creation time, from its root attributes: what tells it from a store created again in its place.
    retry : bool
        Whether a commit whose index rows fail their checks is retried with a newer one (a reader's: a ring writer
        may have reused those slots since).

    Attributes
    ----------
    index : EpisodeIndex
        The index of the committed episodes loaded.
    commit : Commit
        The commit record loaded.
    """

    def __init__(
        self, backend: Backend, version: int, capacity: int | None, slots: int | None, created_at: float, retry: bool
    ) -> None:
        self.backend = backend
        self.version = version
        self.capacity = capacity
        self.created_at = created_at
        self.retry = retry
        self.index = EpisodeIndex(slots)
        self.commit = Commit()
        self._stamp = backend.stamp("zarr.json")

    def read_commit(self) -> Commit:
        """The commit record as the store holds it now (:func:`read_commit`)."""
        return read_commit(self.backend, self.version)

    def load(self, commit: Commit, rows: RowSpace) -> None:
        """Load the index window of ``commit``, checked against the arrays and the record; on error the handle keeps
        what it had (a reader retries with a newer commit where the ring moved on meanwhile)."""
        for attempt in range(RETRIES):
            index = EpisodeIndex(self.index.slots)
            try:
                self._check_fits(commit, rows)
                columns = self._read(rows, commit.first_episode, commit.end_episode)
                self._check(commit, commit.first_episode, columns, 0)
            except CorruptStoreError:
                newer = self.read_commit() if self.retry else commit
                if attempt == RETRIES - 1 or newer.generation == commit.generation:
                    raise
                commit = newer
            else:
                index.load(columns, commit.first_episode, commit.end_episode)
                self.index, self.commit = index, commit
                return

    def refresh(self, rows: RowSpace, reopen: Callable[[], RowSpace]) -> int:
        """Pick up the episodes committed since the last look; returns how many. ``reopen`` opens the arrays again
        (their metadata re-read) when the writer has grown them. Cost is proportional to the new episodes.

        Raises
        ------
        CorruptStoreError
            The new commit record, or the index rows it names, do not fit the store (the handle keeps what it saw),
            or the store was created again at its place.
        """
        # the root is checked after the commit record is read, and again after the index rows it names: a store
        # created again before either read is seen before this handle takes anything of it
        commit = self.read_commit()
        self.check_same_store()
        if commit.generation == self.commit.generation:
            return 0
        if commit.array_rows != self.commit.array_rows or (
            self.index.slots is None and commit.end_episode > rows.index_rows
        ):
            rows = reopen()
        idx = self.index
        old_end = idx.end
        new = None
        if idx.first <= commit.first_episode <= idx.end <= commit.end_episode:
            self._check_fits(commit, rows)
            try:
                new = self._read(rows, idx.end, commit.end_episode)
                self._check(commit, old_end, new, idx.transitions_between(commit.first_episode, old_end))
            except CorruptStoreError:
                new = None  # the ring reused those slots while they were read: reload the window below
        self.check_same_store()
        if new is not None:
            idx.extend(new)
            idx.first = commit.first_episode
            self.commit = commit
        else:  # fell a whole ring behind (or the slots moved on meanwhile): reload the window
            self.load(commit, rows)
        return max(0, commit.end_episode - old_end)

    def check_same_store(self) -> None:
        """A store deleted and created again under this handle (a shard wiped and restarted, say) is another store:
        its rows are not the ones this handle mapped or cached. Its root ``zarr.json`` is then a new file (object)
        with another ``created_at`` (a card edit replaces it too, keeping ``created_at``). Object storage: one HEAD
        of the root object per look, its ETag against the one seen before.

        Raises
        ------
        CorruptStoreError
            The store was created again, or (on local disk) is gone.
        """
        if self._stamp is None:
            return
        stamp = self.backend.stamp("zarr.json")
        if stamp is None or stamp == self._stamp:  # no answer, or none with an ETag (an outage): a store that is gone
            return  # fails the commit record's read
        try:
            created = json.loads(self.backend.read_bytes("zarr.json") or b"null")["attributes"][ATTRS_KEY]["created_at"]
        except (ValueError, TypeError, KeyError, RecursionError):
            created = None
        if created != self.created_at:
            raise CorruptStoreError(
                f"{self.backend} was created again since this handle opened it (its zarr.json holds another store); "
                "open it again"
            )
        self._stamp = stamp

    def _check_fits(self, commit: Commit, rows: RowSpace) -> None:
        where = f"{self.backend}/{COMMIT_KEY}"
        commit.check_fits(self.capacity, self.index.slots, rows.data_rows, rows.index_rows, where)

    def _read(self, rows: RowSpace, first: int, end: int) -> dict[str, np.ndarray]:
        return read_index(rows.columns, self.index.positions, first, end, str(self.backend))

    def _check(self, commit: Commit, first: int, columns: Mapping[str, np.ndarray], transitions: int) -> None:
        check_index(commit, self.capacity, first, columns, transitions, str(self.backend))
