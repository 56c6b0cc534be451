"""Packed stores read in place: a whole store as one uncompressed zip file, on local disk or as one object over HTTP(S)
or S3 (written by ``her-store pack``, :mod:`her_store.ops.pack`).

A packed store is a zip archive (FORMAT.md, Packed stores) whose members are the store's files, stored uncompressed
(ZIP_STORED), each member's bytes contiguous in the archive; a data array's chunks and shards start on a 4,096-byte
boundary. So a chunk of an uncompressed array is memory-mapped at its offset in the archive, and a shard's rows are
read by byte range (``pread`` at the member's offset plus the row's), exactly as from a directory:
:class:`PackedArchive` answers "which bytes of the archive are key K" and the readers use its (file, offset, size)
where they would open a file of their own. Over HTTP(S) and S3 a zip object is read in place the same way
(:func:`open_remote_archive`): each member's bytes are a range of the object, read by a ranged GET conditioned on the
ETag the object had when it was opened.

Nothing in an archive is trusted: :class:`PackedArchive` takes its members from
:func:`~her_store.storage.zip_directory.read_members`, which checks every record, and every read of a member is
bounded by the (offset, size) it was given.
"""

from __future__ import annotations

import asyncio
import io
import os
import re
import stat
import weakref
from collections.abc import Sequence

from her_store.errors import CorruptStoreError, NotAStoreError, StoreError, short_repr
from her_store.storage.base import METADATA_LIMIT, Backend, ObjectReplaced
from her_store.storage.files import SharedFile
from her_store.storage.zip_directory import read_members

__all__ = ["PackedArchive", "RemoteZip", "open_remote_archive"]


class PackedArchive:
    """The members of a packed store, checked: each key's (offset, size) of stored bytes inside the archive.

    Parameters
    ----------
    path : str
        The archive: a regular file, or with ``remote`` the URL of a zip object.
    remote : RemoteZip, optional
        The zip object's bytes over HTTP(S) or S3 (:func:`open_remote_archive`); None for a local file.

    Raises
    ------
    CorruptStoreError
        Not a whole zip archive, or a member that is not a plain stored file inside it (the message names it).

    Examples
    --------
    >>> archive = PackedArchive("runs/fetch.zip")  # doctest: +SKIP
    >>> archive.read("commit.json")  # doctest: +SKIP
    b'{"array_rows": ...'
    """

    def __init__(self, path: str, remote: RemoteZip | None = None) -> None:
        self.path = path
        self.remote = remote
        self.fd = -1  # a local archive's descriptor
        if remote is not None:
            self.size = remote.size
            # a member's tag, what its readers condition their GETs on: it changes only with the whole archive
            self.tag = remote.etag or '"packed"'
            self._close = weakref.finalize(self, lambda: None)  # nothing of its own to close
            self.members = read_members(remote.read_many, self.size, path)
            return
        self.fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        # closed by close(), or when the archive is garbage: readers of members hold descriptors of their own
        self._close = weakref.finalize(self, os.close, self.fd)
        self.tag = '"packed"'
        try:
            st = os.fstat(self.fd)
            if not stat.S_ISREG(st.st_mode):
                raise CorruptStoreError(f"{path} is not a regular file; a packed store is a zip file")
            self.size = st.st_size
            self.members = read_members(self._read_local, self.size, path)
        except BaseException:
            self._close()
            raise

    def __repr__(self) -> str:
        return f"PackedArchive({self.path!r}, {len(self.members)} members)"

    def member(self, key: str) -> tuple[int, int] | None:
        """(offset of its bytes in the archive, size) of ``key``, or None when the archive holds no such member."""
        return self.members.get(key)

    def read(self, key: str, limit: int = METADATA_LIMIT) -> bytes | None:
        """The bytes of ``key`` (None when absent); CorruptStoreError when it holds more than ``limit`` bytes."""
        got = self.members.get(key)
        if got is None:
            return None
        self.check(key, limit)
        return self._pread(got[1], got[0])

    def check(self, key: str, limit: int = METADATA_LIMIT) -> None:
        """CorruptStoreError when ``key`` holds more than ``limit`` bytes (before a library reads it whole)."""
        size = self.members.get(key, (0, 0))[1]
        if size > limit:
            raise CorruptStoreError(f"{self.path}: member {key} holds {size:,} bytes, more than the {limit:,} it may")

    def pread(self, key: str, n: int, at: int) -> bytes:
        """Up to ``n`` bytes of ``key`` from its byte ``at`` (fewer at its end, none when it is absent)."""
        offset, size = self.members.get(key, (0, 0))
        n = max(0, min(n, size - at))
        return self._pread(n, offset + at) if n else b""

    def read_ranges(self, keys: Sequence[str], starts: Sequence[int], ends: Sequence[int]) -> list[bytes | None]:
        """Bytes ``starts[i] .. ends[i]`` of each member ``keys[i]`` (None where it is absent, fewer at its end): one
        ``pread`` each locally, concurrent ranged GETs of the zip object remotely."""
        out: list[bytes | None] = [None] * len(keys)
        where, ranges = [], []
        for i, (key, a, b) in enumerate(zip(keys, starts, ends)):
            got = self.members.get(key)
            if got is not None:
                b = max(0, min(b, got[1]))
                where.append(i)
                ranges.append((max(0, b - min(a, b)), got[0] + min(a, b)))
        read = self.remote.read_many(ranges) if self.remote is not None else [self._pread(n, at) for n, at in ranges]
        for i, raw in zip(where, read):
            out[i] = raw
        return out

    async def get_object(
        self, key: str, rng: str | None, if_match: str | None, limit: int
    ) -> tuple[bytes | None, str, int]:
        """A member as an object of its own, for the readers of objects on S3 and HTTP: (the bytes of HTTP range
        ``rng`` of it, or all of it; None when it is absent), its tag (:attr:`tag`, the same for every member) and its
        size. A range starting past its end gives no bytes, as a server's 416 does.

        Raises
        ------
        ObjectReplaced
            ``if_match`` is not the member's tag (a shard's index is never applied to another archive's bytes).
        CorruptStoreError
            More than ``limit`` bytes asked for.
        """
        got = self.members.get(key)
        if got is None:
            return None, "", 0
        if if_match is not None and if_match != self.tag:
            raise ObjectReplaced(f"{self.path}/{key}")
        offset, size = got
        a, b = _span(rng, size)
        if b - a > limit:
            raise CorruptStoreError(f"{self.path}/{key} holds {b - a:,} bytes, more than the {limit:,} it may")
        if b <= a:
            return b"", self.tag, size
        body = await self.remote.read(offset + a, b - a) if self.remote is not None else self._pread(b - a, offset + a)
        return body, self.tag, size

    def open_range(self, key: str) -> tuple[io.FileIO, int, int]:
        """(the archive, open anew: closed by the caller or when its last holder lets go of it; the offset of
        ``key``'s bytes in it; their size).

        Raises
        ------
        FileNotFoundError
            The archive holds no member ``key`` (or is no local file).
        """
        got = self.members.get(key)
        if got is None or self.remote is not None:
            raise FileNotFoundError(f"{self.path} has no member {key} on local disk")
        return SharedFile(os.dup(self.fd), "rb"), got[0], got[1]

    def _read_local(self, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        return [os.pread(self.fd, n, at) for n, at in ranges]

    def _pread(self, n: int, at: int) -> bytes:
        if self.remote is not None:
            return self.remote.read_many([(n, at)])[0]
        raw = os.pread(self.fd, n, at)
        if len(raw) != n:  # the members were checked to lie in the file: it shrank since
            raise CorruptStoreError(f"{self.path}: read {len(raw)} of {n} bytes at {at:,}; the archive was truncated")
        return raw

    def close(self) -> None:
        """Close the archive; readers that opened members (:meth:`open_range`) keep their own descriptors."""
        self._close()


def _span(rng: str | None, size: int) -> tuple[int, int]:
    """Bytes ``a .. b`` of an object of ``size`` bytes that the HTTP range ``rng`` (``bytes=a-b``, ``bytes=a-``,
    ``bytes=-n``; None for all of it) names, cut at its end.

    Examples
    --------
    >>> _span("bytes=10-19", 100), _span("bytes=-8", 100), _span("bytes=90-", 100), _span(None, 100)
    ((10, 20), (92, 100), (90, 100), (0, 100))
    """
    if rng is None:
        return 0, size
    m = re.fullmatch(r"bytes=(\d*)-(\d*)", rng)
    if m is None or not (m[1] or m[2]):
        raise ValueError(f"unexpected byte range {rng!r}")
    if not m[1]:
        return max(0, size - int(m[2])), size
    a = min(int(m[1]), size)
    return a, max(a, min(size, int(m[2]) + 1 if m[2] else size))


class RemoteZip:
    """The bytes of a zip object on an HTTP(S) server or S3, read by ranged GETs, each conditioned (If-Match) on the
    ETag the object had when it was opened: an archive replaced under its readers is a CorruptStoreError, never its
    new bytes read at the old members' offsets.

    Parameters
    ----------
    backend : Backend
        The backend whose root is the zip object (an HTTP or S3 one:
        :attr:`~her_store.storage.base.Backend.conditional`).
    size : int
        The object's size.
    etag : str
        Its ETag ("" where the server sends none: reads are then not conditioned).
    """

    BATCH = 64  # ranged GETs in flight at once

    def __init__(self, backend: Backend, size: int, etag: str) -> None:
        self.backend, self.url, self.size = backend, backend.url, size
        self.etag = etag if etag and not etag.startswith("W/") else ""  # a weak ETag never matches an If-Match

    async def read(self, at: int, n: int) -> bytes:
        """Bytes ``at .. at + n`` of the object (within it), by one ranged GET."""
        if n <= 0:
            return b""
        try:
            body, _, _ = await self.backend.get_object("", f"bytes={at}-{at + n - 1}", self.etag or None, n)
        except ObjectReplaced:
            raise CorruptStoreError(
                f"{self.url} was replaced since it was opened (its ETag changed); open it again"
            ) from None
        if body is None:
            raise CorruptStoreError(f"{self.url} is gone since it was opened")
        if len(body) != n:
            raise CorruptStoreError(
                f"{self.url}: bytes {at:,}..{at + n:,} read as {len(body):,} bytes; the archive holds {self.size:,}"
            )
        return body

    def read_many(self, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """``n`` bytes at ``at`` for each ``(n, at)`` of ``ranges``, read concurrently (``BATCH`` at a time)."""

        async def read_all() -> list[bytes]:
            out: list[bytes] = []
            for i in range(0, len(ranges), self.BATCH):
                out += await asyncio.gather(*(self.read(at, n) for n, at in ranges[i : i + self.BATCH]))
            return out

        return self.backend.run(read_all) if ranges else []


def open_remote_archive(backend: Backend) -> PackedArchive | None:
    """The packed store that is the zip object at the root of ``backend`` (HTTP(S) or S3), read in place; None where no
    object is there (a store directory whose name ends in ``.zip``, or nothing), or where the backend cannot condition
    its reads on an ETag.

    Its first bytes are read by a ranged GET (the signature, the object's size and ETag), then its end records and
    central directory, then each member's local header (concurrent ranged GETs), each checked as a local archive's
    are (:class:`PackedArchive`) and each read bounded by what the records it comes from allow.

    Raises
    ------
    NotAStoreError
        The object is no zip archive.
    StoreError
        The server answers a Range request with the whole file: a packed store is read only by ranges.
    CorruptStoreError
        As :class:`PackedArchive`.

    Examples
    --------
    >>> open_backend("https://example.org/point.zip")  # doctest: +SKIP
    ArchiveBackend('https://example.org/point.zip')
    """
    if not backend.conditional:
        return None
    head, etag, size, ranged = backend.read_head("", 4)
    if head is None:
        return None
    if head[:4] not in (b"PK\x03\x04", b"PK\x05\x06"):
        raise NotAStoreError(
            f"{backend.url} is not a zip archive (it starts {short_repr(head[:4])}); a packed store is a zip file "
            "her-store pack writes"
        )
    if not ranged:
        raise StoreError(
            f"{backend.url}: the server answers a Range request with the whole file (HTTP 200), and a packed store is "
            "read in place by byte ranges; serve it from a server that honours Range, or download it and open the file"
        )
    return PackedArchive(backend.url, RemoteZip(backend, size, etag))
