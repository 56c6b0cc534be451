"""A store in a directory on local disk: files read and written beneath it without following a link, the flock lock.

Writes are atomic by temp file and ``os.replace`` (fsync'ed with their directory for ``durability="fsync"``);
uncompressed chunk files are mapped by readers and written in place by the writer (:attr:`LocalBackend.mappable`).
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import fsspec
import zarr.storage

from her_store.errors import CorruptStoreError
from her_store.storage.base import METADATA_LIMIT, Backend, Defaults, WriterLock
from her_store.storage.files import (
    SharedFile,
    create_new,
    dir_beneath,
    drop_page_cache,
    fsync_file,
    open_beneath,
    open_bounded,
    pread_into,
    remove_beneath,
    remove_temps,
    write_all,
    write_sparse,
)
from her_store.storage.lock import FlockLock

__all__ = ["LocalBackend"]


class LocalBackend(Backend):
    """A store's directory on local disk.

    Examples
    --------
    >>> import tempfile
    >>> backend = LocalBackend(tempfile.mkdtemp() + "/run")
    >>> backend.make_root(); backend.write_atomic("zarr.json", b"{}", fsync=False)
    >>> backend.read_bytes("zarr.json"), backend.read_bytes("commit.json")
    (b'{}', None)
    """

    mappable = True
    defaults = Defaults(chunk_rows=1 << 20, index_chunk_rows=1 << 16, commit_interval=0.1, refresh_interval=0.1)

    def __init__(self, path: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> None:
        self.root = os.path.abspath(os.fspath(path))
        self.url = self.root
        self.storage_options = dict(storage_options or {})

    def key_path(self, key: str) -> str:
        return os.path.join(self.root, key) if key else self.root

    # -- reading ------------------------------------------------------------------------------------------------------
    def read_bytes(self, key: str, limit: int = METADATA_LIMIT) -> bytes | None:
        try:
            fd, size = open_bounded(self.root, key, limit)
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            return os.pread(fd, size, 0)
        finally:
            os.close(fd)

    def _read_ranges(self, keys: Sequence[str], starts: Sequence[int], ends: Sequence[int]) -> list[Any]:
        got: list[Any] = []
        for key, a, b in zip(keys, starts, ends):
            try:
                fd = open_beneath(self.root, key)
            except FileNotFoundError:
                got.append(None)
                continue
            try:
                got.append(os.pread(fd, b - a, a))
            finally:
                os.close(fd)
        return got

    def check_file(self, key: str, limit: int = METADATA_LIMIT) -> None:
        try:
            os.close(open_bounded(self.root, key, limit)[0])
        except (FileNotFoundError, NotADirectoryError):  # missing (under a file too): what zarr then says is reported
            return

    def exists(self, key: str) -> bool:
        return os.path.exists(self.key_path(key))

    def stamp(self, key: str) -> tuple[int, int]:
        """(inode, mtime) of ``key``.

        Raises
        ------
        CorruptStoreError
            ``key`` is gone (the store was removed).
        """
        try:
            st = os.stat(self.key_path(key))
        except OSError as e:
            raise CorruptStoreError(f"{self.key_path(key)} is gone ({e.strerror}); the store was removed") from e
        return (st.st_ino, st.st_mtime_ns)

    def local_directory(self) -> str:
        return self.root

    def place_problem(self) -> str | None:
        if os.path.lexists(self.root) and not os.path.isdir(self.root):
            return f"{self.root} is a file, not a store directory"
        return None

    def place_exists(self) -> bool:
        return os.path.lexists(self.root)

    def open_range(self, key: str) -> tuple[io.FileIO, int, int]:
        """Raises CorruptStoreError where something other than a regular file, or a link on the way, is at ``key``
        (:func:`~her_store.storage.files.open_beneath`)."""
        f = SharedFile(open_beneath(self.root, key), "rb")
        return f, 0, os.fstat(f.fileno()).st_size

    def pread_into(self, key: str, buf: Any, offset: int) -> int:
        return pread_into(self.root, key, buf, offset)

    def open_file(self, key: str) -> int:
        """A descriptor of ``key`` open for writing in place, made (with its directories) if missing: a regular file
        of the store's own, reached through no link and with no other name (a hard link would see the writes)."""
        return open_beneath(self.root, key, create=True)

    def size(self, key: str) -> int:
        return os.stat(self.key_path(key)).st_size

    def link_count(self, key: str) -> int:
        try:
            return os.lstat(self.key_path(key)).st_nlink
        except OSError:
            return 1

    def fingerprints(self, keys: Sequence[str]) -> dict[str, tuple[str, int]]:
        """Size and mtime (a link is found as itself, and refused when it is read)."""
        out = {}
        for key in keys:
            with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                st = os.lstat(self.key_path(key))
                out[key] = (f"{st.st_size}:{st.st_mtime_ns}", st.st_size)
        return out

    def list_files(self, prefix: str = "") -> dict[str, int]:
        return {key: st.st_size for key, st in self._walk(prefix)}

    def disk_usage(self, prefix: str = "") -> dict[str, tuple[int, int]]:
        return {key: (st.st_size, st.st_blocks * 512) for key, st in self._walk(prefix)}

    def _walk(self, prefix: str) -> list[tuple[str, os.stat_result]]:
        """(key, lstat) of every file under ``prefix``, links included as themselves (never followed)."""
        out = []
        for d, dirs, files in os.walk(self.key_path(prefix)):
            dirs.sort()
            for name in sorted(files) + [n for n in dirs if os.path.islink(os.path.join(d, n))]:
                path = os.path.join(d, name)
                with contextlib.suppress(FileNotFoundError):  # a temp file renamed into place since it was listed
                    out.append((os.path.relpath(path, self.root).replace(os.sep, "/"), os.lstat(path)))
        return out

    def list_dir(self, prefix: str) -> list[str]:
        try:
            return sorted(os.listdir(self.key_path(prefix)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def list_dirs(self, prefix: str) -> list[str]:
        """Raises CorruptStoreError where ``prefix`` itself is a symbolic link (:meth:`check_directory`)."""
        self.check_directory(prefix)
        path = self.key_path(prefix)
        try:
            with os.scandir(path) as entries:
                return sorted(e.name for e in entries if e.is_dir(follow_symlinks=False))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def check_directory(self, key: str) -> None:
        path = self.key_path(key)
        if os.path.islink(path):
            raise CorruptStoreError(f"{path} is a symbolic link; expected the dataset's own directory (FORMAT.md)")

    def zarr_store(self, read_only: bool) -> zarr.storage.StoreLike:
        return zarr.storage.LocalStore(self.root, read_only=read_only)

    @property
    def filesystem(self) -> Any:
        """fsspec's local filesystem (for what reads through fsspec)."""
        return fsspec.filesystem("file")

    # -- writing ------------------------------------------------------------------------------------------------------
    def write_atomic(self, key: str, data: bytes, fsync: bool, if_match: str | None = None) -> str | None:
        """Temp file + ``os.replace`` (atomic on POSIX), with fsync of file and directory for power loss. A temp file
        that could not be written whole (a full disk) is removed and never renamed into place. The key's directories
        are made if missing; one that is a link or a file raises CorruptStoreError (no write leaves the store).
        ``if_match`` has no meaning here (the flock makes the writer the only one)."""
        path = self.key_path(key)
        tmp, fd = self.create_temp(key)
        try:
            try:
                write_all(fd, data)
                if fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        if fsync:
            try:
                fsync_file(os.path.dirname(path))
            except OSError as e:  # the new bytes are in place and visible: raising would report a write that happened
                warnings.warn(
                    f"{path} was replaced but its directory could not be fsync'ed ({e}); it may not survive a "
                    "power loss",
                    RuntimeWarning,
                    stacklevel=2,
                )
        return None

    def create_temp(self, key: str) -> tuple[str, int]:
        """(path, descriptor open for writing) of a new temp file ``<key>.<pid>.tmp`` that the caller renames onto
        ``key`` once written: the key's directories are made if missing, none of them a link (no write leaves the
        store), and the file is made anew, never through a link nor into one a killed process of the same pid left.

        Raises
        ------
        CorruptStoreError
            One of the key's directories is a link or a file.
        """
        self.make_parents(key)
        tmp = f"{self.key_path(key)}.{os.getpid()}.tmp"
        return tmp, create_new(tmp)

    def make_parents(self, key: str, create: bool = True) -> None:
        """Make the directories of ``key`` that are missing, none of them through a link; with ``create`` false, only
        check the ones that exist.

        Raises
        ------
        CorruptStoreError
            One of them is a link, or a file.
        """
        try:
            os.close(dir_beneath(self.root, key.split("/")[:-1], create))
        except FileNotFoundError:
            if create:
                raise

    def create_once(self, key: str, data: bytes) -> bool:
        """A temp file, fsync'ed, then hard-linked to ``key``: ``link`` fails when ``key`` exists, and a reader sees no
        file or the whole one."""
        self.make_root()
        fd, tmp = tempfile.mkstemp(prefix=f".{key}.", suffix=".tmp", dir=self.root)
        try:
            try:
                write_all(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.link(tmp, self.key_path(key))
            except FileExistsError:
                return False
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        fsync_file(self.root)
        return True

    def put_many(self, items: Mapping[str, bytes]) -> None:
        """Each item replaced whole (temp file and rename), in key order, every page of zeros left a hole (as in a
        writer's chunk files); a directory in a key's place is removed first."""
        if items:
            self.make_root()
        for key in sorted(items):
            data = items[key]
            tmp, fd = self.create_temp(key)
            try:
                try:
                    write_sparse(fd, data, 0)
                    os.ftruncate(fd, len(data))
                finally:
                    os.close(fd)
                path = self.key_path(key)
                if os.path.isdir(path) and not os.path.islink(path):
                    remove_beneath(self.root, key)
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise

    def make_root(self) -> None:
        os.makedirs(self.root, exist_ok=True)

    def existing(self, keys: Sequence[str]) -> list[str]:
        """Raises CorruptStoreError where a link or a file is in place of a key's directory (nothing is made or
        removed through one)."""
        for key in keys:
            self.make_parents(key, create=False)
        return [k for k in keys if os.path.lexists(self.key_path(k))]

    def clear(self, keep: str) -> None:
        for name in sorted(os.listdir(self.root), key=lambda n: n == "zarr.json"):
            if name != keep:
                self.remove(name)  # (a zarr temp file may be gone already: its own cleanup removed it first)

    def remove_temp_files(self, keys: Sequence[str] | None = None) -> int:
        """The temp files ``<key>.<pid>.tmp`` of :meth:`write_atomic`; call it holding the writer lock."""
        if keys is None:
            return sum(remove_temps(d, files) for d, _, files in os.walk(self.root))
        removed = 0
        for key in keys:
            *parts, stem = key.split("/")
            try:
                fd = dir_beneath(self.root, parts, create=False)
            except FileNotFoundError:
                continue
            try:
                removed += remove_temps(fd, [n for n in os.listdir(fd) if n.startswith(f"{stem}.")])
            finally:
                os.close(fd)
        return removed

    def remove(self, key: str) -> None:
        """A file, or a directory or link in a file's place, never what a link names
        (:func:`~her_store.storage.files.remove_beneath`)."""
        remove_beneath(self.root, key)

    def drop_page_cache(self, prefix: str) -> None:
        for d, _, files in os.walk(self.key_path(prefix)):  # its files, whatever their keys
            for f in files:
                drop_page_cache(os.path.join(d, f))

    def fsync(self, keys: Sequence[str]) -> None:
        for key in keys:
            fsync_file(self.key_path(key))
        for d in sorted({os.path.dirname(self.key_path(k)) for k in keys}):  # their entries
            fsync_file(d)

    def writer_lock(self, key: str, lease_ttl: float) -> WriterLock:
        return FlockLock(self, key, lease_ttl)

    def active_writer(self, key: str) -> str | None:
        return FlockLock.holder(self, key)

    def child(self, key: str) -> LocalBackend:
        return LocalBackend(os.path.join(self.root, key), self.storage_options)
