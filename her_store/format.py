"""On-disk layout of a store: array paths, packing of fields into arrays, root attributes and the commit record.

FORMAT.md is the prose version of this module; the two change together (and FORMAT_VERSION with them).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from her_store.errors import CorruptStoreError, FormatVersionError
from her_store.schema import Field, Schema

__all__ = [
    "FORMAT_VERSION",
    "ATTRS_KEY",
    "COMMIT_KEY",
    "LOCK_KEY",
    "INDEX_COLUMNS",
    "ArraySpec",
    "Layout",
    "Commit",
    "check_attrs",
]

FORMAT_VERSION = 1
ATTRS_KEY = "her_store"
COMMIT_KEY = "commit.json"
LOCK_KEY = "writer.lock"
IMAGE_CHUNK_BYTES = 1 << 18
PACK_CHUNK_BYTES = 1 << 28  # a pack's chunk file stays under 256 MiB whatever its row width

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
}


@dataclass(frozen=True)
class ArraySpec:
    """One Zarr array under ``steps/`` or ``packs/`` and the fields it holds.

    A pack (``packs/<dtype>``) is 2-D ``(rows, columns)``: fields of one dtype side by side, each a column range,
    so that every low-dimensional value of a row lies in one place on disk (one read per row when cold).
    A field array (``steps/<field>``) is ``(rows, *field.shape)``, used for compressed fields such as images.
    """

    path: str
    dtype: np.dtype
    row_shape: tuple[int, ...]
    chunk_rows: int
    columns: tuple[tuple[str, int, int], ...]
    compressed: bool

    @property
    def row_nbytes(self) -> int:
        return int(np.prod(self.row_shape, dtype=np.int64)) * self.dtype.itemsize

    @property
    def is_pack(self) -> bool:
        return self.path.startswith("packs/")

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "dtype": self.dtype.str,
            "row_shape": list(self.row_shape),
            "chunk_rows": self.chunk_rows,
            "columns": [list(c) for c in self.columns],
            "compressed": self.compressed,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ArraySpec:
        return cls(
            d["path"],
            np.dtype(d["dtype"]),
            tuple(d["row_shape"]),
            int(d["chunk_rows"]),
            tuple((str(n), int(a), int(b)) for n, a, b in d["columns"]),
            bool(d["compressed"]),
        )


def _image_chunk_rows(field: Field, chunk_rows: int) -> int:
    """Largest power of two of rows that keeps one uncompressed chunk near 256 KiB: a sampled row decodes its whole
    chunk, so small chunks waste less; much smaller ones mean very many files."""
    rows = max(1, IMAGE_CHUNK_BYTES // max(1, field.row_nbytes))
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

    def __init__(self, arrays: tuple[ArraySpec, ...]) -> None:
        self.arrays = arrays
        self.fields: dict[str, tuple[ArraySpec, int, int]] = {
            name: (spec, a, b) for spec in arrays for name, a, b in spec.columns
        }

    @classmethod
    def build(cls, schema: Schema, compressed: set[str], chunk_rows: int) -> Layout:
        packs: dict[np.dtype, list[Field]] = {}
        own: list[ArraySpec] = []
        for f in schema.fields:
            if f.name in compressed:
                spec = ArraySpec(
                    f"steps/{f.name}", f.dtype, f.shape, _image_chunk_rows(f, chunk_rows), ((f.name, 0, f.width),), True
                )
                own.append(spec)
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
        return cls(tuple(arrays))

    def to_json(self) -> list[dict[str, Any]]:
        return [a.to_json() for a in self.arrays]

    @classmethod
    def from_json(cls, d: list[Mapping[str, Any]]) -> Layout:
        return cls(tuple(ArraySpec.from_json(a) for a in d))


def check_attrs(attrs: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Return the her_store attributes of a root group, or raise naming what is wrong."""
    from her_store.errors import NotAStoreError

    meta = attrs.get(ATTRS_KEY)
    if not isinstance(meta, Mapping):
        raise NotAStoreError(f"{where} is a Zarr group but not a her_store store (no {ATTRS_KEY!r} attribute)")
    version = meta.get("format_version")
    if not isinstance(version, int):
        raise CorruptStoreError(f"{where}: attribute {ATTRS_KEY}.format_version is {version!r}, expected an integer")
    if version > FORMAT_VERSION:
        raise FormatVersionError(
            f"{where} has format version {version}; this her_store reads versions up to {FORMAT_VERSION}: "
            "upgrade her_store (pip install -U her_store)"
        )
    return dict(meta)


@dataclass(frozen=True)
class Commit:
    """The commit record: the only truth about which episodes and rows are committed.

    Attributes
    ----------
    generation : int
        Incremented by every commit.
    first_episode, end_episode : int
        Live episode ids are ``first_episode <= id < end_episode``; ids below were evicted by the ring.
    write_row : int
        Row where the next episode starts (before any wrap).
    num_transitions : int
        Sum of the lengths of the live episodes.
    array_rows : int
        Rows the arrays are sized to (grows for unbounded stores).
    """

    generation: int = 0
    first_episode: int = 0
    end_episode: int = 0
    write_row: int = 0
    num_transitions: int = 0
    array_rows: int = 0

    def to_bytes(self) -> bytes:
        body = {
            "format_version": FORMAT_VERSION,
            "generation": self.generation,
            "first_episode": self.first_episode,
            "end_episode": self.end_episode,
            "write_row": self.write_row,
            "num_transitions": self.num_transitions,
            "array_rows": self.array_rows,
        }
        body["crc32"] = zlib.crc32(json.dumps(body, sort_keys=True).encode())
        return json.dumps(body, sort_keys=True, indent=1).encode()

    @classmethod
    def from_bytes(cls, raw: bytes, where: str) -> Commit:
        try:
            body = json.loads(raw)
            crc = body.pop("crc32")
            ok = crc == zlib.crc32(json.dumps(body, sort_keys=True).encode())
            version = body.pop("format_version")
            commit = cls(**{k: int(v) for k, v in body.items()})
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CorruptStoreError(f"{where}: commit record {COMMIT_KEY} is unreadable ({e!r}); expected the JSON described in FORMAT.md") from e
        if not ok:
            raise CorruptStoreError(f"{where}: commit record {COMMIT_KEY} fails its crc32 check")
        if version > FORMAT_VERSION:
            raise FormatVersionError(f"{where}: commit record has format version {version}; this her_store reads up to {FORMAT_VERSION}")
        if not (0 <= commit.first_episode <= commit.end_episode and 0 <= commit.write_row <= commit.array_rows):
            raise CorruptStoreError(f"{where}: commit record {COMMIT_KEY} is inconsistent: {commit}")
        return commit
