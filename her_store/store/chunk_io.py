"""How rows of an array are read and written at commit: in place in raw chunk files, or whole chunks through zarr.

:class:`RawChunkFile` writes uncompressed rows in place in local chunk files; :class:`ZarrChunks` writes whole chunks
through zarr (compressed arrays, or any array on object storage).

A v3 chunk without codecs is the raw little-endian rows, so a local uncompressed array's rows are ``pwrite``-n in
place into pre-sized chunk files: a commit writes only its own bytes. Elsewhere whole chunks are assembled in memory
and written through zarr (one PUT per chunk on object storage; temp file and rename on disk), so a chunk is never
torn.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import zarr
from zarr.core.array_spec import ArrayConfigParams

from her_store.errors import CorruptStoreError
from her_store.format.frames import shard_limit
from her_store.format.keys import chunk_entry, chunk_key, key_separator
from her_store.format.layout import Layout
from her_store.format.schema import Schema
from her_store.storage import Backend
from her_store.storage.files import FileShares, write_all
from her_store.store.frame_writer import FrameWriter

__all__ = ["ZARR_CONFIG", "RawChunkFile", "ZarrChunks", "chunk_io", "episode_rows", "read_rows"]


ZARR_CONFIG: ArrayConfigParams = {"write_empty_chunks": True}  # an all-zero chunk is data here, not absence


class RawChunkFile:
    """Rows of an uncompressed local array written in place with ``pwrite`` (see the module docstring).

    Its chunk files stay open between writes, at most its share of ``OPEN`` (every writer's arrays in the process).
    """

    OPEN = FileShares(divisor=16, least=1, most=4096)

    def __init__(
        self, backend: Backend, path: str, dtype: np.dtype, row_shape: tuple[int, ...], chunk_rows: int, separator: str
    ) -> None:
        self.backend = backend
        self.path = path
        self.separator = separator
        self.dtype = dtype
        self.row_shape = row_shape
        self.row_nbytes = int(np.prod(row_shape, dtype=np.int64)) * dtype.itemsize
        self.chunk_rows = chunk_rows
        self._fds: dict[int, int] = {}
        self._dirty: set[int] = set()
        self.OPEN.join(self)

    def _key(self, chunk: int) -> str:
        return chunk_key(self.path, chunk, 1 + len(self.row_shape), self.separator)

    def _fd(self, chunk: int) -> int:
        fd = self._fds.get(chunk)
        if fd is None:
            fd = self.backend.open_file(self._key(chunk))  # a link or a directory there: refused
            size = self.chunk_rows * self.row_nbytes
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)  # zarr expects a full chunk; the unwritten tail stays sparse
            while self._fds and len(self._fds) >= self.OPEN.share():
                os.close(self._fds.pop(next(iter(self._fds))))
            self._fds[chunk] = fd
        return fd

    def write(self, row0: int, rows: np.ndarray) -> None:
        data = np.ascontiguousarray(rows, dtype=self.dtype)
        n = len(data)
        at = 0
        while at < n:
            chunk, r = divmod(row0 + at, self.chunk_rows)
            take = min(n - at, self.chunk_rows - r)
            write_all(self._fd(chunk), data[at : at + take], r * self.row_nbytes)
            self._dirty.add(chunk)
            at += take

    def flush(self, fsync: bool) -> None:
        if fsync:
            self.backend.fsync([self._key(chunk) for chunk in sorted(self._dirty)])
        self._dirty.clear()

    def read(self, row0: int, row1: int) -> np.ndarray:
        """Rows ``[row0, row1)``; rows past a chunk file's end (never written) read as zeros."""
        out = np.empty((row1 - row0, *self.row_shape), self.dtype)
        flat = out.reshape(-1).view(np.uint8)
        at = row0
        while at < row1:
            chunk, r = divmod(at, self.chunk_rows)
            take = min(row1 - at, self.chunk_rows - r)
            o, n = (at - row0) * self.row_nbytes, take * self.row_nbytes
            got = self.backend.pread_into(self._key(chunk), flat[o : o + n], r * self.row_nbytes)
            flat[o + got : o + n] = 0
            at += take
        return out

    def discard(self, chunk: int) -> None:
        """Remove a chunk that holds no committed row, whatever is there (:func:`chunk_entry`; a link itself, never
        what it names)."""
        fd = self._fds.pop(chunk, None)
        if fd is not None:
            os.close(fd)
        self._dirty.discard(chunk)
        self.backend.remove(chunk_entry(self.path, chunk, 1 + len(self.row_shape), self.separator))

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self.OPEN.leave(self)


class ZarrChunks:
    """Rows of a compressed or remote array, written as whole chunks through zarr (see the module docstring)."""

    def __init__(self, array: zarr.Array, backend: Backend, raw: bool = False) -> None:
        self.array = array
        self.backend = backend
        self.chunk_rows = int(array.chunks[0])
        self.raw = raw  # uncompressed: rows are read as byte ranges of their chunks, not whole chunks through zarr
        self._cache: dict[int, np.ndarray] = {}
        self._dirty: set[int] = set()

    def _key(self, chunk: int) -> str:
        return chunk_key(self.array.path, chunk, self.array.ndim, key_separator(self.array))

    def _check(self, first: int, last: int) -> None:
        """Locally, before zarr reads or replaces chunks ``first .. last`` (it would follow a link, and block on a
        FIFO): each a regular file of at most what a compressed chunk may hold
        (:func:`~her_store.format.frames.shard_limit`, as copies and verify bound it), or missing, with no link on its
        way (:meth:`Backend.check_file`)."""
        row_nbytes = int(np.prod(self.array.shape[1:], dtype=np.int64)) * np.dtype(self.array.dtype).itemsize
        limit = shard_limit(self.chunk_rows, row_nbytes)
        for chunk in range(first, last + 1):
            self.backend.check_file(self._key(chunk), limit)

    def _chunk(self, chunk: int) -> np.ndarray:
        buf = self._cache.get(chunk)
        if buf is None:
            self._check(chunk, chunk)
            r0 = chunk * self.chunk_rows
            buf = np.array(self.array[r0 : r0 + self.chunk_rows])  # fill values where the chunk does not exist yet
            self._cache[chunk] = buf
        return buf

    def write(self, row0: int, rows: np.ndarray) -> None:
        n = len(rows)
        at = 0
        while at < n:
            chunk, r = divmod(row0 + at, self.chunk_rows)
            take = min(n - at, self.chunk_rows - r)
            self._chunk(chunk)[r : r + take] = rows[at : at + take]
            self._dirty.add(chunk)
            at += take

    def flush(self, fsync: bool) -> None:
        for chunk in sorted(self._dirty):
            self._check(chunk, chunk)
            r0 = chunk * self.chunk_rows
            self.array[r0 : r0 + self.chunk_rows] = self._cache[chunk]
        if fsync:
            self.backend.fsync([self._key(chunk) for chunk in sorted(self._dirty)])
        # keep only the newest chunk: the next commit most likely appends to it
        if self._dirty:
            keep = max(self._dirty)
            self._cache = {keep: self._cache[keep]}
        self._dirty.clear()

    def read(self, row0: int, row1: int) -> np.ndarray:
        if row1 > self.array.shape[0]:
            raise IndexError(f"rows {row0}..{row1} of {self.array.path} past its {self.array.shape[0]} rows")
        if self.raw:
            return self._read_ranges(row0, row1)
        if row1 > row0:
            self._check(row0 // self.chunk_rows, (row1 - 1) // self.chunk_rows)
        try:
            return np.asarray(self.array[row0:row1])
        except (ValueError, RuntimeError, TypeError) as e:  # what numcodecs and zarr raise for undecodable bytes
            raise CorruptStoreError(f"rows {row0}..{row1} of {self.array.path} cannot be decoded ({e})") from e

    def _read_ranges(self, row0: int, row1: int) -> np.ndarray:
        """Rows of an uncompressed array, one byte range of each chunk they lie in (read at once; a chunk never
        written reads as zeros): a row of a 1,048,576-row chunk costs its bytes, not the chunk's."""
        keys, starts, ends, rows = self.ranges(row0, row1)
        return rows(self.backend.read_ranges(keys, starts, ends))

    def ranges(
        self, row0: int, row1: int
    ) -> tuple[list[str], list[int], list[int], Callable[[Sequence[bytes | None]], np.ndarray]]:
        """The byte ranges (keys, starts, ends) that hold rows ``row0 .. row1`` of an uncompressed array, and what
        makes the rows of their bytes (None for a chunk never written: zeros)."""
        dtype, row_shape = np.dtype(self.array.dtype).newbyteorder("<"), tuple(self.array.shape[1:])
        row_nbytes = int(np.prod(row_shape, dtype=np.int64)) * dtype.itemsize
        first = np.arange(row0 - row0 % self.chunk_rows, row1, self.chunk_rows)
        lo, hi = np.maximum(first, row0), np.minimum(first + self.chunk_rows, row1)
        keys = [self._key(c) for c in (first // self.chunk_rows).tolist()]

        def rows(got: Sequence[bytes | None]) -> np.ndarray:
            out = np.zeros((row1 - row0, *row_shape), dtype)
            flat = out.reshape(-1).view(np.uint8)
            for a, raw in zip((lo - row0) * row_nbytes, got):
                if raw is not None:
                    flat[a : a + len(raw)] = np.frombuffer(raw, np.uint8)
            return out

        return keys, ((lo - first) * row_nbytes).tolist(), ((hi - first) * row_nbytes).tolist(), rows

    def discard(self, chunk: int) -> None:
        """Remove a chunk that holds no committed row, whatever is there (:func:`chunk_entry`)."""
        self._cache.pop(chunk, None)
        self._dirty.discard(chunk)
        self.backend.remove(chunk_entry(self.array.path, chunk, self.array.ndim, key_separator(self.array)))

    def close(self) -> None:
        self._cache.clear()


def read_rows(reads: Sequence[tuple[RawChunkFile | ZarrChunks, int, int]]) -> list[np.ndarray]:
    """``io.read(row0, row1)`` for each ``(io, row0, row1)``; the byte ranges of uncompressed arrays on object storage
    or HTTP, all on one backend, are fetched together (one round of concurrent GETs for the ten index columns of an
    episode table, rather than ten rounds one after the other).

    Examples
    --------
    >>> cols = read_rows([(col, 0, 5) for col in store.index_columns.values()])  # doctest: +SKIP
    """
    remote = [
        (i, col) for i, (col, _, row1) in enumerate(reads)
        if isinstance(col, ZarrChunks) and col.raw and row1 <= col.array.shape[0]
    ]
    plans = {i: col.ranges(reads[i][1], reads[i][2]) for i, col in remote if col.backend is remote[0][1].backend}
    if len(plans) < 2:
        return [col.read(row0, row1) for col, row0, row1 in reads]
    keys, starts, ends = ([x for plan in plans.values() for x in plan[j]] for j in range(3))
    got = remote[0][1].backend.read_ranges(keys, starts, ends)  # type: ignore[arg-type]
    out: list[np.ndarray] = []
    at = 0
    for i, (col, row0, row1) in enumerate(reads):
        if i in plans:
            n, rows = len(plans[i][0]), plans[i][3]
            out.append(rows(got[at : at + n]))
            at += n
        else:
            out.append(col.read(row0, row1))
    return out


def chunk_io(backend: Backend, array: zarr.Array, compressed: bool) -> RawChunkFile | ZarrChunks:
    """Row access to one array, whose metadata the caller has checked against the layout (it names the files written):
    raw chunk files for uncompressed arrays where keys are local files (:attr:`Backend.mappable`), whole chunks through
    zarr otherwise."""
    if backend.mappable and not compressed:
        return RawChunkFile(
            backend, array.path, array.dtype, tuple(array.shape[1:]), int(array.chunks[0]), key_separator(array)
        )
    return ZarrChunks(array.with_config(ZARR_CONFIG), backend, raw=not compressed)


def episode_rows(
    arrays: Mapping[str, RawChunkFile | ZarrChunks | FrameWriter],
    layout: Layout,
    schema: Schema,
    start: int,
    length: int,
) -> tuple[dict[str, np.ndarray], int]:
    """The fields of the episode at rows ``start .. start + length`` (its ``length + 1`` rows of every array; per-step
    fields drop the unused last row), in schema order, and the crc32 of its rows as stored (FORMAT.md, Checksums: an
    image array's rows as encoded)."""
    crc, data = 0, {}
    for spec in layout.arrays:
        io = arrays[spec.path]
        if isinstance(io, FrameWriter):
            frames = io.read_encoded(start, start + length + 1)
            crc = zlib.crc32(b"".join(f or b"" for f in frames), crc)
            rows = io.decode(frames, start)
        else:
            rows = io.read(start, start + length + 1)
            crc = zlib.crc32(np.ascontiguousarray(rows).data, crc)
        for name, a, b in spec.columns:
            f = schema.by_name[name]
            part = rows[:, a:b] if spec.is_pack else rows
            data[name] = part[: length if f.per_step else length + 1].reshape(-1, *f.shape)
    return {f.name: data[f.name] for f in schema.fields}, crc
