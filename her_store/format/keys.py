"""The names of a store's keys: its fixed files and the keys of its chunks (FORMAT.md, Chunk keys).

The fixed files are ``zarr.json``'s attribute, ``commit.json``, ``writer.lock``, and a sharded dataset's
``sharded.json`` and ``shards/``.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ATTRS_KEY",
    "COMMIT_KEY",
    "LOCK_KEY",
    "MARKER_KEY",
    "SHARDS_DIR",
    "chunk_entry",
    "chunk_key",
    "chunk_of",
    "is_chunk_key",
    "key_separator",
]

ATTRS_KEY = "her_store"  # the root zarr.json's attribute holding the store's own
COMMIT_KEY = "commit.json"
LOCK_KEY = "writer.lock"
MARKER_KEY = "sharded.json"  # the root marker of a dataset of many writers' stores
SHARDS_DIR = "shards"  # where those stores lie, one directory each


def chunk_key(path: str, chunk: int, ndim: int, separator: str) -> str:
    """Key of chunk ``chunk`` along rows of a row-chunked array (v3 default encoding with ``separator``, ``"/"`` or
    ``"."``: ``<path>/c/<i>/0...`` or ``<path>/c.<i>.0...``)."""
    return f"{path}/" + separator.join(["c", str(chunk)] + ["0"] * (ndim - 1))


def is_chunk_key(key: str) -> bool:
    """Whether a key relative to a store has the form of one of its chunks' (FORMAT.md, chunk keys):
    ``packs/<dtype>/c/<i>/0``, ``episodes/<column>/c/<i>``, ``steps/<field>/c/<i>/0...`` (versions 1 and 2) or
    ``steps/<field>/c.<i>.0...`` (version 3, at least one ``.0``)."""
    parts = key.split("/")
    if len(parts) == 3 and parts[0] == "steps":
        return len(parts[2].split(".")) >= 3 and chunk_of(parts[2], ".") is not None
    if len(parts) < 4 or parts[2] != "c" or chunk_of(parts[3], "/") is None or any(p != "0" for p in parts[4:]):
        return False
    axes = len(parts) - 3
    return (parts[0], axes) in (("packs", 2), ("episodes", 1)) or (parts[0] == "steps" and axes >= 2)


def chunk_entry(path: str, chunk: int, ndim: int, separator: str) -> str:
    """The entry of an array's directory tree that holds chunk ``chunk`` and nothing else: the file
    ``<path>/c.<i>.0...`` for ``"."``; for ``"/"``, ``<path>/c/<i>``, the chunk's own directory (or, for a 1-D array,
    its file). Removing it removes the chunk, whatever is there, and never reaches past a link in its place."""
    return chunk_key(path, chunk, ndim, separator) if separator == "." else f"{path}/c/{chunk}"


def key_separator(array: Any) -> str:
    """The separator of an array's chunk keys, from its metadata (checked against the layout when it was opened)."""
    return str(array.metadata.chunk_key_encoding.separator)


def chunk_of(name: str, separator: str, ndim: int | None = None) -> int | None:
    """The chunk index of a name in an array's directory or its ``c/`` subdirectory, or None for any other name
    (metadata, a temp file, a number written otherwise): for ``"/"``, the directory name ``<i>``; for ``"."``, the file
    name ``c.<i>.0...``, with one ``.0`` per axis after the first (``ndim``; any number when None). ``<i>`` is ASCII
    digits without a leading zero, as zarr writes it."""
    if separator == ".":
        parts = name.split(".")
        if len(parts) < 2 or parts[0] != "c" or any(p != "0" for p in parts[2:]):
            return None
        if ndim is not None and len(parts) != ndim + 1:
            return None
        name = parts[1]
    if not (name.isascii() and name.isdigit()) or (name[0] == "0" and name != "0"):
        return None
    return int(name)
