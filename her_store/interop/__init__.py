"""Export and import: a store's episodes to and from npz, HDF5, Minari, OGBench's npz and SB3 replay-buffer pickles.

This module is the format registry and the ``her-store export`` / ``her-store import`` commands; each format lives in
its own module (``npz``, ``hdf5``, ``minari``, ``ogbench``, ``sb3_pickle``), imported only when it is used, with

- ``export_<fmt>(store, episode_ids, dest, *, progress=False) -> (episodes, transitions)`` (whole episodes, in the
  format's own conventions, with the store's spaces and dataset card; the counts written), and
- ``import_<fmt>(source, store_path, *, progress=False) -> int`` (a NEW store at ``store_path``; the number of
  episodes imported).

Both write under a temporary name beside the destination and rename it at the end (:func:`staged_store`,
:func:`her_store.storage.files.staged_output`): nothing is left at the destination unless the whole operation succeeded.
The helpers here are shared by the format modules: the JSON header that carries spaces and card
(:func:`header_of`, :func:`parse_header`), the exported episodes read in checked batches (:func:`read_batches`),
streamed npz members (:func:`write_npz`, :class:`NpzReader`), staged destinations (:func:`staged_store`,
:func:`staged_file`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import itertools
import json
import math
import os
import re
import shutil
import stat
import tokenize
import warnings
import zipfile
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, BinaryIO, NamedTuple

import numpy as np

from her_store import _kernels
from her_store.checks import is_int
from her_store.errors import (
    CorruptStoreError,
    EpisodeNotFoundError,
    EpisodeValidationError,
    SchemaMismatchError,
    short_repr,
)
from her_store.format.card import check_card
from her_store.format.schema import Field, Schema
from her_store.ops.selection import parse_selection
from her_store.progress import progress as progress_bar
from her_store.storage.base import METADATA_LIMIT
from her_store.storage.files import staged_output
from her_store.store.episode_store import EpisodeStore
from her_store.store.rows import ChunkReader, MappedArray

__all__ = [
    "EXPORTS",
    "IMPORTS",
    "Batch",
    "NpzReader",
    "add_arguments",
    "exact_cast",
    "export_store",
    "guess_format",
    "header_of",
    "import_source",
    "lengths_of",
    "minari_name",
    "parse_header",
    "read_batches",
    "read_npz_header",
    "run",
    "staged_file",
    "staged_store",
    "write_npz",
]

# format -> (module, function). Modules are imported when their format is used (h5py, minari, ogbench, SB3 lazily).
EXPORTS: dict[str, tuple[str, str]] = {
    "npz": ("her_store.interop.npz", "export_npz"),
    "hdf5": ("her_store.interop.hdf5", "export_hdf5"),
    "minari": ("her_store.interop.minari", "export_minari"),
    "ogbench": ("her_store.interop.ogbench", "export_ogbench"),
}
IMPORTS: dict[str, tuple[str, str]] = {
    "minari": ("her_store.interop.minari", "import_minari"),
    "hdf5": ("her_store.interop.hdf5", "import_hdf5"),
    "npz": ("her_store.interop.npz", "import_npz"),
    "ogbench": ("her_store.interop.ogbench", "import_ogbench"),
    "sb3": ("her_store.interop.sb3_pickle", "import_sb3"),
}
# a store's per-step fields under Minari's names; observation keys are observations/<key>, info keys infos/<key>
MINARI_NAMES = {"action": "actions", "reward": "rewards", "terminated": "terminations", "truncated": "truncations"}
HEADER_KEY = "her_store_header"  # the npz member / HDF5 attribute holding spaces and card as JSON
HEADER_VERSION = 1
_MINARI_ID = re.compile(r"^[\w.-]+(/[\w.-]+)*-v\d+$")


# -- the header: spaces and dataset card, as JSON -------------------------------------------------------------------
def header_of(store: EpisodeStore, kind: str) -> dict[str, Any]:
    """The JSON header an export writes: what wrote it, the store's spaces (:meth:`Schema.to_json`) and card.

    Examples
    --------
    >>> header_of(store, "npz")["format"]  # doctest: +SKIP
    'her_store.npz'
    """
    return {
        "format": f"her_store.{kind}",
        "version": HEADER_VERSION,
        "schema": store.schema.to_json(),
        "metadata": store.metadata,
    }


def parse_header(raw: bytes | str, kind: str, where: str) -> tuple[Schema, dict[str, Any]]:
    """The schema and card of a header read from a file, checked (nothing in it is trusted or run).

    Raises
    ------
    ValueError
        Not JSON, not a header of ``kind``, a newer version, or a card :func:`check_card` refuses.
    SchemaMismatchError
        The spaces are not valid.

    Examples
    --------
    >>> schema, card = parse_header(json.dumps(header_of(store, "npz")), "npz", "x.npz")  # doctest: +SKIP
    """
    if len(raw) > METADATA_LIMIT:
        raise ValueError(f"{where}: the {HEADER_KEY} is {len(raw):,} bytes; at most {METADATA_LIMIT:,} are read")
    try:
        head = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ValueError(f"{where}: {HEADER_KEY} is not JSON, or nested too deep ({type(e).__name__})") from None
    want = f"her_store.{kind}"
    if not isinstance(head, dict) or head.get("format") != want:
        found = head.get("format") if isinstance(head, dict) else head
        raise ValueError(f"{where}: {HEADER_KEY} names format {short_repr(found)}, expected {want!r}")
    version = head.get("version")
    if not is_int(version) or not 1 <= version <= HEADER_VERSION:
        raise ValueError(f"{where}: header version {short_repr(version)}; this her_store reads 1..{HEADER_VERSION}")
    try:
        schema = Schema.from_json(head.get("schema"))
    except SchemaMismatchError as e:
        raise SchemaMismatchError(f"{where}: the spaces of its {HEADER_KEY}: {e}") from None
    return schema, check_card(head.get("metadata", {}), f"{where}: the dataset card")


def minari_name(field: Field) -> str:
    """A field's name in Minari's episode layout (also the npz and HDF5 exports'): ``observations/<key>``,
    ``actions``, ``rewards``, ``terminations``, ``truncations``, ``infos/<key>``.

    Examples
    --------
    >>> [minari_name(f) for f in store.schema.fields][:2]  # doctest: +SKIP
    ['observations/observation', 'observations/achieved_goal']
    """
    if not field.per_step:
        return f"observations/{field.name}"
    return MINARI_NAMES.get(field.name, f"infos/{field.name}")


# -- staged outputs -------------------------------------------------------------------------------------------------
def _local(path: str | os.PathLike[str], what: str) -> str:
    path = os.fspath(path)
    if "://" in path:
        raise ValueError(
            f"{what} {path!r} is a URL; export and import write local files (copy a store to object storage "
            "afterwards with her-store copy)"
        )
    return path


@contextlib.contextmanager
def staged_store(store_path: str | os.PathLike[str], schema: Schema, card: Mapping[str, Any]) -> Iterator[EpisodeStore]:
    """A new store, created under a temporary name beside ``store_path`` and renamed to it when the block succeeds.

    On any exception the temporary store is removed: nothing is left at ``store_path``. Episodes are committed in
    groups (not every append), and all of them at the end.

    Raises
    ------
    FileExistsError
        ``store_path`` exists (an import never writes into an existing store).

    Examples
    --------
    >>> with staged_store("imported", schema, {"env_id": "PointGoal-v0"}) as store:  # doctest: +SKIP
    ...     store.append_episode(episode)
    """
    card = check_card(card, "the dataset card")
    with staged_output(_local(store_path, "the new store")) as tmp:
        store = EpisodeStore.create(
            tmp,
            schema.observation_space,
            schema.action_space,
            info_keys=schema.info_spaces,
            metadata=card,
            commit_interval=60.0,
        )
        try:
            yield store
        except BaseException:
            with contextlib.suppress(Exception):
                store.close()
            raise
        store.close()


def staged_file(dest: str | os.PathLike[str]) -> contextlib.AbstractContextManager[str]:
    """:func:`her_store.storage.files.staged_output` for an export's destination, refusing a URL."""
    return staged_output(_local(dest, "the destination"))


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
    store: EpisodeStore, reader: ChunkReader, ids: np.ndarray, lengths: np.ndarray, starts: np.ndarray, crcs: np.ndarray,
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


def exact_cast(values: Any, dtype: np.dtype, where: str, name: str, episode: int, noted: set[str]) -> np.ndarray:
    """``values`` (an array read from a file made elsewhere) in the store's ``dtype``, when the cast keeps every value.

    A cast is exact when casting back gives every value again (NaN stays NaN): bool to uint8, float64 values that
    float32 holds, int64 values inside int16's range. The first cast of each ``name`` is stated as a warning (the
    caller keeps ``noted`` for one import). A cast that would change a value (float64 digits float32 drops, an
    integer out of range, NaN into an integer or a flag, 0.5 into a flag) is refused.

    Raises
    ------
    ValueError
        Naming ``where`` (the file), ``name``, ``episode`` (its number in the file), the file's dtype, the store's
        and the first value that would change.

    Examples
    --------
    >>> noted = set()
    >>> exact_cast(np.array([-1.0, 0.0]), np.dtype("<f4"), "x.npz", "rewards", 0, noted)
    array([-1.,  0.], dtype=float32)
    >>> exact_cast(np.array([0.1]), np.dtype("<f4"), "x.npz", "rewards", 1, noted)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: x.npz: rewards is float64 in the file and float32 in the store: casting would change 0.1 at (0,) ...
    """
    values, dtype = np.asarray(values), np.dtype(dtype)
    if values.dtype == dtype:
        return values
    if values.dtype.kind not in "biuf":
        raise ValueError(f"{where}: {name} is {values.dtype} in the file; expected numbers ({dtype})")
    with np.errstate(invalid="ignore", over="ignore"):  # what the cast breaks is found below, by casting back
        cast = values.astype(dtype)
        back = cast.astype(values.dtype)
    kept = back == values
    if values.dtype.kind == "f":
        kept |= np.isnan(values) & np.isnan(back)
    if not kept.all():
        at = tuple(int(i) for i in np.unravel_index(np.argmin(kept), kept.shape))
        raise ValueError(
            f"{where}: {name} is {values.dtype} in the file and {dtype} in the store: casting would change "
            f"{values[at].item()!r} at {at} of episode {episode} to {cast[at].item()!r}; refused"
        )
    if name not in noted:
        noted.add(name)
        warnings.warn(f"{where}: {name} is {values.dtype} in the file, stored as {dtype} (every value kept exactly)",
                      stacklevel=2)
    return cast


# -- npz members, streamed ------------------------------------------------------------------------------------------
MEMBER_LIMIT = 1 << 30  # bytes a member read whole, or one HDF5 dataset, may decode to
EPISODE_LIMIT = 1 << 30  # bytes of one imported episode's fields together: they are all read before it is appended


def check_episode_bytes(schema: Schema, T: int, where: str) -> None:
    """Refuse, unread, an episode of ``T`` steps whose fields in ``schema`` (observation fields hold ``T + 1`` rows)
    take more than EPISODE_LIMIT bytes together: a file of deflated zeros can claim any length at a few bytes, and an
    episode's fields are all read (then staged by the store) before it is appended. (HDF5 episodes are bounded from
    their datasets' shapes: :func:`check_hdf5`.)

    Raises
    ------
    ValueError
        Naming the episode (``where``) and its size.
    """
    nbytes = sum((T if f.per_step else T + 1) * f.row_nbytes for f in schema.fields)
    if nbytes > EPISODE_LIMIT:
        raise ValueError(
            f"{where} takes {nbytes:,} bytes in its fields; at most {EPISODE_LIMIT:,} are read for one episode "
            "(split longer episodes before importing)"
        )


def append_from(store: EpisodeStore, episode: Mapping[str, np.ndarray], where: str) -> int:
    """``store.append_episode(episode)``; a refusal names the episode's place in the file read (``where``)."""
    try:
        return store.append_episode(episode)
    except EpisodeValidationError as e:
        raise EpisodeValidationError(f"{where}: {e}") from None


def check_hdf5(f: Any, source: str, frames: Mapping[str, int] | None = None) -> None:
    """Refuse what an HDF5 file may hold that reads outside it or explodes in memory: soft and external links,
    datasets stored in external files or virtual (mapped from other files), datasets over ``MEMBER_LIMIT`` bytes, and
    groups (episodes) whose datasets take over ``EPISODE_LIMIT`` bytes together.

    ``frames`` maps paths below each top-level group (``observations/pixels``) to the bytes one row decodes to, for
    datasets of encoded images a reader decodes row by row: such a dataset counts as what it stores plus its rows
    decoded, which a few bytes of deflated rows could otherwise claim without bound.

    Raises
    ------
    ValueError
        Naming the object and what it is.

    Examples
    --------
    >>> import h5py  # doctest: +SKIP
    >>> with h5py.File("point.hdf5") as f: check_hdf5(f, "point.hdf5")  # doctest: +SKIP
    """
    import h5py

    frames = frames or {}
    groups: dict[str, int] = {}  # bytes of the datasets under each top-level group (an episode's)

    def visit(name: str, link: Any) -> str | None:  # a message stops the walk (h5py cannot raise through it)
        if not isinstance(link, h5py.HardLink):
            return f"{name} is a {type(link).__name__}; a dataset's objects must all lie in its file"
        obj = f[name]
        if isinstance(obj, h5py.Dataset):
            if obj.external or obj.is_virtual:
                return f"{name} keeps its data outside the file; refused"
            nbytes = math.prod(obj.shape or ()) * obj.dtype.itemsize
            top, _, below = name.partition("/")
            what = f"{obj.shape} of {obj.dtype}"
            if below in frames:
                rows = obj.shape[0] if obj.shape else 1
                nbytes += rows * frames[below]
                what += f", {rows:,} encoded frames of {frames[below]:,} bytes each decoded"
            if nbytes > MEMBER_LIMIT:
                return f"{name} is {what} ({nbytes:,} bytes); at most {MEMBER_LIMIT:,} per dataset"
            groups[top] = groups.get(top, 0) + nbytes
            if "/" in name and groups[top] > EPISODE_LIMIT:
                return f"{top} holds datasets of more than {EPISODE_LIMIT:,} bytes together; at most that per episode"
        return None

    try:
        problem = f.visititems_links(visit)
    except (RuntimeError, KeyError, OSError) as e:
        raise ValueError(f"{source}: its objects cannot be walked ({type(e).__name__}: {e})") from None
    if problem is not None:
        raise ValueError(f"{source}: {problem}")


def write_npz(
    path: str,
    members: Mapping[str, tuple[np.dtype, tuple[int, ...]]],
    rows: Iterable[Mapping[str, np.ndarray]],
    small: Callable[[], Mapping[str, np.ndarray]],
) -> None:
    """Write an uncompressed npz (what :func:`numpy.load` reads, ``allow_pickle=False``) whose big members are
    filled piece by piece.

    ``members`` gives each big member's dtype and row shape; ``rows`` yields, piece after piece, the next rows of
    every member (a mapping member -> rows; each member's rows in order); a member holds the rows it was given. Each
    member is first appended to its own ``.npy`` scratch file beside ``path`` (memory stays bounded), its header
    rewritten with the final row count, then copied whole into the zip, which holds each member contiguous as npz
    needs. ``small()``, called once every piece is written, gives the members written from memory.

    Raises
    ------
    ValueError
        A piece does not match its member's dtype or row shape.
    """
    scratch = f"{path}.members"
    os.mkdir(scratch)
    files: dict[str, Any] = {}
    try:
        filled = dict.fromkeys(members, 0)
        for k, (name, (dt, row_shape)) in enumerate(members.items()):
            files[name] = open(os.path.join(scratch, f"{k}.npy"), "w+b")  # noqa: SIM115 - closed in finally
            files[name].write(_npy_header(np.dtype(dt), (_NPY_ROWS_RESERVED, *row_shape)))
        for piece in rows:
            for name, a in piece.items():
                dt, row_shape = members[name]
                if a.dtype != dt or a.shape[1:] != tuple(row_shape):
                    raise ValueError(f"npz member {name!r}: rows {a.dtype}{a.shape} do not fit {dt}{tuple(row_shape)}")
                files[name].write(np.ascontiguousarray(a).data.cast("B"))
                filled[name] += len(a)
        for name, (dt, row_shape) in members.items():  # the same header length: the reserved count is the widest
            files[name].seek(0)
            files[name].write(_npy_header(np.dtype(dt), (filled[name], *row_shape), _npy_header_size(dt, row_shape)))
        with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
            for name, a in small().items():
                with zf.open(f"{name}.npy", "w", force_zip64=True) as f:
                    np.lib.format.write_array(f, np.ascontiguousarray(a), allow_pickle=False)
            for name, f in files.items():
                f.seek(0)
                with zf.open(f"{name}.npy", "w", force_zip64=True) as out:
                    shutil.copyfileobj(f, out, 16 << 20)
                f.close()
    finally:
        for f in files.values():
            with contextlib.suppress(OSError):  # a full disk fails the flush again: the scratch goes all the same
                f.close()
        shutil.rmtree(scratch, ignore_errors=True)


_NPY_ROWS_RESERVED = 10**18  # the row count a member's header is first written with: as wide as any it will hold


def _npy_header_size(dtype: np.dtype, row_shape: tuple[int, ...]) -> int:
    return len(_npy_header(np.dtype(dtype), (_NPY_ROWS_RESERVED, *row_shape)))


def _npy_header(dtype: np.dtype, shape: tuple[int, ...], size: int | None = None) -> bytes:
    """An ``.npy`` version 2.0 header of ``size`` bytes (padded with spaces; by default to a multiple of 64)."""
    text = repr({"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": tuple(shape)})
    body = text.encode("latin1")
    size = size if size is not None else -(-(12 + len(body) + 1) // 64) * 64
    body += b" " * (size - 12 - len(body) - 1) + b"\n"
    return b"\x93NUMPY\x02\x00" + len(body).to_bytes(4, "little") + body


def open_input(path: str, what: str) -> BinaryIO:
    """``path`` opened for reading, which must be a regular file: a FIFO would block the open (and every read)
    forever, a device never ends.

    Raises
    ------
    ValueError
        ``path`` is something other than a regular file.

    Examples
    --------
    >>> open_input("/dev/null", "an npz file")  # doctest: +SKIP
    Traceback (most recent call last):
    ValueError: /dev/null is a character device, not a regular file; expected an npz file
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO opens at once, then is refused
    kind = stat.S_IFMT(os.fstat(fd).st_mode)
    if kind != stat.S_IFREG:
        os.close(fd)
        name = {stat.S_IFIFO: "FIFO", stat.S_IFCHR: "character device", stat.S_IFBLK: "block device",
                stat.S_IFSOCK: "socket", stat.S_IFDIR: "directory"}.get(kind, "special file")
        raise ValueError(f"{path} is a {name}, not a regular file; expected {what}")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


class NpzReader:
    """Reads the members of an npz file as streams: each member's rows in order, a piece at a time (bounded memory),
    never unpickling (object arrays are refused). A damaged file (cut short, bad CRC, not a zip) raises ValueError
    naming the file.

    Examples
    --------
    >>> with NpzReader("episodes.npz") as z:  # doctest: +SKIP
    ...     lengths = z.read_all("episode_lengths")
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._file = open_input(self.path, "an npz file")
        with self.reading():
            try:
                self._zip = zipfile.ZipFile(self._file)
            except BaseException:
                self._file.close()
                raise
        self.keys = [n[:-4] for n in self._zip.namelist() if n.endswith(".npy")]
        self._open: dict[str, tuple[Any, np.dtype, tuple[int, ...]]] = {}

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Turns the zip and npy errors of a damaged file into one ValueError naming the file."""
        try:
            yield
        except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError, zipfile.LargeZipFile) as e:
            raise ValueError(f"{self.path} is not a complete npz file ({type(e).__name__}: {e})") from None
        except RuntimeError as e:  # what zipfile raises for an encrypted member
            raise ValueError(f"{self.path} cannot be read as an npz file ({e})") from None

    def header(self, name: str) -> tuple[np.dtype, tuple[int, ...]]:
        """A member's dtype and shape (its stream is opened and positioned at its first row)."""
        if name not in self._open:
            if name not in self.keys:
                raise ValueError(f"{self.path} has no array {name!r} (it has {short_repr(sorted(self.keys))})")
            with self.reading():
                f = self._zip.open(f"{name}.npy")
                try:
                    version = np.lib.format.read_magic(f)
                    read = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
                    if version not in read:
                        raise ValueError(f"npy format version {version}; expected 1.0 or 2.0")
                    shape, fortran, dtype = read[version](f)
                except (ValueError, SyntaxError, tokenize.TokenError, RecursionError, MemoryError) as e:
                    f.close()
                    raise ValueError(
                        f"{self.path}: array {name!r} has no valid .npy header ({type(e).__name__}: {e})"
                    ) from None
            want = math.prod(shape) * dtype.itemsize if all(d >= 0 for d in shape) else -1
            if want < 0 or want > self._zip.getinfo(f"{name}.npy").file_size:
                f.close()
                raise ValueError(
                    f"{self.path}: array {name!r} claims shape {shape} of {dtype} ({want:,} bytes) but holds "
                    f"{self._zip.getinfo(f'{name}.npy').file_size:,} bytes"
                )
            if dtype.hasobject or fortran:
                raise ValueError(
                    f"{self.path}: array {name!r} is {dtype}{' in Fortran order' if fortran else ''}; expected plain "
                    "numbers in C order"
                )
            self._open[name] = (f, dtype, tuple(shape))
        _, dtype, shape = self._open[name]
        return dtype, shape

    def read(self, name: str, n: int) -> np.ndarray:
        """The next ``n`` rows of a member, at most ``MEMBER_LIMIT`` bytes (an episode claiming more is refused
        unread: a file of deflated zeros can claim any length)."""
        dtype, shape = self.header(name)
        f = self._open[name][0]
        nbytes = n * int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
        if nbytes > MEMBER_LIMIT:
            raise ValueError(
                f"{self.path}: {n:,} rows of array {name!r} are {nbytes:,} bytes; at most {MEMBER_LIMIT:,} are read "
                "at once (one episode's rows of a field)"
            )
        with self.reading():
            raw = f.read(nbytes)
        if len(raw) != nbytes:
            raise ValueError(f"{self.path}: array {name!r} ends early ({len(raw):,} of {nbytes:,} bytes left)")
        return np.frombuffer(raw, dtype).reshape(n, *shape[1:])

    def read_all(self, name: str, limit: int = MEMBER_LIMIT) -> np.ndarray:
        """A whole member (for small ones: lengths, flags, the header), its CRC checked; at most ``limit`` bytes."""
        dtype, shape = self.header(name)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > limit:
            raise ValueError(f"{self.path}: array {name!r} is {nbytes:,} bytes; at most {limit:,} are read whole")
        out = self.read(name, shape[0]) if shape else self.read(name, 1).reshape(())
        self.finish(name)
        return out

    def finish(self, name: str) -> None:
        """Read a member to its end, which checks its CRC; refuse bytes past its rows."""
        f = self._open.pop(name)[0]
        with self.reading():
            extra = f.read(1)
            f.close()
        if extra:
            raise ValueError(f"{self.path}: array {name!r} holds more bytes than its header's shape")

    def close(self) -> None:
        for f, _, _ in self._open.values():
            f.close()
        self._open.clear()
        self._zip.close()
        self._file.close()  # (a ZipFile closes only a file it opened itself)

    def __enter__(self) -> NpzReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_npz_header(z: NpzReader, kind: str) -> tuple[Schema, dict[str, Any]]:
    """The spaces and card of an npz an export wrote (its ``her_store_header`` member)."""
    raw = z.read_all(HEADER_KEY, limit=METADATA_LIMIT)
    if raw.dtype != np.uint8 or raw.ndim != 1:
        raise ValueError(f"{z.path}: {HEADER_KEY} is {raw.dtype}{raw.shape}; expected uint8 bytes of JSON")
    return parse_header(raw.tobytes(), kind, z.path)


# -- the library entry points ---------------------------------------------------------------------------------------
def _function(table: dict[str, tuple[str, str]], fmt: str, what: str) -> Callable[..., Any]:
    if fmt not in table:
        raise ValueError(f"unknown {what} format {fmt!r}; expected one of {', '.join(table)}")
    module, name = table[fmt]
    return getattr(importlib.import_module(module), name)


def export_store(
    source: str | os.PathLike[str],
    fmt: str,
    dest: str | os.PathLike[str],
    episodes: str | None = None,
    *,
    progress: bool = False,
) -> tuple[int, int]:
    """Export the episodes ``episodes`` names (a selection, :func:`her_store.ops.selection.parse_selection`; None: all)
    of the store at ``source`` to ``dest`` as ``fmt``. Returns ``(episodes, transitions)`` written (fewer than
    selected when a ring's writer evicted some while they were read: :func:`read_batches`).

    Examples
    --------
    >>> export_store("runs/point", "npz", "point.npz", "-100:")  # doctest: +SKIP
    (100, 5000)
    """
    export = _function(EXPORTS, fmt, "export")
    _local(dest, "the destination")
    with EpisodeStore.open(source, mode="r") as store:
        ids = parse_selection(episodes, store.first_episode, store.end_episode)
        if not len(ids):
            raise ValueError(
                f"no episode to export: {store.url} holds episodes {store.first_episode}..{store.end_episode - 1}"
                + (f", the selection {episodes!r} names none of them" if episodes else "")
            )
        return tuple(export(store, ids, dest, progress=progress))


def guess_format(source: str | os.PathLike[str]) -> str:
    """The import format of ``source``, guessed: an npz by its arrays (an export's ``her_store_header`` without
    ``terminals``: npz; ``observations``, ``actions``, ``terminals``: OGBench), ``.h5``/``.hdf5``: HDF5,
    ``.pkl``/``.pickle``: an SB3 replay buffer, a directory or a Minari id (``namespace/name-v0``): Minari.

    Raises
    ------
    ValueError
        Nothing tells; pass the format (``--from``).

    Examples
    --------
    >>> guess_format("D4RL/door/human-v2")  # doctest: +SKIP
    'minari'
    """
    path = os.fspath(source)
    ext = os.path.splitext(path)[1].lower()
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, "zarr.json")):
            raise ValueError(f"{path} is a her_store store already; copy it with her-store copy")
        return "minari"
    if os.path.exists(path):
        if ext == ".npz":
            with NpzReader(path) as z:
                if {"observations", "actions", "terminals"} <= set(z.keys):
                    return "ogbench"
                if HEADER_KEY in z.keys:
                    return "npz"
            raise ValueError(
                f"{path}: an npz with neither {HEADER_KEY!r} (her-store export) nor observations, actions and "
                f"terminals (OGBench); it has {short_repr(sorted(z.keys))}"
            )
        if ext in (".h5", ".hdf5"):
            return "hdf5"
        if ext in (".pkl", ".pickle"):
            return "sb3"
        raise ValueError(f"cannot tell the format of {path} from its name; pass --from {{{','.join(IMPORTS)}}}")
    if _MINARI_ID.match(path):
        return "minari"
    raise FileNotFoundError(f"{path} does not exist (and is not a Minari dataset id such as 'D4RL/door/human-v2')")


def import_source(
    source: str | os.PathLike[str],
    store_path: str | os.PathLike[str],
    fmt: str | None = None,
    *,
    progress: bool = False,
) -> int:
    """Import ``source`` as a new store at ``store_path`` (``fmt`` None: :func:`guess_format`). Returns the episodes
    imported. An SB3 pickle (``fmt="sb3"``, or guessed from ``.pkl``) is unpickled: that runs code from the file.

    Examples
    --------
    >>> import_source("antmaze-large-navigate-v0.npz", "runs/antmaze", "ogbench")  # doctest: +SKIP
    1000
    """
    _local(store_path, "the new store")
    fmt = fmt or guess_format(source)
    return _function(IMPORTS, fmt, "import")(source, store_path, progress=progress)


# -- the commands ---------------------------------------------------------------------------------------------------
_EXPORT_HELP = f"""\
Writes whole episodes of a store (local path or URL) to DEST with the store's spaces and dataset card, bit-exact.
DEST must not exist; nothing is left there unless the whole export succeeds.
  npz      one file: per-field arrays, episodes concatenated (observations/<key>: T+1 rows per episode; actions,
           rewards, terminations, truncations, infos/<key>: T rows), episode_lengths, episode_ids and {HEADER_KEY}
           (JSON); numpy.load(DEST, allow_pickle=False) reads it
  hdf5     Minari's episode layout: groups episode_<id>/observations/<key>, actions, rewards, terminations,
           truncations, infos/<key>; spaces and card in the root attribute {HEADER_KEY}
  minari   a local Minari dataset directory that minari.load_dataset opens, the card as its metadata; DEST is
           named name-v<version> unless the card has a dataset_id, and the directories above it are made
  ogbench  OGBench's npz layout (observations, actions, terminals; T+1 rows per episode, the last action zero,
           terminals 1 on it) that ogbench.utils.load_dataset reads, plus achieved_goal, desired_goal, rewards,
           masks, truncations and info keys"""

_IMPORT_HELP = """\
Reads SOURCE into a NEW store at STORE (refused if STORE exists; nothing is left there unless the whole import
succeeds). Formats: a Minari dataset (its id in the local Minari root, or its directory); an npz or HDF5 file written
by her-store export (spaces and dataset card come back exactly); an OGBench npz (observations, actions, terminals:
episodes are split at terminals); an SB3 save_replay_buffer pickle of a DictReplayBuffer or HerReplayBuffer.

An OGBench file without achieved_goal/desired_goal arrays imports with achieved_goal = the observation and
desired_goal = the episode's final observation (every row), reward 0 on the last transition and -1 before it (unless
it has rewards), terminated where masks is 0 (none without masks) and the last step truncated.

WARNING: an SB3 pickle is unpickled, and unpickling runs code from the file. This import (--from sb3, or a
.pkl/.pickle SOURCE) is the only place her_store does that: import only pickles you trust. Opening a store never
runs code."""


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    """Declare the arguments of ``her-store export`` or ``her-store import``.

    Examples
    --------
    >>> p = argparse.ArgumentParser(); add_arguments(p, "export")
    >>> p.parse_args(["runs/point", "--to", "npz", "point.npz"]).to
    'npz'
    """
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    if name == "export":
        parser.description = _EXPORT_HELP
        parser.add_argument("source", metavar="PATH_OR_URL", help="the store to export")
        parser.add_argument("--to", required=True, choices=list(EXPORTS), help="the format to write")
        parser.add_argument("dest", metavar="DEST", help="the file (or Minari dataset) to write; must not exist")
        parser.add_argument(
            "--episodes",
            metavar="SELECTION",
            help="episode ids and ranges, e.g. '0:100,250' (default: all live episodes); a selection starting with '-' "
            "is written --episodes=-10:",
        )
    else:
        parser.description = _IMPORT_HELP
        parser.add_argument("source", metavar="SOURCE", help="a file, a Minari dataset id or directory")
        parser.add_argument("store", metavar="STORE", help="the new store's directory; must not exist")
        parser.add_argument(
            "--from",
            dest="fmt",
            choices=list(IMPORTS),
            help="the format of SOURCE (default: guessed from its name and arrays); sb3 unpickles, which runs code",
        )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    """Run ``her-store export`` or ``her-store import``; returns the exit status."""
    if args.command == "export":
        n, transitions = export_store(args.source, args.to, args.dest, args.episodes, progress=not args.quiet)
        print(f"exported {n:,} episodes ({transitions:,} transitions) to {args.dest} as {args.to}")
        return 0
    n = import_source(args.source, args.store, args.fmt, progress=not args.quiet)
    print(f"imported {n:,} episodes into {args.store}")
    return 0
