"""The row reader of local uncompressed arrays: :class:`MappedArray`, rows copied from memory-mapped chunk files.

The chunks are local files (or members of a local zip); :class:`MappedArray` maps each chunk file and copies rows from
the mapping, a file cut short under it failing the row with EIO.

The raw chunk files are memory-mapped (``_kernels.map_file``; MADV_RANDOM: no readahead for random rows) and gathered
with numpy's take (in C without the GIL where the compiled kernels are built), so the page faults of a cold store (one
larger than RAM) are served in parallel when a gather is split across threads.
"""

from __future__ import annotations

import errno
import io
import os
import threading
from typing import Any

import numpy as np

from her_store import _kernels
from her_store.errors import CorruptStoreError
from her_store.format.layout import ArraySpec
from her_store.storage import Backend
from her_store.storage.files import FileShares

__all__ = ["MappedArray"]


class MappedArray:
    """An uncompressed local array whose chunk files (members, in a packed store) are memory-mapped on first use.

    Each map holds its file open (to see the file's size after a gather; a pure mapping holds a duplicate of the
    descriptor too, :mod:`her_store._kernels.pure`), so at most its share of ``MAPS`` descriptors (every mapped
    array's in the process) stay mapped: past that the oldest half are let go (unmapped once no gather reads them)
    and mapped again when next used. A store of small chunks that a writer keeps growing would otherwise run the
    process out of descriptors.
    """

    MAPS = FileShares(divisor=16, least=1, most=4096)

    def __init__(self, backend: Backend, spec: ArraySpec, random_access: bool = True) -> None:
        self.spec = spec
        self.backend = backend
        self.chunk_rows = spec.chunk_rows
        self.random_access = random_access
        self._maps: dict[int, tuple[Any, io.FileIO, int]] = {}  # per chunk: its mapping, its file, its rows' end in it
        self._lock = threading.Lock()
        self.MAPS.join(self)

    def _map(self, chunk: int) -> tuple[Any, io.FileIO, int]:
        """The chunk's rows mapped (``_kernels.map_file``), its file, and where its rows end in the file (mapped on
        first use)."""
        got = self._maps.get(chunk)
        if got is not None:
            return got
        with self._lock:
            got = self._maps.get(chunk)
            if got is None:
                key = self.spec.chunk_key(chunk)
                f, base, size = self.backend.open_range(key)
                need = self.chunk_rows * self.spec.row_nbytes
                try:
                    if size < need:
                        raise CorruptStoreError(f"{self.backend}/{key}: {size:,} bytes, a chunk holds {need:,}")
                    if os.fstat(f.fileno()).st_size < base + need:  # a packed store's file cut short past its index
                        raise CorruptStoreError(
                            f"{self.backend}/{key}: the file ends before the chunk's rows do (cut short)"
                        )
                    m = _kernels.map_file(f.fileno(), base, need, self.random_access)
                except BaseException:
                    f.close()
                    raise
                # descriptors each map holds: its file's, and a pure mapping's duplicate of it
                bound = self.MAPS.share() // (1 if _kernels.COMPILED else 2)
                if len(self._maps) >= bound:
                    for old in list(self._maps)[: len(self._maps) - bound // 2 + 1]:
                        del self._maps[old]
                self._maps[chunk] = got = (m, f, base + need)
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
        m, f, end = self._map(chunk)
        first = chunk * self.chunk_rows
        args = (m, rows, first, 0, out, self.spec.row_nbytes)
        failed, err = _kernels.take_rows(*args) if at is None else _kernels.take_rows(*args, at)
        # the file's size now (its end, by lseek: no read of the file uses its offset, each is a pread)
        size = os.lseek(f.fileno(), 0, os.SEEK_END) if failed < 0 else end
        if size < end:  # cut short in place, but not below these rows' pages
            past = np.flatnonzero(end + (rows - first + 1 - self.chunk_rows) * self.spec.row_nbytes > size)
            if past.size:  # rows past the new end on its last page: they read as zeros
                failed, err = int(past[0]), errno.EIO
        if failed >= 0:
            key = self.spec.chunk_key(chunk)
            row = int(rows[failed]) - first
            if err:
                raise OSError(err, f"{self.backend}/{key}: reading row {row} failed: {os.strerror(err)} (the file was "
                              "cut short under its mapping)")
            raise CorruptStoreError(f"{self.backend}/{key}: row {row} is outside the chunk")

    def after_fork(self) -> None:
        """In a forked child: the lock made anew (the mappings stay; each is the child's too)."""
        self._lock = threading.Lock()

    def evict_page_cache(self) -> None:
        """Drop this array's pages from memory, for cold-start measurements: the mapping's pages (MADV_DONTNEED;
        mapped pages survive fadvise) and then the file's page cache (written back first, POSIX_FADV_DONTNEED)."""
        for m, _, _ in self._maps.values():
            m.drop_pages()
        self.backend.drop_page_cache(self.spec.path)

    def close(self) -> None:
        self._maps.clear()  # each mapping and file closes when no gather holds it any more
        self.MAPS.leave(self)
