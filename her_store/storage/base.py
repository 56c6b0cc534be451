"""The one interface every place a store can live behind: :class:`Backend`, as zarr's ``Store`` is for its backends.

A backend answers for the bytes of a store's keys (``zarr.json``, ``commit.json``, ``packs/float32/c/0/0``, ...):
whole or ranged reads, each bounded (nothing a store, a server or a file holds is trusted); atomic, create-once and
conditional writes; listings; the writer lock. The layers above never ask which backend they hold: what differs
between local disk, object storage, an HTTP server and a zip archive is said by the backend's methods and by a few
traits (:attr:`Backend.read_only`, :attr:`Backend.mappable`, :attr:`Backend.conditional`, :attr:`Backend.defaults`).
"""

from __future__ import annotations

import abc
import io
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, NamedTuple

import zarr.storage

from her_store.errors import CorruptStoreError, ReadOnlyStoreError

__all__ = ["METADATA_LIMIT", "OBJECT_LIMIT", "Backend", "Defaults", "ObjectReplaced", "WriterLock"]

METADATA_LIMIT = 64 << 20  # bytes a commit record, lease or zarr.json may hold (spaces with per-pixel bounds included)
OBJECT_LIMIT = 1 << 30  # bytes any object of a store read over the network may hold (a chunk is under 256 MiB)


class ObjectReplaced(Exception):
    """A GET conditioned on an ETag (``If-Match``) found the object replaced since that ETag was read (HTTP 412)."""


class Defaults(NamedTuple):
    """The sizes and intervals that suit a backend, used where a store's creator or reader names none.

    Local files are memory-mapped and written in place, so large chunks and frequent commits cost little; an object
    store answers each request after a round trip and replaces objects whole, so chunks are small and commits and
    refreshes are grouped.
    """

    chunk_rows: int  # rows per chunk of a new store's arrays
    index_chunk_rows: int  # episodes per chunk of a new store's index columns
    commit_interval: float  # seconds between a writer's group commits
    refresh_interval: float  # seconds between a reading sampler's looks for new commits


class WriterLock(abc.ABC):
    """One writer per store: :meth:`acquire` takes it, :meth:`ensure_held` proves it still held before every commit,
    :meth:`release` gives it up (the backend hands out the kind that suits it: :meth:`Backend.writer_lock`)."""

    @abc.abstractmethod
    def acquire(self) -> None:
        """Take the lock.

        Raises
        ------
        StoreLockedError
            If another live writer holds it; the message names that writer.
        """

    def ensure_held(self) -> None:
        """Before a commit: prove the lock still ours.

        Raises
        ------
        StoreLockedError
            If another writer took it over; the caller must then write nothing.
        OSError
            If that could not be told; nothing may be written either (a later call retries).
        """

    @property
    def fences_writes(self) -> bool:
        """Whether commit records can be written conditionally on the lock (a writer that lost it then cannot replace
        them)."""
        return False

    @abc.abstractmethod
    def release(self) -> None:
        """Give the lock up; idempotent. A lock another writer took over is left to it."""


class Backend(abc.ABC):
    """Where a store lives, and every way its bytes are read and written.

    Attributes
    ----------
    url : str
        The place as its user names it (a local path made absolute, or a URL without a trailing slash).
    root : str
        The place as the backend addresses it (a local directory, or an fsspec path).
    storage_options : dict
        What the place was opened with (credentials, endpoints, ``request_deadline``).
    read_only : str or None
        Why nothing may be written here, as a sentence for an error; None where the backend takes writes.
    mappable : bool
        Whether a key's bytes lie in a file on this machine (:meth:`open_range`), so readers map them or ``pread``
        them, and writers write rows in place (where writable).
    lists : bool
        Whether keys can be listed (a plain HTTP server offers no listing).
    conditional : bool
        Whether :meth:`get_object` honours ``if_match``: a ranged read of an object replaced since its ETag was read
        raises :class:`ObjectReplaced` rather than mixing two versions.
    defaults : Defaults
        The sizes and intervals that suit this backend.
    """

    url: str
    root: str
    storage_options: dict[str, Any]
    read_only: str | None = None
    mappable: bool = False
    conditional: bool = False
    lists: bool = True
    defaults: Defaults

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def key_path(self, key: str) -> str:
        """The backend's own path of ``key`` (for messages and for the backend itself)."""
        return f"{self.root}/{key}" if key else self.root

    # -- reading ------------------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def read_bytes(self, key: str, limit: int = METADATA_LIMIT) -> bytes | None:
        """Contents of ``key``, or None when it does not exist.

        Raises
        ------
        CorruptStoreError
            ``key`` holds more than ``limit`` bytes, or (locally) is not a regular file of the store's own.
        """

    @abc.abstractmethod
    def _read_ranges(self, keys: Sequence[str], starts: Sequence[int], ends: Sequence[int]) -> list[Any]:
        """Bytes ``starts[i] .. ends[i]`` of each key, None (or a FileNotFoundError) where it does not exist; the
        lengths are checked by :meth:`read_ranges`."""

    def read_ranges(self, keys: Sequence[str], starts: Sequence[int], ends: Sequence[int]) -> list[bytes | None]:
        """Bytes ``starts[i] .. ends[i]`` of each ``keys[i]`` (None where the key does not exist), read concurrently
        where the backend is remote (one ranged GET each).

        Raises
        ------
        CorruptStoreError
            An existing key holds fewer bytes than asked for.
        """
        out: list[bytes | None] = []
        for key, a, b, raw in zip(keys, starts, ends, self._read_ranges(keys, starts, ends)):
            if isinstance(raw, FileNotFoundError):
                raw = None
            elif isinstance(raw, BaseException):
                raise raw
            if raw is not None and len(raw) != b - a:
                raise CorruptStoreError(
                    f"{self.key_path(key)}: bytes {a:,}..{b:,} read as {len(raw):,} bytes; the file is shorter than "
                    "its rows"
                )
            out.append(raw)
        return out

    def read_objects(self, keys: Sequence[str], limit: int = OBJECT_LIMIT) -> list[bytes | None]:
        """Each of ``keys`` whole (None where it does not exist), concurrently where the backend is remote.

        Raises
        ------
        CorruptStoreError
            One holds more than ``limit`` bytes.
        """
        return [self.read_bytes(k, limit) for k in keys]

    @property
    def ranged(self) -> bool:
        """Whether a ranged read of the store fetches only its bytes (an HTTP server may send whole files instead)."""
        return True


    async def get_object(
        self, key: str, rng: str | None, if_match: str | None, limit: int
    ) -> tuple[bytes | None, str, int]:
        """One read of ``key`` as an object: (the bytes of HTTP range ``rng`` of it, or all of it, None when it does
        not exist; its ETag, "" where none; its size). Run it with :meth:`run`.

        Raises
        ------
        ObjectReplaced
            ``if_match`` is given, the backend is :attr:`conditional` and the object no longer has that ETag.
        CorruptStoreError
            More than ``limit`` bytes would be read.
        """
        raise NotImplementedError(f"{self} reads objects by range only through its files")

    def read_head(self, key: str, n: int) -> tuple[bytes | None, str, int, bool]:
        """The first ``n`` bytes of object ``key`` by one ranged GET: (them, None when there is no such object; its
        ETag; its size; whether the backend read only them, as a server that honours Range does)."""
        head, etag, size = self.run(self.get_object, key, f"bytes=0-{n - 1}", None, OBJECT_LIMIT)
        return head, etag, size, True

    def run(self, coroutine: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> Any:
        """The result of ``coroutine(*args)``, run on the backend's event loop (that of its remote client)."""
        raise NotImplementedError(f"{self} has no event loop")

    def check_file(self, key: str, limit: int = METADATA_LIMIT) -> None:
        """Before a library (zarr) reads ``key`` itself: it holds at most ``limit`` bytes and is the store's own (on
        local disk, a regular file reached through no link), or is missing."""

    @abc.abstractmethod
    def exists(self, key: str) -> bool:
        """Whether ``key`` exists."""

    def etag(self, key: str) -> str | None:
        """The ETag of ``key`` where the backend keys objects by one (None elsewhere, or when it is missing)."""
        return None

    def stamp(self, key: str) -> object | None:
        """What tells ``key`` from a file written anew in its place (an inode and mtime, an ETag); None where nothing
        does, or where the place never changes.

        Raises
        ------
        OSError
            ``key`` cannot be looked at (on local disk: it is gone).
        """
        return self.etag(key)

    def local_directory(self) -> str | None:
        """The directory on this machine whose files are the store's keys, files of their own (what tools that work
        on files in place need: pack, repair); None where there is none (object storage, a zip archive)."""
        return None

    def place_problem(self) -> str | None:
        """What makes the place no store's (a file where a store's directory belongs), or None."""
        return None

    def place_exists(self) -> bool | None:
        """Whether the place itself exists, where that can be told without a request (None elsewhere)."""
        return None

    def size(self, key: str) -> int:
        """The size of ``key`` in bytes.

        Raises
        ------
        FileNotFoundError
            No such key.
        """
        sizes = self.list_files(key.rpartition("/")[0])
        if key not in sizes:
            raise FileNotFoundError(self.key_path(key))
        return sizes[key]

    def link_count(self, key: str) -> int:
        """How many names the file of ``key`` has (1 where nothing is written in place)."""
        return 1

    def open_range(self, key: str) -> tuple[io.FileIO, int, int]:
        """``key``'s bytes as (an open file, closed by the caller or when its last holder lets go of it, their offset in
        it, their size), on a :attr:`mappable` backend: a file of its own, or a member of a zip archive.

        Raises
        ------
        FileNotFoundError
            No such key, or a backend whose keys are not local files.
        """
        raise FileNotFoundError(f"{self.key_path(key)} is not a file on this machine")

    def pread_into(self, key: str, buf: Any, offset: int) -> int:
        """Read ``key`` from byte ``offset`` into the writable buffer ``buf``, on a :attr:`mappable` backend; the count
        read, short at the key's end, 0 when it does not exist."""
        raise FileNotFoundError(f"{self.key_path(key)} is not a file on this machine")

    def open_file(self, key: str) -> int:
        """A descriptor of ``key`` open for writing in place (made, with its directories, if missing), on a writable
        :attr:`mappable` backend."""
        self._writable()
        raise NotImplementedError(f"{self} writes no file in place")

    @abc.abstractmethod
    def list_files(self, prefix: str = "") -> dict[str, int]:
        """Every key under ``prefix`` (a directory-like key; "" for the whole store) and its size in bytes."""

    def fingerprints(self, keys: Sequence[str]) -> dict[str, tuple[str, int]]:
        """For each of ``keys`` that exists: (what identifies this version of it, "" where nothing does; its size)."""
        sizes = self.list_files()
        return {k: ("", sizes[k]) for k in keys if k in sizes}

    def disk_usage(self, prefix: str = "") -> dict[str, tuple[int, int]]:
        """(apparent size, bytes allocated) of every key under ``prefix``; where storage has no holes, both are the
        size."""
        return {key: (size, size) for key, size in self.list_files(prefix).items()}

    @abc.abstractmethod
    def list_dir(self, prefix: str) -> list[str]:
        """The names directly under the directory-like key ``prefix`` (files and directories alike)."""

    @abc.abstractmethod
    def list_dirs(self, prefix: str) -> list[str]:
        """The directory-like keys directly under ``prefix`` (never one a link names), sorted."""

    def check_directory(self, key: str) -> None:
        """Refuse a directory-like ``key`` that is not the store's own (a symbolic link in its place, on local disk):
        nothing is written or read through it."""

    def zarr_store(self, read_only: bool) -> zarr.storage.StoreLike:
        """A Zarr store over the same place (what zarr reads metadata and compressed chunks through)."""
        raise NotImplementedError

    # -- writing ------------------------------------------------------------------------------------------------------
    def _writable(self) -> None:
        if self.read_only is not None:
            raise ReadOnlyStoreError(self.read_only)

    @abc.abstractmethod
    def write_atomic(self, key: str, data: bytes, fsync: bool, if_match: str | None = None) -> str | None:
        """Replace ``key`` so that a reader sees the old or the new bytes, never a mix; with ``if_match``, only while
        the object still has that ETag (where the backend keys objects by one). Returns the new ETag, if any.

        Raises
        ------
        ReadOnlyStoreError
            The backend takes no writes.
        """

    def put(self, key: str, data: bytes, *, create: bool = False, if_match: str | None = None) -> str | None:
        """One whole write of ``key`` on object storage: only if it does not exist with ``create`` (If-None-Match: *),
        only while it has ETag ``if_match`` with that; the new ETag where the store reports one.

        Raises
        ------
        FileExistsError
            ``create`` and the object exists.
        OSError
            ``if_match`` no longer holds (or the write failed otherwise).
        """
        raise NotImplementedError(f"{self} writes files, not objects: write_atomic, create_once")

    def head(self, key: str) -> str | None:
        """The ETag of object ``key`` as the store says it now, None where it reports none.

        Raises
        ------
        FileNotFoundError
            There is no such object.
        """
        raise NotImplementedError(f"{self} keys no object by ETag")

    @abc.abstractmethod
    def create_once(self, key: str, data: bytes) -> bool:
        """Write ``key`` whole only if nothing is there, atomically against other writers: True if this call wrote
        it, False if it existed (what is there is left as it is)."""

    @abc.abstractmethod
    def put_many(self, items: Mapping[str, bytes]) -> None:
        """Write every ``key: bytes`` of ``items`` whole (replacing what is there), concurrently where the backend
        is remote; not atomic as a group."""

    @abc.abstractmethod
    def make_root(self) -> None:
        """Make the store's place (its directory) where the backend has directories."""

    def make_parents(self, key: str, create: bool = True) -> None:
        """Make the directories of ``key`` that are missing, where the backend has directories (with ``create``
        false, only check those that exist)."""

    def existing(self, keys: Sequence[str]) -> list[str]:
        """Those of ``keys`` that something (a file, or locally a directory or link) is at."""
        return [k for k in keys if self.exists(k)]

    @abc.abstractmethod
    def clear(self, keep: str) -> None:
        """Remove everything under the place but ``keep`` (an unfinished create being started again); the root
        ``zarr.json`` goes last."""

    def remove_temp_files(self, keys: Sequence[str] | None = None) -> int:
        """Remove the temp files that atomic writes of a writer killed mid-write left, under the place or, given
        ``keys``, of those keys; how many. Only a backend whose writes go through temp files has any."""
        return 0

    @abc.abstractmethod
    def remove(self, key: str) -> None:
        """Remove whatever is at ``key`` (never what a link names); nothing there is no error."""

    def drop_page_cache(self, prefix: str) -> None:
        """Drop the pages of every file under ``prefix`` from the OS page cache (cold reads, for measurements), where
        keys are local files."""

    def fsync(self, keys: Sequence[str]) -> None:
        """Make the writes of ``keys`` (and their directory entries) durable where the backend buffers them."""

    @abc.abstractmethod
    def writer_lock(self, key: str, lease_ttl: float) -> WriterLock:
        """The single-writer lock of the store, kept in ``key`` (not yet taken: :meth:`WriterLock.acquire`)."""

    @abc.abstractmethod
    def active_writer(self, key: str) -> str | None:
        """Who holds the writer lock in ``key`` now, read without taking or touching it; None when nobody does."""

    @abc.abstractmethod
    def child(self, key: str) -> Backend:
        """The backend of the place ``key`` under this one (a directory, or a prefix), with the same options."""

    def close(self) -> None:
        """Let go of what the backend holds open (a zip archive's descriptor); idempotent."""
