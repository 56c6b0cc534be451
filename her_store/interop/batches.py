"""The episodes an export writes, read from a store in batches, each episode checked against its crc32.

The episodes a ring's writer evicts while they are read are left out with one warning. Every export reads through
:func:`read_batches`, which yields batches of consecutive episodes (:class:`Batch`): a batch's fields are the
episodes' rows concatenated, and :meth:`Batch.episodes` cuts them back into episodes.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np

from her_store import _kernels
from her_store.errors import CorruptStoreError, EpisodeNotFoundError, short_repr
from her_store.format.schema import Schema
from her_store.progress import progress as progress_bar
from her_store.store.episode_store import EpisodeStore
from her_store.store.rows import ChunkReader, MappedArray

__all__ = ["Batch", "lengths_of", "read_batches"]


class Batch(NamedTuple):
    """Consecutive episodes of an export, read together.

    ``fields`` maps each field of ``schema`` to the episodes' rows concatenated: ``T + 1`` rows per episode for
    observation keys, ``T`` for the others.
    """

    ids: np.ndarray
    lengths: np.ndarray
    fields: dict[str, np.ndarray]
    schema: Schema

    def episodes(self) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
        """Each episode's id and fields (views into the batch), in order."""
        ends = {True: np.cumsum(self.lengths).tolist(), False: np.cumsum(self.lengths + 1).tolist()}
        for k, (i, T) in enumerate(zip(self.ids.tolist(), self.lengths.tolist())):
            yield (
                i,
                {
                    f.name: self.fields[f.name][ends[f.per_step][k] - T - (not f.per_step) : ends[f.per_step][k]]
                    for f in self.schema.fields
                },
            )


def read_batches(
    store: EpisodeStore, episode_ids: np.ndarray, progress: bool, what: str, batch_rows: int = 1 << 18
) -> Iterator[Batch]:
    """The episodes ``episode_ids`` of ``store``, in order, in batches of about ``batch_rows`` rows, each episode
    checked against its crc32, with a progress bar over episodes.

    A ring store's writer may evict the oldest episodes while they are read: those that fail their check and lie
    below the store's live range by then (:meth:`EpisodeStore.live_first`) are left out, as ``copy`` and ``pack``
    leave them, with one warning naming them. A damaged episode of the live range raises CorruptStoreError.

    A store of uncompressed arrays is read a batch at a time (one gather of every row of the batch per array, then
    one crc32 per episode and array, as :meth:`EpisodeStore.episode` checks them): the fixed cost of reading one
    episode (a fraction of a millisecond) would otherwise bound the export of short low-dimensional episodes far
    below the disk's bandwidth. A store with compressed (image) arrays is read with :meth:`EpisodeStore.episode`,
    one episode a batch, whose checksums cover the stored (encoded) bytes.

    Examples
    --------
    >>> for batch in read_batches(store, np.arange(10), False, "exporting"):  # doctest: +SKIP
    ...     batch.fields["action"].shape
    """
    ids = np.asarray(episode_ids, np.int64)
    lengths = lengths_of(store, ids)
    schema = store.schema
    evicted: list[int] = []
    with progress_bar(len(ids), what, progress, unit="episode") as bar:
        try:
            if any(spec.compressed or spec.sharded for spec in store.layout.arrays):
                for i, T in zip(ids.tolist(), lengths.tolist()):
                    bar.update(1)
                    try:
                        ep = store.episode(i)
                    except (CorruptStoreError, EpisodeNotFoundError):
                        if i >= store.live_first():
                            raise
                        evicted.append(i)
                        continue
                    yield Batch(np.array([i]), np.array([T]), {f.name: ep[f.name] for f in schema.fields}, schema)
            else:
                yield from _read_uncompressed(store, ids, lengths, batch_rows, bar, evicted)
            if len(evicted) == len(ids):
                raise ValueError(
                    f"{store.url}: every episode selected was evicted by the store's writer while it was read; "
                    "select newer episodes (--episodes -N:) or export once the writer has stopped"
                )
        finally:
            if evicted:
                warnings.warn(
                    f"{store.url}: {len(evicted)} episodes ({short_repr(evicted)}) were evicted by the store's writer "
                    "while they were read and are left out", stacklevel=2,
                )


def _read_uncompressed(
    store: EpisodeStore, ids: np.ndarray, lengths: np.ndarray, batch_rows: int, bar: Any, evicted: list[int]
) -> Iterator[Batch]:
    """:func:`read_batches` of a store of uncompressed arrays: each batch's rows gathered at once."""
    table = store.episodes
    pos = ids - store.first_episode
    starts, crcs = table["start_row"][pos], table["crc32"][pos]
    reader = ChunkReader(store, io_threads=0)
    for array in reader.arrays.values():
        if isinstance(array, MappedArray):  # rows are read in order here: let the kernel read ahead
            array.random_access = False
    reader.observe(store.snapshot())
    try:
        rows = np.cumsum(lengths + 1)
        cut = np.searchsorted(rows, np.arange(batch_rows, int(rows[-1]), batch_rows), side="right")
        for a, b in itertools.pairwise([0, *np.unique(cut).tolist(), len(ids)]):
            if a < b:
                batch = _gathered(store, reader, ids[a:b], lengths[a:b], starts[a:b], crcs[a:b], evicted)
                if len(batch.ids):
                    yield batch
                bar.update(b - a)
    finally:
        reader.close()


def _gathered(
    store: EpisodeStore,
    reader: ChunkReader,
    ids: np.ndarray,
    lengths: np.ndarray,
    starts: np.ndarray,
    crcs: np.ndarray,
    evicted: list[int],
) -> Batch:
    """One batch of a store of uncompressed arrays: every row gathered at once, each episode's crc32 checked; the
    episodes the writer evicted meanwhile (below its live range, the batch's first ones) are added to ``evicted``
    and left out."""
    n = lengths + 1
    first = np.cumsum(n) - n  # each episode's first row in the batch
    rows = np.repeat(starts - first, n) + np.arange(int(n.sum()))
    last = np.zeros(len(rows), bool)
    last[first + lengths] = True  # the final observation row: no action, reward, flags or infos
    crc = np.zeros(len(ids), np.uint32)
    fields: dict[str, np.ndarray] = {}
    for spec in store.layout.arrays:
        data = reader.gather(spec.path, rows)
        raw = np.ascontiguousarray(data).reshape(len(rows), -1).view(np.uint8)
        width = raw.shape[1]  # each episode's rows are one run of bytes: checksummed in one call, as verify does
        _kernels.crc32_runs(raw, (first * width).astype(np.int64), ((first + n) * width).astype(np.int64), crc)
        for name, lo, hi in spec.columns:
            f = store.schema.by_name[name]
            part = (data[:, lo:hi] if spec.is_pack else data).reshape(len(rows), *f.shape)
            fields[name] = part[~last] if f.per_step else np.ascontiguousarray(part)
    bad = np.flatnonzero(crc.astype(np.int64) != crcs.astype(np.int64))
    if not len(bad):
        return Batch(ids, lengths, fields, store.schema)
    live = int(np.searchsorted(ids, store.live_first()))  # eviction is committed before a row is overwritten
    if bad[-1] >= live:
        k = int(bad[bad >= live][0])
        raise CorruptStoreError(
            f"{store.url}: rows {int(starts[k])}..{int(starts[k] + lengths[k])} of episode {int(ids[k])} do not match "
            "the crc32 recorded when they were written"
        )
    evicted.extend(ids[:live].tolist())
    kept = np.repeat(np.arange(len(ids)) >= live, lengths + 1)  # the episodes' rows, observation rows included
    out = {}
    for f in store.schema.fields:
        out[f.name] = fields[f.name][kept[~last] if f.per_step else kept]
    return Batch(ids[live:], lengths[live:], out, store.schema)


def lengths_of(store: EpisodeStore, episode_ids: np.ndarray) -> np.ndarray:
    """``T`` of each of ``episode_ids`` (live episodes of ``store``), from the index alone."""
    table = store.episodes
    pos = np.asarray(episode_ids, np.int64) - store.first_episode
    if len(pos) and (pos.min() < 0 or pos.max() >= len(table["length"])):
        raise ValueError(f"episode ids {short_repr(episode_ids)} are not all live in {store.url}")
    return table["length"][pos].astype(np.int64)
