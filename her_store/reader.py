"""ChunkReader: gathers of arbitrary rows straight from the chunks, past zarr's own read path.

zarr's indexing costs tens of milliseconds per 1,024 random rows (FACTS.md), so rows are gathered here:
- uncompressed arrays on local disk: the raw chunk files are memory-mapped (MADV_RANDOM: no readahead for
  random rows) and gathered with numpy fancy indexing. With ``io_threads`` > 0 a gather is split across a
  thread pool; numpy releases the GIL while it copies, so the page faults of a cold store (one larger than RAM)
  are served in parallel, at the disk's queue depth rather than one read at a time.
- compressed arrays (images) or any array on object storage: whole chunks are read (one GET each remotely),
  decoded by zarr and kept in a bounded LRU cache of decoded chunks. Commits and ring evictions change chunks
  after they are cached, so each cached chunk carries the committed end under which it was read, and each array
  records the newest episode whose rows reach each chunk (:meth:`ChunkReader.observe`): a cached chunk serves a
  gather only while no episode at or past its tag reaches it.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import zarr

from her_store.errors import CorruptStoreError
from her_store.format import ArraySpec
from her_store.index import IndexView
from her_store.storage import chunk_key, drop_page_cache

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
        self._mmaps: dict[int, mmap.mmap] = {}
        self._lock = threading.Lock()

    def _file(self, chunk: int) -> str:
        return os.path.join(self.root, chunk_key(self.spec.path, chunk, 1 + len(self.spec.row_shape)))

    def _map(self, chunk: int) -> np.ndarray:
        view = self._maps.get(chunk)
        if view is not None:
            return view
        with self._lock:
            view = self._maps.get(chunk)
            if view is None:
                with open(self._file(chunk), "rb") as f:
                    m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                if self.random_access:
                    m.madvise(mmap.MADV_RANDOM)
                view = np.frombuffer(m, self.spec.dtype).reshape(-1, *self.spec.row_shape)
                self._mmaps[chunk] = m
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
        """Drop this array's pages from memory, for cold-start measurements: the mapping's pages (MADV_DONTNEED;
        mapped pages survive fadvise) and then the file's page cache (written back first, POSIX_FADV_DONTNEED)."""
        for m in self._mmaps.values():
            m.madvise(mmap.MADV_DONTNEED)
        chunk = 0
        while os.path.exists(self._file(chunk)):
            drop_page_cache(self._file(chunk))
            chunk += 1

    def close(self) -> None:
        self._maps.clear()  # each mmap closes when its last view is gone
        self._mmaps.clear()


def _chunk_decoder(array: Any, spec: ArraySpec) -> Callable[[bytes], np.ndarray] | None:
    """Decode a raw chunk without zarr's per-call machinery (about 1 ms a chunk), for the common codec chains:
    bytes alone, or bytes + Zstd / Blosc. Other chains return None and are read through zarr."""
    import numcodecs
    import zarr.codecs as zc

    codecs = list(array.metadata.codecs)
    if not codecs or not isinstance(codecs[0], zc.BytesCodec) or codecs[0].endian not in (None, zc.Endian.little):
        return None
    shape = (spec.chunk_rows, *spec.row_shape)
    if len(codecs) == 1:
        decompress = None
    elif len(codecs) == 2 and isinstance(codecs[1], zc.ZstdCodec):
        decompress = numcodecs.Zstd().decode
    elif len(codecs) == 2 and isinstance(codecs[1], zc.BloscCodec):
        decompress = numcodecs.Blosc().decode  # a Blosc frame carries its own settings
    else:
        return None

    nbytes = int(np.prod(shape, dtype=np.int64)) * spec.dtype.itemsize

    def decode(raw: bytes) -> np.ndarray:
        if decompress is None:
            if len(raw) != nbytes:
                raise ValueError(f"{len(raw)} bytes, expected {nbytes}")
            return np.frombuffer(raw, spec.dtype).reshape(shape)
        out = np.empty(shape, spec.dtype)
        # into a buffer of the chunk's own size: a frame whose header claims more is refused, never allocated
        decompress(raw, out=out.reshape(-1).view(np.uint8))
        return out

    return decode


class CachedArray:
    """A compressed or remote array read chunk by chunk into an LRU cache of decoded chunks.

    A chunk is one read (one GET on object storage), decoded once, then served from the cache until an episode
    committed after it was read reaches it (see :meth:`committed`).
    """

    def __init__(
        self,
        array: Any,
        spec: ArraySpec,
        cache_bytes: int,
        fetch: Callable[[str], bytes | None] | None = None,
        root: str | None = None,
    ) -> None:
        self.array = array
        self.root = root  # local directory of the store (page-cache eviction), None on object storage
        self.spec = spec
        self.chunk_rows = spec.chunk_rows
        self.chunk_nbytes = spec.chunk_rows * spec.row_nbytes
        self.capacity = max(1, cache_bytes // max(1, self.chunk_nbytes))
        self._fetch = fetch
        self._decode = _chunk_decoder(array, spec) if fetch is not None else None
        # chunk -> (tag, decoded rows): every row of an episode with id < tag was on disk before the read began
        self._cache: OrderedDict[int, tuple[int, np.ndarray]] = OrderedDict()
        self._newest = np.full(0, -1, np.int64)  # per chunk: the newest committed episode whose rows reach it
        self._end = 0  # every episode below this id is recorded in _newest
        self._lock = threading.Lock()  # the prefetch thread gathers while the sampler's thread records commits
        self.hits = self.misses = 0

    def committed(self, first: int, start_rows: np.ndarray, lengths: np.ndarray, end: int) -> None:
        """Record episodes ``first, first + 1, ...`` (rows ``start_row .. start_row + length``), committed with
        every id below ``end``: cached chunks their rows reach are read again by the gathers that need them."""
        cr = self.chunk_rows
        c0 = np.asarray(start_rows, np.int64) // cr
        span = (np.asarray(start_rows, np.int64) + lengths) // cr - c0 + 1
        total = int(span.sum())
        offset = np.arange(total) - np.repeat(np.cumsum(span) - span, span)
        chunks = np.repeat(c0, span) + offset
        ids = np.repeat(np.arange(first, first + len(c0), dtype=np.int64), span)
        with self._lock:
            if total and int(chunks.max()) >= len(self._newest):
                grown = np.full(max(int(chunks.max()) + 1, 2 * len(self._newest)), -1, np.int64)
                grown[: len(self._newest)] = self._newest
                self._newest = grown
            np.maximum.at(self._newest, chunks, ids)
            self._end = max(self._end, end)

    def _load(self, chunk: int) -> np.ndarray:
        key = chunk_key(self.spec.path, chunk, 1 + len(self.spec.row_shape))
        try:
            if self._decode is not None and self._fetch is not None:
                raw = self._fetch(key)
                if raw is None:  # never written: fill value
                    return np.zeros((self.chunk_rows, *self.spec.row_shape), self.spec.dtype)
                return self._decode(raw)
            r0 = chunk * self.chunk_rows
            if r0 + self.chunk_rows > self.array.shape[0]:  # the writer grew the array since it was opened here
                self.array = zarr.open_array(self.array.store_path.store, path=self.array.path, mode="r")
            return np.asarray(self.array[r0 : r0 + self.chunk_rows])
        except (ValueError, RuntimeError, TypeError) as e:  # what numcodecs and zarr raise for undecodable bytes
            raise CorruptStoreError(f"chunk {key} cannot be decoded with its array's codecs ({e})") from e

    def _chunk(self, chunk: int) -> np.ndarray:
        with self._lock:
            hit = self._cache.get(chunk)
            newest = int(self._newest[chunk]) if chunk < len(self._newest) else -1
            # a gather asks only for rows of recorded episodes: if none at or past the tag reaches this chunk,
            # every row asked for was on disk when the chunk was read
            if hit is not None and newest < hit[0]:
                self._cache.move_to_end(chunk)
                self.hits += 1
                return hit[1]
            tag = self._end  # read before the chunk: episodes below it were committed before the read
        buf = self._load(chunk)
        with self._lock:
            self.misses += 1
            self._cache[chunk] = (tag, buf)
            self._cache.move_to_end(chunk)
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
        return buf

    def gather(self, rows: np.ndarray, out: np.ndarray) -> None:
        cr = self.chunk_rows
        chunk = rows // cr
        order = np.argsort(chunk, kind="stable")
        bounds = np.flatnonzero(np.diff(chunk[order])) + 1
        for sel in np.split(order, bounds):
            c = int(chunk[sel[0]])
            out[sel] = self._chunk(c)[rows[sel] - c * cr]

    def evict_page_cache(self) -> None:
        """Empty the decoded-chunk cache, and drop local chunk files from the page cache (cold reads)."""
        with self._lock:
            self._cache.clear()
        if self.root is not None:
            for d, _, files in os.walk(os.path.join(self.root, self.spec.path, "c")):
                for f in files:
                    drop_page_cache(os.path.join(d, f))

    def close(self) -> None:
        self._cache.clear()


class ChunkReader:
    """Row gathers for every array of a store.

    Parameters
    ----------
    store : EpisodeStore
        The store to read (its committed rows): pass each committed view to :meth:`observe` before gathering
        rows of its episodes.
    io_threads : int
        Threads a gather is split across (0: gather in the calling thread). Use 8-32 for a store larger than
        RAM: page faults then overlap; for a store in the page cache, 0 is fastest.
    cache_bytes : int
        Bound of the decoded-chunk LRU cache of each compressed or remote array.

    Examples
    --------
    >>> reader = ChunkReader(store)  # doctest: +SKIP
    >>> reader.observe(store.snapshot())  # doctest: +SKIP
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
                self.arrays[spec.path] = CachedArray(
                    store._root[spec.path], spec, cache_bytes, fetch=loc.read_bytes, root=loc.root if loc.is_local else None
                )
        self._pool = ThreadPoolExecutor(self.io_threads, thread_name_prefix="her_store-io") if self.io_threads else None
        self._end = 0  # one past the newest episode id observed
        self._lock = threading.Lock()

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
