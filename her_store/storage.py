"""Bytes in and out of a store's location: local paths or fsspec URLs, atomic writes, the writer lock, chunk writes.

Two ways to write rows into a Zarr array:
- ``RawChunkFile``: uncompressed arrays on local disk. A v3 chunk without codecs is the raw little-endian rows
  (FACTS.md), so rows are ``pwrite``-n in place into pre-sized chunk files: a commit writes only its own bytes.
- ``ZarrChunks``: compressed arrays, or any array on object storage. Whole chunks are assembled in memory and
  written through zarr (one PUT per chunk on S3; temp file + rename on disk), so a chunk is never torn.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Mapping
from typing import Any, cast

import fsspec
import numpy as np
import zarr
import zarr.storage
from zarr.core.array_spec import ArrayConfigParams

from her_store.errors import StoreLockedError

__all__ = ["Location", "WriterLock", "RawChunkFile", "ZarrChunks", "chunk_io", "ZARR_CONFIG"]

DEFAULT_LEASE_TTL = 300.0  # seconds an object-storage writer lease lasts unless renewed
ZARR_CONFIG: ArrayConfigParams = {"write_empty_chunks": True}  # an all-zero chunk is data here, not absence


class Location:
    """A store's place: a local directory or an fsspec URL (``s3://``, ``gs://``, ``memory://``, ``file://``).

    Examples
    --------
    >>> Location("/tmp/run1").is_local
    True
    >>> Location("memory://run1").is_local
    False
    """

    def __init__(self, path_or_url: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> None:
        url = os.fspath(path_or_url)
        self.storage_options = dict(storage_options or {})
        if url.startswith("file://"):
            url = url[len("file://") :]
        self.is_local = "://" not in url
        if self.is_local:
            self.root = os.path.abspath(url)
            self.url = self.root
            self.fs = fsspec.filesystem("file")
        else:
            self.url = url.rstrip("/")
            self.fs, self.root = fsspec.core.url_to_fs(self.url, **self.storage_options)

    def __str__(self) -> str:
        return self.url

    def key_path(self, key: str) -> str:
        return f"{self.root}/{key}" if key else self.root

    def zarr_store(self, read_only: bool) -> zarr.storage.StoreLike:
        if self.is_local:
            return zarr.storage.LocalStore(self.root, read_only=read_only)
        return zarr.storage.FsspecStore.from_url(self.url, storage_options=self.storage_options, read_only=read_only)

    def read_bytes(self, key: str) -> bytes | None:
        """Contents of ``key``, or None when it does not exist."""
        try:
            if self.is_local:
                with open(self.key_path(key), "rb") as f:
                    return f.read()
            return self.fs.cat_file(self.key_path(key))
        except FileNotFoundError:
            return None

    def write_atomic(self, key: str, data: bytes, fsync: bool) -> None:
        """Replace ``key`` so that a reader sees the old or the new bytes, never a mix.

        Local: temp file + ``os.replace`` (atomic on POSIX), with fsync of file and directory for power loss.
        Object storage: a single PUT replaces an object whole.
        """
        path = self.key_path(key)
        if not self.is_local:
            self.fs.pipe_file(path, data)
            return
        tmp = f"{path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, data)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        if fsync:
            fsync_file(os.path.dirname(path))

    def exists(self, key: str) -> bool:
        return bool(self.fs.exists(self.key_path(key)))


def fsync_file(path: str) -> None:
    """fsync a file or directory by path (a directory's fsync makes renames and new entries durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)



def drop_page_cache(path: str) -> None:
    """Write a file's dirty pages back, then drop its pages from the OS page cache (a cold start)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _holder_text(raw: bytes | None) -> str:
    try:
        h = json.loads(raw or b"")
        return f"pid {h['pid']} on host {h['host']} since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(h['since']))}"
    except (ValueError, KeyError, TypeError):
        return "an unknown writer"


class WriterLock:
    """One writer per store.

    Local disk: ``flock`` on ``writer.lock``; the kernel drops it when the holder dies (even by kill -9), so the
    lock of a dead process is taken over without any staleness guess. The file names the holder.
    Object storage: a lease object created with a conditional PUT (If-None-Match: *). A lease is stale when its
    holder is a dead process on this host, or when it was not renewed for ``lease_ttl`` seconds.
    """

    def __init__(self, location: Location, key: str, lease_ttl: float = DEFAULT_LEASE_TTL) -> None:
        self.location = location
        self.key = key
        self.lease_ttl = lease_ttl
        self._fd: int | None = None
        self._renewed = 0.0

    def _record(self) -> bytes:
        now = time.time()
        return json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": now, "expires": now + self.lease_ttl}).encode()

    def acquire(self) -> None:
        if self.location.is_local:
            self._acquire_flock()
        else:
            self._acquire_lease()

    def _acquire_flock(self) -> None:
        import fcntl

        path = self.location.key_path(self.key)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0)
            os.close(fd)
            raise StoreLockedError(
                f"{self.location} is being written by {_holder_text(holder)}; one writer per store "
                "(open with mode='r' to read while it writes)"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, self._record(), 0)
        self._fd = fd

    def _acquire_lease(self) -> None:
        path = self.location.key_path(self.key)
        for _ in range(2):
            try:
                self.location.fs.pipe_file(path, self._record(), mode="create")
                self._renewed = time.monotonic()
                return
            except FileExistsError:
                raw = self.location.read_bytes(self.key)
                if not self._stale(raw):
                    raise StoreLockedError(
                        f"{self.location} is being written by {_holder_text(raw)} (lease {self.key}); one writer per "
                        "store (open with mode='r' to read while it writes)"
                    ) from None
                self.location.fs.rm_file(path)
        raise StoreLockedError(f"{self.location}: another writer took the stale lease {self.key} first")

    def _stale(self, raw: bytes | None) -> bool:
        try:
            h = json.loads(raw or b"")
            if h["host"] == socket.gethostname() and not _pid_alive(int(h["pid"])):
                return True
            return float(h["expires"]) < time.time()
        except (ValueError, KeyError, TypeError):
            return True

    def renew(self) -> None:
        """Extend an object-storage lease (called at commits); a no-op on local disk."""
        if not self.location.is_local and time.monotonic() - self._renewed > self.lease_ttl / 4:
            self.location.fs.pipe_file(self.location.key_path(self.key), self._record())
            self._renewed = time.monotonic()

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock; the file stays (unlinking would race a waiting opener)
            self._fd = None
        elif not self.location.is_local and self._renewed:
            self.location.fs.rm_file(self.location.key_path(self.key))
            self._renewed = 0.0


def chunk_key(path: str, chunk: int, ndim: int) -> str:
    """Key of chunk ``chunk`` along rows of a row-chunked array (v3 default encoding, '/' separator)."""
    return "/".join([path, "c", str(chunk)] + ["0"] * (ndim - 1))


class RawChunkFile:
    """Rows of an uncompressed local array written in place with ``pwrite`` (see the module docstring)."""

    def __init__(self, root: str, path: str, dtype: np.dtype, row_shape: tuple[int, ...], chunk_rows: int) -> None:
        self.root = root
        self.path = path
        self.dtype = dtype
        self.row_shape = row_shape
        self.row_nbytes = int(np.prod(row_shape, dtype=np.int64)) * dtype.itemsize
        self.chunk_rows = chunk_rows
        self._fds: dict[int, int] = {}
        self._dirty: set[int] = set()

    def _file(self, chunk: int) -> str:
        return os.path.join(self.root, chunk_key(self.path, chunk, 1 + len(self.row_shape)))

    def _fd(self, chunk: int) -> int:
        fd = self._fds.get(chunk)
        if fd is None:
            name = self._file(chunk)
            os.makedirs(os.path.dirname(name), exist_ok=True)
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            size = self.chunk_rows * self.row_nbytes
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)  # zarr expects a full chunk; the unwritten tail stays sparse
            if len(self._fds) >= 64:
                old = next(iter(self._fds))
                os.close(self._fds.pop(old))
            self._fds[chunk] = fd
        return fd

    def write(self, row0: int, rows: np.ndarray) -> None:
        data = np.ascontiguousarray(rows, dtype=self.dtype)
        n = len(data)
        at = 0
        while at < n:
            chunk, r = divmod(row0 + at, self.chunk_rows)
            take = min(n - at, self.chunk_rows - r)
            os.pwrite(self._fd(chunk), memoryview(cast(Any, data[at : at + take])).cast("B"), r * self.row_nbytes)
            self._dirty.add(chunk)
            at += take

    def flush(self, fsync: bool) -> None:
        if fsync:
            dirs = set()
            for chunk in self._dirty:
                os.fsync(self._fd(chunk))
                dirs.add(os.path.dirname(self._file(chunk)))
            for d in dirs:
                fsync_file(d)
        self._dirty.clear()

    def read(self, row0: int, row1: int) -> np.ndarray:
        out = np.zeros((row1 - row0, *self.row_shape), self.dtype)
        flat = out.reshape(-1).view(np.uint8)
        at = row0
        while at < row1:
            chunk, r = divmod(at, self.chunk_rows)
            take = min(row1 - at, self.chunk_rows - r)
            try:
                with open(self._file(chunk), "rb") as f:
                    buf = os.pread(f.fileno(), take * self.row_nbytes, r * self.row_nbytes)
            except FileNotFoundError:
                buf = b""
            o = (at - row0) * self.row_nbytes
            flat[o : o + len(buf)] = np.frombuffer(buf, np.uint8)
            at += take
        return out

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class ZarrChunks:
    """Rows of a compressed or remote array, written as whole chunks through zarr (see the module docstring)."""

    def __init__(self, array: zarr.Array, location: Location) -> None:
        self.array = array
        self.location = location
        self.chunk_rows = int(array.chunks[0])
        self._cache: dict[int, np.ndarray] = {}
        self._dirty: set[int] = set()

    def _chunk(self, chunk: int) -> np.ndarray:
        buf = self._cache.get(chunk)
        if buf is None:
            r0 = chunk * self.chunk_rows
            buf = np.array(self.array[r0 : r0 + self.chunk_rows])  # fill values where the chunk does not exist yet
            self._cache[chunk] = buf
        return buf

    def write(self, row0: int, rows: np.ndarray) -> None:
        n = len(rows)
        at = 0
        while at < n:
            chunk, r = divmod(row0 + at, self.chunk_rows)
            take = min(n - at, self.chunk_rows - r)
            self._chunk(chunk)[r : r + take] = rows[at : at + take]
            self._dirty.add(chunk)
            at += take

    def flush(self, fsync: bool) -> None:
        for chunk in sorted(self._dirty):
            r0 = chunk * self.chunk_rows
            self.array[r0 : r0 + self.chunk_rows] = self._cache[chunk]
            if fsync and self.location.is_local:
                fsync_file(self.location.key_path(chunk_key(self.array.path, chunk, self.array.ndim)))
        if fsync and self.location.is_local and self._dirty:
            fsync_file(os.path.dirname(self.location.key_path(chunk_key(self.array.path, max(self._dirty), self.array.ndim))))
        # keep only the newest chunk: the next commit most likely appends to it
        if self._dirty:
            keep = max(self._dirty)
            self._cache = {keep: self._cache[keep]}
        self._dirty.clear()

    def read(self, row0: int, row1: int) -> np.ndarray:
        if row1 > self.array.shape[0]:
            raise IndexError(f"rows {row0}..{row1} of {self.array.path} past its {self.array.shape[0]} rows")
        return np.asarray(self.array[row0:row1])

    def close(self) -> None:
        self._cache.clear()


def chunk_io(location: Location, array: zarr.Array, compressed: bool) -> RawChunkFile | ZarrChunks:
    """Row access to one array, whose metadata the caller has checked against the layout (it names the files written):
    raw files for uncompressed local arrays, whole chunks through zarr otherwise."""
    if location.is_local and not compressed:
        return RawChunkFile(location.root, array.path, array.dtype, tuple(array.shape[1:]), int(array.chunks[0]))
    return ZarrChunks(array.with_config(ZARR_CONFIG), location)
