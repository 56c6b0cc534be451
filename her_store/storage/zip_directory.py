"""A zip archive's records, parsed and checked: which bytes of the archive each member's stored bytes are, every
member refused, by name, where it is not a plain stored file inside the archive.

A packed store (FORMAT.md, Packed stores) is read in place, so nothing in its archive is trusted: the end records,
the central directory and each member's local header are parsed here (zipfile is not used to read, so no second parser
can disagree with this one), and anything that is not a plain stored file inside the archive is refused, naming the
member: compressed or encrypted members, absolute names or names with ``..``, duplicates, symbolic links, offsets or
sizes past the end, and more members or central-directory bytes than a store has. Every read is bounded by what the
records it comes from allow. A compressed member is refused rather than read slowly: extract such an archive
(``unzip``) and open the directory. (zarr's ZipStore reads through zipfile, which trusts the archive, and reads local
files only.)
"""

from __future__ import annotations

import os
import stat
import struct
import zipfile
from collections.abc import Callable, Sequence

from her_store.errors import CorruptStoreError, short_repr

__all__ = ["LOCAL_HEADER", "MAX_DIRECTORY_BYTES", "MAX_MEMBERS", "is_archive", "read_members"]

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


def _corrupt(path: str, what: str) -> CorruptStoreError:
    return CorruptStoreError(
        f"{path}: {what}; expected a packed store as her-store pack writes it (FORMAT.md, Packed stores)"
    )


def read_members(
    read_many: Callable[[Sequence[tuple[int, int]]], list[bytes]], size: int, path: str
) -> dict[str, tuple[int, int]]:
    """Every member's (data offset, size), each checked (see the module docstring) before any is used.

    Parameters
    ----------
    read_many : callable
        The archive's bytes: ``n`` bytes at ``at`` for each ``(n, at)`` asked for, within the archive.
    size : int
        The archive's size.
    path : str
        The archive's path or URL, for messages.

    Raises
    ------
    CorruptStoreError
        Not a whole zip archive, or a member that is not a plain stored file inside it (the message names it).
    """

    def read(n: int, at: int) -> bytes:
        return read_many([(n, at)])[0]

    count, cd_size, cd_offset = _end_records(read, size, path)
    cd = read(cd_size, cd_offset)
    entries = _central_entries(cd, count, path)
    # every local header, read at once (concurrently remotely), each no further than the members' end
    asked = {name: e for name, e in entries.items() if e[1] < cd_offset}
    got = read_many([(min(LOCAL_HEADER.size + len(raw), cd_offset - at), at) for raw, at, _ in asked.values()])
    headers = dict(zip(asked, got))
    return {
        name: (_data_offset(headers.get(name, b""), at, raw, usize, cd_offset, path, name), usize)
        for name, (raw, at, usize) in entries.items()
    }


def _end_records(read: Callable[[int, int], bytes], size: int, path: str) -> tuple[int, int, int]:
    """The central directory's (number of entries, size, offset), from the archive's end records (zip64 ones where
    the end record says so), checked to be one disk's, within a store's bounds, and before the records that follow
    it; ``read(n, at)`` gives the archive's ``n`` bytes at ``at``."""
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
    return count, cd_size, cd_offset


def _central_entries(cd: bytes, count: int, path: str) -> dict[str, tuple[bytes, int, int]]:
    """The ``count`` entries of central directory ``cd`` by member name: (raw name, local header offset, size), each
    a plain stored file (a directory entry holds nothing and is left out), named once."""
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
    return entries


def _zip64_values(
    extra: bytes, usize: int, csize: int, header_at: int, path: str, raw_name: bytes
) -> tuple[int, int, int]:
    """The sizes and header offset of a central directory entry, from its zip64 extra field where they are
    0xFFFFFFFF."""
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
            got = tuple(next(values) if w else v for w, v in zip(want, (usize, csize, header_at)))
            return got  # type: ignore[return-value]
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
