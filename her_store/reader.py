"""ChunkReader: gathers of arbitrary rows straight from the chunks, past zarr's own read path.

zarr's indexing costs tens of milliseconds per 1,024 random rows (FACTS.md), so rows are gathered here:
- uncompressed arrays on local disk: the raw chunk files are memory-mapped (MADV_RANDOM: no readahead for
  random rows) and gathered with numpy fancy indexing. With ``io_threads`` > 0 a gather is split across a
  thread pool; numpy releases the GIL while it copies, so the page faults of a cold store (one larger than RAM)
  are served in parallel, at the disk's queue depth rather than one read at a time.
- sharded arrays (compressed images, format version 2): each row is its own inner chunk, so a gathered row is one
  byte range of a shard (memory-mapped locally, the shard fetched whole in one GET remotely) and one decode,
  straight into the batch. Decoding is CPU work done in C without the GIL, so it is split across ``io_threads``
  (by default one per core).
- other compressed arrays (version 1) and uncompressed arrays on object storage: whole chunks are read (one GET
  each remotely), decoded and kept in a bounded LRU cache of decoded chunks.
Commits and ring evictions change chunks and shards after they are cached, so each cached one carries the
committed end under which it was read, and each array records the newest episode whose rows reach each chunk
(:meth:`ChunkReader.observe`): a cached chunk serves a gather only while no episode at or past its tag reaches it.
"""

from __future__ import annotations

import io
import mmap
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import zarr

from her_store.errors import CorruptStoreError
from her_store.format import ArraySpec
from her_store.index import IndexView
from her_store import _frames
from her_store.shard import FrameCodec, index_nbytes, parse_index
from her_store.storage import Location, chunk_key, drop_page_cache

if TYPE_CHECKING:
    from her_store.store import EpisodeStore

__all__ = ["ChunkReader", "MappedArray", "CachedArray", "ShardedArray"]

MIN_ROWS_PER_THREAD = 16  # below this a thread costs more than the rows it reads
MIN_FRAMES_PER_THREAD = 4  # a compressed frame costs a decode: worth a thread from a few on


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
        self.cache_bytes = cache_bytes
        self.max_entries = 1 << 30
        self._bytes = 0  # cost of what the cache holds
        self._fetch = fetch
        self._decode = _chunk_decoder(array, spec) if fetch is not None else None
        # chunk -> (tag, decoded rows): every row of an episode with id < tag was on disk before the read began
        self._cache: OrderedDict[int, tuple[int, Any]] = OrderedDict()
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

    def _cost(self, item: Any) -> int:
        """Bytes a cached item counts against ``cache_bytes``."""
        return self.chunk_nbytes

    def _chunk(self, chunk: int) -> Any:
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
            old = self._cache.pop(chunk, None)
            if old is not None:
                self._bytes -= self._cost(old[1])
            self._cache[chunk] = (tag, buf)
            self._bytes += self._cost(buf)
            while len(self._cache) > 1 and (self._bytes > self.cache_bytes or len(self._cache) > self.max_entries):
                self._bytes -= self._cost(self._cache.popitem(last=False)[1][1])
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
            self._bytes = 0
        if self.root is not None:
            for d, _, files in os.walk(os.path.join(self.root, self.spec.path, "c")):
                for f in files:
                    drop_page_cache(os.path.join(d, f))

    def close(self) -> None:
        self._cache.clear()
        self._bytes = 0


class _Tail:
    """The last bytes of a file of ``size`` bytes, indexed by file offsets: what :func:`parse_index` reads."""

    def __init__(self, size: int, tail: bytes) -> None:
        self.size, self.tail = size, tail

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, s: slice) -> bytes:
        base = self.size - len(self.tail)
        return self.tail[s.start - base : s.stop - base]


class _Shard(NamedTuple):
    """A shard as read: its file (local) or its bytes (fetched whole remotely), and each row's byte range."""

    buf: Any  # io.FileIO, bytes, or None for a shard never written (every row zeros)
    offsets: np.ndarray  # int64, -1 for a row never written
    nbytes: np.ndarray


class ShardedArray(CachedArray):
    """A sharded array (format version 2 images): reading a row decodes that row alone.

    Shards are kept in the same committed-end-tagged LRU as decoded chunks: locally an open shard file and its parsed
    index (bounded by count; a frame is one ``pread``, so a cold store is read one frame per disk read, in parallel
    across ``io_threads``), remotely the shard's compressed bytes fetched in one GET (bounded by ``cache_bytes``). A
    shard that a commit rewrote since it was opened is opened again by the gathers that need it; until then, the old
    file still holds every row committed when it was opened (a shard is replaced by a rename, never written in
    place).
    """

    MAX_OPEN = 512  # open shard files per array

    def __init__(self, array: Any, spec: ArraySpec, cache_bytes: int, location: Location) -> None:
        super().__init__(array, spec, cache_bytes, root=location.root if location.is_local else None)
        self.location = location
        self.codec = FrameCodec(array, f"{location}/{spec.path}/zarr.json")
        self._ndim = 1 + len(spec.row_shape)
        if location.is_local:
            self.max_entries = self.MAX_OPEN

    def _cost(self, item: Any) -> int:
        return 0 if self.root is not None or item.buf is None else len(item.buf)

    def _load(self, chunk: int) -> _Shard:
        key = chunk_key(self.spec.path, chunk, self._ndim)
        if self.root is None:
            buf: Any = self.location.read_bytes(key)
            index = buf
        else:
            try:
                buf = open(os.path.join(self.root, key), "rb", buffering=0)  # closed when no gather holds it
            except FileNotFoundError:
                buf = None
            else:
                os.posix_fadvise(buf.fileno(), 0, 0, os.POSIX_FADV_RANDOM)  # a frame is one read, no readahead
                size = os.fstat(buf.fileno()).st_size
                need = min(size, index_nbytes(self.chunk_rows))
                index = _Tail(size, os.pread(buf.fileno(), need, size - need))
        if buf is None:
            empty = np.full(self.chunk_rows, -1, np.int64)
            return _Shard(None, empty, empty)
        offsets, nbytes = parse_index(index, self.chunk_rows, f"{self.location}/{key}")
        return _Shard(buf, offsets, nbytes)

    def gather(self, rows: np.ndarray, out: np.ndarray) -> None:
        cr = self.chunk_rows
        shard_of = rows // cr
        order = np.argsort(shard_of, kind="stable")
        bounds = np.flatnonzero(np.diff(shard_of[order])) + 1
        if self.codec.is_lz4:
            self.gather_lz4(rows, out, None, 1)
            return
        decode = self.codec.decode
        for sel in np.split(order, bounds):
            c = int(shard_of[sel[0]])
            shard = self._chunk(c)
            local = rows[sel] - c * cr
            offsets, ends = shard.offsets[local].tolist(), (shard.offsets[local] + shard.nbytes[local]).tolist()
            buf = shard.buf
            # locally one pread per frame (the GIL is released while the disk works), remotely a slice of the shard
            fd = buf.fileno() if isinstance(buf, io.FileIO) else None
            for i, o, e in zip(sel.tolist(), offsets, ends):
                if o < 0:
                    out[i] = 0
                    continue
                try:
                    decode(buf[o:e] if fd is None else os.pread(fd, e - o, o), out[i])
                except (ValueError, RuntimeError, TypeError) as e:  # what the codecs raise for undecodable bytes
                    key = chunk_key(self.spec.path, c, self._ndim)
                    raise CorruptStoreError(f"{self.location}/{key}: row {int(rows[i]) - c * cr} cannot be decoded ({e})") from e


    def gather_lz4(self, rows: np.ndarray, out: np.ndarray, pool: ThreadPoolExecutor | None, parts: int) -> None:
        """The default codec's path: every row's byte range is found here, once, then the rows are read (locally)
        and decoded in C with the GIL released, split across ``parts`` threads of ``pool``."""
        cr, row_nbytes = self.chunk_rows, self.spec.row_nbytes
        shard_of = rows // cr
        uniq, inv = np.unique(shard_of, return_inverse=True)
        shards = [self._chunk(int(c)) for c in uniq]  # held open until their rows are decoded
        local = rows - shard_of * cr
        offsets = np.stack([s.offsets for s in shards])[inv, local]
        nbytes = np.stack([s.nbytes for s in shards])[inv, local]
        nbytes[offsets < 0] = -1
        if self.root is None:  # remote: each shard's bytes are in memory
            for j, shard in enumerate(shards):
                sel = np.flatnonzero(inv == j)
                part = np.empty((len(sel), *self.spec.row_shape), self.spec.dtype)
                failed, err = _frames.decode_lz4(shard.buf or b"", offsets[sel], nbytes[sel], part, row_nbytes)
                if failed >= 0:
                    self._undecodable(int(rows[sel[failed]]), err)
                out[sel] = part
            return
        fds = np.array([s.buf.fileno() if s.buf is not None else -1 for s in shards], np.int32)[inv]
        edges = np.linspace(0, len(rows), max(1, parts) + 1).astype(np.int64)

        def decode(i: int) -> tuple[int, int]:
            a, b = int(edges[i]), int(edges[i + 1])
            failed, err = _frames.pread_lz4(fds[a:b], offsets[a:b], nbytes[a:b], out[a:b], row_nbytes)
            return (a + failed if failed >= 0 else -1), err

        k = len(edges) - 1
        if pool is None or k == 1:
            results = [decode(0)]
        else:  # the calling thread decodes the last part itself rather than wait idle
            futures = [pool.submit(decode, i) for i in range(k - 1)]
            results = [decode(k - 1)] + [f.result() for f in futures]
        for failed, err in results:
            if failed >= 0:
                self._undecodable(int(rows[failed]), err)

    def _undecodable(self, row: int, err: int) -> None:
        c = row // self.chunk_rows
        where = f"{self.location}/{chunk_key(self.spec.path, c, self._ndim)}"
        if err:
            raise OSError(err, f"{where}: reading row {row - c * self.chunk_rows} failed: {os.strerror(err)}")
        raise CorruptStoreError(f"{where}: row {row - c * self.chunk_rows} is not one row's LZ4 block")


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
        self.arrays: dict[str, MappedArray | CachedArray] = {}
        loc = store._loc
        for spec in store.layout.arrays:
            if spec.sharded:
                self.arrays[spec.path] = ShardedArray(store._root[spec.path], spec, cache_bytes, loc)
            elif loc.is_local and not spec.compressed:
                self.arrays[spec.path] = MappedArray(loc.root, spec)
            else:
                self.arrays[spec.path] = CachedArray(
                    store._root[spec.path], spec, cache_bytes, fetch=loc.read_bytes, root=loc.root if loc.is_local else None
                )
        sharded = any(isinstance(a, ShardedArray) for a in self.arrays.values())
        # decoding frames is CPU work, one thread per core by default; rows in the page cache are fastest gathered
        # in the calling thread, so the default splits only decoding
        self.io_threads = 0 if io_threads is None else int(io_threads)
        self.decode_threads = (os.cpu_count() or 1) if io_threads is None and sharded else self.io_threads
        threads = max(self.io_threads, self.decode_threads)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="her_store-io") if threads else None
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
        per_thread = MIN_FRAMES_PER_THREAD if isinstance(arr, ShardedArray) else MIN_ROWS_PER_THREAD
        threads = self.decode_threads if isinstance(arr, ShardedArray) else self.io_threads
        if isinstance(arr, ShardedArray) and arr.codec.is_lz4:
            arr.gather_lz4(rows, out, self._pool, min(threads, n // per_thread))
            return out
        if self._pool is None or threads == 0 or n < 2 * per_thread:
            arr.gather(rows, out)
            return out
        parts = min(threads, n // per_thread)
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
