"""ChunkReader: gathers of arbitrary rows straight from the chunks, past zarr's own read path.

zarr's indexing costs tens of milliseconds per 1,024 random rows (FACTS.md), so rows are gathered here:
- uncompressed arrays on local disk: the raw chunk files are memory-mapped (MADV_RANDOM: no readahead for
  random rows) and gathered with numpy fancy indexing. With ``io_threads`` > 0 a gather is split across a
  thread pool; numpy releases the GIL while it copies, so the page faults of a cold store (one larger than RAM)
  are served in parallel, at the disk's queue depth rather than one read at a time.
- compressed arrays (images) or any array on object storage: whole chunks are read (one GET each remotely),
  decoded by zarr and kept in a bounded LRU cache of decoded chunks.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

from her_store.format import ArraySpec
from her_store.storage import chunk_key

if TYPE_CHECKING:
    from her_store.store import EpisodeStore

__all__ = ["ChunkReader", "MappedArray", "CachedArray"]

MIN_ROWS_PER_THREAD = 16  # below this a thread costs more than the rows it reads


class MappedArray:
    """An uncompressed local array whose chunk files are memory-mapped on first use."""

    def __init__(self, root: str, spec: ArraySpec, random_access: bool = True) -> None:
        self.spec = spec
        self.root = root
        self.chunk_rows = spec.chunk_rows
        self.random_access = random_access
        self._maps: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()

    def _map(self, chunk: int) -> np.ndarray:
        view = self._maps.get(chunk)
        if view is not None:
            return view
        with self._lock:
            view = self._maps.get(chunk)
            if view is None:
                name = os.path.join(self.root, chunk_key(self.spec.path, chunk, 1 + len(self.spec.row_shape)))
                with open(name, "rb") as f:
                    m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                if self.random_access:
                    m.madvise(mmap.MADV_RANDOM)
                view = np.frombuffer(m, self.spec.dtype).reshape(-1, *self.spec.row_shape)
                self._maps[chunk] = view
        return view

    def gather(self, rows: np.ndarray, out: np.ndarray) -> None:
        """``out[i] = array[rows[i]]``; rows must be committed (their chunk files exist)."""
        cr = self.chunk_rows
        chunk = rows // cr
        lo, hi = int(chunk.min()), int(chunk.max())
        if lo == hi:
            np.take(self._map(lo), rows - lo * cr, axis=0, out=out)
            return
        for c in range(lo, hi + 1):
            sel = np.flatnonzero(chunk == c)
            if sel.size:
                out[sel] = self._map(c)[rows[sel] - c * cr]

    def evict_page_cache(self) -> None:
        """Drop this array's pages from the OS page cache (posix_fadvise DONTNEED): a cold start, for benchmarks."""
        for chunk in range(0, 1 << 30):
            name = os.path.join(self.root, chunk_key(self.spec.path, chunk, 1 + len(self.spec.row_shape)))
            if not os.path.exists(name):
                break
            fd = os.open(name, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    def close(self) -> None:
        self._maps.clear()  # the mmap closes when its last view is gone


class CachedArray:
    """A compressed or remote array read chunk by chunk through zarr into an LRU cache of decoded chunks."""

    def __init__(self, array: object, spec: ArraySpec, cache_bytes: int) -> None:
        self.array = array
        self.spec = spec
        self.chunk_rows = spec.chunk_rows
        self.chunk_nbytes = spec.chunk_rows * spec.row_nbytes
        self.capacity = max(1, cache_bytes // max(1, self.chunk_nbytes))
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def _chunk(self, chunk: int) -> np.ndarray:
        with self._lock:
            buf = self._cache.get(chunk)
            if buf is not None:
                self._cache.move_to_end(chunk)
                self.hits += 1
                return buf
        r0 = chunk * self.chunk_rows
        buf = np.asarray(self.array[r0 : r0 + self.chunk_rows])  # one chunk: one read, one decode
        with self._lock:
            self.misses += 1
            self._cache[chunk] = buf
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
        return buf

    def gather(self, rows: np.ndarray, out: np.ndarray) -> None:
        cr = self.chunk_rows
        chunk = rows // cr
        order = np.argsort(chunk, kind="stable")
        sorted_chunks = chunk[order]
        bounds = np.flatnonzero(np.diff(sorted_chunks)) + 1
        for sel in np.split(order, bounds):
            c = int(chunk[sel[0]])
            out[sel] = self._chunk(c)[rows[sel] - c * cr]

    def evict_page_cache(self) -> None:
        with self._lock:
            self._cache.clear()

    def close(self) -> None:
        self._cache.clear()


class ChunkReader:
    """Row gathers for every array of a store.

    Parameters
    ----------
    store : EpisodeStore
        The store to read (its committed rows).
    io_threads : int
        Threads a gather is split across (0: gather in the calling thread). Use 8-32 for a store larger than
        RAM: page faults then overlap; for a store in the page cache, 0 is fastest.
    cache_bytes : int
        Bound of the decoded-chunk LRU cache of each compressed or remote array.

    Examples
    --------
    >>> reader = ChunkReader(store)  # doctest: +SKIP
    >>> rows = reader.gather("packs/float32", np.array([0, 5, 9]))  # doctest: +SKIP
    """

    def __init__(self, store: EpisodeStore, io_threads: int = 0, cache_bytes: int = 32 << 20) -> None:
        self.io_threads = int(io_threads)
        self.arrays: dict[str, MappedArray | CachedArray] = {}
        loc = store._loc
        for spec in store.layout.arrays:
            if loc.is_local and not spec.compressed:
                self.arrays[spec.path] = MappedArray(loc.root, spec)
            else:
                self.arrays[spec.path] = CachedArray(store._root[spec.path], spec, cache_bytes)
        self._pool = ThreadPoolExecutor(self.io_threads, thread_name_prefix="her_store-io") if self.io_threads else None

    def gather(self, path: str, rows: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Rows ``rows`` of array ``path`` as ``(len(rows), *row_shape)``."""
        arr = self.arrays[path]
        rows = np.asarray(rows, np.int64)
        if out is None:
            out = np.empty((len(rows), *arr.spec.row_shape), arr.spec.dtype)
        if len(rows) == 0:
            return out
        n = len(rows)
        if self._pool is None or n < 2 * MIN_ROWS_PER_THREAD:
            arr.gather(rows, out)
            return out
        parts = min(self.io_threads, n // MIN_ROWS_PER_THREAD)
        edges = np.linspace(0, n, parts + 1).astype(np.int64)
        work: Callable[[int], None] = lambda i: arr.gather(rows[edges[i] : edges[i + 1]], out[edges[i] : edges[i + 1]])  # noqa: E731
        list(self._pool.map(work, range(parts)))
        return out

    def evict_page_cache(self) -> None:
        """Make the next reads cold: page cache of local arrays dropped, decoded-chunk caches emptied."""
        for arr in self.arrays.values():
            arr.evict_page_cache()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for arr in self.arrays.values():
            arr.close()
