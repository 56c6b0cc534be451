"""ChunkReader: gathers of arbitrary rows straight from the chunks, past zarr's own read path.

zarr's indexing costs tens of milliseconds per 1,024 random rows (FACTS.md), so rows are gathered here:
- uncompressed arrays on local disk: the raw chunk files are memory-mapped (MADV_RANDOM: no readahead for
  random rows) and gathered with numpy fancy indexing. With ``io_threads`` > 0 a gather is split across a
  thread pool; numpy releases the GIL while it copies, so the page faults of a cold store (one larger than RAM)
  are served in parallel, at the disk's queue depth rather than one read at a time.
- sharded arrays (compressed images, format version 2): each row is its own inner chunk, so a gathered row is one
  byte range of a shard (locally a pread, or read where the shard is memory-mapped once gathers find their rows in
  the page cache; remotely a ranged GET conditioned on the shard's ETag, adjacent rows in one, or the shard fetched
  whole when a gather needs several runs of its rows) and one decode, straight into the batch. Decoding is CPU
  work done in C without the GIL, so it is split across ``io_threads`` (by default one per core), and a sampler
  assembles the rest of its batch while its frames are decoded (:meth:`ChunkReader.gather_later`).
- uncompressed arrays on object storage or HTTP: blocks of rows (about 1 MiB each, a byte range of their chunk) are
  read by concurrent ranged GETs and kept in a bounded LRU cache, so a store copied from local disk, whose chunks
  hold 1,048,576 rows, reads only the blocks a gather needs (whole chunks from an HTTP server that ignores Range);
- other compressed arrays (version 1): whole chunks are read (one GET each remotely), decoded and kept in a bounded
  LRU cache of decoded chunks.
Commits and ring evictions change chunks and shards after they are cached, so each cached one carries the
committed end under which it was read, and each array records the newest episode whose rows reach each chunk
(:meth:`ChunkReader.observe`): a cached chunk serves a gather only while no episode at or past its tag reaches it.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import mmap
import os
import resource
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, NamedTuple

import fsspec.asyn
import numpy as np
import zarr

from her_store import _kernels
from her_store.errors import CorruptStoreError, StoreError
from her_store.format.frames import SPLIT_BYTES, FrameCodec, index_nbytes, parse_index, shard_limit
from her_store.format.layout import ArraySpec
from her_store.storage.location import FileShares, Location, ObjectReplaced, drop_page_cache, s3_get_object
from her_store.store.index import IndexView
from her_store.store.split import Balance

if TYPE_CHECKING:
    from her_store.store.episode_store import EpisodeStore

__all__ = ["CachedArray", "ChunkReader", "MappedArray", "RangedArray", "ShardedArray"]

MIN_ROWS_PER_THREAD = 16  # below this a thread costs more than the rows it reads
MIN_FRAMES_PER_THREAD = 4  # a compressed frame costs a decode: worth a thread from a few on
CORES = os.cpu_count() or 1  # (os.cpu_count() costs tens of microseconds a call)
WARM_GATHERS = 8  # local frames are decoded from mapped shards once this many gathers in a row read nothing from disk


class MappedArray:
    """An uncompressed local array whose chunk files (members, in a packed store) are memory-mapped on first use.

    Each map holds a file descriptor (Python's mmap keeps a duplicate of the file's), so at most its share of ``MAPS``
    (every mapped array's in the process) stay mapped: past that the oldest half are let go (unmapped once no gather
    reads them) and mapped again when next used. A store of small chunks that a writer keeps growing would otherwise
    run the process out of descriptors.
    """

    MAPS = FileShares(divisor=16, least=1, most=4096)

    def __init__(self, location: Location, spec: ArraySpec, random_access: bool = True) -> None:
        self.spec = spec
        self.location = location
        self.root = location.root
        self.chunk_rows = spec.chunk_rows
        self.random_access = random_access
        self._maps: dict[int, tuple[mmap.mmap, int, int]] = {}  # per chunk: its mapping, its rows' start in it and end in the file
        self._lock = threading.Lock()
        self.MAPS.join(self)

    def _file(self, chunk: int) -> str:
        return os.path.join(self.root, self.spec.chunk_key(chunk))

    def _map(self, chunk: int) -> tuple[mmap.mmap, int, int]:
        """The chunk's mapping, where its rows start in it, and where they end in the file (mapped on first use)."""
        got = self._maps.get(chunk)
        if got is not None:
            return got
        with self._lock:
            got = self._maps.get(chunk)
            if got is None:
                key = self.spec.chunk_key(chunk)
                f, base, size = self.location.open_range(key)
                need = self.chunk_rows * self.spec.row_nbytes
                with f:
                    if size < need:
                        raise CorruptStoreError(f"{self.location}/{key}: {size:,} bytes, a chunk holds {need:,}")
                    if os.fstat(f.fileno()).st_size < base + need:  # a packed store's file cut short past its index
                        raise CorruptStoreError(
                            f"{self.location}/{key}: the file ends before the chunk's rows do (cut short)"
                        )
                    skip = base % mmap.ALLOCATIONGRANULARITY  # a map starts on a page; a packed store's members do
                    m = mmap.mmap(f.fileno(), skip + need, access=mmap.ACCESS_READ, offset=base - skip)
                if self.random_access:
                    m.madvise(mmap.MADV_RANDOM)
                bound = self.MAPS.share()
                if len(self._maps) >= bound:
                    for old in list(self._maps)[: len(self._maps) - bound // 2 + 1]:
                        del self._maps[old]
                self._maps[chunk] = got = (m, skip, base + need)
        return got

    def gather(self, rows: np.ndarray, out: np.ndarray) -> None:
        """``out[i] = array[rows[i]]``; rows must be committed (their chunk files exist).

        Raises
        ------
        OSError
            EIO: a chunk file was cut short in place under its mapping (by another process): rows past its new end
            cannot be read (on pages past it, a plain copy from the mapping would end the process with SIGBUS; on its
            last page, they would read as zeros). Rows before the cut still read.
        """
        cr = self.chunk_rows
        chunk = rows // cr
        lo, hi = int(chunk.min()), int(chunk.max())
        rows = np.ascontiguousarray(rows, np.int64)
        if lo == hi:
            self._take(lo, rows, out)
            return
        for c in range(lo, hi + 1):
            sel = np.flatnonzero(chunk == c)
            if sel.size:
                self._take(c, rows[sel], out, sel)

    def _take(self, chunk: int, rows: np.ndarray, out: np.ndarray, at: np.ndarray | None = None) -> None:
        """Rows ``rows`` (int64, of chunk ``chunk``) into ``out`` (its rows ``at``), copied from the chunk's mapping
        in C."""
        m, skip, end = self._map(chunk)
        first = chunk * self.chunk_rows
        args = (m, rows, first, skip, out, self.spec.row_nbytes)
        failed, err = _kernels.take_rows(*args) if at is None else _kernels.take_rows(*args, at)
        size = m.size() if failed < 0 else end
        if size < end:  # cut short in place, but not below these rows' pages
            past = np.flatnonzero(end + (rows - first + 1 - self.chunk_rows) * self.spec.row_nbytes > size)
            if past.size:  # rows past the new end on its last page: they read as zeros
                failed, err = int(past[0]), errno.EIO
        if failed >= 0:
            key = self.spec.chunk_key(chunk)
            row = int(rows[failed]) - first
            if err:
                raise OSError(err, f"{self.location}/{key}: reading row {row} failed: {os.strerror(err)} (the file was "
                              "cut short under its mapping)")
            raise CorruptStoreError(f"{self.location}/{key}: row {row} is outside the chunk")

    def evict_page_cache(self) -> None:
        """Drop this array's pages from memory, for cold-start measurements: the mapping's pages (MADV_DONTNEED;
        mapped pages survive fadvise) and then the file's page cache (written back first, POSIX_FADV_DONTNEED)."""
        for m, _, _ in self._maps.values():
            m.madvise(mmap.MADV_DONTNEED)
        chunk = 0
        while os.path.exists(self._file(chunk)):
            drop_page_cache(self._file(chunk))
            chunk += 1

    def close(self) -> None:
        self._maps.clear()  # each mmap closes when no gather holds it any more
        self.MAPS.leave(self)


def _chunk_decoder(array: Any, spec: ArraySpec, where: str) -> Callable[[bytes], np.ndarray] | None:
    """Decode a raw chunk of a version 1 array without zarr's per-call machinery (about 1 ms a chunk), with
    :class:`FrameCodec`'s checks: a chunk's bytes must decode to exactly one chunk. Chains FrameCodec does not
    know return None and are read through zarr."""
    try:
        codec = FrameCodec.of_chunks(array, spec.chunk_rows, where)
    except CorruptStoreError:
        return None
    shape = (spec.chunk_rows, *spec.row_shape)

    def decode(raw: bytes) -> np.ndarray:
        out = np.empty(shape, spec.dtype)  # every byte of it decoded, or an error
        codec.decode(raw, out)
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
        self._decode = _chunk_decoder(array, spec, f"{spec.path}/zarr.json") if fetch is not None else None
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
        key = self.spec.chunk_key(chunk)
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
        hit, tag = self._cached(chunk)
        if hit is not None:
            return hit
        buf = self._load(chunk)
        self._keep(chunk, tag, buf)
        return buf

    def _cached(self, chunk: int) -> tuple[Any, int]:
        """The cached item of ``chunk`` if it still serves every recorded episode (else None), and the tag an item
        read from now on carries."""
        with self._lock:
            hit = self._cache.get(chunk)
            newest = int(self._newest[chunk]) if chunk < len(self._newest) else -1
            # a gather asks only for rows of recorded episodes: if none at or past the tag reaches this chunk,
            # every row asked for was on disk when the chunk was read
            if hit is not None and newest < hit[0]:
                self._cache.move_to_end(chunk)
                self.hits += 1
                return hit[1], hit[0]
            return None, self._end  # read before the chunk: episodes below it were committed before the read

    def _keep(self, chunk: int, tag: int, item: Any) -> None:
        """Cache ``item``, read for ``chunk`` with ``tag`` (from :meth:`_cached`), evicting the least recently used."""
        with self._lock:
            self.misses += 1
            old = self._cache.pop(chunk, None)
            if old is not None:
                self._bytes -= self._cost(old[1])
            self._cache[chunk] = (tag, item)
            self._bytes += self._cost(item)
            while len(self._cache) > 1 and (self._bytes > self.cache_bytes or len(self._cache) > self.max_entries):
                self._bytes -= self._cost(self._cache.popitem(last=False)[1][1])

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
            for d, _, files in os.walk(os.path.join(self.root, self.spec.path)):  # its chunk files, whatever their keys
                for f in files:
                    drop_page_cache(os.path.join(d, f))

    def close(self) -> None:
        self._cache.clear()
        self._bytes = 0


class RangedArray(CachedArray):
    """An uncompressed array on object storage or an HTTP server, read in blocks of rows into the LRU cache.

    A block is ``chunk_rows`` halved until it holds at most ``BLOCK_BYTES`` (at least one row): one byte range of its
    chunk, whose bytes are the raw rows. The blocks a gather misses are fetched at once, by concurrent ranged GETs.
    From an HTTP server that ignores Range a block is its whole chunk. Cached blocks carry the committed-end tags of
    :class:`CachedArray` (rows written into a block after it was read are read again by the gathers that need them).
    """

    BLOCK_BYTES = 1 << 20

    def __init__(self, array: Any, spec: ArraySpec, cache_bytes: int, location: Location) -> None:
        super().__init__(array, spec, cache_bytes)
        self.location = location
        rows = spec.chunk_rows
        if location.ranged:
            while rows % 2 == 0 and rows * spec.row_nbytes > self.BLOCK_BYTES:
                rows //= 2
        self.chunk_rows = rows  # the cache's unit: a block
        self.chunk_nbytes = rows * spec.row_nbytes

    def _blocks(self, blocks: list[int]) -> list[np.ndarray]:
        """Blocks ``blocks`` read at once (a block of a chunk never written reads as zeros, the fill value)."""
        per_chunk, nb = self.spec.chunk_rows // self.chunk_rows, self.chunk_nbytes
        keys = [self.spec.chunk_key(b // per_chunk) for b in blocks]
        starts = [(b % per_chunk) * nb for b in blocks]
        got = self.location.read_ranges(keys, starts, [a + nb for a in starts])
        shape = (self.chunk_rows, *self.spec.row_shape)
        return [np.zeros(shape, self.spec.dtype) if raw is None else np.frombuffer(raw, self.spec.dtype).reshape(shape) for raw in got]

    def gather(self, rows: np.ndarray, out: np.ndarray) -> None:
        br = self.chunk_rows
        block = rows // br
        order = np.argsort(block, kind="stable")
        bounds = np.flatnonzero(np.diff(block[order])) + 1
        groups = np.split(order, bounds)
        found = [self._cached(int(block[sel[0]])) for sel in groups]
        missing = [j for j, (hit, _) in enumerate(found) if hit is None]
        if missing:
            read = self._blocks([int(block[groups[j][0]]) for j in missing])
            for j, item in zip(missing, read):
                self._keep(int(block[groups[j][0]]), found[j][1], item)
                found[j] = (item, found[j][1])
        for sel, (item, _) in zip(groups, found):
            b = int(block[sel[0]])
            out[sel] = item[rows[sel] - b * br]


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
    """A shard as read: its file (local), its bytes (fetched whole remotely) or its index alone (remotely, rows then
    read by ranged GETs conditioned on ``etag``), and each row's byte range."""

    buf: Any  # io.FileIO, bytes, or None for a shard never written (every row zeros) or read by ranges
    offsets: np.ndarray  # int64, -1 for a row never written
    nbytes: np.ndarray
    etag: str | None = None  # remotely, the ETag of the object whose index this is, when rows are read by ranges
    mapping: Any = None  # locally, the shard's bytes mapped (_kernels.map_file), None where the file cannot be mapped
    base: int = 0  # locally, where the shard's bytes start in its file (a packed store's member), and its mapping


class _Changed(Exception):
    """A conditional GET found its object replaced since its index was read (HTTP 412)."""


def _is_s3(fs: Any) -> bool:
    """Whether ``fs`` is s3fs's filesystem, whose GETs take S3's If-Match."""
    try:
        import s3fs
    except ImportError:
        return False
    return isinstance(fs, s3fs.S3FileSystem)


class ShardedArray(CachedArray):
    """A sharded array (format version 2 images): reading a row decodes that row alone.

    Locally a shard is an open file whose index is parsed into a per-row table of byte ranges (see
    :meth:`_local_rows`; open shards bounded by count, least recently used closed first): a batch's frames are read
    with one ``pread`` per pair of adjacent frames and decoded in C, in parallel across ``io_threads``; once
    ``WARM_GATHERS`` gathers in a row found them all in the page cache, they are decoded where the shard is mapped,
    without a system call each (:meth:`_gather_lz4`). A shard that a commit rewrote since it was opened (the same
    committed-end tags as :class:`CachedArray`) is opened again by the gathers that need it; until then, the old
    file (and its mapping) still holds every row committed when it was opened (a shard is replaced by a rename,
    never written in place, so a mapped shard never shrinks under its readers).

    On object storage (bounded by ``cache_bytes``) a shard is kept as its parsed index alone, read by one ranged GET
    of the object's last bytes, and the frames of a gather are fetched by concurrent ranged GETs (adjacent frames,
    such as rows ``t`` and ``t + 1``, in one), each conditioned on the ETag the index was read with: a shard a
    commit replaced since (one PUT) answers 412, and its index is read again before its frames are, so old offsets
    are never applied to new bytes. A shard a gather needs ``WHOLE_RUNS`` separate runs of rows from (as many
    GETs by range) is fetched whole in one GET and kept whole, as is every shard on a store that cannot condition a GET on an ETag (checked, not
    assumed: S3 through s3fs can).
    """

    # open shard files, shared by every local image array of the process (all samplers': a mixture over many stores):
    # a store of 1,000,000 frames has about 4,000 shards of 3x84x84 frames
    OPEN = FileShares(divisor=4, least=2, most=8192)
    WHOLE_RUNS = 2  # a gather needing this many separate runs of rows of a shard fetches it whole (README, measured)
    REREADS = 2  # a shard replaced under this many successive reads of its index is then fetched whole

    def __init__(self, array: Any, spec: ArraySpec, cache_bytes: int, location: Location) -> None:
        super().__init__(array, spec, cache_bytes, root=location.root if location.is_local else None)
        self.location = location
        self.codec = FrameCodec(array, f"{location}/{spec.path}/zarr.json")
        self._balance = Balance()  # the decoding threads' share of a local LZ4 gather
        if location.is_local:
            self.OPEN.join(self)
        # local shards (see _local_rows): open files, and per shard its descriptor, the committed end when it was
        # opened (-1: not open) and the gather that last used it; per row its (offset, nbytes)
        self._files: dict[int, Any] = {}
        self._maps: dict[int, Any] = {}  # the open shards' mappings (those that could be mapped)
        self._tags = np.full(0, -1, np.int64)
        self._fds = np.full(0, -1, np.int32)
        self._bases = np.zeros(0, np.int64)
        self._warm = 0  # gathers in a row that read nothing from disk (rows in the page cache)
        self.mapped_gathers = 0  # local gathers decoded from the mapped shards
        self._used = np.zeros(0, np.int64)
        self._uses = 0
        self._table = np.full((0, 2), -1, np.int64)
        # GETs that can be conditioned on an ETag: S3's, and an HTTP server's (If-Match, RFC 9110)
        self._conditional = not location.is_local and (location.is_http or _is_s3(location.fs))
        # whether GETs here honour If-Match: None until a probe could tell (S3 and HTTP may; then it is checked)
        self._ranged: bool | None = None if self._conditional else False
        self.gets = 0  # requests sent to object storage
        self.replaced = 0  # conditional GETs that found their shard replaced since its index was read

    @property
    def max_entries(self) -> int:
        """Shards it keeps: locally, open shard files, its share of ``OPEN``; on object storage, cached shards (the
        cache is bounded by bytes)."""
        return self.OPEN.share() if self.root is not None else self._max_entries

    @max_entries.setter
    def max_entries(self, n: int) -> None:
        self._max_entries = n

    def _cost(self, item: Any) -> int:
        if self.root is not None:
            return 0
        return len(item.buf) if item.buf is not None else item.offsets.nbytes + item.nbytes.nbytes

    def _key(self, chunk: int) -> str:
        return self.spec.chunk_key(chunk)

    def _load(self, chunk: int) -> _Shard:
        """A local shard: its file, open, and its index (object storage: :meth:`_remote_frames`)."""
        key = self._key(chunk)
        try:
            # closed when no gather holds it; in a packed store, the archive with the shard's bytes at `base`
            buf, base, size = self.location.open_range(key)
        except FileNotFoundError:
            return self._empty()
        os.posix_fadvise(buf.fileno(), base, size, os.POSIX_FADV_RANDOM)  # a frame is one read, no readahead
        if size > shard_limit(self.chunk_rows, self.spec.row_nbytes):
            raise CorruptStoreError(f"{self.location}/{key}: {size:,} bytes, more than a shard of its rows may hold")
        need = min(size, index_nbytes(self.chunk_rows))
        index = _Tail(size, os.pread(buf.fileno(), need, base + size - need))
        offsets, nbytes = parse_index(index, self.chunk_rows, f"{self.location}/{key}")
        try:  # bounded with its file by OPEN (a compiled mapping holds no descriptor, a pure one mmap's duplicate)
            mapping = _kernels.map_file(buf.fileno(), base, size)
        except (OSError, ValueError):  # a file system that cannot map files (or an empty shard): read with pread
            mapping = None
        return _Shard(buf, np.where(offsets < 0, offsets, offsets + base), nbytes, mapping=mapping, base=base)

    def _empty(self) -> _Shard:
        """A shard never written: every row zeros."""
        empty = np.full(self.chunk_rows, -1, np.int64)
        return _Shard(None, empty, empty)

    # object storage ---------------------------------------------------------------------------------------------

    def _run(self, coro: Callable[..., Any], *args: Any) -> Any:
        """Run a coroutine function on the filesystem's event loop (fsspec's I/O thread), from any other thread."""
        return fsspec.asyn.sync(self.location.fs.loop, coro, *args)

    async def _get(self, chunk: int, rng: str | None = None, etag: str | None = None) -> tuple[bytes | None, str, int]:
        """One GET of shard ``chunk`` (S3, HTTP, or a packed store's member there): its bytes (None when it does not
        exist), its ETag and the object's size.

        Raises
        ------
        _Changed
            ``etag`` is given and the object no longer has it.
        """
        fs, key, limit = self.location.fs, self._key(chunk), shard_limit(self.chunk_rows, self.spec.row_nbytes)
        self.gets += 1
        try:
            if self.location.archive is not None:  # a packed store's member: a byte range of the zip
                body, tag, size = await self.location.archive.get_object(key, rng, etag, limit)
            elif self.location.is_http:
                body, tag, size, _ = await fs.get_object(self.location.key_path(key), rng, etag, limit)
            else:
                body, tag, size = await s3_get_object(fs, self.location.key_path(key), rng, etag, limit)
        except ObjectReplaced:
            raise _Changed from None
        if body is None and etag is not None:  # the object its index was read from is gone: read the index again
            raise _Changed
        return body, tag, size

    async def _fetch_one(self, chunk: int, whole: bool) -> _Shard:
        """Shard ``chunk`` from S3: whole (one GET), or its index alone (one GET of the object's last bytes: a
        suffix range, so no HEAD), remembering the ETag its rows are then read under."""
        where = f"{self.location}/{self._key(chunk)}"
        if whole:
            raw, _, _ = await self._get(chunk)
            return self._empty() if raw is None else _Shard(raw, *parse_index(raw, self.chunk_rows, where))
        need = index_nbytes(self.chunk_rows)
        tail, etag, size = await self._get(chunk, f"bytes=-{need}")
        if tail is None:
            return self._empty()
        if len(tail) == size > need:  # an HTTP server that ignores Range sent the whole shard
            return _Shard(tail, *parse_index(tail, self.chunk_rows, where))
        if len(tail) != min(need, size):
            raise CorruptStoreError(f"{where}: a GET of its last {need} bytes returned {len(tail)} of {size}")
        offsets, nbytes = parse_index(_Tail(size, tail), self.chunk_rows, where)
        if not etag:  # nothing to condition its rows' reads on: read it whole
            return await self._fetch_one(chunk, True)
        return _Shard(None, offsets, nbytes, etag)

    async def _fetch_many(self, chunks: list[int], whole: list[bool]) -> list[_Shard]:
        return list(await asyncio.gather(*(self._fetch_one(c, w) for c, w in zip(chunks, whole))))

    async def _get_ranges(self, reqs: list[tuple[int, str, int, int]]) -> list[Any]:
        """Concurrent conditional GETs of ``(chunk, etag, start, end)``: each range's bytes, or the exception."""
        return list(
            await asyncio.gather(*(self._get(c, f"bytes={a}-{b - 1}", etag) for c, etag, a, b in reqs), return_exceptions=True)
        )

    def _probe(self, chunk: int) -> bool | None:
        """Whether GETs here are refused when their If-Match names another ETag (None: shard ``chunk`` is absent,
        so it could not tell). A store that ignored If-Match would let old offsets read a replaced shard's bytes,
        so that is checked, not assumed."""
        try:
            raw, _, _ = self._run(self._get, chunk, "bytes=-1", '"her_store-if-match-probe"')
        except _Changed:
            return True
        return None if raw is None else False

    def _fetch_shards(self, chunks: list[int], whole: list[bool]) -> list[_Shard]:
        """Shards ``chunks``, fetched concurrently: whole, or (S3, HTTP) their index alone where ``whole`` is False."""
        if self._conditional:
            return self._run(self._fetch_many, chunks, whole)
        # no conditional GET on this filesystem: whole shards, concurrently where the filesystem is asynchronous
        paths = [self.location.key_path(self._key(c)) for c in chunks]
        self.gets += len(paths)
        got = self.location.fs.cat_ranges(paths, [None] * len(paths), [None] * len(paths), on_error="return")
        out = []
        for c, raw in zip(chunks, got):
            if isinstance(raw, FileNotFoundError):
                out.append(self._empty())
            elif isinstance(raw, BaseException):
                raise raw
            else:
                out.append(_Shard(raw, *parse_index(raw, self.chunk_rows, f"{self.location}/{self._key(c)}")))
        return out

    def _remote_frames(self, rows: np.ndarray) -> tuple[list[bytes], np.ndarray, np.ndarray, np.ndarray]:
        """Fetch the encoded bytes of ``rows`` from object storage: the buffers holding them, and per row its
        buffer, its offset there and its size (-1: a row never written).

        Shards come from the cache while no commit recorded since reached them; the others are fetched at once
        (their index alone, or whole when the gather needs ``WHOLE_RUNS`` separate runs of their rows). The frames of shards
        read by index are then fetched in one round of concurrent ranged GETs conditioned on each index's ETag; a
        shard whose object changed since (412) has its index read again and its frames fetched again.
        """
        cr = self.chunk_rows
        frames, inv = np.unique(rows, return_inverse=True)  # a frame asked for twice is fetched once
        shard_of = frames // cr
        local = frames - shard_of * cr
        uniq, sidx = np.unique(shard_of, return_inverse=True)
        chunks = uniq.tolist()
        if self._ranged is None:
            self._ranged = self._probe(chunks[0])
        # rows are stored in order, so a run of consecutive rows is one range (one GET): ranges cost a request each
        # whatever their size, so a shard needing several is cheaper fetched whole
        starts_run = np.ones(len(frames), bool)
        starts_run[1:] = (frames[1:] != frames[:-1] + 1) | (shard_of[1:] != shard_of[:-1])
        runs = np.bincount(sidx[starts_run], minlength=len(chunks))
        whole = ((runs >= self.WHOLE_RUNS) | (self._ranged is not True)).tolist()
        shards: list[Any] = []
        tags: list[int] = []
        for c, w in zip(chunks, whole):
            hit, tag = self._cached(c)
            # a cached whole shard serves any gather; a cached index, one that reads the shard by ranges
            shards.append(hit if hit is not None and (hit.etag is None or not w) else None)
            tags.append(tag)
        missing = [j for j, s in enumerate(shards) if s is None]
        self._refresh(chunks, shards, tags, missing, [whole[j] for j in missing])

        n = len(frames)
        src = np.zeros(n, np.int64)  # 0: the ranged frames' buffer, k > 0: whole shard k - 1 of `held`
        pos = np.zeros(n, np.int64)
        pieces: list[bytes] = []
        at = 0  # bytes in `pieces`
        pending = np.array([s.etag is not None for s in shards], bool)
        attempt = 0
        while True:
            offsets = np.stack([s.offsets for s in shards])[sidx, local]
            nbytes = np.stack([s.nbytes for s in shards])[sidx, local]
            f = np.flatnonzero(pending[sidx] & (offsets >= 0))
            if len(f) == 0:
                break
            f = f[np.lexsort((offsets[f], sidx[f]))]  # by shard, then by offset: adjacent frames make one range
            o, e, s = offsets[f], offsets[f] + nbytes[f], sidx[f]
            new = np.ones(len(f), bool)
            new[1:] = (s[1:] != s[:-1]) | (o[1:] != e[:-1])
            first = np.flatnonzero(new)
            rid = np.cumsum(new) - 1
            starts, ends, rshard = o[first], np.maximum.reduceat(e, first), s[first]
            reqs = [(chunks[j], shards[j].etag, a, b) for j, a, b in zip(rshard.tolist(), starts.tolist(), ends.tolist())]
            got = self._run(self._get_ranges, reqs)
            changed = sorted({j for j, g in zip(rshard.tolist(), got) if isinstance(g, _Changed)})
            for g in got:
                if isinstance(g, BaseException) and not isinstance(g, _Changed):
                    raise g
            ok = ~np.isin(rshard, changed)
            lens = np.zeros(len(got), np.int64)
            for k in np.flatnonzero(ok).tolist():
                body = got[k][0]
                if len(body) != ends[k] - starts[k]:
                    where = f"{self.location}/{self._key(chunks[int(rshard[k])])}"
                    raise CorruptStoreError(f"{where}: bytes {starts[k]}..{ends[k]} read as {len(body)} bytes")
                pieces.append(body)
                lens[k] = len(body)
            base = at + np.cumsum(lens) - lens  # where each range's bytes start in the joined buffer
            at += int(lens.sum())
            done = ok[rid]
            pos[f[done]] = base[rid[done]] + o[done] - starts[rid[done]]
            pending[:] = False
            if not changed:
                break
            self.replaced += len(changed)
            # replaced since its index was read: the index again, then (after REREADS) the whole shard
            attempt += 1
            self._refresh(chunks, shards, tags, changed, [attempt >= self.REREADS] * len(changed))
            pending[changed] = [shards[j].etag is not None for j in changed]

        held = [j for j, s in enumerate(shards) if s.buf is not None]
        buffers = [b"".join(pieces)] + [shards[j].buf for j in held]
        if held:
            in_held = np.zeros(len(shards), np.int64)
            in_held[held] = np.arange(1, len(held) + 1)
            k = in_held[sidx]
            src[k > 0] = k[k > 0]
            pos[k > 0] = offsets[k > 0]
        nbytes[offsets < 0] = -1
        return buffers, src[inv], pos[inv], nbytes[inv]

    def _refresh(self, chunks: list[int], shards: list[Any], tags: list[int], js: list[int], whole: list[bool]) -> None:
        """Fetch shards ``chunks[j]`` for ``j`` in ``js`` (the i-th whole where ``whole[i]``), into ``shards`` and the
        cache."""
        if not js:
            return
        got = self._fetch_shards([chunks[j] for j in js], whole)
        for j, shard in zip(js, got):
            self._keep(chunks[j], tags[j], shard)
            shards[j] = shard

    def _gather_remote(self, rows: np.ndarray, out: np.ndarray) -> None:
        """Rows of a codec decoded row by row (not LZ4), fetched from object storage."""
        buffers, src, pos, nbytes = self._remote_frames(rows)
        decode = self.codec.decode
        for i, (k, o, n) in enumerate(zip(src.tolist(), pos.tolist(), nbytes.tolist())):
            if n < 0:
                self._never_written(int(rows[i]))
            try:
                decode(buffers[k][o : o + n], out[i])
            except (ValueError, RuntimeError, TypeError) as e:  # what the codecs raise for undecodable bytes
                c, r = divmod(int(rows[i]), self.chunk_rows)
                raise CorruptStoreError(f"{self.location}/{self._key(c)}: row {r} cannot be decoded ({e})") from e

    def _gather_remote_lz4(self, rows: np.ndarray, out: np.ndarray, pool: ThreadPoolExecutor | None, parts: int) -> None:
        """LZ4 rows fetched from object storage, decoded in C from each buffer holding them (the ranged frames' one,
        each whole shard's), split across ``parts`` threads of ``pool``."""
        buffers, src, pos, nbytes = self._remote_frames(rows)
        if (nbytes < 0).any():
            self._never_written(int(rows[np.argmax(nbytes < 0)]))
        n = len(rows)
        order = np.argsort(src, kind="stable") if len(buffers) > 1 else np.arange(n)
        dst = out if len(buffers) == 1 else np.empty_like(out)
        src, pos, nbytes = src[order], pos[order], nbytes[order]
        # runs of one buffer, cut into pieces of at most n / parts rows
        cuts = np.union1d(np.flatnonzero(np.diff(src)) + 1, np.linspace(0, n, max(1, parts) + 1).astype(np.int64))
        edges = np.union1d(cuts, [0, n])

        def decode(i: int) -> int:
            a, b = int(edges[i]), int(edges[i + 1])
            failed, _ = _kernels.decode_lz4(buffers[int(src[a])], pos[a:b], nbytes[a:b], dst[a:b], self.spec.row_nbytes)
            return a + failed if failed >= 0 else -1

        k = len(edges) - 1
        if pool is None or parts <= 1:
            results = [decode(i) for i in range(k)]
        else:
            results = list(pool.map(decode, range(k)))
        for failed in results:
            if failed >= 0:
                self._undecodable(int(rows[order[failed]]), 0)
        if dst is not out:
            out[order] = dst

    # gathers ----------------------------------------------------------------------------------------------------

    def gather(self, rows: np.ndarray, out: np.ndarray) -> None:
        self.gather_split(rows, out, None, 1)

    def gather_split(self, rows: np.ndarray, out: np.ndarray, pool: ThreadPoolExecutor | None, parts: int) -> None:
        """Rows ``rows`` into ``out``, their byte ranges found once, then read and decoded in ``parts`` pieces on the
        threads of ``pool`` (the calling thread takes one): LZ4 in C without the GIL, other codecs row by row.
        Locally, a gather over more shards than half of those it may keep open (its share of ``OPEN``: tiny shards,
        a low descriptor limit) takes them a group at a time, each group's files let go before the next is opened."""
        if self._grouped(rows):
            _, group = np.unique(rows // self.chunk_rows, return_inverse=True)
            group //= self.max_entries // 2
            for g in range(int(group.max()) + 1):
                sel = np.flatnonzero(group == g)
                part = np.empty((len(sel), *out.shape[1:]), out.dtype)
                self.gather_split(rows[sel], part, pool, parts)
                out[sel] = part
            return
        if self.codec.is_lz4:
            self._gather_lz4(rows, out, pool, parts)
            return
        if self.root is None:
            self._gather_remote(rows, out)
            return
        held, fds, offsets, nbytes, *_ = self._local_rows(rows, pool)
        decode = self.codec.decode

        def work(a: int, b: int) -> None:
            # one pread per frame (the GIL is released while the disk works), then its decode
            for i, (fd, o, n) in enumerate(zip(fds[a:b].tolist(), offsets[a:b].tolist(), nbytes[a:b].tolist()), a):
                try:
                    decode(os.pread(fd, n, o), out[i])
                except (ValueError, RuntimeError, TypeError) as e:  # what the codecs raise for undecodable bytes
                    c, r = divmod(int(rows[i]), self.chunk_rows)
                    raise CorruptStoreError(f"{self.location}/{self._key(c)}: row {r} cannot be decoded ({e})") from e

        _start(work, len(rows), pool, parts)()
        del held  # the files stay open until their rows are decoded

    def _grouped(self, rows: np.ndarray) -> bool:
        """Whether a local gather of ``rows`` needs more shards than half of those this array may keep open."""
        half = self.max_entries // 2
        return self.root is not None and len(rows) > half and len(np.unique(rows // self.chunk_rows)) > half

    def start(self, rows: np.ndarray, out: np.ndarray, pool: ThreadPoolExecutor | None, parts: int) -> Callable[[], None]:
        """:meth:`gather_split`, started: a local LZ4 gather returns once its rows' byte ranges are found and its
        decoding is under way on other threads (:meth:`_start_lz4`); the returned function decodes what they have
        not taken and waits for the rest (``out`` is complete when it returns). Other gathers are done here, and the
        function does nothing."""
        if self.root is not None and self.codec.is_lz4 and not self._grouped(rows):
            return self._start_lz4(rows, out, pool, parts)
        self.gather_split(rows, out, pool, parts)
        return _done

    def _gather_lz4(self, rows: np.ndarray, out: np.ndarray, pool: ThreadPoolExecutor | None, parts: int) -> None:
        """The default codec's path: every row's byte range is found here, once, then the rows are read (locally)
        and decoded in C with the GIL released, split across ``parts`` threads of ``pool``.

        Locally, rows are read with ``pread`` (adjacent rows in one) while the disk serves them, and decoded straight
        from the mapped shards once ``WARM_GATHERS`` gathers in a row found every row in the page cache: a warm
        pread costs a system call and a copy per frame, a page fault of a mapped file costs a disk read per page
        (a frame's pread, one for the pair). A mapped gather that reads from disk goes back to pread."""
        if self.root is None:
            self._gather_remote_lz4(rows, out, pool, parts)
        else:
            self._start_lz4(rows, out, pool, parts)()

    def _start_lz4(
        self, rows: np.ndarray, out: np.ndarray, pool: ThreadPoolExecutor | None, parts: int
    ) -> Callable[[], None]:
        """A local LZ4 gather, started: the returned function finishes it. From the page cache, the rows are decoded
        from the mapped shards by threads of their own (C threads: they start at once, never waiting for the GIL; up
        to one per core but the caller's) and, once it calls the function, by the calling thread too; else they are
        read and decoded in pieces on ``pool``."""
        held, fds, offsets, nbytes, slots, maps, bases = self._local_rows(rows, pool)
        mapped = maps is not None and self._warm >= WARM_GATHERS
        if mapped:
            offsets = offsets - bases  # where each row starts in its shard's mapping
        # by shard and offset: frames t and t + 1 of an episode follow each other in their shard and are read at once
        order = np.lexsort((offsets, slots))
        fds, offsets, nbytes, slots = fds[order], offsets[order], nbytes[order], slots[order]
        failed: list[tuple[int, int]] = []
        blocks: list[int] = []  # 512-byte blocks each piece read from disk
        rn = self.spec.row_nbytes

        def note(a: int, bad: int, err: int, read: int) -> None:
            blocks.append(read)
            if bad >= 0:
                failed.append((int(order[a + bad]), err))

        def decode(a: int, b: int, files: list[Any] = held) -> None:  # the files stay open while their rows are read
            if mapped:
                note(a, *_kernels.map_lz4(maps, slots[a:b], offsets[a:b], nbytes[a:b], order[a:b], out, rn))
            else:
                note(a, *_kernels.pread_lz4(fds[a:b], offsets[a:b], nbytes[a:b], order[a:b], out, rn))

        if mapped:
            self.mapped_gathers += 1
            # a thread is worth starting for a few hundred KiB of frames (a start costs tens of microseconds); the
            # calling thread takes its share of the rows once the rest of its batch is done (threads and caller take
            # the rows not taken yet, 8 at a time, so each decodes what it has time for)
            threads = min(parts, CORES, len(rows) * rn // SPLIT_BYTES + 1) - 1
            task = None
            if threads > 0:
                task = _kernels.map_lz4_start(maps, slots, offsets, nbytes, order, out, rn, threads)

            def pieces() -> None:
                if task is not None:
                    note(0, *task.wait())
                else:
                    decode(0, len(rows))

        else:
            pieces = _start(decode, len(rows), pool, parts, self._balance)

        def finish() -> None:
            pieces()
            # cold: more than a block a row from disk on average (not a few rows a writer's commit left uncached)
            self._warm = 0 if sum(blocks) > len(rows) else self._warm + 1
            for row, err in failed:
                self._undecodable(int(rows[row]), err)

        return finish

    # local shards: open files and a per-row table of byte ranges ---------------------------------------------------

    def _local_rows(
        self, rows: np.ndarray, pool: ThreadPoolExecutor | None
    ) -> tuple[list[Any], np.ndarray, np.ndarray, np.ndarray, np.ndarray, tuple[Any, ...] | None, np.ndarray]:
        """Local rows as found: the open files held for this gather; per row its file descriptor, offset in the file
        and size; per row its shard's place among the shards gathered from (int32), those shards' mappings (None when
        one has none), and per row where its shard's mapping starts in its file.

        A shard is opened (its index read: a small read at the end of its file, on the pool's threads when several
        are needed) the first time a gather needs it and again when a commit recorded since reached it; its rows'
        byte ranges go into a table indexed by row, so a gather finds them in a few vectorised operations. Files,
        descriptors and ranges are taken together under the lock, so a shard reopened by another thread meanwhile
        cannot pair one file's descriptor with another's ranges.
        """
        cr = self.chunk_rows
        shard_of = rows // cr
        uniq, slots = np.unique(shard_of, return_inverse=True)
        with self._lock:
            self._grow(int(uniq[-1]) + 1)
            newest = np.full(len(uniq), -1, np.int64)  # the newest recorded episode whose rows reach each shard
            inside = uniq < len(self._newest)
            newest[inside] = self._newest[uniq[inside]]
            tags = self._tags[uniq]
            stale = uniq[(tags < 0) | (newest >= tags)].tolist()
            if self._uses == 0 and pool is not None:
                # a sampler's first gather opens every shard holding committed rows (up to half the open-file
                # bound), in parallel: a cold store then reads their indexes at once rather than one per gather
                known = np.flatnonzero(self._newest >= 0)[: self.max_entries // 2]
                stale = sorted(set(stale) | set(known.tolist()))
                self._grow(int(known[-1]) + 1 if len(known) else 0)
            tag = self._end  # read before the shards: episodes below it were committed before they were opened
        if stale:
            opened = list(pool.map(self._load, stale)) if pool is not None and len(stale) > 1 else [self._load(c) for c in stale]
        with self._lock:
            self._grow(int(uniq[-1]) + 1)
            for c, shard in zip(stale, opened if stale else ()):
                self.misses += 1
                self._files[c] = shard.buf
                self._fds[c] = shard.buf.fileno() if shard.buf is not None else -1
                self._maps[c] = shard.mapping
                self._bases[c] = shard.base
                self._table[c * cr : (c + 1) * cr, 0] = shard.offsets
                self._table[c * cr : (c + 1) * cr, 1] = np.where(shard.offsets < 0, -1, shard.nbytes)
                self._tags[c] = tag
            self.hits += len(uniq) - len(stale)
            self._uses += 1
            self._used[uniq] = self._uses
            shards = uniq.tolist()
            held = list(map(self._files.get, shards))
            maps: tuple[Any, ...] | None = tuple(map(self._maps.get, shards))
            if None in maps:  # type: ignore[operator]
                maps = None
            fds, offsets, nbytes = self._fds[shard_of], self._table[rows, 0], self._table[rows, 1]
            bases = self._bases[shard_of]
            if len(self._files) > self.max_entries:
                self._close_oldest(len(self._files) - self.max_entries // 2)
        if (offsets < 0).any():
            self._never_written(int(rows[np.argmax(offsets < 0)]))
        return held, fds, offsets, nbytes, slots.astype(np.int32), maps, bases

    def _grow(self, shards: int) -> None:
        """Size the per-shard and per-row tables for ``shards`` shards (under the lock)."""
        have = len(self._tags)
        if shards <= have:
            return
        n = max(shards, 2 * have)
        self._tags = np.concatenate([self._tags, np.full(n - have, -1, np.int64)])
        self._fds = np.concatenate([self._fds, np.full(n - have, -1, np.int32)])
        self._bases = np.concatenate([self._bases, np.zeros(n - have, np.int64)])
        self._used = np.concatenate([self._used, np.zeros(n - have, np.int64)])
        self._table = np.concatenate([self._table, np.full(((n - have) * self.chunk_rows, 2), -1, np.int64)])

    def close(self) -> None:
        super().close()
        with self._lock:
            self._files.clear()
            self._maps.clear()
            self._tags[:] = -1
            self._fds[:] = -1
        self.OPEN.leave(self)

    def _close_oldest(self, k: int) -> None:
        """Forget the ``k`` least recently used open shards (under the lock); gathers holding them finish first."""
        open_ = np.fromiter(self._files, np.int64, len(self._files))
        for c in open_[np.argsort(self._used[open_], kind="stable")[:k]].tolist():
            del self._files[c]
            self._maps.pop(c, None)
            self._tags[c], self._fds[c] = -1, -1

    def evict_page_cache(self) -> None:
        """Drop the shard files from the page cache (their mapped pages first). Locally the open shards and their
        parsed indexes stay: an index is the sampler's own memory (16 bytes a row), not a page of the store, so cold
        reads are frames; they are read with pread again, until gathers find them in the page cache."""
        if self.root is None:
            super().evict_page_cache()
            return
        with self._lock:
            maps = [m for m in self._maps.values() if m is not None]
            self._warm = 0
        for m in maps:
            m.drop_pages()
        for d, _, files in os.walk(os.path.join(self.root, self.spec.path)):  # its chunk files, whatever their keys
            for f in files:
                drop_page_cache(os.path.join(d, f))

    def _never_written(self, row: int) -> None:
        """A gather asks only for committed rows, so a row its shard's index marks never written is damage."""
        c = row // self.chunk_rows
        where = f"{self.location}/{self.spec.chunk_key(c)}"
        raise CorruptStoreError(f"{where}: committed row {row - c * self.chunk_rows} is missing from its shard")

    def _undecodable(self, row: int, err: int) -> None:
        c = row // self.chunk_rows
        where = f"{self.location}/{self.spec.chunk_key(c)}"
        if err:
            raise OSError(err, f"{where}: reading row {row - c * self.chunk_rows} failed: {os.strerror(err)}")
        raise CorruptStoreError(f"{where}: row {row - c * self.chunk_rows} is not one row's LZ4 block")


def _done() -> None:
    """A gather's finish when there is nothing left to do."""


def _start(
    work: Callable[[int, int], None], n: int, pool: ThreadPoolExecutor | None, parts: int, balance: Balance | None = None
) -> Callable[[], None]:
    """``work(a, b)`` over ``parts`` consecutive pieces of ``range(n)``, started: the pool's pieces are submitted
    (each begins once its thread has the GIL), and the returned function runs the calling thread's piece (the
    last, rather than wait idle), then waits for the pool's; it raises the first exception raised, after every
    piece ran. With ``balance``, the pool's share follows who finished first (decoding, where the calling thread
    has less of the batch to do than its threads once they start late); else the pieces are even."""
    if pool is None or parts <= 1:
        return lambda: work(0, n)
    if balance is not None:
        edges = balance.edges(n, parts - 1, n // parts // 2)
    else:
        edges = np.linspace(0, n, parts + 1).astype(np.int64).tolist()
    futures = [pool.submit(work, a, b) for a, b in itertools.pairwise(edges[:-1])]

    def finish() -> None:
        try:
            work(edges[-2], edges[-1])
        finally:
            if balance is not None and futures:
                balance.observe(all(f.done() for f in futures))
            for f in futures:
                f.result()

    return finish


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
                self.arrays[spec.path] = MappedArray(loc, spec)
            elif not spec.compressed:
                self.arrays[spec.path] = RangedArray(store._root[spec.path], spec, cache_bytes, loc)
            else:
                self.arrays[spec.path] = CachedArray(
                    store._root[spec.path], spec, cache_bytes, fetch=loc.read_bytes, root=loc.root if loc.is_local else None
                )
        sharded = any(isinstance(a, ShardedArray) for a in self.arrays.values())
        # decoding frames is CPU work, one thread per core by default; rows in the page cache are fastest gathered
        # in the calling thread, so the default splits only decoding
        self.io_threads = 0 if io_threads is None else int(io_threads)
        self.decode_threads = CORES if io_threads is None and sharded else self.io_threads
        self._threads = max(self.io_threads, self.decode_threads)
        self._threads_of: ThreadPoolExecutor | None = None
        self._threads_pid = -1
        self._end = 0  # one past the newest episode id observed
        self._lock = threading.Lock()

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
        if not isinstance(arr, ShardedArray) or len(rows) == 0:
            return self.gather(path, rows), _done
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
        if isinstance(arr, ShardedArray):
            arr.gather_split(rows, out, self._pool, self._decode_parts(n))
            return out
        if self._pool is None or self.io_threads == 0 or n < 2 * MIN_ROWS_PER_THREAD:
            arr.gather(rows, out)
            return out
        parts = min(self.io_threads, n // MIN_ROWS_PER_THREAD)
        edges = np.linspace(0, n, parts + 1).astype(np.int64)
        work: Callable[[int], None] = lambda i: arr.gather(rows[edges[i] : edges[i + 1]], out[edges[i] : edges[i + 1]])
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
        if self._threads_of is not None and self._threads_pid == os.getpid():
            self._threads_of.shutdown(wait=True)
        self._threads_of, self._threads = None, 0
        for arr in self.arrays.values():
            arr.close()
