"""The priorities of a prioritized sampler, checkpointed to its store: ``priorities/`` beside the arrays.

A checkpoint is a manifest (``priorities/manifest.json``) naming, for each chunk of ``CHUNK_ROWS`` rows, the file
holding that chunk's priorities (``priorities/c<chunk>.<generation>``, raw little-endian float64, one value per
store row). A checkpoint writes the chunks that changed under names of its own (a random generation: no other
sampler's checkpoint, of this process or another, writes the same names), then replaces the manifest (one atomic
write), then removes every file under ``priorities/`` that the manifest does not name (what a killed checkpoint or
an earlier one left). A process killed at any point leaves the last manifest and every file it names whole: a
resumed sampler reads exactly the last checkpoint.

Nothing read is trusted: the manifest's numbers and names are checked, every chunk's size is the one its rows
need, and every value is finite and >= 0; a checkpoint that fails a check is not used (a warning says why), and the
sampler starts from the largest priority.
"""

from __future__ import annotations

import json
import math
import secrets
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from her_store.errors import CorruptStoreError, StoreError, short_repr
from her_store.format.layout import MAX_COUNT, is_count
from her_store.storage import Backend

__all__ = [
    "CHUNK_BITS", "CHUNK_ROWS", "MAX_VALUE", "PRIORITIES_DIR", "PriorityCheckpoint", "SavedPriorities",
    "discard_checkpoint",
]

PRIORITIES_DIR = "priorities"
MANIFEST_KEY = f"{PRIORITIES_DIR}/manifest.json"
MAX_VALUE = 1e250  # the largest priority ** alpha: a tree of up to 2**60 of them sums without overflow
CHUNK_BITS = 18
CHUNK_ROWS = 1 << CHUNK_BITS  # rows per chunk file: 2 MiB of float64


@dataclass(frozen=True)
class SavedPriorities:
    """A checkpoint as read back.

    Attributes
    ----------
    values : numpy.ndarray
        float64 ``(rows,)``: each store row's ``priority ** alpha`` (0 where no live transition was).
    first, end : int
        The episodes ``[first, end)`` whose rows it holds.
    alpha : float
        The exponent the values were raised to.
    max_priority : float
        The largest priority (before ``alpha``) seen when it was written.
    """

    values: np.ndarray
    first: int
    end: int
    alpha: float
    max_priority: float


class PriorityCheckpoint:
    """Writes and reads the priorities checkpoint of the store behind ``backend``.

    Parameters
    ----------
    backend : Backend
        The store's backend (``store.backend``).
    store_id : float
        The store's ``created_at``: a checkpoint of another store at the same place is not used.
    fsync : bool
        fsync what a checkpoint writes (the store's ``durability="fsync"``).
    """

    def __init__(self, backend: Backend, store_id: float, fsync: bool) -> None:
        self.backend = backend
        self.store_id = float(store_id)
        self.fsync = fsync
        self._files: dict[int, int] = {}  # chunk -> generation, as the last manifest read or written names them
        self._generation = 0

    @property
    def writable(self) -> bool:
        """Whether the store takes writes (not over HTTP, not a packed archive)."""
        return not self.backend.read_only

    def load(self, max_rows: int) -> SavedPriorities | None:
        """The last checkpoint, or None when there is none or it fails a check (with a warning saying which); one of
        more than ``max_rows`` rows (the store's rows) fails."""
        try:
            raw = self.backend.read_bytes(MANIFEST_KEY)
            if raw is None:
                return None
            return self._parse(raw, max_rows)
        except (StoreError, OSError) as e:
            warnings.warn(
                f"the priorities checkpoint of {self.backend} is not used ({e}); the sampler starts from the largest "
                "priority, and its next checkpoint replaces this one",
                RuntimeWarning,
                stacklevel=4,
            )
            self._files = {}
            return None

    def is_current(self) -> bool:
        """Whether the checkpoint in the store is the last one this object read or wrote (another sampler's, or
        none where this one read one, is not: a checkpoint then writes every chunk, not only those that changed)."""
        try:
            raw = self.backend.read_bytes(MANIFEST_KEY)
            doc = json.loads(raw) if raw is not None else None
        except (StoreError, OSError, ValueError, UnicodeDecodeError, RecursionError):
            return False
        if doc is None:
            return self._generation == 0
        return isinstance(doc, dict) and doc.get("generation") == self._generation and self._generation != 0

    def _parse(self, raw: bytes, max_rows: int) -> SavedPriorities:
        where = self.backend.key_path(MANIFEST_KEY)
        try:
            doc = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise CorruptStoreError(f"{where} is not JSON ({e})") from e
        if not isinstance(doc, dict):
            raise CorruptStoreError(f"{where} holds {short_repr(doc)}, expected a JSON object")
        ints = {k: doc.get(k) for k in ("generation", "rows", "first", "end", "chunk_rows")}
        bad = [k for k, v in ints.items() if not is_count(v)]
        if bad or doc.get("chunk_rows") != CHUNK_ROWS or ints["first"] > ints["end"]:  # type: ignore[operator]
            raise CorruptStoreError(f"{where}: {bad or ['chunk_rows', 'first', 'end']} are not what a checkpoint "
                                    f"holds (counts, chunk_rows={CHUNK_ROWS}, first <= end)")
        numbers = {k: doc.get(k) for k in ("alpha", "max_priority", "store_id")}
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
                   for v in numbers.values()):
            raise CorruptStoreError(f"{where}: alpha, max_priority and store_id must be finite numbers >= 0, got "
                                    f"{short_repr(numbers)}")
        if float(numbers["store_id"]) != self.store_id:  # type: ignore[arg-type]
            raise StoreError(f"{where} was written for another store at this place")
        rows = int(ints["rows"])  # type: ignore[arg-type]
        if rows > max_rows:
            raise CorruptStoreError(f"{where}: rows={rows:,}, more than the store's {max_rows:,}")
        chunks = doc.get("chunks")
        n_chunks = -(-rows // CHUNK_ROWS)
        if not isinstance(chunks, dict) or not all(
            isinstance(k, str) and k.isdigit() and int(k) < n_chunks and is_count(g) for k, g in chunks.items()
        ):
            raise CorruptStoreError(f"{where}: chunks must map chunk numbers below {n_chunks} to generations")
        files = {int(k): int(g) for k, g in chunks.items()}
        values = np.zeros(rows)
        order = sorted(files)
        got = self.backend.read_objects([_chunk_key(c, files[c]) for c in order], limit=CHUNK_ROWS * 8)
        for c, data in zip(order, got):
            key = self.backend.key_path(_chunk_key(c, files[c]))
            need = (min(rows, (c + 1) * CHUNK_ROWS) - c * CHUNK_ROWS) * 8
            if data is None or len(data) != need:
                raise CorruptStoreError(f"{key}: expected {need:,} bytes, found "
                                        f"{'none' if data is None else f'{len(data):,}'}")
            chunk = np.frombuffer(data, "<f8")
            if not ((chunk >= 0).all() and (chunk <= MAX_VALUE).all()):
                raise CorruptStoreError(f"{key}: priorities must lie in [0, {MAX_VALUE:.0e}]")
            values[c * CHUNK_ROWS : c * CHUNK_ROWS + len(chunk)] = chunk
        self._files, self._generation = files, int(ints["generation"])  # type: ignore[arg-type]
        return SavedPriorities(values, int(ints["first"]), int(ints["end"]),  # type: ignore[arg-type]
                               float(numbers["alpha"]), float(numbers["max_priority"]))  # type: ignore[arg-type]

    def save(self, chunks: dict[int, np.ndarray], rows: int, first: int, end: int, alpha: float,
             max_priority: float) -> None:
        """Write a checkpoint whose chunks are those of the last one, replaced by ``chunks`` (chunk number ->
        its values, float64, ``CHUNK_ROWS`` or, for the last chunk, fewer), covering ``rows`` rows and the episodes
        ``[first, end)``.

        Raises
        ------
        ReadOnlyStoreError
            The store takes no writes.
        """
        if not (0 <= first <= end <= MAX_COUNT):
            raise ValueError(f"episodes {first}..{end} are not a range of episode ids")
        generation = self._new_generation()
        files = {c: g for c, g in self._files.items() if c * CHUNK_ROWS < rows}
        try:
            for c, values in sorted(chunks.items()):
                self.backend.write_atomic(_chunk_key(c, generation), np.ascontiguousarray(values, "<f8").tobytes(),
                                          fsync=self.fsync)
                files[c] = generation
            doc: dict[str, Any] = {
                "generation": generation, "rows": rows, "first": first, "end": end, "chunk_rows": CHUNK_ROWS,
                "alpha": alpha, "max_priority": max_priority, "store_id": self.store_id,
                "chunks": {str(c): g for c, g in sorted(files.items())},
            }
            self.backend.write_atomic(MANIFEST_KEY, json.dumps(doc).encode(), fsync=self.fsync)
        except OSError as e:
            raise StoreError(f"{self.backend.key_path(PRIORITIES_DIR)}: the priorities checkpoint cannot be written "
                             f"({e}); the last one stays") from e
        stale = [_chunk_key(c, g) for c, g in self._files.items() if files.get(c) != g]
        self._files, self._generation = files, generation
        named = {_chunk_key(c, g) for c, g in files.items()} | {MANIFEST_KEY}
        if self.backend.lists:  # and what killed checkpoints left, half-written files included
            try:
                stale = [k for k in self.backend.list_files(PRIORITIES_DIR) if k not in named]
            except OSError:
                pass
        for key in stale:  # the manifest names none of them now; a failure here leaves a file no one reads
            try:
                self.backend.remove(key)
            except OSError:
                pass

    def _new_generation(self) -> int:
        """A generation no checkpoint of this store has used, with overwhelming odds (random, 52 bits)."""
        while True:
            g = secrets.randbits(52)
            if g != self._generation and g not in self._files.values():
                return g


def discard_checkpoint(backend: Backend) -> bool:
    """Remove the priorities checkpoint of the store behind ``backend`` (its episodes were renumbered: the ids and rows
    it names are others'); returns whether there was one."""
    if backend.read_only or not backend.exists(MANIFEST_KEY):
        return False
    backend.remove(MANIFEST_KEY)
    return True


def _chunk_key(chunk: int, generation: int) -> str:
    return f"{PRIORITIES_DIR}/c{chunk}.{generation}"
