"""The backend of a packed store (:class:`ArchiveBackend`): a zip file on local disk, or a zip object over HTTP(S) or
S3, read in place through its :class:`~her_store.storage.archive.PackedArchive` and never written.
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any

import numpy as np
import zarr.storage

from her_store.errors import NotAStoreError
from her_store.storage.archive import PackedArchive
from her_store.storage.archive_zarr import ArchiveStore
from her_store.storage.base import METADATA_LIMIT, Backend, Defaults, WriterLock
from her_store.storage.files import data_between, data_runs, drop_page_cache

__all__ = ["ArchiveBackend"]


class ArchiveBackend(Backend):
    """A packed store read in place: a zip file on local disk (:attr:`mappable`: members are mapped at their offset
    in it) or a zip object over HTTP(S) or S3 (members read by ranged GETs conditioned on its ETag). Read-only.

    Parameters
    ----------
    archive : PackedArchive
        The archive, its members checked.
    defaults : Defaults
        Those of the place the archive lies in (local disk, or the network).

    Examples
    --------
    >>> open_backend("runs/point.zip").read_bytes("commit.json")  # doctest: +SKIP
    b'{"array_rows": ...'
    """

    def __init__(
        self, archive: PackedArchive, defaults: Defaults, storage_options: Mapping[str, Any] | None = None
    ) -> None:
        self.archive = archive
        self.url = self.root = archive.path
        self.storage_options = dict(storage_options or {})
        self.defaults = defaults
        self.mappable = archive.remote is None
        self.conditional = archive.remote is not None
        self.read_only = (
            f"{self.url} is a packed store (one zip file), which is read in place and never written: extract it "
            "(any unzip tool gives the store directory) to append to it"
        )

    def read_bytes(self, key: str, limit: int = METADATA_LIMIT) -> bytes | None:
        return self.archive.read(key, limit)

    def _read_ranges(self, keys: Sequence[str], starts: Sequence[int], ends: Sequence[int]) -> list[Any]:
        return self.archive.read_ranges(keys, starts, ends)

    async def get_object(
        self, key: str, rng: str | None, if_match: str | None, limit: int
    ) -> tuple[bytes | None, str, int]:
        return await self.archive.get_object(key, rng, if_match, limit)

    def run(self, coroutine: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> Any:
        if self.archive.remote is None:
            return asyncio.run(coroutine(*args))
        return self.archive.remote.backend.run(coroutine, *args)

    def check_file(self, key: str, limit: int = METADATA_LIMIT) -> None:
        self.archive.check(key, limit)

    def exists(self, key: str) -> bool:
        return self.archive.member(key) is not None

    def stamp(self, key: str) -> None:
        return None  # an archive never changes under its readers (a remote one replaced fails their reads)

    def place_exists(self) -> bool:
        return True

    def open_range(self, key: str) -> tuple[io.FileIO, int, int]:
        return self.archive.open_range(key)

    def pread_into(self, key: str, buf: Any, offset: int) -> int:
        raw = self.archive.pread(key, len(memoryview(buf).cast("B")), offset)
        memoryview(buf).cast("B")[: len(raw)] = raw
        return len(raw)

    def size(self, key: str) -> int:
        got = self.archive.member(key)
        if got is None:
            raise FileNotFoundError(f"{self.url}: no member {key}")
        return got[1]

    def fingerprints(self, keys: Sequence[str]) -> dict[str, tuple[str, int]]:
        """A member's place in the archive, and the archive's tag: an archive never changes under its readers."""
        return {k: (f"{self.archive.tag}:{o}", n) for k in keys if (m := self.archive.member(k)) for o, n in [m]}

    def list_files(self, prefix: str = "") -> dict[str, int]:
        below = prefix.rstrip("/") + "/" if prefix else ""
        return {k: size for k, (_, size) in self.archive.members.items() if k.startswith(below)}

    def disk_usage(self, prefix: str = "") -> dict[str, tuple[int, int]]:
        """A local archive's members' bytes that are not holes of the zip file (pages of zeros it left unwritten)."""
        sizes = self.list_files(prefix)
        if self.archive.remote is not None:
            return {k: (n, n) for k, n in sizes.items()}
        keys = list(sizes)
        spans = np.array([self.archive.members[k] for k in keys], np.int64).reshape(-1, 2)
        held = data_between(data_runs(self.archive.fd, self.archive.size), spans[:, 0], spans[:, 0] + spans[:, 1])
        return {key: (sizes[key], int(h)) for key, h in zip(keys, held.tolist())}

    def list_dir(self, prefix: str) -> list[str]:
        below = prefix.rstrip("/") + "/" if prefix.rstrip("/") else ""
        return sorted({k[len(below) :].split("/", 1)[0] for k in self.archive.members if k.startswith(below)})

    def drop_page_cache(self, prefix: str) -> None:
        if self.archive.remote is None:  # the whole archive: its members are its pages
            drop_page_cache(self.archive.path)

    def list_dirs(self, prefix: str) -> list[str]:
        below = prefix.rstrip("/") + "/" if prefix.rstrip("/") else ""
        children = (k[len(below) :] for k in self.archive.members if k.startswith(below))
        return sorted({c.split("/", 1)[0] for c in children if "/" in c})

    def zarr_store(self, read_only: bool) -> zarr.storage.StoreLike:
        return ArchiveStore(self.archive)

    def write_atomic(self, key: str, data: bytes, fsync: bool, if_match: str | None = None) -> str | None:
        self._writable()
        return None

    def create_once(self, key: str, data: bytes) -> bool:
        self._writable()
        return False

    def put_many(self, items: Mapping[str, bytes]) -> None:
        self._writable()

    def make_root(self) -> None:
        self._writable()

    def clear(self, keep: str) -> None:
        self._writable()

    def remove(self, key: str) -> None:
        self._writable()

    def writer_lock(self, key: str, lease_ttl: float) -> WriterLock:
        self._writable()
        raise AssertionError("unreachable: a packed store is read-only")

    def active_writer(self, key: str) -> str | None:
        return None

    def child(self, key: str) -> Backend:
        raise NotAStoreError(f"{self.url} is a packed store (one zip file), not a sharded dataset's root")

    def close(self) -> None:
        self.archive.close()
