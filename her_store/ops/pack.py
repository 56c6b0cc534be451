"""Packed stores: a whole store as one uncompressed zip file, written by ``her-store pack`` and read in place.

A packed store is a zip archive (FORMAT.md, Packed stores) whose members are the store's files, stored uncompressed
(ZIP_STORED), each member's bytes contiguous in the archive; a data array's chunks and shards start on a 4,096-byte
boundary (padding in the local header's extra field, as Android's zipalign does). So a chunk of an uncompressed array is
memory-mapped at its offset in the archive, and a shard's rows are read by byte range (``pread`` at the member's offset
plus the row's), exactly as from a directory: :class:`PackedArchive` answers "which bytes of the archive are key K" and
the readers use its (file, offset, size) where they would open a file of their own. Over HTTP(S) and S3 a zip object
is read in place the same way (:func:`open_remote_archive`): each member's bytes are a range of the object, read by a
ranged GET conditioned on the ETag the object had when it was opened.

Nothing in an archive is trusted: :class:`PackedArchive` parses the central directory itself (zipfile is not used
to read, so no second parser can disagree with it) and refuses, naming the member, anything that is not a plain
stored file inside the archive: compressed or encrypted members, absolute names or names with ``..``, duplicates,
symbolic links, offsets or sizes past the end, and more members or central-directory bytes than a store has; every
read of it is bounded by what the records it comes from allow. A compressed member is refused rather than read
slowly: extract such an archive (``unzip``) and open the directory.

An archive holds the store's data, not the holes of its chunk files. On local disk an uncompressed array's chunk files
are full-size (up to 1,048,576 rows) with the rows not yet written left as holes (storage.RawChunkFile): copied whole,
five episodes would make an archive of 90 MB. ``pack`` writes the uncompressed arrays, packs and index columns, with chunks of
fewer rows (:func:`packed_chunk_rows`), the live rows' bytes as the store holds them and every other row zeros; their
zarr.json and the root's layout say so, and every row keeps its position. Pages of zeros left in it (the last chunk's
tail, the alignment) are holes in the archive file.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import io
import json
import os
import re
import stat
import struct
import weakref
import zipfile
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from typing import Any

import fsspec.asyn
import numpy as np
from zarr.abc.store import ByteRequest, OffsetByteRequest, RangeByteRequest, Store, SuffixByteRequest
from zarr.core.buffer import Buffer, BufferPrototype

from her_store.errors import CorruptStoreError, NotAStoreError, StoreError, short_repr
from her_store.format.layout import ATTRS_KEY, COMMIT_KEY, INDEX_COLUMNS, Commit, Layout
from her_store.progress import progress as progress_bar
from her_store.storage.location import (
    METADATA_LIMIT,
    OBJECT_LIMIT,
    Location,
    ObjectReplaced,
    chunk_key,
    data_runs,
    is_chunk_key,
    open_regular,
    s3_get_object,
    staged_output,
    write_all,
    write_sparse,
)
from her_store.store.index import chunks_holding

__all__ = [
    "ALIGNMENT",
    "ArchiveStore",
    "PackedArchive",
    "RemoteZip",
    "is_archive",
    "open_remote_archive",
    "pack_store",
    "packed_chunk_rows",
]

# a data array's chunk starts on a page boundary, so it is mapped at its own offset and its zeros stay pages
ALIGNMENT = 4096
MAX_MEMBERS = 1 << 22  # a store of 10^9 frames in shards of 256 rows has about 4 million files
MAX_DIRECTORY_BYTES = 1 << 30  # the central directory is read whole: about 250 bytes per member at most
COPY_BLOCK = 8 << 20
ZIPALIGN_EXTRA = 0xD935  # Android zipalign's extra field id: 2 bytes of alignment, then zero padding
_EOCD = struct.Struct("<4s4H2LH")  # end of central directory record
_EOCD64 = struct.Struct("<4sQ2H2L4Q")  # zip64 end of central directory record
_LOCATOR = struct.Struct("<4sLQL")  # zip64 end of central directory locator
_CENTRAL = struct.Struct("<4s6H3L5H2L")  # central directory file header
_LOCAL = struct.Struct("<4s5H3L2H")  # local file header


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
    fs : fsspec filesystem
        her_store's bounded HTTP filesystem (``Location.fs``), or s3fs.
    path, url : str
        The object's path on ``fs``, and its URL (for messages).
    is_http : bool
        Whether ``fs`` is the HTTP filesystem.
    size : int
        The object's size.
    etag : str
        Its ETag ("" where the server sends none: reads are then not conditioned).
    """

    BATCH = 64  # ranged GETs in flight at once

    def __init__(self, fs: Any, path: str, url: str, is_http: bool, size: int, etag: str) -> None:
        self.fs, self.path, self.url, self.is_http, self.size = fs, path, url, is_http, size
        self.etag = etag if etag and not etag.startswith("W/") else ""  # a weak ETag never matches an If-Match

    async def read(self, at: int, n: int) -> bytes:
        """Bytes ``at .. at + n`` of the object (within it), by one ranged GET."""
        if n <= 0:
            return b""
        rng, if_match = f"bytes={at}-{at + n - 1}", self.etag or None
        try:
            if self.is_http:
                body, _, _, partial = await self.fs.get_object(self.path, rng, if_match, n)
            else:
                (body, _, _), partial = await s3_get_object(self.fs, self.path, rng, if_match, n), True
        except ObjectReplaced:
            raise CorruptStoreError(
                f"{self.url} was replaced since it was opened (its ETag changed); open it again"
            ) from None
        if body is None:
            raise CorruptStoreError(f"{self.url} is gone since it was opened")
        if not partial or len(body) != n:
            raise CorruptStoreError(
                f"{self.url}: bytes {at:,}..{at + n:,} read as {len(body):,} bytes ({'a' if partial else 'no'} ranged "
                f"answer); the archive holds {self.size:,}"
            )
        return body

    def read_many(self, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """``n`` bytes at ``at`` for each ``(n, at)`` of ``ranges``, read concurrently (``BATCH`` at a time)."""

        async def read_all() -> list[bytes]:
            out: list[bytes] = []
            for i in range(0, len(ranges), self.BATCH):
                out += await asyncio.gather(*(self.read(at, n) for n, at in ranges[i : i + self.BATCH]))
            return out

        return fsspec.asyn.sync(self.fs.loop, read_all) if ranges else []


def open_remote_archive(fs: Any, path: str, url: str, is_http: bool) -> PackedArchive | None:
    """The packed store that is the zip object at ``url`` on an HTTP(S) server or S3, read in place; None where no
    object is there (a store directory whose name ends in ``.zip``, or nothing), or on other filesystems.

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
    >>> loc = Location("https://example.org/point.zip")  # doctest: +SKIP
    >>> loc.archive  # doctest: +SKIP
    PackedArchive('https://example.org/point.zip', 31 members)
    """
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    if not is_http and not {"s3", "s3a"} & set(protocols):
        return None
    probe = "bytes=0-3"
    if is_http:  # a whole file sent for the range is read no further than its first 4 bytes
        head, etag, size, ranged = fsspec.asyn.sync(fs.loop, fs.get_object, path, probe, None, OBJECT_LIMIT)
    else:
        (head, etag, size), ranged = fsspec.asyn.sync(fs.loop, s3_get_object, fs, path, probe, None, 4), True
    if head is None:
        return None
    if head[:4] not in (b"PK\x03\x04", b"PK\x05\x06"):
        raise NotAStoreError(
            f"{url} is not a zip archive (it starts {short_repr(head[:4])}); a packed store is a zip file her-store "
            "pack writes"
        )
    if not ranged:
        raise StoreError(
            f"{url}: the server answers a Range request with the whole file (HTTP 200), and a packed store is read in "
            "place by byte ranges; serve it from a server that honours Range, or download it and open the file"
        )
    return PackedArchive(url, RemoteZip(fs, path, url, is_http, size, etag))


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
    got = read_many([(min(_LOCAL.size + len(raw), cd_offset - at), at) for raw, at, _ in asked.values()])
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
    if len(header) < _LOCAL.size or header[:4] != b"PK\x03\x04":
        raise _corrupt(
            path,
            f"member {name!r}: no local header at byte {header_at:,} (the archive holds {limit:,} bytes of members)",
        )
    _, _, _, method, _, _, _, _, _, name_len, extra_len = _LOCAL.unpack_from(header)
    if method != zipfile.ZIP_STORED or header[_LOCAL.size :] != raw_name or name_len != len(raw_name):
        raise _corrupt(path, f"member {name!r}: its local header disagrees with the central directory")
    start = header_at + _LOCAL.size + name_len + extra_len
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


# -- writing ----------------------------------------------------------------------------------------------------------


def _store_files(root: str, keep: set[str]) -> list[tuple[str, int]]:
    """(key, size) of the files under ``root`` whose keys are in ``keep`` (:func:`_packed_keys`), in key order. Each
    is opened as a regular file when it is copied (:func:`open_regular`), so a link or a FIFO there stops the pack, as
    does a linked directory on the way to one."""
    found = []
    for d, dirs, files in os.walk(root):
        dirs.sort()
        for name in dirs:  # os.walk does not enter a linked directory: what the store needs behind one would be lost
            rel = os.path.relpath(os.path.join(d, name), root).replace(os.sep, "/")
            if os.path.islink(os.path.join(d, name)) and any(k.startswith(f"{rel}/") for k in keep):
                raise CorruptStoreError(f"{os.path.join(d, name)} is a symbolic link; a store's directories are its own")
        for name in sorted(files):
            key = os.path.relpath(os.path.join(d, name), root).replace(os.sep, "/")
            if key in keep:
                with contextlib.suppress(FileNotFoundError):  # a temp file renamed into place since it was listed
                    found.append((key, os.lstat(os.path.join(d, name)).st_size))
    return found


def packed_chunk_rows(rows: int, most: int, least: int = 1) -> int:
    """Rows per chunk of an uncompressed array in a pack whose live rows number ``rows``: the smallest power of two
    that holds them all (so the chunks hold fewer than twice the rows they are written for, the zeros of the last one
    included, and a gather maps as few members as it does in the source), at most ``most`` (the source's) and at least
    ``least``.

    Examples
    --------
    >>> packed_chunk_rows(255, most=1 << 20)  # five episodes of 50 steps
    256
    >>> packed_chunk_rows(100_000, most=1 << 20)
    131072
    >>> packed_chunk_rows(10_000_000, most=1 << 20)  # as many rows as a chunk of the source holds
    1048576
    """
    return int(min(most, max(least, _pow2_at_least(rows))))


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _runs(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """The rows ``starts[i] .. ends[i]`` as sorted, disjoint runs ``(start, end)``: touching runs joined."""
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    if not len(s):
        return np.zeros((0, 2), np.int64)
    new = np.ones(len(s), bool)
    new[1:] = s[1:] > np.maximum.accumulate(e)[:-1]
    first = np.flatnonzero(new)
    return np.stack([s[first], np.maximum.reduceat(e, first)], axis=1).astype(np.int64)


@dataclasses.dataclass(frozen=True)
class _Member:
    """A member to write: its key, its size, its bytes (given the progress bar), and whether they start on a page."""

    key: str
    size: int
    blocks: Callable[[Any], Iterable[bytes | memoryview]]
    aligned: bool


@dataclasses.dataclass(frozen=True)
class _Rows:
    """An uncompressed array as a pack writes it: its source chunk files of ``source_rows`` rows (keys by
    ``source_key``, those that exist in ``files``), its live rows (``runs``), and its rows per chunk in the pack."""

    root: str
    files: dict[str, int]
    source_key: Callable[[int], str]
    key: Callable[[int], str]
    source_rows: int
    rows: int
    row_nbytes: int
    runs: np.ndarray

    def members(self, zeros: bytes) -> list[_Member]:
        """One member per chunk of ``rows`` rows holding a live row, each ``rows * row_nbytes`` bytes: the live rows
        as the source holds them, every other row zeros."""
        chunks = chunks_holding(self.runs[:, 0], self.runs[:, 1], self.rows) if len(self.runs) else []
        aligned = not self.key(0).startswith("episodes/")  # data chunks are mapped; index chunks are read whole
        return [
            _Member(self.key(c), self.rows * self.row_nbytes, functools.partial(self._chunk, c, zeros), aligned)
            for c in chunks
        ]

    def _chunk(self, chunk: int, zeros: bytes, bar: Any) -> Iterator[bytes | memoryview]:
        lo, hi = chunk * self.rows, (chunk + 1) * self.rows
        rb, at = self.row_nbytes, lo
        j = int(np.searchsorted(self.runs[:, 1], lo, side="right"))
        while j < len(self.runs) and self.runs[j, 0] < hi:
            a, b = max(int(self.runs[j, 0]), lo), min(int(self.runs[j, 1]), hi)
            yield from _zeros((a - at) * rb, zeros, bar)
            while a < b:  # the live rows, from the source chunks they lie in
                c, r = divmod(a, self.source_rows)
                take = min(b - a, self.source_rows - r)
                key = self.source_key(c)
                if key in self.files:
                    yield from _blocks(os.path.join(self.root, key), zeros, bar, r * rb, (r + take) * rb)
                else:  # a chunk never written: zeros
                    yield from _zeros(take * rb, zeros, bar)
                a += take
            at, j = b, j + 1
        yield from _zeros((hi - at) * rb, zeros, bar)


def _members(store: Any, root: str, zeros: bytes) -> list[_Member]:
    """What a packed store holds but its commit record, in key order: the Zarr metadata of the root, its groups and the
    layout's arrays and index columns; the shards (chunks) of compressed arrays that hold rows of live episodes, as
    they are; the uncompressed arrays (packs, index columns) with chunks of :func:`packed_chunk_rows` rows, those
    holding live rows (the index: live positions, ids or a ring's slots), every other row zeros, their zarr.json and
    the root's layout saying so. Nothing else (the writer lock, temp files, what a crash left past the commit, files of
    anyone else) is ever read from a store, and inside a zip it could not be repaired."""
    layout, table, commit = store.layout, store.episodes, store.commit_record
    starts = table["start_row"].astype(np.int64)
    runs = _runs(starts, starts + table["length"] + 1)
    rows = packed_chunk_rows(
        int((runs[:, 1] - runs[:, 0]).sum()),
        max(spec.chunk_rows for spec in layout.arrays),
        max((spec.chunk_rows for spec in layout.arrays if spec.compressed), default=1),  # compressed arrays as they are
    )
    compressed = {spec.columns[0][0] for spec in layout.arrays if spec.compressed}
    packed = Layout.build(store.schema, compressed, rows, layout.version)
    slots = store.index.slots
    ids = np.arange(commit.first_episode, commit.end_episode, dtype=np.int64)
    at = ids % slots if slots is not None else ids
    positions = _runs(at, at + 1)
    columns = store._index_io
    index_rows = packed_chunk_rows(
        slots if slots is not None else commit.end_episode, min(col.chunk_rows for col in columns.values())
    )

    groups = ["zarr.json", "packs/zarr.json", "steps/zarr.json", "episodes/zarr.json"]
    keep = {*groups, *(f"{spec.path}/zarr.json" for spec in layout.arrays)}
    keep |= {f"episodes/{name}/zarr.json" for name in columns}
    for spec in layout.arrays:
        keep |= {spec.chunk_key(c) for c in chunks_holding(runs[:, 0], runs[:, 1], spec.chunk_rows)}
    for name, col in columns.items():
        held = chunks_holding(positions[:, 0], positions[:, 1], col.chunk_rows)
        keep |= {chunk_key(f"episodes/{name}", c, 1, "/") for c in held}
    files = dict(_store_files(root, keep))

    def copied(key: str) -> _Member:
        path, aligned = os.path.join(root, key), key.startswith(("packs/", "steps/")) and is_chunk_key(key)
        return _Member(key, files[key], lambda bar: _blocks(path, zeros, bar), aligned)

    def written(key: str, data: bytes) -> _Member:
        def blocks(bar: Any) -> Iterator[bytes]:
            bar.update(len(data))
            yield data

        return _Member(key, len(data), blocks, False)

    def rechunked(key: str, chunk_rows: int) -> _Member:
        doc = json.loads(store._loc.read_bytes(key) or b"")
        doc["chunk_grid"]["configuration"]["chunk_shape"][0] = chunk_rows  # checked at open: a regular grid
        return written(key, json.dumps(doc, indent=2).encode())

    root_doc = json.loads(store._loc.read_bytes("zarr.json") or b"")
    root_doc["attributes"][ATTRS_KEY]["layout"] = packed.to_json()
    members = [written("zarr.json", json.dumps(root_doc, indent=2).encode())]
    members += [copied(key) for key in groups[1:] if key in files]
    for old, new in zip(layout.arrays, packed.arrays):
        if old.compressed:
            assert new == old, (old, new)  # kept as they are: packed_chunk_rows is at least their rows
            members.append(copied(f"{old.path}/zarr.json"))
            shards = map(old.chunk_key, chunks_holding(runs[:, 0], runs[:, 1], old.chunk_rows))
            members += [copied(k) for k in shards if k in files]
            continue
        members.append(rechunked(f"{old.path}/zarr.json", new.chunk_rows))
        rows_of = _Rows(root, files, old.chunk_key, new.chunk_key, old.chunk_rows, new.chunk_rows, old.row_nbytes, runs)
        members += rows_of.members(zeros)
    for name, col in columns.items():
        path = f"episodes/{name}"
        key = functools.partial(chunk_key, path, ndim=1, separator="/")
        members.append(rechunked(f"{path}/zarr.json", index_rows))
        itemsize = INDEX_COLUMNS[name].itemsize
        members += _Rows(root, files, key, key, col.chunk_rows, index_rows, itemsize, positions).members(zeros)
    return sorted(members, key=lambda m: m.key)


def _zip_info(key: str, at: int, aligned: bool) -> zipfile.ZipInfo:
    """The entry of ``key`` whose local header starts at byte ``at``; ``aligned``: padded so that its data starts on
    ALIGNMENT."""
    info = zipfile.ZipInfo(key, date_time=(1980, 1, 1, 0, 0, 0))  # fixed: the same store packs to the same bytes
    info.compress_type = zipfile.ZIP_STORED
    info.create_system = 3  # Unix: external_attr holds the file type and mode
    info.external_attr = (stat.S_IFREG | 0o644) << 16
    # local header: 30 bytes, the name, our extra field, then the 20-byte zip64 extra zipfile appends (force_zip64)
    used = at + _LOCAL.size + len(key.encode("utf-8")) + 20
    pad = -used % ALIGNMENT if aligned else 0
    if 0 < pad < 6:  # an extra field needs 4 bytes of header, zipalign's 2 of alignment
        pad += ALIGNMENT
    if pad:
        info.extra = struct.pack("<3H", ZIPALIGN_EXTRA, pad - 4, ALIGNMENT) + bytes(pad - 6)
    return info


def pack_store(
    store_path: str | os.PathLike[str], archive: str | os.PathLike[str], *, progress: bool = False
) -> Commit:
    """Pack a local store into one zip file that :meth:`EpisodeStore.open` reads in place (read-only).

    Exactly one commit is packed: the one read first, so packing a store that a writer is appending to gives that
    commit's episodes, whole. On a ring store, episodes the writer evicted while they were being copied are left
    out (the packed commit record starts after them): their rows may have been overwritten. The archive holds the
    store's data, not the holes of its chunk files: its uncompressed arrays are written with chunks of fewer rows
    (:func:`packed_chunk_rows`). It is written under a temporary name, opened and checked like any store, and only
    then renamed to ``archive``.

    Parameters
    ----------
    store_path : str or PathLike
        A store directory on local disk.
    archive : str or PathLike
        The zip file to write; it must not exist.
    progress : bool
        Show a progress bar over the bytes written.

    Returns
    -------
    Commit
        The commit record packed.

    Raises
    ------
    FileExistsError
        ``archive`` exists.
    StoreError
        The store cannot be opened, or the archive did not open as the same store.

    Examples
    --------
    >>> pack_store("runs/fetch", "fetch.zip")  # doctest: +SKIP
    Commit(generation=41, first_episode=0, end_episode=2000, ...)
    """
    from her_store.store.episode_store import EpisodeStore

    source = Location(store_path)
    if not source.is_local or source.archive is not None:
        raise ValueError(
            f"{source} is not a store directory on local disk; her-store pack packs one (copy it here first)"
        )
    with EpisodeStore.open(source.root, mode="r") as store:
        commit = store.commit_record
        version = store.layout.version
        zeros = bytes(COPY_BLOCK)  # a hole's bytes, for the members' CRC-32
        members = _members(store, source.root, zeros)
        total = sum(m.size for m in members)
        with staged_output(archive) as tmp, progress_bar(total, "packing", progress, unit="B", unit_scale=True) as bar:
            with _SparseFile(tmp) as out, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
                at = 0
                for m in members:
                    at = _add(zf, m.key, at, m.blocks(bar), m.aligned)
                # the record last: a ring writer may have evicted episodes while their rows were copied. Rows of the
                # episodes from live_first() on were intact throughout (eviction is committed before any overwrite)
                commit = _trimmed(store, commit, store.live_first())
                _add(zf, COMMIT_KEY, at, [commit.to_bytes(version)], False)
            with EpisodeStore.open(tmp) as packed:  # the archive opens, checked like any store, as that commit
                if packed.commit_record != commit:
                    raise CorruptStoreError(f"{tmp} opened as {packed.commit_record}, packed as {commit}")
    return commit


def _trimmed(store: Any, commit: Commit, first: int) -> Commit:
    """``commit`` without its episodes below id ``first`` (evicted since it was read)."""
    first = min(max(first, commit.first_episode), commit.end_episode)
    if first == commit.first_episode:
        return commit
    gone = int(store.episodes["length"][: first - commit.first_episode].sum())
    return dataclasses.replace(commit, first_episode=first, num_transitions=commit.num_transitions - gone)


def _zeros(n: int, zeros: bytes, bar: Any) -> Iterator[memoryview]:
    """``n`` zero bytes, in slices of ``zeros``."""
    while n > 0:
        k = min(n, len(zeros))
        bar.update(k)
        yield memoryview(zeros)[:k]
        n -= k


def _blocks(path: str, zeros: bytes, bar: Any, start: int = 0, end: int | None = None) -> Iterator[bytes | memoryview]:
    """Bytes ``start .. end`` (by default all) of the file at ``path`` in pieces of at most ``len(zeros)``: its data as
    read, its holes (never read) and what lies past its end as slices of ``zeros``."""
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        end = size if end is None else end
        stop, at = min(end, size), start
        for first, last in [*data_runs(fd, stop, min(start, stop)), (stop, stop)]:
            yield from _zeros(first - at, zeros, bar)
            at = max(at, first)
            while at < last:
                block = os.pread(fd, min(len(zeros), last - at), at)
                if not block:
                    raise CorruptStoreError(f"{path} shrank to {at:,} bytes while it was packed (it held {size:,})")
                bar.update(len(block))
                yield block
                at += len(block)
        yield from _zeros(end - at, zeros, bar)
    finally:
        os.close(fd)


class _SparseFile(io.RawIOBase):
    """A new file that zipfile writes an archive into, leaving every page of zeros a hole (:func:`write_sparse`)."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        self.pos = self.end = 0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self.pos = offset + {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: self.end}[whence]
        return self.pos

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        again = max(0, min(n, self.end - self.pos))  # bytes written before (a local header, CRC-32 and sizes now known)
        write_all(self.fd, view[:again], self.pos)
        write_sparse(self.fd, view[again:], self.pos + again)  # past every byte written: the file reads as zeros there
        self.pos += n
        self.end = max(self.end, self.pos)
        return n

    def close(self) -> None:
        if not self.closed:
            try:
                os.ftruncate(self.fd, self.end)  # a hole at the end has no byte written past it
            finally:
                os.close(self.fd)
                super().close()


def _add(zf: zipfile.ZipFile, key: str, at: int, blocks: Iterable[bytes | memoryview], aligned: bool) -> int:
    """Write member ``key`` whose local header starts at byte ``at``; returns where the next one starts."""
    info = _zip_info(key, at, aligned)
    start = at + _LOCAL.size + len(key.encode("utf-8")) + len(info.extra) + 20
    n = 0
    with zf.open(info, "w", force_zip64=True) as w:
        for block in blocks:
            w.write(block)
            n += len(block)
    info.extra = b""  # the padding is for the local header; the central directory need not repeat it
    return start + n


# -- the command --------------------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    """Arguments of ``her-store pack STORE ARCHIVE``.

    Examples
    --------
    >>> add_arguments(argparse.ArgumentParser(), "pack")
    """
    parser.add_argument("store", help="a store directory on local disk")
    parser.add_argument(
        "archive", help="the zip file to write (it must not exist); EpisodeStore.open reads it in place"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.epilog = (
        "The archive holds the store's data, not the holes of its chunk files: its uncompressed arrays are written with "
        "chunks of the rows they hold, so it is about the size of the data. EpisodeStore.open reads it in place from "
        "local disk, and from an HTTP(S) server (one that honours Range) or S3 by its URL."
    )


def run(args: argparse.Namespace) -> int:
    """Pack ``args.store`` into ``args.archive``; prints what was packed.

    Examples
    --------
    >>> run(argparse.Namespace(store="runs/fetch", archive="fetch.zip", quiet=True))  # doctest: +SKIP
    0
    """
    commit = pack_store(args.store, args.archive, progress=not args.quiet)
    st = os.stat(args.archive)
    print(
        f"packed {commit.end_episode - commit.first_episode:,} episodes ({commit.num_transitions:,} transitions, "
        f"commit generation {commit.generation}) into {args.archive} ({st.st_size / 1e6:,.1f} MB, "
        f"{st.st_blocks * 512 / 1e6:,.1f} MB on disk)"
    )
    return 0
