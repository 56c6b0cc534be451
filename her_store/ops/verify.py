"""``her-store verify``: check a store against FORMAT.md and every live episode's crc32, reading chunk files in order.

Opening a store (:meth:`EpisodeStore.open`) already checks its attributes, its arrays' metadata, the commit record
against the store and the index (episode ids, row ranges inside the arrays, no two live episodes sharing a row, the
lengths against ``num_transitions``); a store it refuses is reported with that reason. :func:`verify` then checks
what opening does not read: every chunk file and frame file holding committed rows (present, of its size, a frame
file's index parsing and holding every committed row), every live episode's crc32 (the rule of FORMAT.md, Checksums,
computed from chunk files read in order, a frame file in one read and a raw chunk in pieces of PIECE_BYTES, into
buffers used again, the next reads under way while the current one is checksummed), and what a commit that never
completed left past the record (index rows of ids never committed; an unbounded store's rows past ``write_row``, of
which only the file's data is read, not its holes), and in any store the chunks holding no committed row that a
writer could not read or write in place (something else in their place, a file with another hard link).
:mod:`her_store.ops.repair` mends what it finds.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from her_store import _kernels
from her_store.errors import CorruptStoreError
from her_store.format.frames import parse_index, shard_limit
from her_store.format.keys import LOCK_KEY, chunk_of
from her_store.format.layout import ArraySpec
from her_store.ops.repair_plan import plan_of, spill_dir
from her_store.ops.report import Problem, Report, id_ranges
from her_store.progress import progress as progress_bar
from her_store.storage import Backend, open_backend
from her_store.storage.files import data_runs
from her_store.store.episode_store import EpisodeStore
from her_store.store.index import EpisodeIndex, chunks_holding

__all__ = ["Problem", "Report", "id_ranges", "verify"]

INDEX_TAIL_PIECE = 4096  # index positions read at a time when looking for rows of ids never committed
READ_AHEAD = 64 << 20  # bytes of chunk files read ahead of the one being checked
READ_THREADS = 4  # reads in flight: small files (shards) keep the disk's queue filled
PIECE_BYTES = 16 << 20  # a raw chunk is read and checksummed this much at a time (whole rows)
SPARE_BYTES = READ_AHEAD + PIECE_BYTES  # read buffers kept for later reads, at most: as many as are read ahead
SPARE_MIN = 256 << 10  # smaller reads are not kept: malloc serves them from memory used before, without a page fault


def verify(
    store_or_path: EpisodeStore | str | os.PathLike[str],
    *,
    checksums: bool = True,
    progress: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> Report:
    """Check a store against every invariant of FORMAT.md and (``checksums``) every live episode's crc32.

    Parameters
    ----------
    store_or_path : EpisodeStore, str or PathLike
        An open store (any mode), or a path or URL, opened read-only here.
    checksums : bool
        Read every committed row and check each episode's crc32; False checks the files' presence, sizes and shard
        indexes and what lies past the commit only.
    progress : bool
        Show a progress bar over the bytes read.
    storage_options : dict, optional
        fsspec options for a URL.

    Returns
    -------
    Report
        ``report.clean`` when nothing is wrong; otherwise ``report.problems`` say what and which episodes. A store
        that :meth:`EpisodeStore.open` refuses gives one problem of kind ``"open"`` with its reason.

    Raises
    ------
    NotAStoreError
        The path holds no store at all.

    Examples
    --------
    >>> report = verify("runs/fetch")  # doctest: +SKIP
    >>> report.clean, report.bytes_read / report.seconds  # doctest: +SKIP
    (True, 1.2e9)
    """
    t0 = time.perf_counter()
    if isinstance(store_or_path, EpisodeStore):
        return _Check(store_or_path, checksums, progress).run(t0)
    try:
        store = EpisodeStore.open(store_or_path, storage_options=storage_options)
    except CorruptStoreError as e:
        where = str(open_backend(store_or_path, storage_options))
        return Report(where, [Problem("open", f"the store cannot be opened: {e}")])
    with store:
        report = _Check(store, checksums, progress).run(t0)
        writer = store.backend.active_writer(LOCK_KEY)
        if writer is not None:  # rows past the commit are a live writer's work in progress, not a crash's leftovers
            report.notes += [f"{p} (being written by {writer})" for p in report.problems if p.kind == "uncommitted"]
            report.problems = [p for p in report.problems if p.kind != "uncommitted"]
            report.tail_positions, report.tail_chunks, report.junk_chunks = [], {}, {}
        plan = plan_of(store.url) if store.backend.local_directory() is not None else None
        if plan is not None and store.commit_record.generation != plan["generation"]:  # the cut was committed
            waiting = plan["count"] - max(0, store.end_episode - plan["cut"])
            report.problems.append(Problem(
                "repair", f"a repair was interrupted: {waiting} good episodes it was moving wait in "
                f"{spill_dir(store.url)}; run verify --repair to finish it"))
    return report


class _Check:
    """One pass over a store: files and checksums array by array, in layout order (the crc32 chain's order)."""

    def __init__(self, store: EpisodeStore, checksums: bool, progress: bool) -> None:
        self.store, self.checksums, self.progress = store, checksums, progress
        self.loc: Backend = store.backend
        self.commit = store.commit_record
        table = store.episodes
        order = np.argsort(table["start_row"], kind="stable")  # row order (ring order too), for chunk-by-chunk reads
        self.ids = table["episode_id"][order]
        self.starts = table["start_row"][order].astype(np.int64)
        self.ends = self.starts + table["length"][order] + 1
        self.expected = table["crc32"][order].astype(np.int64)
        self.starts_list, self.ends_list = self.starts.tolist(), self.ends.tolist()  # for the loops over episodes
        self.crcs = np.zeros(len(order), np.uint32)  # running crc32 per episode, chained over arrays in layout order
        self.bad = np.zeros(len(order), bool)
        self.report = Report(store.url, episodes=len(order), transitions=int(table["length"].sum()))
        self._spare: list[np.ndarray] = []  # read buffers given back (_buffer), SPARE_MIN bytes or more each
        self._spare_bytes = 0
        self._spare_lock = threading.Lock()

    def run(self, t0: float) -> Report:
        chunks = [(spec, c) for spec in self.store.layout.arrays for c in self._chunks(spec)]
        sizes = [min(self._size(spec, c), self._limit(spec, c)) for spec, c in chunks] if self.loc.mappable else None
        bar = progress_bar(sum(sizes) if sizes else None, "verifying", self.progress, unit="B", unit_scale=True)
        jobs = [piece for spec, c in chunks for piece in self._pieces(spec, c)]
        with bar, ThreadPoolExecutor(READ_THREADS, thread_name_prefix="her_store-verify") as pool:
            for (spec, c, lo, hi), read in self._prefetched(pool, jobs):
                nbytes = self._check_chunk(spec, c, read, lo, hi)
                if read is not None:
                    self._give_back(read[0])
                self.report.bytes_read += nbytes
                bar.update(nbytes)
        r = self.report
        if self.checksums:
            failed = self.crcs.astype(np.int64) != self.expected
            failed &= ~self.bad
            if failed.any():
                r.problems.append(
                    Problem(
                        "checksum",
                        "rows do not match the crc32 recorded when they were written",
                        tuple(self.ids[failed].tolist()),
                    )
                )
            self.bad |= failed
        r.bad_episodes = np.sort(self.ids[self.bad])
        self._index_tail()
        self._data_tail()
        r.seconds = time.perf_counter() - t0
        return r

    # -- which files -----------------------------------------------------------------------------------------
    def _chunks(self, spec: ArraySpec) -> list[int]:
        """The chunks (shards) of an array holding committed rows, in order."""
        return chunks_holding(self.starts, self.ends, spec.chunk_rows)

    def _pieces(self, spec: ArraySpec, c: int) -> list[tuple[ArraySpec, int, int, int]]:
        """Chunk ``c``'s jobs, (spec, c, first byte, end byte) of the bytes to check: a raw chunk's checksummed rows in
        pieces of about PIECE_BYTES (whole rows), read into buffers used again; anything else in one."""
        limit = self._limit(spec, c)
        if spec.compressed or not self.checksums or limit == 0:
            return [(spec, c, 0, limit)]
        step = max(1, PIECE_BYTES // spec.row_nbytes) * spec.row_nbytes
        return [(spec, c, lo, min(lo + step, limit)) for lo in range(0, limit, step)]

    def _size(self, spec: ArraySpec, c: int) -> int:
        try:
            return self.loc.size(spec.chunk_key(c))
        except OSError:
            return 0

    def _limit(self, spec: ArraySpec, c: int, committed: bool = True) -> int:
        """The bytes of chunk (shard) ``c`` to read: a shard's all (at most what a shard may hold); a raw chunk's up to
        its last committed row (``committed``: rows past it are not checksummed), else all of it."""
        cr = spec.chunk_rows
        if spec.sharded:
            return shard_limit(cr, spec.row_nbytes)
        k = self._episodes_in(c * cr, (c + 1) * cr)
        if committed and len(k):
            return (min(self.ends_list[k.stop - 1], (c + 1) * cr) - c * cr) * spec.row_nbytes
        return cr * spec.row_nbytes

    def _read(
        self, spec: ArraySpec, c: int, start: int = 0, end: int | None = None, spare: bool = False
    ) -> tuple[bytes | memoryview | None, int, str | None]:
        """(the file's bytes ``start`` .. ``end``, by default a shard's all and a raw chunk's up to its last committed
        row (from ``start`` 0; all of it from another); its size; or why it cannot be read). A file that does not
        exist gives (None, 0, None). With ``spare``, a local file's bytes are read into a buffer a checked piece gave
        back (:meth:`_buffer`), as a memoryview of it: :meth:`_give_back` it once they are checked."""
        key = spec.chunk_key(c)
        end = self._limit(spec, c, start == 0) if end is None else end
        try:
            if self.loc.mappable:  # a file of its own, or a member of a packed store
                f, offset, size = self.loc.open_range(key)
                with f:
                    n = max(min(size, end) - start, 0)
                    if not spare:
                        return os.pread(f.fileno(), n, offset + start), size, None
                    return self._pread_spare(f.fileno(), n, offset + start), size, None
            size = self.loc.size(key)
            return self.loc.read_ranges([key], [start], [max(min(size, end), start)])[0], size, None
        except FileNotFoundError:
            return None, 0, None
        except (CorruptStoreError, OSError) as e:
            return None, 0, str(e)

    def _pread_spare(self, fd: int, n: int, at: int) -> memoryview:
        """Up to ``n`` bytes at ``at`` of ``fd``, read into a buffer of :meth:`_buffer` (:meth:`_give_back` it)."""
        view = memoryview(self._buffer(n))[:n]
        try:
            return view[: os.preadv(fd, [view], at)]
        except BaseException:
            self._give_back(view)
            raise

    def _buffer(self, n: int) -> np.ndarray:
        """A buffer of at least ``n`` bytes: the smallest one given back that holds them, else a new one. Bytes read
        into a new large buffer (one malloc maps afresh) cost a page fault per 4 KiB, the kernel zeroing
        each page first: as much time again as reading them from a fast disk."""
        if n < SPARE_MIN:
            return np.empty(n, np.uint8)
        with self._spare_lock:
            fits = [i for i, b in enumerate(self._spare) if len(b) >= n]
            if fits:
                b = self._spare.pop(min(fits, key=lambda i: len(self._spare[i])))
                self._spare_bytes -= b.nbytes
                return b
        return np.empty(-(-n // (64 << 10)) * (64 << 10), np.uint8)  # 64 KiB steps: shards of about a size share

    def _give_back(self, data: Any) -> None:
        """Keep the buffer under ``data`` (a memoryview :meth:`_read` returned) for later reads, up to SPARE_BYTES."""
        buf = data.obj if isinstance(data, memoryview) else None
        if not isinstance(buf, np.ndarray) or buf.nbytes < SPARE_MIN:
            return
        with self._spare_lock:
            if self._spare_bytes + buf.nbytes <= SPARE_BYTES:
                self._spare.append(buf)
                self._spare_bytes += buf.nbytes

    def _holds_bytes(self, spec: ArraySpec, c: int, start: int) -> bool:
        """Whether a local raw chunk's rows hold a byte other than zero from byte ``start`` on: its data read a piece at
        a time, past the holes of a file of its own (``SEEK_DATA``, ``SEEK_HOLE``: a hole reads as zeros, and the rows
        past ``write_row`` of a store are holes unless a commit stopped there). Raises what reading raises."""
        f, offset, size = self.loc.open_range(spec.chunk_key(c))
        size = min(size, spec.chunk_rows * spec.row_nbytes)  # past its rows, a file's bytes are no row's
        with f:
            fd = f.fileno()
            for pos, end in data_runs(fd, offset + size, offset + start):  # in the file (an archive's: the member's)
                while pos < end:
                    view = self._pread_spare(fd, min(PIECE_BYTES, end - pos), pos)
                    try:
                        if np.frombuffer(view, np.uint8).any():
                            return True
                    finally:
                        self._give_back(view)
                    if not len(view):
                        return False
                    pos += len(view)
        return False

    def _links(self, spec: ArraySpec, c: int) -> int:
        """How many names a raw chunk's file has (1 on object storage and in a packed store, where nothing is written
        in place)."""
        return self.loc.link_count(spec.chunk_key(c))

    def _prefetched(
        self, pool: ThreadPoolExecutor, jobs: list[tuple[ArraySpec, int, int, int]]
    ) -> Iterator[tuple[tuple[ArraySpec, int, int, int], Any]]:
        """The jobs with their bytes read (one large read each), up to READ_AHEAD bytes read ahead on the pool's
        threads while the current one is checked: the disk stays busy, with several reads queued."""

        def read(job: tuple[ArraySpec, int, int, int]) -> Any:
            spec, c, lo, hi = job
            if spec.compressed and not spec.sharded:
                return None  # a version 1 chunk: decoded through zarr
            return self._read(spec, c, lo, hi if self.checksums or spec.sharded else 0, spare=True)

        ahead: deque[tuple[tuple[ArraySpec, int, int, int], Future]] = deque()
        queued, at = 0, 0

        def fill() -> None:
            nonlocal queued, at
            while at < len(jobs) and (not ahead or queued < READ_AHEAD):
                job = jobs[at]
                ahead.append((job, pool.submit(read, job)))
                queued, at = queued + job[3] - job[2], at + 1

        for _ in jobs:
            fill()
            job, future = ahead.popleft()
            queued -= job[3] - job[2]
            fill()  # the next pieces are read while this one is checked, however large it is
            yield job, future.result()

    # -- one chunk or shard ----------------------------------------------------------------------------------
    def _episodes_in(self, r0: int, r1: int) -> range:
        """Positions (in row order) of the episodes with rows in ``[r0, r1)``."""
        return range(bisect.bisect_right(self.ends_list, r0), bisect.bisect_left(self.starts_list, r1))

    def _affected(self, k: range, r0: int, r1: int) -> tuple[int, ...]:
        """Ids of the episodes among ``k`` with rows in ``[r0, r1)``."""
        sel = np.arange(k.start, k.stop)
        sel = sel[(self.starts[sel] < r1) & (self.ends[sel] > r0)]
        return tuple(self.ids[sel].tolist())

    def _check_chunk(self, spec: ArraySpec, c: int, read: Any, lo: int, hi: int) -> int:
        """Check bytes ``lo`` .. ``hi`` of chunk (shard) ``c`` (a raw chunk's file-level checks with its last piece,
        when none of its pieces could not be read: such a chunk is reported as that alone); returns the bytes read."""
        cr, rb = spec.chunk_rows, spec.row_nbytes
        r0, r1 = c * cr, (c + 1) * cr
        k = self._episodes_in(r0, r1)
        where = f"{self.loc}/{spec.chunk_key(c)}"
        if spec.sharded:
            return self._check_shard(spec, c, read, k, where)
        if spec.compressed:  # a version 1 compressed chunk: decoded through zarr
            return self._check_v1_chunk(spec, c, k, where)
        data, size, error = read
        if error is not None:
            if spec.chunk_entry(c) not in self.report.damaged_files:  # once, whichever of its pieces failed
                self.report.problems.append(
                    Problem("file", f"{where} cannot be read: {error}", self._affected(k, r0, r1))
                )
                self.report.damaged_files.append(spec.chunk_entry(c))
                self.bad[k.start : k.stop] |= (self.starts[k.start : k.stop] < r1) & (self.ends[k.start : k.stop] > r0)
            return 0
        if hi >= self._limit(spec, c) and spec.chunk_entry(c) not in self.report.damaged_files:
            self._check_file(spec, c, data is not None, size, k, where)  # with its last piece: none failed
        if not self.checksums:
            return 0
        p0, p1 = r0 + lo // rb, r0 + hi // rb  # the piece's rows
        if len(data or b"") < hi - lo:  # FORMAT.md: what a raw chunk is missing reads as zeros
            data = bytes(data or b"").ljust(hi - lo, b"\0")
        pk = self._episodes_in(p0, p1)
        a = (np.maximum(self.starts[pk.start : pk.stop], p0) - p0) * rb
        b = (np.minimum(self.ends[pk.start : pk.stop], p1) - p0) * rb
        crcs = self.crcs[pk.start : pk.stop].copy()
        _kernels.crc32_runs(memoryview(data), a.astype(np.int64), b.astype(np.int64), crcs)  # one call, no GIL
        self.crcs[pk.start : pk.stop] = crcs
        return len(data)

    def _check_file(self, spec: ArraySpec, c: int, exists: bool, size: int, k: range, where: str) -> None:
        """A raw chunk's file: one name, its full size."""
        cr, rb = spec.chunk_rows, spec.row_nbytes
        r0, r1 = c * cr, (c + 1) * cr
        links = self._links(spec, c) if exists else 1
        if links > 1:
            self.report.problems.append(Problem(
                "file", f"{where} has {links} names (hard links): a writer, which writes its rows in place, refuses "
                "it; a repair gives the store a copy of its own"))
            self.report.linked_files.append(spec.chunk_key(c))
        want = cr * rb
        if size != want:
            # FORMAT.md: raw chunks are always full-size; what is missing reads as zeros (as the readers read it)
            have_rows = min(size, want) // rb
            what = (
                "is missing" if not exists else f"holds {size:,} bytes, expected {want:,} ({cr:,} rows of {rb} bytes)"
            )
            self.report.problems.append(Problem("file", f"{where} {what}", self._affected(k, r0 + have_rows, r1)))
            self.report.short_files.append((spec.chunk_key(c), want))

    def _check_shard(self, spec: ArraySpec, c: int, read: Any, k: range, where: str) -> int:
        cr = spec.chunk_rows
        r0, r1 = c * cr, (c + 1) * cr
        data, size, error = read
        if error is None and data is not None and size > len(data):
            error = f"it holds {size:,} bytes, more than a shard of {cr} rows may ({len(data):,})"
        offsets = None
        if error is None and data is not None:
            try:
                offsets, nbytes = parse_index(data, cr, where)
            except CorruptStoreError as e:
                error = str(e)
        if offsets is None:
            what = f"{where} is missing" if error is None else f"{where} cannot be read: {error}"
            self.report.problems.append(Problem("file", what, self._affected(k, r0, r1)))
            if error is not None:
                self.report.damaged_files.append(spec.chunk_entry(c))
            self.bad[k.start : k.stop] |= (self.starts[k.start : k.stop] < r1) & (self.ends[k.start : k.stop] > r0)
            return len(data or b"")
        view = memoryview(data)
        # consecutive rows whose bytes follow each other (how her_store writes a shard) are checksummed in one call
        follows = np.append(offsets[1:] == offsets[:-1] + nbytes[:-1], False)
        missing = []
        for i in k:
            a, b = max(int(self.starts[i]), r0) - r0, min(int(self.ends[i]), r1) - r0
            if (offsets[a:b] < 0).any():
                missing.append(int(self.ids[i]))
                self.bad[i] = True
            elif self.checksums:
                if follows[a : b - 1].all():
                    self.crcs[i] = _kernels.crc32(view[offsets[a] : offsets[b - 1] + nbytes[b - 1]], self.crcs[i])
                else:
                    for o, n in zip(offsets[a:b].tolist(), nbytes[a:b].tolist()):
                        self.crcs[i] = _kernels.crc32(view[o : o + n], self.crcs[i])
        if missing:
            self.report.problems.append(
                Problem("file", f"{where}: committed rows are missing from the shard", tuple(missing))
            )
        return len(data)

    def _check_v1_chunk(self, spec: ArraySpec, c: int, k: range, where: str) -> int:
        cr, rb = spec.chunk_rows, spec.row_nbytes
        r0, r1 = c * cr, (c + 1) * cr
        try:  # before zarr reads it: no link on its way, not a FIFO (zarr would follow the one, block on the other)
            self.loc.check_file(spec.chunk_key(c), shard_limit(cr, rb))
        except CorruptStoreError as e:
            self.report.problems.append(Problem("file", f"{where} cannot be read: {e}", self._affected(k, r0, r1)))
            self.report.damaged_files.append(spec.chunk_entry(c))
            self.bad[k.start : k.stop] |= (self.starts[k.start : k.stop] < r1) & (self.ends[k.start : k.stop] > r0)
            return 0
        if not self.loc.exists(spec.chunk_key(c)):
            self.report.problems.append(Problem("file", f"{where} is missing", self._affected(k, r0, r1)))
        if not self.checksums:
            return 0
        try:
            rows = np.ascontiguousarray(self.store.zarr_array(spec.path)[r0:r1])
        except (ValueError, RuntimeError, TypeError) as e:  # what numcodecs and zarr raise for undecodable bytes
            self.report.problems.append(Problem("file", f"{where} cannot be decoded ({e})", self._affected(k, r0, r1)))
            self.bad[k.start : k.stop] |= (self.starts[k.start : k.stop] < r1) & (self.ends[k.start : k.stop] > r0)
            return 0
        view = memoryview(rows).cast("B")
        for i in k:
            a, b = max(int(self.starts[i]), r0) - r0, min(int(self.ends[i]), r1) - r0
            self.crcs[i] = _kernels.crc32(view[a * rb : b * rb], self.crcs[i])
        return rows.nbytes

    # -- past the commit record ------------------------------------------------------------------------------
    def _index_tail(self) -> None:
        """Index rows of the ids after ``end_episode``, written by a commit whose record never replaced the old one."""
        store, c = self.store, self.commit
        slots = store.index.slots
        room = store.index_rows - c.end_episode if slots is None else slots - (c.end_episode - c.first_episode)
        found: list[int] = []
        at = c.end_episode
        while room > 0:
            n = min(INDEX_TAIL_PIECE, room)
            segments = EpisodeIndex(slots).positions(at, at + n)
            piece = EpisodeIndex.read(store.index_columns, segments)
            hit = (piece["episode_id"] == np.arange(at, at + n)) & (piece["length"] >= 1)
            take = n if hit.all() else int(np.argmin(hit))
            found.extend([pos for p, a, b in segments for pos in range(p, p + b - a)][:take])
            if take < n:
                break
            at, room = at + n, room - n
        if found:
            ids = range(c.end_episode, c.end_episode + len(found))
            self.report.tail_positions = found
            self.report.problems.append(
                Problem(
                    "uncommitted",
                    f"index rows of episodes {id_ranges(ids)} lie past the commit record (end_episode "
                    f"{c.end_episode}): a commit stopped before its record; readers ignore them and the next writer "
                    "overwrites them",
                )
            )

    def _existing(self, spec: ArraySpec, first: int) -> list[int]:
        """The chunks (shards) from ``first`` on that have a file, in order."""
        # chunk keys <path>/c/<i>/0... name a directory <i> under <path>/c; keys <path>/c.<i>.0... a file under <path>
        directory = f"{spec.path}/c" if spec.separator == "/" else spec.path
        names = self.loc.list_dir(directory)  # (a file in its place lists nothing: its committed chunks are reported)
        found = (chunk_of(n, spec.separator, 1 + len(spec.row_shape)) for n in names)
        return sorted(c for c in found if c is not None and c >= first)

    def _tail_chunk(self, spec: ArraySpec, c: int, ring: bool) -> bool | None:
        """Whether chunk (shard) ``c`` of the tail (:meth:`_data_tail`) holds data past ``write_row``: False also where
        that is not read (a ring's chunk, a compressed chunk that is no shard: those are only opened); None when it
        cannot be read or written in place (cut short, undecodable, a link or something else in its place, a raw chunk
        file with other names)."""
        w, cr, rb = self.commit.write_row, spec.chunk_rows, spec.row_nbytes
        if spec.compressed and not spec.sharded:
            # version 1 chunks are not decoded past the commit (the next writer overwrites them), only opened
            try:
                self.loc.check_file(spec.chunk_key(c), shard_limit(cr, rb))
            except CorruptStoreError:
                return None
            return False
        skip = 0 if ring else max(w - c * cr, 0)
        # a ring's raw chunk is only opened: whether it can be is all there is to know of it
        start = 0 if spec.sharded else skip * rb
        local_tail = not (spec.sharded or ring) and self.loc.mappable  # read past its holes (_holds_bytes)
        whole = spec.sharded or not (ring or local_tail)
        data, _, error = self._read(spec, c, start, None if whole else 0)
        nonzero = None
        if local_tail and error is None and data is not None:
            try:
                nonzero = self._holds_bytes(spec, c, start)
            except (CorruptStoreError, OSError) as e:
                error = str(e)
        if spec.sharded and error is None and data is not None:
            try:
                offsets, _ = parse_index(data, cr, spec.chunk_key(c))
            except CorruptStoreError as e:
                error = str(e)
        raw_linked = not spec.sharded and data is not None and self._links(spec, c) > 1
        if error is not None or spec.chunk_entry(c) in self.report.damaged_files or raw_linked:
            return None
        if ring or data is None:
            return False
        if spec.sharded:
            nonzero = (offsets[skip:] >= 0).any()
        elif nonzero is None:
            nonzero = np.frombuffer(data, np.uint8).any()
        return bool(nonzero)

    def _data_tail(self) -> None:
        """What lies in chunks (shards) that hold no committed row, or past ``write_row`` of an unbounded store: rows
        there hold nothing (zeros, or rows a shard never wrote) unless a commit stopped before its record; and a chunk
        there that cannot be read (a file cut short, a directory, a link or a file in its place) would fail the next
        writer, which reads or writes it, so it is reported too, in any store."""
        w, r = self.commit.write_row, self.report
        ring = self.store.capacity is not None
        for spec in self.store.layout.arrays:
            cr = spec.chunk_rows
            live = set(self._chunks(spec))
            held, junk = [], []
            for c in self._existing(spec, 0 if ring else w // cr):
                if ring and c in live:
                    continue  # checked with the committed rows; a ring's other rows are its evicted episodes'
                holds = self._tail_chunk(spec, c, ring)
                if holds is None:  # one holding committed rows is reported with them
                    if c not in live and (ring or c * cr >= w):
                        junk.append(c)
                elif holds:
                    held.append(c)
            if held:
                r.tail_chunks[spec.path] = held
                keys = ", ".join(spec.chunk_key(c) for c in held)
                r.problems.append(
                    Problem(
                        "uncommitted",
                        f"{spec.path}: rows past write_row {w:,} hold data that was never committed ({keys})",
                    )
                )
            if junk:
                r.junk_chunks[spec.path] = junk
                keys = ", ".join(spec.chunk_key(c) for c in junk)
                r.problems.append(
                    Problem(
                        "uncommitted",
                        f"{spec.path}: {keys} hold no committed row and cannot be read or written in place (something "
                        "else is in their place, or a file with other names); the next writer would fail on them, and "
                        "a repair removes them",
                    )
                )


