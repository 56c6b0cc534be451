"""Rows of image arrays gathered from their frame files (Zarr shards, one frame per inner chunk): :class:`FrameArray`.

Each row is its own inner chunk, so a gathered row is one byte range of a frame file (locally a pread, or read where
the file is memory-mapped once gathers find their rows in the page cache; remotely a ranged GET conditioned on the
file's ETag, adjacent rows in one, or the file fetched whole when a gather needs several runs of its rows) and one
decode, straight into the batch. Decoding is CPU work done in C without the GIL, so it is split across threads, and a
sampler assembles the rest of its batch while its frames are decoded (:meth:`FrameArray.start`).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np

from her_store import _kernels
from her_store.errors import CorruptStoreError
from her_store.format.frames import FrameCodec, index_nbytes, parse_index, shard_limit
from her_store.format.layout import ArraySpec
from her_store.storage import Backend
from her_store.storage.base import ObjectReplaced
from her_store.storage.files import FileShares
from her_store.store.cached_rows import CachedArray
from her_store.store.split import CORES, SPLIT_BYTES, Balance, done, start_split

__all__ = ["WARM_GATHERS", "FrameArray"]


WARM_GATHERS = 8  # local frames are decoded from mapped shards once this many gathers in a row read nothing from disk


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


class FrameArray(CachedArray):
    """A sharded array (format version 2 images): reading a row decodes that row alone.

    Locally a shard is an open file whose index is parsed into a per-row table of byte ranges (see
    :meth:`_local_rows`; open shards bounded by count, least recently used closed first): a batch's frames are read
    with one ``pread`` per pair of adjacent frames and decoded in C, in parallel across ``io_threads``; once
    ``WARM_GATHERS`` gathers in a row found them all in the page cache, they are decoded where the shard is mapped,
    without a system call each (:meth:`_gather_lz4`). A shard that a commit rewrote since it was opened (the same
    committed-end tags as :class:`CachedArray`) is opened again by the gathers that need it; until then, the old
    file (and its mapping) still holds every row committed when it was opened (a shard is replaced by a rename,
    never written in place, so a mapped shard never shrinks under its readers).

    On object storage (bounded by ``cache_bytes``) a shard is kept as its parsed index alone, read by one ranged GET of
    the object's last bytes, and the frames of a gather are fetched by concurrent ranged GETs (adjacent frames, such as
    rows ``t`` and ``t + 1``, in one), each conditioned on the ETag the index was read with: a shard a commit replaced
    since (one PUT) answers 412, and its index is read again before its frames are, so old offsets are never applied to
    new bytes. A shard a gather needs ``WHOLE_RUNS`` separate runs of rows from (as many GETs by range) is fetched whole
    in one GET and kept whole, as is every shard on a store that cannot condition a GET on an ETag (checked, not
    assumed: S3 through s3fs can).
    """

    # open shard files, shared by every local image array of the process (all samplers': a mixture over many stores):
    # a store of 1,000,000 frames has about 4,000 shards of 3x84x84 frames
    OPEN = FileShares(divisor=4, least=2, most=8192)
    WHOLE_RUNS = 2  # a gather needing this many separate runs of a shard's rows fetches it whole: one GET, not one each
    REREADS = 2  # a shard replaced under this many successive reads of its index is then fetched whole

    def __init__(self, array: Any, spec: ArraySpec, cache_bytes: int, backend: Backend) -> None:
        super().__init__(array, spec, cache_bytes, backend)
        self.codec = FrameCodec(array, f"{backend}/{spec.path}/zarr.json")
        self._balance = Balance()  # the decoding threads' share of a local LZ4 gather
        if self.local:
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
        self._conditional = backend.conditional
        # whether GETs here honour If-Match: None until a probe could tell (S3 and HTTP may; then it is checked)
        self._ranged: bool | None = None if self._conditional else False
        self.gets = 0  # requests sent to object storage
        self.replaced = 0  # conditional GETs that found their shard replaced since its index was read

    @property
    def max_entries(self) -> int:
        """Shards it keeps: locally, open shard files, its share of ``OPEN``; on object storage, cached shards (the
        cache is bounded by bytes)."""
        return self.OPEN.share() if self.local else self._max_entries

    @max_entries.setter
    def max_entries(self, n: int) -> None:
        self._max_entries = n

    def _cost(self, item: Any) -> int:
        if self.local:
            return 0
        return len(item.buf) if item.buf is not None else item.offsets.nbytes + item.nbytes.nbytes

    def _key(self, chunk: int) -> str:
        return self.spec.chunk_key(chunk)

    def _load(self, chunk: int) -> _Shard:
        """A local shard: its file, open, and its index (object storage: :meth:`_remote_frames`)."""
        key = self._key(chunk)
        try:
            # closed when no gather holds it; in a packed store, the archive with the shard's bytes at `base`
            buf, base, size = self.backend.open_range(key)
        except FileNotFoundError:
            return self._empty()
        os.posix_fadvise(buf.fileno(), base, size, os.POSIX_FADV_RANDOM)  # a frame is one read, no readahead
        if size > shard_limit(self.chunk_rows, self.spec.row_nbytes):
            raise CorruptStoreError(f"{self.backend}/{key}: {size:,} bytes, more than a shard of its rows may hold")
        need = min(size, index_nbytes(self.chunk_rows))
        index = _Tail(size, os.pread(buf.fileno(), need, base + size - need))
        offsets, nbytes = parse_index(index, self.chunk_rows, f"{self.backend}/{key}")
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
        return self.backend.run(coro, *args)

    async def _get(self, chunk: int, rng: str | None = None, etag: str | None = None) -> tuple[bytes | None, str, int]:
        """One GET of shard ``chunk`` (S3, HTTP, or a packed store's member there): its bytes (None when it does not
        exist), its ETag and the object's size.

        Raises
        ------
        _Changed
            ``etag`` is given and the object no longer has it.
        """
        key, limit = self._key(chunk), shard_limit(self.chunk_rows, self.spec.row_nbytes)
        self.gets += 1
        try:
            body, tag, size = await self.backend.get_object(key, rng, etag, limit)
        except ObjectReplaced:
            raise _Changed from None
        if body is None and etag is not None:  # the object its index was read from is gone: read the index again
            raise _Changed
        return body, tag, size

    async def _fetch_one(self, chunk: int, whole: bool) -> _Shard:
        """Shard ``chunk`` from S3: whole (one GET), or its index alone (one GET of the object's last bytes: a
        suffix range, so no HEAD), remembering the ETag its rows are then read under."""
        where = f"{self.backend}/{self._key(chunk)}"
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
            await asyncio.gather(
                *(self._get(c, f"bytes={a}-{b - 1}", etag) for c, etag, a, b in reqs), return_exceptions=True
            )
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
        keys = [self._key(c) for c in chunks]
        self.gets += len(keys)
        got = self.backend.read_objects(keys, shard_limit(self.chunk_rows, self.spec.row_nbytes))
        return [
            self._empty() if raw is None else _Shard(raw, *parse_index(raw, self.chunk_rows, f"{self.backend}/{key}"))
            for key, raw in zip(keys, got)
        ]

    def _remote_frames(self, rows: np.ndarray) -> tuple[list[bytes], np.ndarray, np.ndarray, np.ndarray]:
        """Fetch the encoded bytes of ``rows`` from object storage: the buffers holding them, and per row its
        buffer, its offset there and its size (-1: a row never written).

        Shards come from the cache while no commit recorded since reached them; the others are fetched at once
        (their index alone, or whole when the gather needs ``WHOLE_RUNS`` separate runs of their rows). The frames of
        shards read by index are then fetched in one round of concurrent ranged GETs conditioned on each index's ETag; a
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
            reqs = [
                (chunks[j], shards[j].etag, a, b) for j, a, b in zip(rshard.tolist(), starts.tolist(), ends.tolist())
            ]
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
                    where = f"{self.backend}/{self._key(chunks[int(rshard[k])])}"
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
                raise CorruptStoreError(f"{self.backend}/{self._key(c)}: row {r} cannot be decoded ({e})") from e

    def _gather_remote_lz4(
        self, rows: np.ndarray, out: np.ndarray, pool: ThreadPoolExecutor | None, parts: int
    ) -> None:
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
        if not self.local:
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
                    raise CorruptStoreError(f"{self.backend}/{self._key(c)}: row {r} cannot be decoded ({e})") from e

        start_split(work, len(rows), pool, parts)()
        del held  # the files stay open until their rows are decoded

    def _grouped(self, rows: np.ndarray) -> bool:
        """Whether a local gather of ``rows`` needs more shards than half of those this array may keep open."""
        half = self.max_entries // 2
        return self.local and len(rows) > half and len(np.unique(rows // self.chunk_rows)) > half

    def start(
        self, rows: np.ndarray, out: np.ndarray, pool: ThreadPoolExecutor | None, parts: int
    ) -> Callable[[], None]:
        """:meth:`gather_split`, started: a local LZ4 gather returns once its rows' byte ranges are found and its
        decoding is under way on other threads (:meth:`_start_lz4`); the returned function decodes what they have
        not taken and waits for the rest (``out`` is complete when it returns). Other gathers are done here, and the
        function does nothing."""
        if self.local and self.codec.is_lz4 and not self._grouped(rows):
            return self._start_lz4(rows, out, pool, parts)
        self.gather_split(rows, out, pool, parts)
        return done

    def _gather_lz4(self, rows: np.ndarray, out: np.ndarray, pool: ThreadPoolExecutor | None, parts: int) -> None:
        """The default codec's path: every row's byte range is found here, once, then the rows are read (locally)
        and decoded in C with the GIL released, split across ``parts`` threads of ``pool``.

        Locally, rows are read with ``pread`` (adjacent rows in one) while the disk serves them, and decoded straight
        from the mapped shards once ``WARM_GATHERS`` gathers in a row found every row in the page cache: a warm
        pread costs a system call and a copy per frame, a page fault of a mapped file costs a disk read per page
        (a frame's pread, one for the pair). A mapped gather that reads from disk goes back to pread."""
        if not self.local:
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
            pieces = start_split(decode, len(rows), pool, parts, self._balance)

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
            if pool is not None and len(stale) > 1:
                opened = list(pool.map(self._load, stale))
            else:
                opened = [self._load(c) for c in stale]
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

    def after_fork(self) -> None:
        super().after_fork()
        self._files.clear()
        self._maps.clear()
        # the per-shard and per-row tables made anew, empty: a gather of the parent may have been growing them
        self._tags = np.full(0, -1, np.int64)
        self._fds = np.full(0, -1, np.int32)
        self._bases = np.zeros(0, np.int64)
        self._used = np.zeros(0, np.int64)
        self._table = np.full((0, 2), -1, np.int64)
        self._uses = self._warm = 0

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
        if not self.local:
            super().evict_page_cache()
            return
        with self._lock:
            maps = [m for m in self._maps.values() if m is not None]
            self._warm = 0
        for m in maps:
            m.drop_pages()
        self.backend.drop_page_cache(self.spec.path)

    def _never_written(self, row: int) -> None:
        """A gather asks only for committed rows, so a row its shard's index marks never written is damage."""
        c = row // self.chunk_rows
        where = f"{self.backend}/{self.spec.chunk_key(c)}"
        raise CorruptStoreError(f"{where}: committed row {row - c * self.chunk_rows} is missing from its shard")

    def _undecodable(self, row: int, err: int) -> None:
        c = row // self.chunk_rows
        where = f"{self.backend}/{self.spec.chunk_key(c)}"
        if err:
            raise OSError(err, f"{where}: reading row {row - c * self.chunk_rows} failed: {os.strerror(err)}")
        raise CorruptStoreError(f"{where}: row {row - c * self.chunk_rows} is not one row's LZ4 block")
