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

Nothing in an archive is trusted: :class:`PackedArchive` parses the central directory itself (zipfile is not used
to read, so no second parser can disagree with it) and refuses, naming the member, anything that is not a plain
stored file inside the archive: compressed or encrypted members, absolute names or names with ``..``, duplicates,
symbolic links, offsets or sizes past the end, and more members or central-directory bytes than a store has; every
read of it is bounded by what the records it comes from allow. A compressed member is refused rather than read
slowly: extract such an archive (``unzip``) and open the directory. (zarr's ZipStore reads through zipfile, which
trusts the archive, and reads local files only.)
"""

from __future__ import annotations

import asyncio
import io
import os
import re
import stat
import struct
import weakref
import zipfile
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import zarr.storage
from zarr.abc.store import ByteRequest, OffsetByteRequest, RangeByteRequest, Store, SuffixByteRequest
from zarr.core.buffer import Buffer, BufferPrototype

from her_store.errors import CorruptStoreError, NotAStoreError, StoreError, short_repr
from her_store.storage.base import METADATA_LIMIT, Backend, Defaults, ObjectReplaced, WriterLock
from her_store.storage.files import data_between, data_runs, drop_page_cache

__all__ = ["LOCAL_HEADER", "ArchiveBackend", "ArchiveStore", "PackedArchive", "RemoteZip", "is_archive", "open_remote_archive"]

LOCAL_HEADER = struct.Struct("<4s5H3L2H")  # a zip's local file header
MAX_MEMBERS = 1 << 22  # a store of 10^9 frames in shards of 256 rows has about 4 million files


MAX_DIRECTORY_BYTES = 1 << 30  # the central directory is read whole: about 250 bytes per member at most


_EOCD = struct.Struct("<4s4H2LH")  # end of central directory record


_EOCD64 = struct.Struct("<4sQ2H2L4Q")  # zip64 end of central directory record


_LOCATOR = struct.Struct("<4sLQL")  # zip64 end of central directory locator


_CENTRAL = struct.Struct("<4s6H3L5H2L")  # central directory file header


def is_archive(path: str) -> bool:
    """Whether ``path`` is a regular file starting like a zip archive (a local file header or an empty archive).

    Examples
    --------
    >>> is_archive("runs/fetch.zip")  # doctest: +SKIP
    True
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO must not block the open
    except OSError:
        return False
    try:
        return stat.S_ISREG(os.fstat(fd).st_mode) and os.pread(fd, 4, 0) in (b"PK\x03\x04", b"PK\x05\x06")
    finally:
        os.close(fd)


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
            self.members = _read_members(remote.read_many, self.size, path)
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
            self.members = _read_members(self._read_local, self.size, path)
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
        """(the archive, open anew for the caller to close; the offset of ``key``'s bytes in it; their size).

        Raises
        ------
        FileNotFoundError
            The archive holds no member ``key`` (or is no local file).
        """
        got = self.members.get(key)
        if got is None or self.remote is not None:
            raise FileNotFoundError(f"{self.path} has no member {key} on local disk")
        return io.FileIO(os.dup(self.fd), "rb"), got[0], got[1]

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

    def zarr_store(self) -> ArchiveStore:
        """A read-only Zarr store over the members (what zarr reads metadata through)."""
        return ArchiveStore(self)


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
        The backend whose root is the zip object (an HTTP or S3 one: :attr:`~her_store.storage.base.Backend.conditional`).
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


def _corrupt(path: str, what: str) -> CorruptStoreError:
    return CorruptStoreError(
        f"{path}: {what}; expected a packed store as her-store pack writes it (FORMAT.md, Packed stores)"
    )


def _read_members(
    read_many: Callable[[Sequence[tuple[int, int]]], list[bytes]], size: int, path: str
) -> dict[str, tuple[int, int]]:
    """Every member's (data offset, size), each checked (see the module docstring) before any is used. The archive's
    bytes come from ``read_many``: ``n`` bytes at ``at`` for each ``(n, at)`` asked for, within the archive."""

    def read(n: int, at: int) -> bytes:
        return read_many([(n, at)])[0]

    tail_len = min(size, _EOCD.size + 0xFFFF)  # the record, then a comment of at most 65,535 bytes
    tail = read(tail_len, size - tail_len)
    at = tail.rfind(b"PK\x05\x06")
    while at >= 0 and (at + _EOCD.size > len(tail) or at + _EOCD.size + _EOCD.unpack_from(tail, at)[-1] != len(tail)):
        at = tail.rfind(b"PK\x05\x06", 0, at)
    if at < 0:
        raise _corrupt(path, "no end of central directory record (a truncated or damaged zip)")
    eocd_at = size - tail_len + at
    _, disk, cd_disk, _, count, cd_size, cd_offset, _ = _EOCD.unpack_from(tail, at)
    end = eocd_at  # the central directory ends where the records after it start
    if 0xFFFF in (disk, cd_disk, count) or 0xFFFFFFFF in (cd_size, cd_offset):
        if eocd_at < _LOCATOR.size:
            raise _corrupt(path, "a zip64 end record without its locator")
        sig, _, eocd64_at, _ = _LOCATOR.unpack(read(_LOCATOR.size, eocd_at - _LOCATOR.size))
        if sig != b"PK\x06\x07" or eocd64_at > eocd_at - _LOCATOR.size - _EOCD64.size:
            raise _corrupt(path, "a damaged zip64 end of central directory locator")
        sig, _, _, _, disk, cd_disk, _, count, cd_size, cd_offset = _EOCD64.unpack(read(_EOCD64.size, eocd64_at))
        if sig != b"PK\x06\x06":
            raise _corrupt(path, f"no zip64 end of central directory record at byte {eocd64_at:,}")
        end = eocd64_at
    if disk or cd_disk:
        raise _corrupt(path, "a zip split over several disks")
    if count > MAX_MEMBERS or cd_size > MAX_DIRECTORY_BYTES:
        raise _corrupt(
            path,
            f"{count:,} members in {cd_size:,} bytes of central directory, more than a store has "
            f"({MAX_MEMBERS:,} members, {MAX_DIRECTORY_BYTES:,} bytes)",
        )
    if cd_offset + cd_size > end:
        raise _corrupt(
            path, f"its central directory (bytes {cd_offset:,}..{cd_offset + cd_size:,}) runs past byte {end:,}"
        )
    cd = read(cd_size, cd_offset)
    entries: dict[str, tuple[bytes, int, int]] = {}  # name: (raw name, local header offset, size)
    p = 0
    for i in range(count):
        if p + _CENTRAL.size > len(cd) or cd[p : p + 4] != b"PK\x01\x02":
            raise _corrupt(path, f"central directory entry {i} of {count} is missing or damaged")
        (
            _,
            made_by,
            _,
            flags,
            method,
            _,
            _,
            _,
            csize,
            usize,
            name_len,
            extra_len,
            comment_len,
            _,
            _,
            ext_attr,
            header_at,
        ) = _CENTRAL.unpack_from(cd, p)
        raw_name = cd[p + _CENTRAL.size : p + _CENTRAL.size + name_len]
        extra = cd[p + _CENTRAL.size + name_len : p + _CENTRAL.size + name_len + extra_len]
        p += _CENTRAL.size + name_len + extra_len + comment_len
        if p > len(cd):
            raise _corrupt(path, f"central directory entry {i} runs past the directory")
        usize, csize, header_at = _zip64_values(extra, usize, csize, header_at, path, raw_name)
        name = _member_name(raw_name, path)
        kind = stat.S_IFMT(ext_attr >> 16) if made_by >> 8 == 3 else 0  # Unix file type, when a Unix zip says so
        if name.endswith("/"):  # a directory entry (zip -r adds them): holds nothing
            if usize or kind not in (0, stat.S_IFDIR):
                raise _corrupt(path, f"directory entry {name!r} holds {usize} bytes or is not a directory")
            continue
        if kind == stat.S_IFLNK:
            raise _corrupt(path, f"member {name!r} is a symbolic link; a store's files are regular files")
        if kind not in (0, stat.S_IFREG):
            raise _corrupt(path, f"member {name!r} is not a regular file (Unix mode {ext_attr >> 16:o})")
        if flags & 1:
            raise _corrupt(path, f"member {name!r} is encrypted")
        if method != zipfile.ZIP_STORED or csize != usize:
            raise _corrupt(
                path,
                f"member {name!r} is compressed (method {method}, {csize:,} bytes for {usize:,}); a packed store's "
                "members are stored uncompressed, so that they are read in place (extract this archive with unzip and "
                "open the directory instead)",
            )
        if name in entries:
            raise _corrupt(path, f"member {name!r} appears twice")
        entries[name] = (raw_name, header_at, usize)
    # every local header, read at once (concurrently remotely), each no further than the members' end
    asked = {name: e for name, e in entries.items() if e[1] < cd_offset}
    got = read_many([(min(LOCAL_HEADER.size + len(raw), cd_offset - at), at) for raw, at, _ in asked.values()])
    headers = dict(zip(asked, got))
    return {
        name: (_data_offset(headers.get(name, b""), at, raw, usize, cd_offset, path, name), usize)
        for name, (raw, at, usize) in entries.items()
    }


def _zip64_values(
    extra: bytes, usize: int, csize: int, header_at: int, path: str, raw_name: bytes
) -> tuple[int, int, int]:
    """The sizes and header offset of a central directory entry, from its zip64 extra field where they are 0xFFFFFFFF."""
    want = [v == 0xFFFFFFFF for v in (usize, csize, header_at)]
    if not any(want):
        return usize, csize, header_at
    q = 0
    while q + 4 <= len(extra):
        tag, n = struct.unpack_from("<2H", extra, q)
        if tag == 1:
            if n < 8 * sum(want) or q + 4 + n > len(extra):
                break
            values = iter(struct.unpack_from(f"<{sum(want)}Q", extra, q + 4))
            return tuple(next(values) if w else v for w, v in zip(want, (usize, csize, header_at)))  # type: ignore[return-value]
        q += 4 + n
    raise _corrupt(path, f"member {short_repr(raw_name)} lacks the zip64 sizes its entry says it has")


def _member_name(raw: bytes, path: str) -> str:
    """A member's name, which must be a relative key inside the store: no absolute path, ``..``, backslash or NUL."""
    try:
        name = raw.decode("utf-8")  # flagged UTF-8 (bit 11), or ASCII, which any store key written by pack is
    except UnicodeDecodeError:
        raise _corrupt(path, f"member name {short_repr(raw)} is not UTF-8 text") from None
    parts = name.rstrip("/").split("/")
    if not name or name.startswith("/") or "\\" in name or "\0" in name or any(s in ("", ".", "..") for s in parts):
        raise _corrupt(
            path,
            f"member name {short_repr(name)} is not a relative path inside the store (no leading /, "
            "no empty, '.' or '..' parts, no backslash or NUL)",
        )
    return name


def _data_offset(header: bytes, header_at: int, raw_name: bytes, size: int, limit: int, path: str, name: str) -> int:
    """Where a member's bytes start, from its local ``header`` (read at ``header_at``; empty when that lies past the
    members' end), which must name it; its bytes must end by ``limit``."""
    if len(header) < LOCAL_HEADER.size or header[:4] != b"PK\x03\x04":
        raise _corrupt(
            path,
            f"member {name!r}: no local header at byte {header_at:,} (the archive holds {limit:,} bytes of members)",
        )
    _, _, _, method, _, _, _, _, _, name_len, extra_len = LOCAL_HEADER.unpack_from(header)
    if method != zipfile.ZIP_STORED or header[LOCAL_HEADER.size :] != raw_name or name_len != len(raw_name):
        raise _corrupt(path, f"member {name!r}: its local header disagrees with the central directory")
    start = header_at + LOCAL_HEADER.size + name_len + extra_len
    if start + size > limit:
        raise _corrupt(
            path, f"member {name!r}: bytes {start:,}..{start + size:,} run past the members' end, byte {limit:,}"
        )
    return start


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

    def __init__(self, archive: PackedArchive, defaults: Defaults, storage_options: Mapping[str, Any] | None = None) -> None:
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
        return sorted({k[len(below) :].split("/", 1)[0] for k in self.archive.members if k.startswith(below) and "/" in k[len(below) :]})

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
