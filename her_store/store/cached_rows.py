"""The row readers of compressed or remote arrays: chunks read into an LRU cache, or blocks by ranged GETs.

:class:`CachedArray` reads whole chunks, decoded; :class:`RangedArray` reads blocks of rows of an uncompressed array
on object storage or HTTP, by ranged GETs.

Commits and ring evictions change chunks after they are cached, so each cached one carries the committed end under
which it was read, and each array records the newest episode whose rows reach each chunk
(:meth:`CachedArray.committed`): a cached chunk serves a gather only while no episode at or past its tag reaches it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import zarr

from her_store.errors import CorruptStoreError
from her_store.format.frames import FrameCodec
from her_store.format.layout import ArraySpec
from her_store.storage import Backend

__all__ = ["CachedArray", "RangedArray"]


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
        backend: Backend,
        fetch: Callable[[str], bytes | None] | None = None,
    ) -> None:
        self.array = array
        self.backend = backend
        self.local = backend.mappable  # keys are local files: open and mapped, their pages evictable
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

    def after_fork(self) -> None:
        """In a forked child: the lock made anew; the cache and the commits recorded dropped (a thread of the
        parent may have been changing them)."""
        self._lock = threading.Lock()
        self._cache.clear()
        self._bytes = 0
        self._newest = np.full(0, -1, np.int64)
        self._end = 0

    def evict_page_cache(self) -> None:
        """Empty the decoded-chunk cache, and drop local chunk files from the page cache (cold reads)."""
        with self._lock:
            self._cache.clear()
            self._bytes = 0
        if self.local:
            self.backend.drop_page_cache(self.spec.path)

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

    def __init__(self, array: Any, spec: ArraySpec, cache_bytes: int, backend: Backend) -> None:
        super().__init__(array, spec, cache_bytes, backend)
        rows = spec.chunk_rows
        if backend.ranged:
            while rows % 2 == 0 and rows * spec.row_nbytes > self.BLOCK_BYTES:
                rows //= 2
        self.chunk_rows = rows  # the cache's unit: a block
        self.chunk_nbytes = rows * spec.row_nbytes

    def _blocks(self, blocks: list[int]) -> list[np.ndarray]:
        """Blocks ``blocks`` read at once (a block of a chunk never written reads as zeros, the fill value)."""
        per_chunk, nb = self.spec.chunk_rows // self.chunk_rows, self.chunk_nbytes
        keys = [self.spec.chunk_key(b // per_chunk) for b in blocks]
        starts = [(b % per_chunk) * nb for b in blocks]
        got = self.backend.read_ranges(keys, starts, [a + nb for a in starts])
        shape = (self.chunk_rows, *self.spec.row_shape)
        return [
            np.zeros(shape, self.spec.dtype) if raw is None else np.frombuffer(raw, self.spec.dtype).reshape(shape)
            for raw in got
        ]

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
