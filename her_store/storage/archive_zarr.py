"""A packed store as a read-only Zarr store (:class:`ArchiveStore`): what zarr reads a packed store's metadata through,
each key a member of its :class:`~her_store.storage.archive.PackedArchive`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from typing import Any

from zarr.abc.store import ByteRequest, OffsetByteRequest, RangeByteRequest, Store, SuffixByteRequest
from zarr.core.buffer import Buffer, BufferPrototype

from her_store.storage.archive import PackedArchive

__all__ = ["ArchiveStore"]


class ArchiveStore(Store):
    """A read-only Zarr store over a :class:`PackedArchive`: what zarr reads a packed store's metadata through.

    Examples
    --------
    >>> zarr.open_group(ArchiveStore(PackedArchive("runs/fetch.zip")), mode="r")  # doctest: +SKIP
    """

    supports_writes = False
    supports_deletes = False
    supports_partial_writes = False
    supports_listing = True

    def __init__(self, archive: PackedArchive) -> None:
        super().__init__(read_only=True)
        self.archive = archive

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ArchiveStore) and other.archive is self.archive

    def __str__(self) -> str:
        return self.archive.path

    async def get(self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None) -> Buffer | None:
        got = self.archive.member(key)
        if got is None:
            return None
        size = got[1]
        if byte_range is None:
            a, b = 0, size
        elif isinstance(byte_range, RangeByteRequest):
            a, b = byte_range.start, byte_range.end
        elif isinstance(byte_range, OffsetByteRequest):
            a, b = byte_range.offset, size
        elif isinstance(byte_range, SuffixByteRequest):
            a, b = max(0, size - byte_range.suffix), size
        else:
            raise TypeError(f"unexpected byte range {byte_range!r}")
        return prototype.buffer.from_bytes(self.archive.pread(key, max(0, b - a), a))

    async def get_partial_values(
        self, prototype: BufferPrototype, key_ranges: Iterable[tuple[str, ByteRequest | None]]
    ) -> list[Buffer | None]:
        return [await self.get(key, prototype, byte_range) for key, byte_range in key_ranges]

    async def exists(self, key: str) -> bool:
        return key in self.archive.members

    async def set(self, key: str, value: Buffer) -> None:
        self._check_writable()

    async def set_partial_values(self, key_start_values: Iterable[tuple[str, int, Any]]) -> None:
        self._check_writable()

    async def delete(self, key: str) -> None:
        self._check_writable()

    async def list(self) -> AsyncIterator[str]:
        for key in list(self.archive.members):
            yield key

    async def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        for key in list(self.archive.members):
            if key.startswith(prefix):
                yield key

    async def list_dir(self, prefix: str) -> AsyncIterator[str]:
        prefix = prefix.rstrip("/") + "/" if prefix.rstrip("/") else ""
        seen = set()
        for key in list(self.archive.members):
            if key.startswith(prefix):
                child = key[len(prefix) :].split("/")[0]
                if child not in seen:
                    seen.add(child)
                    yield child
