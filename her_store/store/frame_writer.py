"""How image rows are written: :class:`FrameWriter` encodes frames as episodes are staged, replaces frame files.

Rows are encoded as episodes are staged (the appending thread and the encoder threads each take a share, read in place,
:class:`Encoded`), placed at commit, and a commit replaces each frame file (a Zarr shard of ``chunk_rows`` frames) it
touched whole (a temp file renamed into place, or one PUT), so a reader or a crash sees the old file or the new one,
never a mix.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from itertools import pairwise
from typing import Any

import numpy as np
import zarr

from her_store import _kernels
from her_store.errors import CorruptStoreError
from her_store.format.frames import FrameCodec, build_shard, parse_index, shard_limit
from her_store.format.keys import chunk_entry, chunk_key, key_separator
from her_store.storage import Backend
from her_store.store.split import SPLIT_BYTES, Balance

__all__ = ["Encoded", "FrameWriter"]


MIN_ROWS_PER_THREAD = 8  # below this, encoding in the calling thread is faster than handing rows to a pool


class Encoded:
    """An episode's rows being encoded: by C threads that started at once (LZ4: a ``Task``, which the calling thread
    joins in :meth:`frames`), or by the encoder pool's shares (futures, reading the rows in place) and the rows the
    calling thread encoded. :meth:`frames` must be called before the rows may change.

    Examples
    --------
    >>> frames = writer.encode(rows).frames()  # doctest: +SKIP
    """

    def __init__(
        self,
        writer: FrameWriter,
        rows: np.ndarray,
        background: Sequence[tuple[Future[list[bytes]], int, int]] = (),
        done: list[bytes] | None = None,
        task: Any = None,
    ) -> None:
        self._writer = writer
        self._task = task
        self._background = list(background)
        self._rows: np.ndarray | None = rows if task is not None or background else None
        self._frames: list[bytes] | None = None if self._rows is not None else done
        self._done = done or []

    def frames(self) -> list[bytes]:
        """The encoded rows in order, once the threads' shares are done. The calling thread encodes the rows the C
        threads have not taken yet and the pool's shares no thread has started yet, and again the rows of a share
        whose thread failed (out of memory); if that fails again it raises, and a later call tries again."""
        if self._frames is None:
            assert self._rows is not None
            if self._task is not None or not self._background:  # C threads (their rows, again if they failed)
                task, self._task = self._task, None
                try:
                    frames = task.wait() if task is not None else self._writer._encode_part(self._rows)
                except (MemoryError, RuntimeError):
                    frames = self._writer._encode_part(self._rows)
            else:
                self._writer._balance.observe(all(f.done() for f, _, _ in self._background))
                frames = []
                for future, a, b in self._background:
                    if future.cancel() or future.exception() is not None:
                        frames += self._writer._encode_part(self._rows[a:b])
                    else:
                        frames += future.result()
                frames += self._done
            self._frames = frames
            self._rows, self._background = None, []
        return self._frames

    def wait(self) -> None:
        """Wait until no thread reads the rows any more (their frames are not needed: an append that failed)."""
        task, self._task = self._task, None
        if task is not None:
            with contextlib.suppress(MemoryError, RuntimeError):
                task.wait()
        _let_go([future for future, _, _ in self._background])
        self._rows = None


def _let_go(futures: list[Future[list[bytes]]]) -> None:
    """Cancel the shares no thread has started, and wait for the others to end."""
    futures_wait([f for f in futures if not f.cancel()])


class FrameWriter:
    """Rows of a sharded array: encoded by :meth:`encode`, placed by :meth:`put`, published as whole shards by
    :meth:`flush`.

    The encoded rows of each shard a commit touches are held in memory (a shard already on disk is read first, so
    rows of other episodes in it are kept); :meth:`flush` replaces each such shard whole, then keeps only the newest,
    which the next commit most likely appends to.

    Examples
    --------
    >>> w = FrameWriter(store.zarr_array("steps/observation"), store.backend)  # doctest: +SKIP
    >>> w.put(0, w.encode(frames).frames())  # doctest: +SKIP
    >>> w.flush(fsync=False)  # doctest: +SKIP

    Parameters
    ----------
    array : zarr.Array
        The sharded array (its metadata checked against the layout).
    backend : Backend
        Where the store lives.
    """

    def __init__(self, array: zarr.Array, backend: Backend) -> None:
        self.array = array
        self.backend = backend
        self.chunk_rows = int((array.shards or array.chunks)[0])
        self.codec = FrameCodec(array, f"{backend}/{array.path}/zarr.json")
        self._ndim = array.ndim
        self._separator = key_separator(array)
        self._shards: dict[int, list[bytes | None]] = {}
        self._dirty: set[int] = set()
        self._pool: ThreadPoolExecutor | None = None
        self._threads = (os.cpu_count() or 1) - 1  # encoder threads beside the calling one
        self._balance = Balance()  # their share of an episode's rows

    def _key(self, shard: int) -> str:
        return chunk_key(self.array.path, shard, self._ndim, self._separator)

    def _load(self, shard: int) -> list[bytes | None]:
        """The encoded rows of a shard as published: those on disk, or all empty."""
        raw = self.backend.read_bytes(self._key(shard), shard_limit(self.chunk_rows, self.codec.nbytes))
        if raw is None:
            return [None] * self.chunk_rows
        offsets, nbytes = parse_index(raw, self.chunk_rows, f"{self.backend}/{self._key(shard)}")
        view = memoryview(raw)
        return [None if o < 0 else bytes(view[o : o + n]) for o, n in zip(offsets.tolist(), nbytes.tolist())]

    def _frames(self, shard: int) -> list[bytes | None]:
        """The encoded rows of a shard being written (loaded once, then held until published)."""
        frames = self._shards.get(shard)
        if frames is None:
            frames = self._shards[shard] = self._load(shard)
        return frames

    def _lz4_rows(self, rows: np.ndarray) -> np.ndarray:
        """Rows as the C encoder reads them in place (taken at any stride): each row C-contiguous, little-endian."""
        dtype = self.codec.dtype.newbyteorder("<")
        if rows.dtype != dtype or (len(rows) and not rows[0].flags.c_contiguous):
            rows = np.ascontiguousarray(rows, dtype)
        return rows

    def _encode_part(self, rows: np.ndarray) -> list[bytes]:
        if self.codec.is_lz4:  # in C, the GIL released
            return _kernels.encode_lz4(self._lz4_rows(rows), self.codec.nbytes, self.codec.lz4_acceleration)  # type: ignore[no-any-return]
        return [self.codec.encode(r) for r in rows]

    def encode(self, rows: np.ndarray) -> Encoded:
        """Encode rows on every core, reading them in place (no copy). The caller goes on (staging the episode's
        other fields) while threads encode; :meth:`Encoded.frames` waits for them, and must be called before ``rows``
        may change.

        LZ4 rows are encoded by C threads (one per core but the caller's, for SPLIT_BYTES of rows each at least),
        which start before this returns; in :meth:`Encoded.frames` the calling thread encodes the rows they have not
        taken yet (each takes 2 at a time), so each encodes what it has time for. Other codecs' rows are shared with
        the encoder pool: its threads take a share, the calling thread encodes the rest before this returns, and the
        threads' share is kept where both finish together (:class:`~her_store.store.split.Balance`).
        """
        if self.codec.is_lz4:
            rows = self._lz4_rows(rows)
            threads = min(self._threads, len(rows) * self.codec.nbytes // SPLIT_BYTES)
            if threads < 1:
                return Encoded(self, rows, done=self._encode_part(rows))
            task = _kernels.encode_lz4_start(rows, self.codec.nbytes, self.codec.lz4_acceleration, threads)
            return Encoded(self, rows, task=task)
        edges = self._balance.edges(len(rows), self._threads, MIN_ROWS_PER_THREAD)
        if len(edges) == 2:
            return Encoded(self, rows, done=self._encode_part(rows))
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="her_store-encode")
        pieces = list(pairwise(edges))
        background = [(self._pool.submit(self._encode_part, rows[a:b]), a, b) for a, b in pieces[:-1]]
        try:
            done = self._encode_part(rows[pieces[-1][0] :])
        except BaseException:
            _let_go([future for future, _, _ in background])  # no thread reads the rows when the caller hears of it
            raise
        return Encoded(self, rows, background, done)

    def put(self, row0: int, frames: Sequence[bytes]) -> None:
        """Place encoded rows (from :meth:`encode`) at rows ``row0, row0 + 1, ...``, published by the next
        :meth:`flush`."""
        at, n = 0, len(frames)
        while at < n:
            shard, r = divmod(row0 + at, self.chunk_rows)
            take = min(n - at, self.chunk_rows - r)
            self._frames(shard)[r : r + take] = frames[at : at + take]
            self._dirty.add(shard)
            at += take

    def flush(self, fsync: bool) -> None:
        """Replace every shard written since the last flush, whole and atomically."""
        for shard in sorted(self._dirty):
            self.backend.write_atomic(self._key(shard), build_shard(self._shards[shard]), fsync)
        if self._dirty:
            keep = max(self._dirty)
            self._shards = {keep: self._shards[keep]}
        self._dirty.clear()

    def discard(self, shard: int) -> None:
        """Remove a shard that holds no committed row (past the commit record of an unbounded store), whatever is
        there, and forget any of its rows held here."""
        self._shards.pop(shard, None)
        self._dirty.discard(shard)
        self.backend.remove(chunk_entry(self.array.path, shard, self._ndim, self._separator))

    def read_encoded(self, row0: int, row1: int) -> list[bytes | None]:
        """The stored bytes of rows ``row0 .. row1`` (None for a row never written), as published or being written
        here: what an episode's crc32 covers."""
        if row1 > self.array.shape[0]:
            raise IndexError(f"rows {row0}..{row1} of {self.array.path} past its {self.array.shape[0]} rows")
        out: list[bytes | None] = []
        at = row0
        while at < row1:
            shard, r = divmod(at, self.chunk_rows)
            take = min(row1 - at, self.chunk_rows - r)
            out.extend((self._shards.get(shard) or self._load(shard))[r : r + take])
            at += take
        return out

    def decode(self, frames: Sequence[bytes | None], row0: int = 0) -> np.ndarray:
        """Encoded rows (as :meth:`read_encoded` gives them, from row ``row0``) decoded; rows never written are zeros.

        Raises
        ------
        CorruptStoreError
            A row's bytes do not decode to one row.
        """
        out = np.zeros((len(frames), *self.codec.row_shape), self.codec.dtype)
        for i, raw in enumerate(frames):
            if raw is not None:
                try:
                    self.codec.decode(raw, out[i])
                except (ValueError, RuntimeError, TypeError) as e:
                    shard, r = divmod(row0 + i, self.chunk_rows)
                    raise CorruptStoreError(
                        f"{self.backend}/{self._key(shard)}: row {r} cannot be decoded ({e})"
                    ) from e
        return out

    def read(self, row0: int, row1: int) -> np.ndarray:
        """Rows ``row0 .. row1`` decoded (rows never written are zeros), as published or being written here."""
        return self.decode(self.read_encoded(row0, row1), row0)

    def close(self) -> None:
        self._shards.clear()
        self._dirty.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
