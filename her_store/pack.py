"""Packed stores: a whole store as one uncompressed zip file, written by ``her-store pack`` and read in place.

A packed store is a zip archive (FORMAT.md, Packed stores) whose members are the store's files, stored uncompressed
(ZIP_STORED), each member's bytes contiguous in the archive and starting on a 4,096-byte boundary (padding in the
local header's extra field, as Android's zipalign does). So a chunk of an uncompressed array is memory-mapped at its
offset in the archive, and a shard's rows are read by byte range (``pread`` at the member's offset plus the row's),
exactly as from a directory: :class:`PackedArchive` answers "which bytes of the archive are key K" and the readers
use its (file, offset, size) where they would open a file of their own.

Nothing in an archive is trusted: :class:`PackedArchive` parses the central directory itself (zipfile is not used
to read, so no second parser can disagree with it) and refuses, naming the member, anything that is not a plain
stored file inside the archive: compressed or encrypted members, absolute names or names with ``..``, duplicates,
symbolic links, offsets or sizes past the end, and more members or central-directory bytes than a store has.
A compressed member is refused rather than read slowly: extract such an archive (``unzip``) and open the directory.

An archive is as sparse as its store: an uncompressed array's chunk files are full-size with their rows not yet written
left as holes (storage.RawChunkFile), and ``pack`` reads only their data (``SEEK_DATA``/``SEEK_HOLE``) and leaves every
page of zeros a hole in the archive too, so the archive takes about the store's disk space. Its members' CRC-32 cover
the zeros as well. ``her-store copy`` to local disk does the same (:func:`her_store.storage.write_sparse`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import os
import stat
import struct
import weakref
import zipfile
from collections.abc import AsyncIterator, Iterable
from typing import Any

import numpy as np
from zarr.abc.store import ByteRequest, OffsetByteRequest, RangeByteRequest, Store, SuffixByteRequest
from zarr.core.buffer import Buffer, BufferPrototype

from her_store.errors import CorruptStoreError, short_repr
from her_store.format import COMMIT_KEY, Commit
from her_store.index import chunks_holding
from her_store.progress import progress as progress_bar
from her_store.storage import (
    METADATA_LIMIT,
    Location,
    chunk_key,
    data_runs,
    open_regular,
    staged_output,
    write_all,
    write_sparse,
)

__all__ = [
    "ALIGNMENT",
    "ArchiveStore",
    "PackedArchive",
    "is_archive",
    "pack_store",
]

# member data starts on a page boundary, so an uncompressed chunk is mapped at its own offset and its holes stay pages
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
        The archive (a regular file).

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

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        # closed by close(), or when the archive is garbage: readers of members hold descriptors of their own
        self._close = weakref.finalize(self, os.close, self.fd)
        try:
            st = os.fstat(self.fd)
            if not stat.S_ISREG(st.st_mode):
                raise CorruptStoreError(f"{path} is not a regular file; a packed store is a zip file")
            self.size = st.st_size
            self.members = _read_members(self.fd, self.size, path)
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

    def open_range(self, key: str) -> tuple[io.FileIO, int, int]:
        """(the archive, open anew for the caller to close; the offset of ``key``'s bytes in it; their size).

        Raises
        ------
        FileNotFoundError
            The archive holds no member ``key``.
        """
        got = self.members.get(key)
        if got is None:
            raise FileNotFoundError(f"{self.path} has no member {key}")
        return io.FileIO(os.dup(self.fd), "rb"), got[0], got[1]

    def _pread(self, n: int, at: int) -> bytes:
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


def _corrupt(path: str, what: str) -> CorruptStoreError:
    return CorruptStoreError(
        f"{path}: {what}; expected a packed store as her-store pack writes it (FORMAT.md, Packed stores)"
    )


def _read_members(fd: int, size: int, path: str) -> dict[str, tuple[int, int]]:
    """Every member's (data offset, size), each checked (see the module docstring) before any is used."""
    tail_len = min(size, _EOCD.size + 0xFFFF)  # the record, then a comment of at most 65,535 bytes
    tail = os.pread(fd, tail_len, size - tail_len)
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
        sig, _, eocd64_at, _ = _LOCATOR.unpack(os.pread(fd, _LOCATOR.size, eocd_at - _LOCATOR.size))
        if sig != b"PK\x06\x07" or eocd64_at > eocd_at - _LOCATOR.size - _EOCD64.size:
            raise _corrupt(path, "a damaged zip64 end of central directory locator")
        sig, _, _, _, disk, cd_disk, _, count, cd_size, cd_offset = _EOCD64.unpack(
            os.pread(fd, _EOCD64.size, eocd64_at)
        )
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
    cd = os.pread(fd, cd_size, cd_offset)
    members: dict[str, tuple[int, int]] = {}
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
        if name in members:
            raise _corrupt(path, f"member {name!r} appears twice")
        members[name] = (_data_offset(fd, header_at, raw_name, usize, cd_offset, path, name), usize)
    return members


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


def _data_offset(fd: int, header_at: int, raw_name: bytes, size: int, limit: int, path: str, name: str) -> int:
    """Where a member's bytes start, from its local header, which must name it; its bytes must end by ``limit``."""
    header = os.pread(fd, _LOCAL.size + len(raw_name), header_at) if header_at < limit else b""
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


def _packed_keys(store: Any) -> set[str]:
    """The keys a packed store holds: the Zarr metadata of the root, its groups and the layout's arrays and index
    columns; the chunks (shards) of the data arrays that hold rows of live episodes, and the index chunks holding their
    positions (ids, or a ring's slots). Nothing else (the writer lock, temp files, what a crash left past the commit,
    files of anyone else) is ever read from a store, and inside a zip it could not be repaired."""
    keep = {"zarr.json", "packs/zarr.json", "steps/zarr.json", "episodes/zarr.json"}
    keep |= {f"{spec.path}/zarr.json" for spec in store.layout.arrays}
    table = store.episodes
    starts = table["start_row"].astype(np.int64)
    ends = starts + table["length"] + 1
    for spec in store.layout.arrays:
        keep |= {spec.chunk_key(c) for c in chunks_holding(starts, ends, spec.chunk_rows)}
    positions = store.index.slots if store.index.slots is not None else store.commit_record.end_episode
    for name, column in store._index_io.items():
        keep.add(f"episodes/{name}/zarr.json")
        keep |= {chunk_key(f"episodes/{name}", c, 1, "/") for c in range(-(-positions // column.chunk_rows))}
    return keep


def _zip_info(key: str, at: int) -> zipfile.ZipInfo:
    """The entry of ``key`` whose local header starts at byte ``at``, padded so that its data starts on ALIGNMENT."""
    info = zipfile.ZipInfo(key, date_time=(1980, 1, 1, 0, 0, 0))  # fixed: the same store packs to the same bytes
    info.compress_type = zipfile.ZIP_STORED
    info.create_system = 3  # Unix: external_attr holds the file type and mode
    info.external_attr = (stat.S_IFREG | 0o644) << 16
    # local header: 30 bytes, the name, our extra field, then the 20-byte zip64 extra zipfile appends (force_zip64)
    used = at + _LOCAL.size + len(key.encode("utf-8")) + 20
    pad = -used % ALIGNMENT
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
    out (the packed commit record starts after them): their rows may have been overwritten. The archive is written
    under a temporary name, opened and checked like any store, and only then renamed to ``archive``.

    Parameters
    ----------
    store_path : str or PathLike
        A store directory on local disk.
    archive : str or PathLike
        The zip file to write; it must not exist.
    progress : bool
        Show a progress bar over the bytes copied.

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
    from her_store.store import EpisodeStore

    source = Location(store_path)
    if not source.is_local or source.archive is not None:
        raise ValueError(
            f"{source} is not a store directory on local disk; her-store pack packs one (copy it here first)"
        )
    with EpisodeStore.open(source.root, mode="r") as store:
        commit = store.commit_record
        version = store.layout.version
        files = _store_files(source.root, _packed_keys(store))
        total = sum(size for _, size in files)
        zeros = bytes(COPY_BLOCK)  # a hole's bytes, for the members' CRC-32
        with staged_output(archive) as tmp, progress_bar(total, "packing", progress, unit="B", unit_scale=True) as bar:
            with _SparseFile(tmp) as out, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
                at = 0
                for key, _ in files:
                    at = _add(zf, key, at, _blocks(os.path.join(source.root, key), zeros, bar))
                # the record last: a ring writer may have evicted episodes while their rows were copied. Rows of the
                # episodes from live_first() on were intact throughout (eviction is committed before any overwrite)
                commit = _trimmed(store, commit, store.live_first())
                _add(zf, COMMIT_KEY, at, [commit.to_bytes(version)])
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


def _blocks(path: str, zeros: bytes, bar: Any) -> Iterable[bytes | memoryview]:
    """The bytes of the file at ``path`` in pieces of at most ``len(zeros)``: its data as read, its holes (never read)
    as slices of ``zeros``."""
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        at = 0
        for start, end in [*data_runs(fd, size), (size, size)]:
            while at < start:
                n = min(len(zeros), start - at)
                bar.update(n)
                yield memoryview(zeros)[:n]
                at += n
            while at < end:
                block = os.pread(fd, min(len(zeros), end - at), at)
                if not block:
                    raise CorruptStoreError(f"{path} shrank to {at:,} bytes while it was packed (it held {size:,})")
                bar.update(len(block))
                yield block
                at += len(block)
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


def _add(zf: zipfile.ZipFile, key: str, at: int, blocks: Iterable[bytes | memoryview]) -> int:
    """Write member ``key`` whose local header starts at byte ``at``; returns where the next one starts."""
    info = _zip_info(key, at)
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
        "The archive is as sparse as the store: the rows an uncompressed array's chunk files do not hold yet are holes "
        "there and in the archive, so it takes about the store's disk space (its size counts them)."
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
