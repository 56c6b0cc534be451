"""HDF5 export and import (h5py): a store's episodes in Minari's HDF5 episode layout, with spaces and card.

Layout of the file:

- root attributes ``her_store_header`` (JSON ``{"format": "her_store.hdf5", "version": 1, "schema": ...,
  "metadata": ...}``: the store's spaces as in FORMAT.md and its dataset card), ``total_episodes``, ``total_steps``;
- one group per episode, ``episode_<id>`` (the id in the exported store; attributes ``id``, ``total_steps`` and
  ``crc32``, zlib's crc32 chained over the episode's fields in schema order, which import checks: HDF5 checks none of
  its own), as Minari writes them: ``observations/<key>`` (``T + 1`` rows), ``actions``, ``rewards``, ``terminations``,
  ``truncations`` and ``infos/<key>`` (``T`` rows), in the store's dtypes (a round trip is bit-exact).

Import reads files written by export (their header gives the spaces); a Minari dataset imports with ``--from minari``.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from her_store.checks import is_int
from her_store.extras import require
from her_store.format.schema import Field
from her_store.interop.batches import read_batches
from her_store.interop.checks import check_hdf5
from her_store.interop.layout import HEADER_KEY, header_of, minari_name, parse_header
from her_store.interop.staging import append_from, staged_file, staged_store
from her_store.progress import progress as progress_bar
from her_store.store.episode_store import EpisodeStore

__all__ = ["export_hdf5", "import_hdf5"]

_EPISODE = re.compile(r"^episode_(0|[1-9]\d{0,17})$")  # as export names them: one name per id


def export_hdf5(
    store: EpisodeStore, episode_ids: np.ndarray, dest: str | os.PathLike[str], *, progress: bool = False
) -> tuple[int, int]:
    """Write episodes ``episode_ids`` of ``store`` to the HDF5 file ``dest`` (layout in the module docstring); returns
    the episodes and transitions written.

    Raises
    ------
    FileExistsError
        ``dest`` exists (nothing is overwritten; ``dest`` appears only when the whole file is written).

    Examples
    --------
    >>> with EpisodeStore.open("runs/point") as store:  # doctest: +SKIP
    ...     export_hdf5(store, np.arange(store.first_episode, store.end_episode), "point.hdf5")
    """
    h5py = require("h5py", "hdf5")
    ids = np.asarray(episode_ids, np.int64)
    # HDF5 writes through a Python file: a failed write (a full disk) raises OSError, where HDF5's own file driver
    # crashes the process when the file is closed after it
    with staged_file(dest) as tmp, open(tmp, "w+b") as raw, h5py.File(raw, "w") as f:
        f.attrs[HEADER_KEY] = json.dumps(header_of(store, "hdf5"))
        episodes = steps = 0
        for batch in read_batches(store, ids, progress, "exporting hdf5"):
            episodes += len(batch.ids)
            for i, ep in batch.episodes():
                g = f.create_group(f"episode_{i}")
                g.attrs["id"] = i
                g.attrs["total_steps"] = len(ep["action"])
                g.attrs["crc32"] = _crc32(ep, store.schema.fields)  # HDF5 checks none of its own: import checks this
                for field in store.schema.fields:
                    g.create_dataset(minari_name(field), data=ep[field.name])
            steps += int(batch.lengths.sum())
        f.attrs["total_episodes"] = episodes
        f.attrs["total_steps"] = steps
    return episodes, steps


def import_hdf5(source: str | os.PathLike[str], store_path: str | os.PathLike[str], *, progress: bool = False) -> int:
    """Read an HDF5 file written by :func:`export_hdf5` into a new store at ``store_path``; returns the episodes.

    Episodes are imported in the order of their ids; each must hold every field of the header's spaces in the
    stored dtype, with ``T + 1`` observation rows and ``T`` rows of the rest.

    Raises
    ------
    ValueError
        The file is not HDF5 or not written by export, a group or dataset is missing or has the wrong dtype or
        rows.
    FileExistsError
        ``store_path`` exists.

    Examples
    --------
    >>> import_hdf5("point.hdf5", "runs/point_copy")  # doctest: +SKIP
    120
    """
    h5py = require("h5py", "hdf5")
    source = os.fspath(source)
    if not os.path.isfile(source):
        raise FileNotFoundError(f"{source} is not a file")
    try:
        f = h5py.File(source, "r")
    except OSError as e:
        raise ValueError(f"{source} is not a readable HDF5 file ({e})") from None
    with f:
        check_hdf5(f, source)
        raw = f.attrs.get(HEADER_KEY)
        if raw is None:
            raise ValueError(
                f"{source} has no {HEADER_KEY!r} attribute: it was not written by her-store export "
                "(a Minari dataset imports with --from minari)"
            )
        schema, card = parse_header(raw if isinstance(raw, (str, bytes)) else str(raw), "hdf5", source)
        groups = sorted((int(m.group(1)), name) for name in f for m in [_EPISODE.match(name)] if m)
        others = [name for name in f if not _EPISODE.match(name)]
        if others or not groups:
            raise ValueError(f"{source}: expected only groups episode_<id>, found {sorted(others)[:5] or 'none'}")
        bar = progress_bar(len(groups), "importing hdf5", progress, unit="episode")
        with staged_store(store_path, schema, card) as store, bar:
            for _, name in groups:
                ep = {fl.name: _dataset(f, f"{name}/{minari_name(fl)}", fl.dtype, source) for fl in schema.fields}
                recorded = f[name].attrs.get("crc32")
                if not is_int(recorded) or int(recorded) != _crc32(ep, schema.fields):
                    raise ValueError(f"{source}: {name} does not match the crc32 its export recorded (damaged?)")
                append_from(store, ep, f"{source}: {name}")
                bar.update(1)
    return len(groups)


def _crc32(episode: Mapping[str, np.ndarray], fields: Sequence[Field]) -> int:
    """zlib.crc32 chained over an episode's fields, in schema order, as their bytes."""
    crc = 0
    for field in fields:
        crc = zlib.crc32(np.ascontiguousarray(episode[field.name]).data, crc)
    return crc


def _dataset(f: Any, path: str, dtype: np.dtype, source: str) -> np.ndarray:
    """A dataset's values, which must be in the stored dtype (a round trip never casts)."""
    d = f.get(path)
    if d is None or not hasattr(d, "dtype") or not hasattr(d, "shape"):
        raise ValueError(f"{source}: {path} is missing or not a dataset")
    if d.dtype != dtype:
        raise ValueError(f"{source}: {path} is {d.dtype}; the header's spaces store {dtype}")
    try:
        return d[()]
    except OSError as e:
        raise ValueError(f"{source}: {path} cannot be read ({e})") from None
