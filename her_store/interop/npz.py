"""npz export and import: a store's episodes as one numpy ``.npz`` file, read back without unpickling.

Layout (every member a plain numeric array; ``numpy.load(path, allow_pickle=False)`` reads it):

- ``observations/<key>``: each observation key, the ``T + 1`` rows of every episode, episodes concatenated;
- ``actions``, ``rewards``, ``terminations``, ``truncations``, ``infos/<key>``: the ``T`` rows of every episode;
- ``episode_lengths`` (int64, ``T`` of each episode) and ``episode_ids`` (int64, the ids in the exported store);
- ``her_store_header``: uint8, the UTF-8 JSON ``{"format": "her_store.npz", "version": 1, "schema": ...,
  "metadata": ...}``: the store's spaces (as in FORMAT.md) and its dataset card.

Episode ``i`` of a per-step field is rows ``cumsum(lengths)[i-1]`` onward; of an observation key, rows
``cumsum(lengths + 1)[i-1]`` onward. Dtypes are the store's, so a store -> npz -> store round trip is bit-exact.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import numpy as np

from her_store.interop.batches import Batch, read_batches
from her_store.interop.checks import check_episode_bytes
from her_store.interop.layout import HEADER_KEY, header_of, minari_name
from her_store.interop.npz_members import NpzReader, read_npz_header, write_npz
from her_store.interop.staging import append_from, staged_file, staged_store
from her_store.progress import progress as progress_bar
from her_store.store.episode_store import EpisodeStore

__all__ = ["export_npz", "import_npz"]


def export_npz(
    store: EpisodeStore, episode_ids: np.ndarray, dest: str | os.PathLike[str], *, progress: bool = False
) -> tuple[int, int]:
    """Write episodes ``episode_ids`` of ``store`` to the npz file ``dest`` (layout in the module docstring); returns
    the episodes and transitions written.

    Memory stays bounded: each field is filled in a memory-mapped scratch file beside ``dest``, then stored in the
    zip. ``dest`` appears only when the whole file is written.

    Raises
    ------
    FileExistsError
        ``dest`` exists.

    Examples
    --------
    >>> with EpisodeStore.open("runs/point") as store:  # doctest: +SKIP
    ...     export_npz(store, np.arange(store.first_episode, store.end_episode), "point.npz")
    """
    ids = np.asarray(episode_ids, np.int64)
    fields = store.schema.fields
    members = {minari_name(f): (f.dtype, f.shape) for f in fields}
    written: list[Batch] = []  # ids and lengths of the episodes written (a ring's writer may evict some meanwhile)

    def pieces() -> Iterator[dict[str, np.ndarray]]:
        for b in read_batches(store, ids, progress, "exporting npz"):
            written.append(Batch(b.ids, b.lengths, {}, b.schema))
            yield {minari_name(f): b.fields[f.name] for f in fields}

    def small() -> dict[str, np.ndarray]:
        return {
            HEADER_KEY: np.frombuffer(json.dumps(header_of(store, "npz")).encode(), np.uint8),
            "episode_lengths": np.concatenate([b.lengths for b in written]).astype(np.int64),
            "episode_ids": np.concatenate([b.ids for b in written]).astype(np.int64),
        }

    with staged_file(dest) as tmp:
        write_npz(tmp, members, pieces(), small)
    return sum(len(b.ids) for b in written), sum(int(b.lengths.sum()) for b in written)


def import_npz(source: str | os.PathLike[str], store_path: str | os.PathLike[str], *, progress: bool = False) -> int:
    """Read an npz file written by :func:`export_npz` into a new store at ``store_path``; returns the episodes.

    The file's arrays are streamed (memory stays bounded) and checked against its header before anything is
    written: dtypes, shapes, and that the episode lengths account for every row.

    Raises
    ------
    ValueError
        The file is damaged or cut short, lacks an array, or its arrays do not match its header or lengths.
    FileExistsError
        ``store_path`` exists.

    Examples
    --------
    >>> import_npz("point.npz", "runs/point_copy")  # doctest: +SKIP
    120
    """
    source = os.fspath(source)
    with NpzReader(source) as z:
        schema, card = read_npz_header(z, "npz")
        lengths = z.read_all("episode_lengths")
        if lengths.dtype.kind not in "iu" or lengths.ndim != 1 or not len(lengths) or lengths.min() < 1:
            raise ValueError(f"{source}: episode_lengths {lengths.dtype}{lengths.shape} is not a list of lengths >= 1")
        if int(lengths.max()) >= 1 << 40:  # before the cast (uint64 near 2**64 would turn negative) and the sum
            raise ValueError(f"{source}: episode_lengths holds {int(lengths.max()):,}; an episode has fewer steps")
        lengths = lengths.astype(np.int64)
        names = {f.name: minari_name(f) for f in schema.fields}
        for f in schema.fields:
            dtype, shape = z.header(names[f.name])
            want = (int(lengths.sum()) + (0 if f.per_step else len(lengths)), *f.shape)
            if dtype != f.dtype or shape != want:
                raise ValueError(
                    f"{source}: array {names[f.name]!r} is {dtype}{shape}; its header and episode_lengths say "
                    f"{f.dtype}{want}"
                )
        bar = progress_bar(len(lengths), "importing npz", progress, unit="episode")
        with staged_store(store_path, schema, card) as store, bar:
            for i, T in enumerate(lengths.tolist()):
                where = f"{source}: episode {i} ({T:,} steps)"
                check_episode_bytes(schema, T, where)
                episode = {f.name: z.read(names[f.name], T if f.per_step else T + 1) for f in schema.fields}
                append_from(store, episode, where)
                bar.update(1)
            for name in names.values():
                z.finish(name)
    return len(lengths)
