"""``her-store copy``: a store copied between local disk and object storage, up to one commit, resumable.

What is copied is exactly what one commit record of SRC needs: the Zarr metadata (every ``zarr.json``), the chunks
and shards holding the rows of its live episodes, and the index chunks holding their rows; ``writer.lock`` never.
The record is read first (by opening SRC read-only), so a writer appending to SRC meanwhile changes nothing the copy
relies on: rows of committed episodes are never rewritten, except by a ring's eviction. Every copied episode is
checked against the crc32 its index row records, computed from the bytes as written to DEST (the rows of packs as
raw bytes, a sharded array's rows as stored); an episode that fails (a ring evicted it while it was copied) makes the
copy read SRC's newer record and copy again what changed since, and the copy ends with the first record whose every
episode checks out. DEST's ``commit.json`` is written last: until then DEST is not a store.

Resuming: every file copied is recorded in a manifest, ``.her_store-copy.json`` (the source's identity, and per key
its size, crc32 and the source's fingerprint: size and mtime locally, ETag on object storage). A run of the same
copy skips the files whose source fingerprint is unchanged and whose copy is still whole, and copies the rest.
A local DEST is built in ``.NAME.copy-partial`` beside it (kept by an interrupted copy, for the next run) and renamed
into place at the end; on object storage the manifest sits under DEST's prefix until ``commit.json`` is written.

Sparse files: an uncompressed array's chunk files are full-size, the rows not yet written left as holes
(storage.RawChunkFile). A local DEST leaves every page of zeros a hole too
(:func:`her_store.storage.files.write_sparse`), so a copy takes about its source's disk space. Object storage has no
holes, and Zarr reads an uncompressed chunk only whole, so such a chunk is sent whole, zeros included: only the chunks
holding committed rows are sent at all, and the result counts the bytes sent and the zeros among them. A store meant for
sharing sends less with compressed arrays (the default for images: their shards hold only the rows written) or smaller
chunks (``chunk_rows``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import stat
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from her_store.checks import is_int
from her_store.errors import CorruptStoreError, ReadOnlyStoreError, StoreExistsError, short_repr
from her_store.format.frames import parse_index, shard_limit
from her_store.format.keys import COMMIT_KEY, chunk_key
from her_store.format.layout import ArraySpec, index_columns
from her_store.ops.repair import clear_tail
from her_store.ops.verify import verify
from her_store.progress import progress as progress_bar
from her_store.storage import Backend, open_backend
from her_store.storage.base import METADATA_LIMIT
from her_store.storage.files import blocks_directory, nonzero_runs, staged_output
from her_store.store.episode_store import EpisodeStore

__all__ = ["CopyResult", "add_arguments", "copy_store", "run"]

MANIFEST_KEY = ".her_store-copy.json"
MAX_PASSES = 5  # records tried while a ring evicts episodes faster than they are copied
BATCH_FILES, BATCH_BYTES = 32, 64 << 20  # files read and written at once (concurrent GETs and PUTs)


@dataclass(frozen=True)
class CopyResult:
    """What :func:`copy_store` did."""

    dest: str
    generation: int  # of the commit record copied
    episodes: int
    transitions: int
    files_copied: int
    files_skipped: int  # already copied whole by an earlier, interrupted run
    bytes_copied: int  # written: sent to object storage whole; on local disk every page of zeros left a hole
    bytes_zero: int  # of the files copied, in pages of zeros (rows not yet written, mostly): sent, or left holes
    passes: int  # records tried: more than one when a ring evicted episodes while they were copied
    seconds: float


class _Dest:
    """Where the copy writes: a local partial directory (renamed into place at the end) or DEST's prefix."""

    def __init__(self, dest: str, storage_options: Mapping[str, Any] | None) -> None:
        self.final = open_backend(dest, storage_options)
        if self.final.read_only:
            raise ReadOnlyStoreError(f"cannot copy to {dest}: {self.final.read_only}")
        directory = self.final.local_directory()
        self.local = directory is not None  # built aside in a directory of its own, renamed into place at the end
        if directory is not None:
            parent, name = os.path.split(directory)
            if os.path.lexists(directory):
                raise StoreExistsError(f"{directory} exists; copy to a new destination (nothing was overwritten)")
            partial = os.path.join(parent, f".{name}.copy-partial")  # made by the first file written
            if blocks_directory(partial):
                raise StoreExistsError(
                    f"{partial} is a link or a file where the copy builds {dest} (a directory of its own); nothing was "
                    "copied: move it away, or copy to another destination"
                )
            self.loc = open_backend(partial)
            self.partial = partial
        else:
            self.loc = self.final
            if self.loc.exists(COMMIT_KEY):
                raise StoreExistsError(
                    f"{dest} already holds a store; copy to a new destination (nothing was overwritten)"
                )

    def manifest(self, identity: str) -> dict[str, list[Any]]:
        """The files an earlier run of this copy recorded; refuses a destination holding anything else."""
        raw = self.loc.read_bytes(MANIFEST_KEY)
        if raw is None:
            if self.local:  # the partial directory is this copy's own: a run killed before its manifest
                shutil.rmtree(self.partial, ignore_errors=True)
            elif self.loc.list_files():
                raise StoreExistsError(
                    f"{self.final} holds objects that are not a copy in progress; copy to a new destination (nothing "
                    "was overwritten)"
                )
            else:  # claimed before the first object is written, so that a copy killed at any point resumes
                self.loc.write_atomic(MANIFEST_KEY, json.dumps({"source": identity, "files": {}}).encode(), fsync=False)
            return {}
        try:
            doc = json.loads(raw)
            same, files = doc["source"] == identity, dict(doc["files"])
            for key, entry in files.items():  # [size, crc32, the source's fingerprint], as write() records them
                if not (
                    isinstance(key, str) and isinstance(entry, list) and len(entry) == 3 and is_int(entry[0])
                    and entry[0] >= 0 and is_int(entry[1]) and isinstance(entry[2], str)
                ):
                    raise ValueError(f"its entry for {key!r} is {short_repr(entry)}, not [size, crc32, fingerprint]")
        except (ValueError, KeyError, TypeError) as e:
            raise CorruptStoreError(
                f"{self.loc}/{MANIFEST_KEY} is not a copy manifest ({e}); delete it to start over"
            ) from e
        if not same:
            raise StoreExistsError(
                f"{self.loc} holds a copy in progress of another store; delete it or choose a new destination"
            )
        return files

    def sizes(self) -> dict[str, int]:
        """The size of every file under the destination, by key."""
        if self.local:  # regular files only: anything else here (a link, a FIFO) is written over
            found = {}
            for d, _, names in os.walk(self.partial):
                for f in names:
                    st = os.lstat(os.path.join(d, f))
                    if stat.S_ISREG(st.st_mode):
                        found[os.path.relpath(os.path.join(d, f), self.partial)] = st.st_size
            return found
        return self.loc.list_files()

    def write(self, items: Mapping[str, bytes], identity: str, files: Mapping[str, list[Any]]) -> tuple[int, int]:
        """Files replaced whole (concurrent PUTs on object storage; locally temp file + rename, every page of zeros
        left a hole as in a writer's chunk files), then the manifest recording them. Returns (bytes written, bytes
        of the files in pages of zeros)."""
        self.loc.put_many(items)  # locally, every page of zeros left a hole, as in a writer's chunk files
        total = sum(len(v) for v in items.values())
        held = sum(b - a for v in items.values() for a, b in nonzero_runs(v, 0))
        written, zeros = (held if self.local else total), total - held
        self.loc.write_atomic(MANIFEST_KEY, json.dumps({"source": identity, "files": files}).encode(), fsync=False)
        return written, zeros

    def finish(self, commit: bytes, copied: set[str]) -> None:
        """Write the commit record last (DEST becomes a store), the manifest gone first; locally, the partial
        directory holding nothing but the ``copied`` keys (whatever else a killed copy or anyone left there is
        removed), renamed into place."""
        if self.local:
            os.unlink(os.path.join(self.partial, MANIFEST_KEY))
            _prune(self.loc, self.partial, copied)
            self.loc.write_atomic(COMMIT_KEY, commit, fsync=False)
            with staged_output(self.final.url) as tmp:
                os.rename(self.partial, tmp)
            return
        # the record first: until it is in place the manifest claims DEST for this copy, so that a copy stopped at any
        # point (a failed PUT of the record too) resumes; a manifest left beside a record is inert
        self.loc.write_atomic(COMMIT_KEY, commit, fsync=False)
        self.loc.remove(MANIFEST_KEY)


def _prune(loc: Backend, directory: str, keep: set[str]) -> None:
    """Remove from a local directory every entry that is neither one of the ``keep`` keys (a regular file) nor a
    directory on the way to one: links (never followed), FIFOs, other files and directories."""
    leads = {"/".join(k.split("/")[:i]) for k in keep for i in range(1, k.count("/") + 1)}
    for d, dirs, names in os.walk(directory):
        here = os.path.relpath(d, directory).replace(os.sep, "/")
        for name in [*names, *dirs]:
            key = name if here == "." else f"{here}/{name}"
            st = os.lstat(os.path.join(d, name))
            wanted = key in keep and stat.S_ISREG(st.st_mode) or key in leads and stat.S_ISDIR(st.st_mode)
            if not wanted:
                loc.remove(key)
        dirs[:] = [
            n for n in dirs if (n if here == "." else f"{here}/{n}") in leads and os.path.isdir(os.path.join(d, n))
        ]


def _read(loc: Backend, keys: list[str], limits: list[int]) -> list[bytes]:
    """Whole files, concurrently on object storage and HTTP, each of at most its limit."""
    got = loc.read_objects(keys, max(limits, default=0))
    for key, n, raw in zip(keys, limits, got):
        if raw is None:
            raise CorruptStoreError(f"{loc}/{key} disappeared while it was copied")
        if len(raw) > n:
            raise CorruptStoreError(f"{loc}/{key} holds more than the {n:,} bytes it may")
    return got  # type: ignore[return-value]


def _limit(spec: ArraySpec | None, key: str, index_chunk: int) -> int:
    """The most bytes a file of the store may hold: metadata, an index chunk, a chunk or a shard."""
    if key.endswith("zarr.json"):
        return METADATA_LIMIT
    if spec is None:
        return index_chunk * 8
    # a compressed chunk (a shard, a version 1 chunk) may hold a little more than its rows when they do not compress
    return shard_limit(spec.chunk_rows, spec.row_nbytes) if spec.compressed else spec.chunk_rows * spec.row_nbytes


def _plan(store: EpisodeStore) -> tuple[list[str], list[tuple[ArraySpec | None, str, int]]]:
    """The metadata keys and the (array, key, chunk) of every chunk the commit's live episodes need, in layout order
    (the order their crc32 is chained in), index chunks last (array None)."""
    columns = index_columns(store.layout.version)
    meta = ["zarr.json", "episodes/zarr.json", *(f"episodes/{c}/zarr.json" for c in columns)]
    for spec in store.layout.arrays:
        meta += [f"{spec.path.split('/')[0]}/zarr.json", f"{spec.path}/zarr.json"]
    table = store.episodes
    starts, ends = table["start_row"], table["start_row"] + table["length"] + 1
    chunks: list[tuple[ArraySpec | None, str, int]] = []
    for spec in store.layout.arrays:
        cr = spec.chunk_rows
        span = (ends - 1) // cr - starts // cr + 1
        used = np.unique(
            np.repeat(starts // cr, span) + np.arange(int(span.sum())) - np.repeat(np.cumsum(span) - span, span)
        )
        chunks += [(spec, spec.chunk_key(int(c)), int(c)) for c in used.tolist()]
    slots = store.index.slots
    ids = table["episode_id"]
    positions = ids % slots if slots else ids
    index_chunk = int(store.zarr_array("episodes/episode_id").chunks[0])
    for c in np.unique(positions // index_chunk).tolist():
        chunks += [(None, chunk_key(f"episodes/{name}", int(c), 1, "/"), int(c)) for name in columns]
    return list(dict.fromkeys(meta)), chunks


def _episode_bytes(spec: ArraySpec, chunk: int, raw: bytes, starts: np.ndarray, ends: np.ndarray, where: str):
    """For each episode with rows in this chunk: (its index in the table, the bytes of its rows here, as its crc32
    covers them)."""
    cr = spec.chunk_rows
    lo, hi = np.maximum(starts, chunk * cr), np.minimum(ends, (chunk + 1) * cr)
    inside = np.flatnonzero(lo < hi)
    if not spec.sharded:
        nb = spec.row_nbytes
        for e in inside.tolist():
            yield e, raw[(lo[e] - chunk * cr) * nb : (hi[e] - chunk * cr) * nb]
        return
    offsets, nbytes = parse_index(raw, cr, where)
    for e in inside.tolist():
        a, b = int(lo[e] - chunk * cr), int(hi[e] - chunk * cr)
        o, n = offsets[a:b], nbytes[a:b]
        live = o >= 0
        if live.all() and (o[1:] == o[:-1] + n[:-1]).all():  # rows stored in order: one slice
            yield e, raw[int(o[0]) : int(o[-1] + n[-1])]
        else:
            yield e, b"".join(raw[int(x) : int(x + y)] for x, y in zip(o[live].tolist(), n[live].tolist()))


def _identity(store: EpisodeStore) -> str:
    """What tells this store from another: its creation time, schema and layout (the card may change)."""
    attrs = store.attrs
    return json.dumps(
        {k: attrs[k] for k in ("created_at", "schema", "layout", "capacity", "index_slots")}, sort_keys=True
    )


@dataclass
class _Tally:
    copied: int = 0
    skipped: int = 0
    nbytes: int = 0
    zeros: int = 0


def _copy_pass(
    store: EpisodeStore, out: _Dest, files: dict[str, list[Any]], tally: _Tally, progress: bool
) -> np.ndarray:
    """Copy what the store's commit record needs (skipping files an earlier run copied whole); returns per live
    episode whether it failed its crc32 or its index rows as copied."""
    meta, chunks = _plan(store)
    table = store.episodes
    starts, ends = table["start_row"], table["start_row"] + table["length"] + 1
    crc = np.zeros(len(starts), np.int64)
    bad = np.zeros(len(starts), bool)
    identity = _identity(store)
    found = store.backend.fingerprints([*meta, *(k for _, k, _ in chunks)])
    have = out.sizes()
    index_chunk = int(store.zarr_array("episodes/episode_id").chunks[0])
    # a version 1 array's chunks are compressed whole: its rows' bytes need a decode, checked by `verify`
    checkable = all(spec.sharded or not spec.compressed for spec in store.layout.arrays)
    index_rows: dict[str, list[tuple[int, bytes]]] = {name: [] for name in index_columns(store.layout.version)}
    items = [(None, k, -1) for k in meta if k in found] + chunks
    bar = progress_bar(sum(size for _, size in found.values()), "copying", progress, unit="B", unit_scale=True)
    at = 0
    while at < len(items):
        batch, size = [], 0  # files read and written at once
        while at < len(items) and len(batch) < BATCH_FILES and size < BATCH_BYTES:
            batch.append(items[at])
            size += found.get(items[at][1], ("", 0))[1]
            at += 1
        fresh = [
            (spec, key) for spec, key, _ in batch
            if key in found and (files.get(key, [None] * 3)[2] != found[key][0] or have.get(key) != files[key][0])
        ]
        renew = {key for _, key in fresh}
        old = [key for _, key, _ in batch if key in found and key not in renew]  # copied whole by an earlier run
        got = dict(zip(old, _read(out.loc, old, [files[k][0] for k in old])))
        # one whose bytes are no longer those the earlier run wrote (a power loss before they reached the disk, anyone
        # else) is copied again
        changed = {k for k in old if got[k] is None or zlib.crc32(got[k]) != files[k][1]}
        if changed:
            fresh += [(spec, key) for spec, key, _ in batch if key in changed]
            old = [k for k in old if k not in changed]
        read = _read(store.backend, [k for _, k in fresh], [_limit(spec, k, index_chunk) for spec, k in fresh])
        for (_, key), raw in zip(fresh, read):
            files[key] = [len(raw), zlib.crc32(raw), found[key][0]]
            got[key] = raw
        written, zeros = out.write({key: got[key] for _, key in fresh}, identity, files)
        tally.copied += len(fresh)
        tally.skipped += len(old)
        tally.nbytes += written
        tally.zeros += zeros
        bar.update(size)
        for spec, key, chunk in batch:
            raw = got.get(key)
            if spec is None and chunk >= 0:
                index_rows[key.split("/")[1]].append((chunk, raw or b""))
            elif spec is not None and checkable:
                if raw is None and not spec.sharded:  # a chunk never written: its rows read as zeros
                    raw = bytes(spec.chunk_rows * spec.row_nbytes)
                if raw is None:  # a shard never written holds no committed row
                    bad[(starts < (chunk + 1) * spec.chunk_rows) & (ends > chunk * spec.chunk_rows)] = True
                    continue
                for e, part in _episode_bytes(spec, chunk, raw, starts, ends, f"{store.url}/{key}"):
                    crc[e] = zlib.crc32(part, int(crc[e]))
    bar.close()
    if checkable:
        bad |= crc != table["crc32"]
    return bad | ~_index_matches(store, index_rows, table)


def copy_store(
    src: str | os.PathLike[str],
    dest: str | os.PathLike[str],
    *,
    storage_options: Mapping[str, Any] | None = None,
    dest_storage_options: Mapping[str, Any] | None = None,
    progress: bool = False,
) -> CopyResult:
    """Copy a store, up to one commit, between local disk, object storage (``s3://bucket/name``) and HTTP (source only).

    Parameters
    ----------
    src, dest : str or PathLike
        Local paths or fsspec URLs. DEST must not hold a store or anything else, except an interrupted copy of the
        same SRC, which is resumed.
    storage_options : mapping, optional
        fsspec options of SRC (and of DEST unless ``dest_storage_options`` is given).
    dest_storage_options : mapping, optional
        fsspec options of DEST.
    progress : bool
        A progress bar over the bytes of the files to copy.

    Returns
    -------
    CopyResult

    Raises
    ------
    StoreExistsError
        DEST holds a store, another store's copy in progress, or other files: nothing is overwritten.
    CorruptStoreError
        SRC's episodes fail their checksums in every one of ``MAX_PASSES`` records tried.
    ValueError
        SRC is a packed store (a zip file: copy the file).

    Examples
    --------
    >>> copy_store("runs/fetch", "s3://bucket/fetch", storage_options={"anon": False})  # doctest: +SKIP
    CopyResult(dest='s3://bucket/fetch', generation=41, episodes=2000, ...)
    """
    t0 = time.perf_counter()
    tally = _Tally()
    store = EpisodeStore.open(src, storage_options=storage_options)
    try:
        out = _Dest(os.fspath(dest), storage_options if dest_storage_options is None else dest_storage_options)
        files = out.manifest(_identity(store))
        for attempt in range(1, MAX_PASSES + 1):
            commit, table = store.commit_record, store.episodes
            bad = _copy_pass(store, out, files, tally, progress)
            # a ring evicts its oldest episodes first: when only they fail, the copy is the commit that drops them
            # (as the writer's own eviction record does: first_episode advanced, the rest unchanged)
            keep = int(np.argmin(bad)) if bad.any() else 0
            if not bad[keep:].any() and keep < len(bad) and store.capacity is not None:
                commit = dataclasses.replace(
                    commit,
                    first_episode=commit.first_episode + keep,
                    num_transitions=commit.num_transitions - int(table["length"][:keep].sum()),
                )
                bad[:] = False
            if not bad.any():
                out.finish(commit.to_bytes(store.layout.version), set(files))
                tail = verify(out.final.url, checksums=False, storage_options=out.final.storage_options)
                # rows the writer added past this commit meanwhile
                if tail.tail_positions or tail.tail_chunks or tail.junk_chunks:
                    with EpisodeStore.open(out.final.url, "a", out.final.storage_options) as copied:
                        clear_tail(copied, log=lambda line: None)
                return CopyResult(
                    str(out.final), commit.generation, commit.end_episode - commit.first_episode,
                    commit.num_transitions, tally.copied, tally.skipped, tally.nbytes, tally.zeros, attempt,
                    time.perf_counter() - t0,
                )
            failed = table["episode_id"][bad]
            store.refresh()  # a ring evicted them while they were copied: copy a newer record, what changed since
            if store.first_episode <= int(failed.min()):
                raise CorruptStoreError(
                    f"{store.url}: episodes {failed[:10].tolist()}{' ...' if len(failed) > 10 else ''} do not match "
                    "the crc32 of their index rows in SRC itself; run `her-store verify` on it"
                )
        raise CorruptStoreError(
            f"{store.url} evicted episodes faster than they could be copied ({MAX_PASSES} commit records tried); copy "
            "it while its writer is paused"
        )
    finally:
        store.close()


def _index_matches(
    store: EpisodeStore, pieces: Mapping[str, list[tuple[int, bytes]]], table: Mapping[str, np.ndarray]
) -> np.ndarray:
    """Per live episode: whether the index rows as copied are the ones the commit's open read (a ring reuses the
    slots of evicted episodes)."""
    ok = np.ones(len(table["episode_id"]), bool)
    slots = store.index.slots
    positions = table["episode_id"] % slots if slots else table["episode_id"]
    for name, dtype in index_columns(store.layout.version).items():
        size = int(store.zarr_array(f"episodes/{name}").chunks[0])
        bits = np.dtype(f"<u{np.dtype(dtype).itemsize}")  # compared as bits: a NaN return equals itself
        column = np.zeros(max((c + 1) * size for c, _ in pieces[name]) if pieces[name] else 0, bits)
        for c, raw in pieces[name]:
            rows = np.frombuffer(raw, bits)[:size]
            column[c * size : c * size + len(rows)] = rows
        have = positions < len(column)
        ok &= have
        ok[have] &= column[positions[have]] == np.ascontiguousarray(table[name][have]).view(bits)
    return ok


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    """``her-store copy SRC DEST``."""
    parser.add_argument("src", help="the store to copy: a local path, s3://bucket/name or http(s)://... (read only)")
    parser.add_argument(
        "dest", help="where to: a new local path or s3://bucket/name (an interrupted copy there resumes)"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.epilog = (
        "Only the chunks holding committed rows are copied. An uncompressed array (the low-dimensional fields, by "
        "default) travels as whole chunks: object storage has no holes and Zarr reads such a chunk only whole, so the "
        "rows of its chunks not yet written are sent as zeros (a local chunk holds up to 1,048,576 rows; a local DEST "
        "keeps them as holes). For sharing, compressed arrays (the default for images) or a smaller chunk_rows send "
        "less."
    )


def run(args: argparse.Namespace) -> int:
    """Run ``her-store copy``; 0 on success."""
    print(_summary(copy_store(args.src, args.dest, progress=not args.quiet)))
    return 0


def _summary(r: CopyResult) -> str:
    """The line ``her-store copy`` ends with: what was copied, and the bytes written or sent."""
    local = "://" not in r.dest  # as storage.Location tells a path from a URL
    zeros = (
        f" ({r.bytes_zero / 1e6:.1f} MB of zeros: "
        + ("left as holes)" if local else "rows not yet written of uncompressed chunks, which travel whole)")
        if r.bytes_zero
        else ""
    )
    return (
        f"copied {r.episodes:,} episodes ({r.transitions:,} transitions, commit generation {r.generation}) "
        f"to {r.dest}: "
        f"{r.files_copied} files, {r.bytes_copied / 1e6:.1f} MB {'written' if local else 'sent'}{zeros} in "
        f"{r.seconds:.1f} s" + (f", {r.files_skipped} already copied by an earlier run" if r.files_skipped else "")
    )
