"""How a store is packed: ``her-store pack``, a whole store as one zip file that opens read-only in place.

The archive is uncompressed; :mod:`her_store.storage.archive` reads it.

A packed store is a zip archive (FORMAT.md, Packed stores) whose members are the store's files, stored uncompressed
(ZIP_STORED), each member's bytes contiguous in the archive; a data array's chunks and frame files start on a
4,096-byte boundary (padding in the local header's extra field, as Android's zipalign does), so that they are mapped
at their offset in the archive.

An archive holds the store's data, not the holes of its chunk files. On local disk an uncompressed array's chunk files
are full-size (up to 1,048,576 rows) with the rows not yet written left as holes: copied whole, five episodes would
make an archive of 90 MB. ``pack`` writes the uncompressed arrays, packs and index columns, with chunks of fewer rows
(:func:`packed_chunk_rows`), the live rows' bytes as the store holds them and every other row zeros; their zarr.json and
the root's layout say so, and every row keeps its position. Pages of zeros left in it (the last chunk's tail, the
alignment) are holes in the archive file.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import io
import json
import os
import stat
import struct
import zipfile
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from her_store.errors import CorruptStoreError
from her_store.format.commit_record import Commit
from her_store.format.keys import ATTRS_KEY, COMMIT_KEY, chunk_key, is_chunk_key
from her_store.format.layout import INDEX_COLUMNS, Layout
from her_store.progress import progress as progress_bar
from her_store.storage import open_backend
from her_store.storage.files import data_runs, open_regular, staged_output, write_all, write_sparse
from her_store.storage.zip_directory import LOCAL_HEADER
from her_store.store.episode_store import EpisodeStore
from her_store.store.index import chunks_holding

__all__ = ["ALIGNMENT", "pack_store", "packed_chunk_rows"]

# a data array's chunk starts on a page boundary, so it is mapped at its own offset and its zeros stay pages
ALIGNMENT = 4096
COPY_BLOCK = 8 << 20
ZIPALIGN_EXTRA = 0xD935  # Android zipalign's extra field id: 2 bytes of alignment, then zero padding


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
                raise CorruptStoreError(
                    f"{os.path.join(d, name)} is a symbolic link; a store's directories are its own"
                )
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
    columns = store.index_columns
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
        doc = json.loads(store.backend.read_bytes(key) or b"")
        doc["chunk_grid"]["configuration"]["chunk_shape"][0] = chunk_rows  # checked at open: a regular grid
        return written(key, json.dumps(doc, indent=2).encode())

    root_doc = json.loads(store.backend.read_bytes("zarr.json") or b"")
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
    used = at + LOCAL_HEADER.size + len(key.encode("utf-8")) + 20
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
    source = open_backend(store_path)
    directory = source.local_directory()
    if directory is None:
        raise ValueError(
            f"{source} is not a store directory on local disk; her-store pack packs one (copy it here first)"
        )
    with EpisodeStore.open(source, mode="r") as store:
        commit = store.commit_record
        version = store.layout.version
        zeros = bytes(COPY_BLOCK)  # a hole's bytes, for the members' CRC-32
        members = _members(store, directory, zeros)
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
    start = at + LOCAL_HEADER.size + len(key.encode("utf-8")) + len(info.extra) + 20
    n = 0
    with zf.open(info, "w", force_zip64=True) as w:
        for block in blocks:
            w.write(block)
            n += len(block)
    info.extra = b""  # the padding is for the local header; the central directory need not repeat it
    return start + n


# -- the command ------------------------------------------------------------------------------------------------------


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
        "The archive holds the store's data, not the holes of its chunk files: its uncompressed arrays are written "
        "with chunks of the rows they hold, so it is about the size of the data. EpisodeStore.open reads it in place "
        "from local disk, and from an HTTP(S) server (one that honours Range) or S3 by its URL."
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
