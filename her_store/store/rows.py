"""Where rows are gathered: :class:`ChunkReader`, arbitrary rows of a store's arrays straight from their chunks.

It reads past zarr's own read path, whose indexing costs tens of milliseconds per 1,024 random rows.

Each array gets the reader that suits its storage:
- uncompressed arrays whose chunks are local files: memory-mapped (:class:`~her_store.store.mapped_rows.MappedArray`);
  with ``io_threads`` > 0 a gather is split across a thread pool, so the page faults of a cold store (one larger than
  RAM) are served in parallel, at the disk's queue depth rather than one read at a time;
- image arrays (frame files): one byte range and one decode per frame, decoded in C across threads
  (:class:`~her_store.store.frame_rows.FrameArray`); a sampler assembles the rest of its batch meanwhile
  (:meth:`ChunkReader.gather_later`);
- uncompressed arrays on object storage or HTTP: blocks of about 1 MiB of rows by concurrent ranged GETs into a
  bounded cache (:class:`~her_store.store.cached_rows.RangedArray`);
- other compressed arrays (format version 1): whole chunks, decoded into a bounded cache
  (:class:`~her_store.store.cached_rows.CachedArray`).
Commits and ring evictions change chunks after they are cached, so what is cached carries the committed end under
which it was read, and every commit seen is recorded (:meth:`ChunkReader.observe`): a cached chunk serves a gather
only while no episode at or past its tag reaches it.
"""

from __future__ import annotations

import errno
import os
import resource
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

from her_store.checks import check_int
from her_store.errors import StoreError
from her_store.forks import reset_in_child
from her_store.store.cached_rows import CachedArray, RangedArray
from her_store.store.frame_rows import FrameArray
from her_store.store.index import IndexView
from her_store.store.mapped_rows import MappedArray
from her_store.store.split import CORES, done

if TYPE_CHECKING:
    from her_store.store.episode_store import EpisodeStore

__all__ = ["ChunkReader"]

MIN_ROWS_PER_THREAD = 16  # below this a thread costs more than the rows it reads
MIN_FRAMES_PER_THREAD = 4  # a compressed frame costs a decode: worth a thread from a few on


class ChunkReader:
    """Row gathers for every array of a store.

    Parameters
    ----------
    store : EpisodeStore
        The store to read (its committed rows): pass each committed view to :meth:`observe` before gathering
        rows of its episodes.
    io_threads : int, optional
        Threads a gather is split across (0: gather in the calling thread). Use 8-32 for a store larger than
        RAM: page faults then overlap. Default: one per core when the store has sharded (compressed image) arrays,
        whose frames are decoded in these threads; else 0, fastest for rows in the page cache.
    cache_bytes : int
        Bound of the LRU cache of each compressed or remote array (decoded chunks; fetched shards on object
        storage).

    Examples
    --------
    >>> reader = ChunkReader(store)  # doctest: +SKIP
    >>> reader.observe(store.snapshot())  # doctest: +SKIP
    >>> rows = reader.gather("packs/float32", np.array([0, 5, 9]))  # doctest: +SKIP
    """

    def __init__(self, store: EpisodeStore, io_threads: int | None = None, cache_bytes: int = 32 << 20) -> None:
        io_threads = check_int(io_threads, "io_threads", low=0, or_none=True)
        cache_bytes = check_int(cache_bytes, "cache_bytes", low=0)
        self.arrays: dict[str, MappedArray | CachedArray] = {}
        backend = store.backend
        for spec in store.layout.arrays:
            array = store.zarr_array(spec.path)
            if spec.sharded:
                self.arrays[spec.path] = FrameArray(array, spec, cache_bytes, backend)
            elif backend.mappable and not spec.compressed:
                self.arrays[spec.path] = MappedArray(backend, spec)
            elif not spec.compressed:
                self.arrays[spec.path] = RangedArray(array, spec, cache_bytes, backend)
            else:
                self.arrays[spec.path] = CachedArray(array, spec, cache_bytes, backend, fetch=backend.read_bytes)
        sharded = any(isinstance(a, FrameArray) for a in self.arrays.values())
        # decoding frames is CPU work, one thread per core by default; rows in the page cache are fastest gathered
        # in the calling thread, so the default splits only decoding
        self.io_threads = 0 if io_threads is None else io_threads
        self.decode_threads = CORES if io_threads is None and sharded else self.io_threads
        self._threads = max(self.io_threads, self.decode_threads)
        self._threads_of: ThreadPoolExecutor | None = None
        self._threads_pid = -1
        self._end = 0  # one past the newest episode id observed
        self._lock = threading.Lock()
        reset_in_child(self)

    @property
    def _pool(self) -> ThreadPoolExecutor | None:
        """The reader's threads (None for none), started at the first gather of each process: a forked child has
        none of its parent's, and a gather handed to them waited forever."""
        if self._threads and self._threads_pid != os.getpid():
            self._threads_of = ThreadPoolExecutor(self._threads, thread_name_prefix="her_store-io")
            self._threads_pid = os.getpid()
        return self._threads_of

    def gather(self, path: str, rows: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Rows ``rows`` of array ``path`` as ``(len(rows), *row_shape)``."""
        arr = self.arrays[path]
        rows = np.asarray(rows, np.int64)
        if out is None:
            out = np.empty((len(rows), *arr.spec.row_shape), arr.spec.dtype)
        if len(rows) == 0:
            return out
        try:
            return self._gather(arr, rows, out)
        except OSError as e:
            if e.errno != errno.EMFILE:
                raise
            raise self._out_of_files(path) from e

    def gather_later(self, path: str, rows: np.ndarray) -> tuple[np.ndarray, Callable[[], None]]:
        """:meth:`gather`, started: rows ``rows`` of array ``path`` go into the array returned at once, complete when
        the function returned with it has been called (it raises what the gather raises). A compressed local image
        array's frames are meanwhile decoded on the reader's threads, so the caller can assemble the rest of a batch
        while they are; other arrays are gathered before this returns.

        Examples
        --------
        >>> frames, finish = reader.gather_later("steps/observation", np.array([0, 5, 9]))  # doctest: +SKIP
        >>> finish()  # doctest: +SKIP
        """
        arr = self.arrays[path]
        rows = np.asarray(rows, np.int64)
        if not isinstance(arr, FrameArray) or len(rows) == 0:
            return self.gather(path, rows), done
        out = np.empty((len(rows), *arr.spec.row_shape), arr.spec.dtype)
        try:
            pending = arr.start(rows, out, self._pool, self._decode_parts(len(rows)))
        except OSError as e:
            if e.errno != errno.EMFILE:
                raise
            raise self._out_of_files(path) from e
        return out, pending

    def _decode_parts(self, n: int) -> int:
        """The pieces a gather of ``n`` frames is decoded in (one per decoding thread, a few frames each at least)."""
        return min(self.decode_threads, n // MIN_FRAMES_PER_THREAD)

    @staticmethod
    def _out_of_files(path: str) -> StoreError:
        """What a gather raises when the process ran out of file descriptors (EMFILE): what to do about it."""
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return StoreError(
            f"{path}: out of file descriptors (the process may have {soft:,} open): every sampler and writer of "
            "the process shares a bound on the files it keeps open, but each keeps a few at least; raise the "
            "limit (ulimit -n, resource.setrlimit) or close the samplers no longer used"
        )

    def _gather(self, arr: MappedArray | CachedArray, rows: np.ndarray, out: np.ndarray) -> np.ndarray:
        n = len(rows)
        if isinstance(arr, FrameArray):
            arr.gather_split(rows, out, self._pool, self._decode_parts(n))
            return out
        if self._pool is None or self.io_threads == 0 or n < 2 * MIN_ROWS_PER_THREAD:
            arr.gather(rows, out)
            return out
        parts = min(self.io_threads, n // MIN_ROWS_PER_THREAD)
        edges = np.linspace(0, n, parts + 1).astype(np.int64)

        def work(i: int) -> None:
            arr.gather(rows[edges[i] : edges[i + 1]], out[edges[i] : edges[i + 1]])

        list(self._pool.map(work, range(parts)))
        return out

    def observe(self, view: IndexView) -> None:
        """Take note of the episodes committed up to ``view.end``, before gathering their rows.

        Cached chunks that episodes committed since the previous call reach (rows written into a partly filled
        chunk, ring rows overwritten) are read again by the next gather that needs them, and only those.
        Uncompressed local arrays are memory-mapped, always current, and need nothing.

        Parameters
        ----------
        view : IndexView
            A committed view (every row of its episodes is on disk), at least as new as any view passed before
            whose rows are still gathered.

        Examples
        --------
        >>> reader.observe(store.snapshot())  # doctest: +SKIP
        """
        cached = [a for a in self.arrays.values() if isinstance(a, CachedArray)]
        with self._lock:
            if view.end <= self._end or not cached:
                self._end = max(self._end, view.end)
                return
            # episodes between the last end seen and this view's first were evicted unseen: no gather asks for them
            k = max(self._end, view.first) - view.first
            for arr in cached:
                arr.committed(view.first + k, view.start_rows[k:], view.lengths[k:], view.end)
            self._end = view.end

    def after_fork(self) -> None:
        """In a forked child: the locks made anew, and what the parent's gathers may have been changing (caches,
        open shards, the commits recorded) dropped, to be read again; the next :meth:`observe` records every
        committed episode."""
        self._lock = threading.Lock()
        self._end = 0
        for arr in self.arrays.values():
            arr.after_fork()

    def evict_page_cache(self) -> None:
        """Make the next reads cold: page cache of local arrays dropped, decoded-chunk caches emptied."""
        for arr in self.arrays.values():
            arr.evict_page_cache()

    def close(self) -> None:
        if self._threads_of is not None and self._threads_pid == os.getpid():
            self._threads_of.shutdown(wait=True)
        self._threads_of, self._threads = None, 0
        for arr in self.arrays.values():
            arr.close()
