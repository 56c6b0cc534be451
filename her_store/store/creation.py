"""How a store is made: its arrays planned, its Zarr metadata and first commit record written, its root opened.

The arrays are planned from the creation options; the root group and arrays of a store are opened and checked
against its layout; a create cut short is told apart (it left no commit record and no chunk) and started again.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import zarr
import zarr.api.asynchronous
from zarr.core.sync import sync as zarr_sync

from her_store.checks import check_int, check_mapping
from her_store.errors import (
    CorruptStoreError,
    NotAStoreError,
    SchemaMismatchError,
    StoreError,
    StoreExistsError,
    short_repr,
)
from her_store.format.commit_record import Commit
from her_store.format.frames import frame_codecs, lz4_codec
from her_store.format.keys import ATTRS_KEY, COMMIT_KEY, LOCK_KEY, MARKER_KEY, is_chunk_key
from her_store.format.layout import INDEX_COLUMNS, MAX_COUNT, Layout, check_array, check_attrs
from her_store.format.schema import Schema
from her_store.storage import Backend
from her_store.store.chunk_io import ZARR_CONFIG
from her_store.store.commit import round_up

__all__ = [
    "MAX_CAPACITY",
    "make_store",
    "checked_arrays",
    "open_arrays",
    "open_root",
    "plan_arrays",
    "plan_nodes",
    "ring_sizes",
    "unfinished_create",
    "write_nodes",
]

# a ring holds row space for capacity transitions plus one extra row per episode of >= 4 steps on average
RING_ROW_SLACK = 4


MAX_CAPACITY = MAX_COUNT // 2  # the ring's rows, capacity * 5/4 rounded up to a chunk, stay a count


def to_zarr_codecs(codecs: Any) -> Any:
    """Accept zarr v3 codecs and plain numcodecs codecs (mapped to zarr's own Zstd/Blosc, else the numcodecs
    wrapper)."""
    import numcodecs.abc
    import zarr.codecs

    if codecs is None:
        return None
    items = list(codecs) if isinstance(codecs, (list, tuple)) else [codecs]
    out = []
    for c in items:
        if isinstance(c, str):
            c = named_codec(c)
        elif isinstance(c, numcodecs.abc.Codec):
            cfg = c.get_config()
            kind = cfg.pop("id")
            if kind == "lz4":
                c = lz4_codec(cfg.get("acceleration", 1))
            elif kind == "zstd":
                c = zarr.codecs.ZstdCodec(level=cfg.get("level", 0), checksum=cfg.get("checksum", False))
            elif kind == "blosc":
                shuffle: Any = {0: "noshuffle", 1: "shuffle", 2: "bitshuffle", -1: "shuffle"}[cfg.get("shuffle", 1)]
                c = zarr.codecs.BloscCodec(cname=cfg["cname"], clevel=cfg["clevel"], shuffle=shuffle)
            else:
                import zarr.codecs.numcodecs as zn

                cls = getattr(zn, type(c).__name__, None)
                if cls is None:
                    raise StoreError(
                        f"compressor {c!r} has no Zarr v3 form; use a zarr.codecs or numcodecs Zstd/Blosc codec"
                    )
                c = cls(**cfg)
        out.append(c)
    return out


def named_codec(name: str) -> Any:
    """The codec a name in ``compressors`` stands for: 'lz4' (the default for images), 'zstd', 'jpeg' (lossy)."""
    import zarr.codecs

    if name == "lz4":
        return lz4_codec()
    if name == "zstd":
        return zarr.codecs.ZstdCodec(level=3)
    if name == "jpeg":
        from her_store.format.jpeg import jpeg_codec

        return jpeg_codec()
    raise StoreError(f"compressor name {name!r} is not one of 'lz4', 'zstd', 'jpeg' (or pass a codec, or None)")


def plan_arrays(
    loc: Backend, schema: Schema, capacity: Any, chunk_rows: int | None, compressors: Mapping[str, Any] | None
) -> tuple[Layout, dict[str, Any]]:
    """The arrays a store of these creation options gets: its Layout and the zarr codecs of compressed fields."""
    capacity = check_int(capacity, "capacity", low=1, high=MAX_CAPACITY, or_none=True)
    if chunk_rows is None:
        chunk_rows = loc.defaults.chunk_rows
        if capacity is not None:  # a small ring needs no chunk larger than itself
            chunk_rows = min(chunk_rows, 1 << int(capacity + capacity // RING_ROW_SLACK).bit_length())
    chunk_rows = check_int(chunk_rows, "chunk_rows", low=1)
    compressors = check_mapping(compressors, "compressors") or {}
    unknown = sorted(set(compressors) - set(schema.by_name))
    if unknown:
        raise SchemaMismatchError(f"compressors name unknown fields {unknown}; fields are {list(schema.by_name)}")
    codecs = {f.name: to_zarr_codecs(compressors.get(f.name, default_codec(f))) for f in schema.fields}
    codecs = {k: frame_codecs(v, schema.by_name[k]) for k, v in codecs.items() if v}
    if "zarr.json" in codecs:  # its array's directory, steps/zarr.json/, would be the steps group's metadata file
        raise SchemaMismatchError(
            "a compressed field cannot be named 'zarr.json' (its array steps/zarr.json would take the place of the "
            "steps group's metadata); rename the observation key, or store it uncompressed (compressors={'zarr.json': "
            "None})"
        )
    return Layout.build(schema, set(codecs), int(chunk_rows)), codecs


def open_arrays(root: zarr.Group, paths: Sequence[str]) -> list[zarr.Array | BaseException]:
    """The arrays at ``paths`` under ``root``, opened concurrently on zarr's event loop; a path that failed to open
    gives its exception."""

    async def open_all() -> list[Any]:
        return await asyncio.gather(
            *(zarr.api.asynchronous.open_array(store=root.store, path=p, zarr_format=3) for p in paths),
            return_exceptions=True,
        )

    return [a if isinstance(a, BaseException) else zarr.Array(a) for a in zarr_sync(open_all())]


def write_nodes(loc: Backend, files: Mapping[str, bytes], fsync: bool) -> None:
    """Write a new store's Zarr metadata documents, the root's first: from then on a create cut short is recognised
    as unfinished (:func:`unfinished_create`) and started again.

    Raises
    ------
    StoreExistsError
        Something is already where a document goes (another Zarr node there, say): nothing is written.
    """
    taken = loc.existing(list(files))  # (a link on the way is refused before anything is made, or removed)
    if taken:
        raise StoreExistsError(
            f"{loc} already holds {', '.join(taken[:3])}{', ...' if len(taken) > 3 else ''} where a new store's Zarr "
            "metadata goes (a Zarr node her_store did not create); the create was refused and left it as it was: "
            "create the store somewhere empty"
        )
    for key in files:  # every directory before any file, so fsync'ing a file's directory makes the tree durable
        loc.make_parents(key)
    loc.remove_temp_files(list(files))  # what a create killed mid-write left
    for key in sorted(files, key=lambda k: (k != "zarr.json", k)):
        loc.write_atomic(key, files[key], fsync=fsync)


def unfinished_create(loc: Backend) -> bool:
    """Whether ``loc`` holds what a create killed before its commit record leaves: her_store's root attributes,
    no commit record and no chunk of data (a commit record is the last thing a create writes, and no row is
    written before one exists). Anything else is a store, someone else's Zarr node, or damage: never removed."""
    if loc.exists(COMMIT_KEY):
        return False
    try:
        attrs = json.loads(loc.read_bytes("zarr.json") or b"").get("attributes", {})
    except (ValueError, AttributeError):
        return False
    return (
        isinstance(attrs, dict)
        and isinstance(attrs.get(ATTRS_KEY), dict)
        and not any(map(is_chunk_key, loc.list_files()))
    )


def default_codec(field: Any) -> Any:
    """LZ4 for uint8 images (a rendered frame compresses 4-8x and decodes in a few microseconds, about 3x faster
    than with Blosc's bit-shuffle or with Zstd); None (raw, memory-mapped) otherwise."""
    return lz4_codec() if field.is_image else None


def open_root(loc: Backend, read_only: bool) -> zarr.Group:
    """The store's root group. A path holding anything else is not a store; a zarr.json zarr cannot parse is a
    damaged one."""
    loc.check_file("zarr.json")  # zarr reads it whole: a regular file of bounded size
    try:
        return zarr.open_group(loc.zarr_store(read_only=read_only), mode="r" if read_only else "r+", zarr_format=3)
    except zarr.errors.ContainsArrayError as e:
        raise NotAStoreError(f"{loc} holds a Zarr array, not a her_store store (a Zarr group)") from e
    except (
        FileNotFoundError,
        NotADirectoryError,
        FileExistsError,
        zarr.errors.GroupNotFoundError,
        zarr.errors.NodeTypeValidationError,
    ) as e:
        if loc.exists(MARKER_KEY):
            raise NotAStoreError(
                f"{loc} is a sharded dataset's root: her_store.open_dataset(root) reads every shard; "
                f"EpisodeStore.open(root + '/shards/<name>') opens one"
            ) from e
        if loc.place_exists() is False:
            raise NotAStoreError(f"{loc} does not exist") from e
        if loc.place_exists() is None and isinstance(e, zarr.errors.GroupNotFoundError):  # its root object is missing
            raise NotAStoreError(f"there is no store at {loc} (no Zarr group: {loc}/zarr.json does not exist)") from e
        raise NotAStoreError(f"{loc} is not a her_store store (no Zarr group there)") from e
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError, RecursionError) as e:  # zarr's parse
        raise CorruptStoreError(f"{loc}/zarr.json is not Zarr v3 group metadata ({short_repr(e)})") from e


def plan_nodes(
    attrs: Mapping[str, Any], layout: Layout, codecs: Mapping[str, Any], array_rows: int, index_rows: int,
    index_chunk: int,
) -> dict[str, bytes]:
    """The Zarr metadata documents of a new store (its root group with ``attrs``, the layout's arrays of ``array_rows``
    rows, the index columns of ``index_rows``), by key. zarr plans them in memory, so that each is then written once
    (zarr writing straight to the store rewrites every parent group's zarr.json at each array: 96 writes, not 20)."""
    nodes: dict[str, Any] = {}
    plan = zarr.open_group(zarr.storage.MemoryStore(nodes), mode="w", zarr_format=3, attributes={ATTRS_KEY: attrs})
    for spec in layout.arrays:
        plan.create_array(
            spec.path,
            shape=(array_rows, *spec.row_shape),
            chunks=(1, *spec.row_shape) if spec.sharded else (spec.chunk_rows, *spec.row_shape),
            shards=(spec.chunk_rows, *spec.row_shape) if spec.sharded else None,
            dtype=spec.dtype,
            compressors=codecs.get(spec.columns[0][0]) if spec.compressed else None,
            fill_value=0,
            chunk_key_encoding={"name": "default", "separator": spec.separator},
            config=ZARR_CONFIG,
        )
    for name, dt in INDEX_COLUMNS.items():
        plan.create_array(
            f"episodes/{name}", shape=(index_rows,), chunks=(index_chunk,), dtype=dt, compressors=None, fill_value=0,
            config=ZARR_CONFIG,
        )
    return {key: buf.to_bytes() for key, buf in nodes.items()}


def ring_sizes(layout: Layout, capacity: int | None, index_chunk: int) -> tuple[int, int | None, int, int]:
    """(array rows, index slots, index rows, index chunk rows) of a new store: an unbounded store starts with a chunk
    of rows and of index; a ring holds row space for ``capacity`` transitions plus one extra row per episode of 4 or
    more steps on average, rounded up to a chunk of every array, and ``capacity`` index slots rounded up to a chunk."""
    grain = math.lcm(*(a.chunk_rows for a in layout.arrays))
    if capacity is None:
        return grain, None, index_chunk, index_chunk
    slots = round_up(capacity, min(index_chunk, capacity))
    return round_up(capacity + capacity // RING_ROW_SLACK + 1, grain), slots, slots, min(index_chunk, slots)


def checked_arrays(
    backend: Backend,
    root: zarr.Group,
    wanted: Sequence[tuple[str, np.dtype, tuple[int, ...], int | None, bool, bool, str]],
) -> list[zarr.Array]:
    """The arrays at ``(path, dtype, row_shape, chunk_rows, raw, sharded, separator)``, each checked against what
    the layout says it is. Their metadata is read concurrently: on object storage an open waits one request, not
    one per array."""
    for path, *_ in wanted:
        backend.check_file(f"{path}/zarr.json")  # zarr reads it whole: a regular file of bounded size
    opened = open_arrays(root, [path for path, *_ in wanted])
    arrays = []
    for (path, dtype, row_shape, chunk_rows, raw, sharded, separator), array in zip(wanted, opened):
        where = f"{backend}/{path}/zarr.json"
        if isinstance(array, zarr.errors.NodeTypeValidationError):
            raise CorruptStoreError(f"{where} is not an array's metadata: {str(array)[:200]}") from array
        if isinstance(
            array, (KeyError, ValueError, TypeError, AttributeError, OverflowError, RecursionError, NotADirectoryError)
        ):
            raise CorruptStoreError(  # zarr's parse
                f"{where} is missing or unreadable ({short_repr(array)}); expected the array FORMAT.md describes"
            ) from array
        if isinstance(array, BaseException):
            raise array
        check_array(array, dtype, row_shape, chunk_rows, raw, where, sharded, separator)
        arrays.append(array)
    return arrays


def make_store(loc: Backend, nodes: Mapping[str, bytes], array_rows: int, fsync: bool) -> tuple[zarr.Group, Commit]:
    """Write a new store at ``loc`` (its writer lock held): its Zarr metadata ``nodes``, then its first commit record,
    the last thing a create writes (a create cut short before it is started again). Returns the root group and that
    record.

    Raises
    ------
    StoreExistsError
        A store, a dataset of many writers' root or another Zarr node is there already: nothing is written.
    CorruptStoreError
        her_store arrays with rows but no commit record are there (a damaged store; nothing is removed).
    """
    if loc.exists(MARKER_KEY):
        raise StoreExistsError(
            f"{loc} is a sharded dataset's root: a writer appends to its own shard, "
            "her_store.open_store(root, observation_space, action_space, shard='actor-7')"
        )
    if loc.exists("zarr.json"):
        if loc.exists(COMMIT_KEY):
            raise StoreExistsError(
                f"{loc} already holds a store; open it with EpisodeStore.open({str(loc)!r}, mode='a') or "
                "her_store.open_store(...) to resume"
            )
        if not unfinished_create(loc):
            check_attrs(open_root(loc, read_only=True).attrs.asdict(), str(loc))  # someone else's node?
            raise CorruptStoreError(
                f"{loc} holds her_store arrays with rows but no commit record {COMMIT_KEY}; it is damaged "
                "(nothing there was removed)"
            )
        loc.clear(keep=LOCK_KEY)  # nothing was ever committed there: finish the create from scratch
    write_nodes(loc, nodes, fsync)
    root = open_root(loc, read_only=False)
    commit = Commit(array_rows=array_rows)
    loc.write_atomic(COMMIT_KEY, commit.to_bytes(), fsync=fsync)
    return root, commit
