"""On-disk layout of a store: array paths, packing of fields into arrays, index columns, root attributes.

FORMAT.md is the prose version of this module; the two change together (and FORMAT_VERSION with them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeGuard

import numpy as np
import zarr
import zarr.codecs
from zarr.core.chunk_key_encodings import DefaultChunkKeyEncoding
from zarr.core.metadata import ArrayV3Metadata

from her_store.checks import is_int, is_number
from her_store.errors import CorruptStoreError, FormatVersionError, NotAStoreError, SchemaMismatchError, short_repr
from her_store.format.keys import ATTRS_KEY, chunk_entry, chunk_key
from her_store.format.schema import Field, Schema

__all__ = [
    "FORMAT_VERSION",
    "INDEX_COLUMNS",
    "MAX_COUNT",
    "ArraySpec",
    "Layout",
    "StoreAttrs",
    "check_array",
    "check_attrs",
    "index_columns",
    "is_count",
    "parse_attrs",
]

FORMAT_VERSION = 4
# Version 2 stores compressed fields (images) as sharded arrays, one row per inner chunk; version 3 names their shards
# c.<i>.0.0... (one file each, not a file under a directory per axis); version 4 adds the episode priority to the
# index. Stores of versions 1 (compressed chunks of several rows), 2 and 3 are still read and appended to in their own
# layout.
SHARDED_SINCE = 2
FLAT_SHARD_KEYS_SINCE = 3
PRIORITY_SINCE = 4  # version 4 adds the index column ``priority``; older stores are read and appended without it
IMAGE_CHUNK_BYTES = 1 << 18  # version 1: rows per compressed chunk
SHARD_BYTES = 1 << 23  # version 2: rows per shard, uncompressed (a commit rewrites its tail shard whole)
PACK_CHUNK_BYTES = 1 << 28  # a pack's chunk file stays under 256 MiB whatever its row width
# Counts in a commit record stay exact as JSON numbers everywhere (and far from int64 overflow in numpy sums).
MAX_COUNT = (1 << 53) - 1

# The episode-index table: one 1-D array per column under episodes/, position = id (or id % index_slots in a ring).
INDEX_COLUMNS: dict[str, np.dtype] = {
    "episode_id": np.dtype("<i8"),
    "start_row": np.dtype("<i8"),
    "length": np.dtype("<i8"),
    "terminated": np.dtype("bool"),
    "truncated": np.dtype("bool"),
    "return": np.dtype("<f8"),
    "success": np.dtype("i1"),
    "env_index": np.dtype("<i4"),
    "created_at": np.dtype("<f8"),
    "crc32": np.dtype("<u4"),
    "priority": np.dtype("<f8"),
}


def index_columns(version: int) -> dict[str, np.dtype]:
    """The index columns a store of format ``version`` persists (every column is held in memory, absent ones as 0).

    Examples
    --------
    >>> "priority" in index_columns(3), "priority" in index_columns(4)
    (False, True)
    """
    if version >= PRIORITY_SINCE:
        return INDEX_COLUMNS
    return {name: dt for name, dt in INDEX_COLUMNS.items() if name != "priority"}


@dataclass(frozen=True)
class ArraySpec:
    """One Zarr array under ``steps/`` or ``packs/`` and the fields it holds.

    A pack (``packs/<dtype>``) is 2-D ``(rows, columns)``: fields of one dtype side by side, each a column range,
    so that every low-dimensional value of a row lies in one place on disk (one read per row when cold).
    A field array (``steps/<field>``) is ``(rows, *field.shape)``, used for compressed fields such as images; from
    format version 2 it is sharded: ``chunk_rows`` rows per shard (one file or object), each row its own inner chunk,
    so a sampled row decodes one row. ``separator`` is that of its chunk keys: ``"."`` for a sharded array from format
    version 3, else ``"/"`` (implied by the version, so not in the layout's JSON).
    """

    path: str
    dtype: np.dtype
    row_shape: tuple[int, ...]
    chunk_rows: int
    columns: tuple[tuple[str, int, int], ...]
    compressed: bool
    sharded: bool = False
    separator: str = "/"

    @property
    def row_nbytes(self) -> int:
        return int(np.prod(self.row_shape, dtype=np.int64)) * self.dtype.itemsize

    @property
    def is_pack(self) -> bool:
        return self.path.startswith("packs/")

    def chunk_key(self, chunk: int) -> str:
        """The key of chunk (or shard) ``chunk``: ``<path>/c/<i>/0...`` or, for ``"."``, ``<path>/c.<i>.0...``."""
        return chunk_key(self.path, chunk, 1 + len(self.row_shape), self.separator)

    def chunk_entry(self, chunk: int) -> str:
        """The entry that holds chunk (or shard) ``chunk`` and nothing else
        (:func:`~her_store.format.keys.chunk_entry`): what removing the chunk removes."""
        return chunk_entry(self.path, chunk, 1 + len(self.row_shape), self.separator)

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "dtype": self.dtype.str,
            "row_shape": list(self.row_shape),
            "chunk_rows": self.chunk_rows,
            "columns": [list(c) for c in self.columns],
            "compressed": self.compressed,
            **({"sharded": True} if self.sharded else {}),
        }


def _image_chunk_rows(field: Field, chunk_rows: int, version: int) -> int:
    """Rows per chunk of a compressed field: the largest power of two keeping one uncompressed shard near 8 MiB
    (version 2: a sampled row decodes only itself, and a commit rewrites the tail shard), or one chunk near 256 KiB
    (version 1: a sampled row decoded its whole chunk); at most ``chunk_rows``."""
    target = SHARD_BYTES if version >= SHARDED_SINCE else IMAGE_CHUNK_BYTES
    rows = max(1, target // max(1, field.row_nbytes))
    return min(chunk_rows, 1 << (rows.bit_length() - 1))


class Layout:
    """Where every field lives: which array, which columns.

    Uncompressed fields are packed by dtype into ``packs/<dtype name>``; a field with a compressor gets its own
    array ``steps/<field>``. ``fields`` maps a field name to ``(ArraySpec, first column, last column + 1)``.

    Examples
    --------
    >>> from gymnasium import spaces
    >>> obs = spaces.Dict({k: spaces.Box(-1, 1, (3,)) for k in ("observation", "achieved_goal", "desired_goal")})
    >>> layout = Layout.build(Schema(obs, spaces.Box(-1, 1, (4,))), set(), chunk_rows=1024)
    >>> [a.path for a in layout.arrays]
    ['packs/float32', 'packs/bool']
    """

    def __init__(self, arrays: tuple[ArraySpec, ...], version: int = FORMAT_VERSION) -> None:
        self.arrays = arrays
        self.version = version
        self.fields: dict[str, tuple[ArraySpec, int, int]] = {
            name: (spec, a, b) for spec in arrays for name, a, b in spec.columns
        }

    @classmethod
    def build(cls, schema: Schema, compressed: set[str], chunk_rows: int, version: int = FORMAT_VERSION) -> Layout:
        packs: dict[np.dtype, list[Field]] = {}
        own: list[ArraySpec] = []
        for f in schema.fields:
            if f.name in compressed:
                rows = _image_chunk_rows(f, chunk_rows, version)
                sharded = version >= SHARDED_SINCE
                separator = "." if version >= FLAT_SHARD_KEYS_SINCE else "/"
                columns = ((f.name, 0, f.width),)
                own.append(ArraySpec(f"steps/{f.name}", f.dtype, f.shape, rows, columns, True, sharded, separator))
            else:
                packs.setdefault(f.dtype, []).append(f)
        arrays = []
        for dtype, members in packs.items():
            ends = np.cumsum([f.width for f in members])
            cols = tuple((f.name, int(e - f.width), int(e)) for f, e in zip(members, ends))
            fit = max(1, PACK_CHUNK_BYTES // (int(ends[-1]) * dtype.itemsize))
            rows = min(chunk_rows, 1 << (fit.bit_length() - 1))
            arrays.append(ArraySpec(f"packs/{dtype.name}", dtype, (int(ends[-1]),), rows, cols, False))
        arrays.extend(own)
        return cls(tuple(arrays), version)

    def to_json(self) -> list[dict[str, Any]]:
        return [a.to_json() for a in self.arrays]

    def describe(self) -> str:
        """The arrays in a line, as messages and ``her-store info`` show them."""
        return ", ".join(
            f"{a.path} ({a.chunk_rows} rows/{'shard' if a.sharded else 'chunk'}"
            f"{', compressed' if a.compressed else ''})"
            for a in self.arrays
        )

    @classmethod
    def from_json(cls, d: Any, schema: Schema, where: str, version: int = FORMAT_VERSION) -> Layout:
        """The layout a store's attributes describe, checked against its schema and format version.

        Array paths become file names, so a layout is never taken as written: it must be exactly what
        :meth:`build` makes of the schema, given which fields it compresses and the chunk rows it asked for (the
        largest ``chunk_rows`` of its arrays). Anything else raises CorruptStoreError naming the first difference.
        """
        if not isinstance(d, list) or not d or not all(isinstance(a, Mapping) for a in d):
            raise CorruptStoreError(f"{where}: {ATTRS_KEY}.layout is {short_repr(d)}, expected a list of arrays")
        rows = [a.get("chunk_rows") for a in d]
        if not all(is_count(r) and r >= 1 for r in rows):
            raise CorruptStoreError(
                f"{where}: {ATTRS_KEY}.layout chunk_rows {short_repr(rows)} are not all positive integers"
            )
        names = {f"packs/{f.dtype.name}" for f in schema.fields} | {f"steps/{f.name}" for f in schema.fields}
        for i, a in enumerate(d):
            if not isinstance(a.get("path"), str) or a["path"] not in names:
                raise CorruptStoreError(
                    f"{where}: {ATTRS_KEY}.layout[{i}].path is {short_repr(a.get('path'))}, expected packs/<dtype> or "
                    "steps/<field> for a dtype or field of the schema"
                )
        compressed = {a["path"][len("steps/") :] for a in d if a["path"].startswith("steps/")}
        layout = cls.build(schema, compressed, max(rows), version)
        expected = layout.to_json()
        if d != expected:
            i = next((i for i, (a, b) in enumerate(zip(d, expected)) if a != b), min(len(d), len(expected)))
            found, want = (d[i] if i < len(d) else {}), (expected[i] if i < len(expected) else {})
            key = next(k for k in [*want, *found] if found.get(k) != want.get(k))
            raise CorruptStoreError(
                f"{where}: {ATTRS_KEY}.layout[{i}].{key} is {short_repr(found.get(key))}, expected "
                f"{short_repr(want.get(key))}: a layout must be what the schema gives (FORMAT.md, Arrays)"
            )
        return layout


class StoreAttrs(NamedTuple):
    """The root attributes of a store, each checked: what opening a store trusts."""

    schema: Schema
    layout: Layout
    capacity: int | None
    index_slots: int | None


def is_count(v: Any) -> TypeGuard[int]:
    """A non-negative JSON integer small enough to stay exact (bools are not integers here)."""
    return is_int(v) and 0 <= v <= MAX_COUNT


def check_attrs(attrs: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Return the her_store attributes of a root group, or raise naming what is wrong."""
    meta = attrs.get(ATTRS_KEY)
    if not isinstance(meta, Mapping):
        raise NotAStoreError(f"{where} is a Zarr group but not a her_store store (no {ATTRS_KEY!r} attribute)")
    version = meta.get("format_version")
    if not is_count(version) or version < 1:
        raise CorruptStoreError(
            f"{where}: attribute {ATTRS_KEY}.format_version is {short_repr(version)}, expected an integer >= 1"
        )
    if version > FORMAT_VERSION:
        raise FormatVersionError(
            f"{where} has format version {version}; this her_store reads versions up to {FORMAT_VERSION}: "
            "upgrade her_store (pip install -U her_store)"
        )
    return dict(meta)


def parse_attrs(meta: Mapping[str, Any], where: str) -> StoreAttrs:
    """Check every her_store attribute (FORMAT.md, Root attributes) and return what the store uses.

    Parameters
    ----------
    meta : mapping
        ``attributes["her_store"]`` of the root group.
    where : str
        The file they were read from, for messages.

    Raises
    ------
    CorruptStoreError
        Naming the attribute, the value found and what was expected.
    """
    missing = [k for k in ("schema", "layout", "capacity", "index_slots", "metadata", "created_at") if k not in meta]
    if missing:
        raise CorruptStoreError(f"{where}: attributes {ATTRS_KEY}.{missing} are missing; see FORMAT.md")
    capacity, slots = meta["capacity"], meta["index_slots"]
    if capacity is not None and not (is_count(capacity) and capacity >= 1):
        raise CorruptStoreError(
            f"{where}: {ATTRS_KEY}.capacity is {short_repr(capacity)}, expected null or an integer >= 1"
        )
    ring = capacity is not None and is_count(slots) and slots >= capacity
    if not (ring or (capacity is None and slots is None)):
        raise CorruptStoreError(
            f"{where}: {ATTRS_KEY}.index_slots is {short_repr(slots)} with capacity {capacity}, expected null for an "
            "unbounded store, else an integer >= capacity"
        )
    if not isinstance(meta["metadata"], Mapping):
        raise CorruptStoreError(f"{where}: {ATTRS_KEY}.metadata is {short_repr(meta['metadata'])}, expected an object")
    created = meta["created_at"]
    if not is_number(created, finite=True):
        raise CorruptStoreError(f"{where}: {ATTRS_KEY}.created_at is {short_repr(created)}, expected unix seconds")
    try:
        schema = Schema.from_json(meta["schema"])
    except SchemaMismatchError as e:
        raise CorruptStoreError(f"{where}: {ATTRS_KEY}.schema is invalid: {e}") from e
    version = meta.get("format_version")
    if not (is_count(version) and 1 <= version <= FORMAT_VERSION):
        raise CorruptStoreError(
            f"{where}: {ATTRS_KEY}.format_version is {short_repr(version)}, expected 1..{FORMAT_VERSION}"
        )
    return StoreAttrs(schema, Layout.from_json(meta["layout"], schema, where, version), capacity, slots)


def check_array(
    array: Any,
    dtype: np.dtype,
    row_shape: tuple[int, ...],
    chunk_rows: int | None,
    raw: bool,
    where: str,
    sharded: bool = False,
    separator: str = "/",
) -> None:
    """Check a Zarr array's own metadata against what the layout says it is, before any row is read or written.

    Row access trusts ``dtype``, the row shape and ``chunk_rows`` (``None``: any positive number of rows, as
    for index columns), and finds chunks by the default key encoding with ``separator``; a ``raw`` array is read and
    written as bare little-endian chunk files, so it must have no codec but ``bytes``. A ``sharded`` array has shards of
    ``chunk_rows`` rows, one row per inner chunk, and its shard index (little-endian, crc32c) at the end.
    """
    if not isinstance(array, zarr.Array):
        raise CorruptStoreError(f"{where} is a {type(array).__name__}, expected an array")
    grid = tuple(array.shards or array.chunks) if sharded else tuple(array.chunks)
    rows = chunk_rows or (grid[0] if grid else 0)
    if (
        array.dtype != dtype
        or len(array.shape) != 1 + len(row_shape)
        or tuple(array.shape[1:]) != row_shape
        or grid != (rows, *row_shape)
        or (sharded and tuple(array.chunks) != (1, *row_shape))
        or rows < 1
    ):
        chunks = f"chunks of {chunk_rows} rows" if chunk_rows else "chunks of whole rows"
        if sharded:
            chunks = f"shards of {chunk_rows} rows, each row an inner chunk"
        raise CorruptStoreError(
            f"{where}: array of dtype {array.dtype}, shape {array.shape} and chunks {array.chunks}; expected dtype "
            f"{dtype}, rows of shape {row_shape} and {chunks}"
        )
    meta = array.metadata
    if not isinstance(meta, ArrayV3Metadata):
        raise CorruptStoreError(f"{where}: Zarr v{meta.zarr_format} array metadata, expected v3")
    if meta.storage_transformers or not np.all(np.asarray(meta.fill_value) == 0):
        raise CorruptStoreError(
            f"{where}: fill value {short_repr(meta.fill_value)} and storage transformers "
            f"{short_repr(meta.storage_transformers)}, expected 0 and none (a row never written reads as zeros)"
        )
    encoding = meta.chunk_key_encoding
    if not isinstance(encoding, DefaultChunkKeyEncoding) or encoding.separator != separator:
        raise CorruptStoreError(f"{where}: chunk key encoding {encoding!r}, expected the default with {separator!r}")
    codecs = tuple(meta.codecs)
    if raw and not (
        len(codecs) == 1
        and isinstance(codecs[0], zarr.codecs.BytesCodec)
        and codecs[0].endian in (None, zarr.codecs.Endian.little)
    ):
        raise CorruptStoreError(f"{where}: codecs {codecs!r}, expected only little-endian bytes (uncompressed)")
    if sharded:
        shard = codecs[0] if len(codecs) == 1 else None
        index = tuple(shard.index_codecs) if isinstance(shard, zarr.codecs.ShardingCodec) else ()
        if not (
            isinstance(shard, zarr.codecs.ShardingCodec)
            and shard.index_location == zarr.codecs.ShardingCodecIndexLocation.end
            and len(index) == 2
            and isinstance(index[0], zarr.codecs.BytesCodec)
            and index[0].endian in (None, zarr.codecs.Endian.little)
            and isinstance(index[1], zarr.codecs.Crc32cCodec)
        ):
            raise CorruptStoreError(
                f"{where}: codecs {codecs!r}, expected one sharding_indexed codec with its index at the end, encoded "
                "as little-endian bytes + crc32c"
            )


