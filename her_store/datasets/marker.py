"""The root of a dataset of many writers: its marker, the names of its shards, and finding them.

A dataset root holds the root marker, ``sharded.json``, written once by whichever writer comes first (create-if-absent:
a hard link locally, a conditional PUT on object storage) and never rewritten, and ``shards/<name>/``, each one writer's
store, a full store with its own commit record and writer lock. Writers never share a file: a writer appends to its own
shard, and readers find shards by listing ``shards/``. FORMAT.md (Sharded datasets) is the on-disk contract.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

from her_store.checks import is_int, is_number
from her_store.errors import (
    CorruptStoreError,
    FormatVersionError,
    NotAStoreError,
    SchemaMismatchError,
    StoreExistsError,
    short_repr,
)
from her_store.format.keys import COMMIT_KEY, MARKER_KEY, SHARDS_DIR
from her_store.format.schema import Schema
from her_store.storage import Backend

__all__ = [
    "MARKER_FORMAT", "check_shard_name", "is_sharded", "list_shards", "read_marker", "root_schema", "shard_backend"
]

MARKER_FORMAT = "her_store.sharded"
MARKER_VERSION = 1
MARKER_LIMIT = 64 << 20  # bytes the root marker may hold: its spaces may carry per-pixel bounds, as zarr.json does
# a shard name is one path component everywhere (local directory, S3 key part): no separators, no dots at all
SHARD_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")


def check_shard_name(name: Any) -> str:
    """Return ``name`` if it may name a shard, else raise ValueError saying what a shard name is.

    A shard name is 1 to 128 ASCII letters, digits, ``-`` and ``_``, starting with a letter or digit: it is a
    directory name locally and a key part on object storage, so it holds no path separator and no dot.

    Examples
    --------
    >>> check_shard_name("actor-7")
    'actor-7'
    >>> check_shard_name("../x")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: shard name '../x' is not allowed: expected 1 to 128 ASCII letters, digits, '-' and '_', starting ...
    """
    if not isinstance(name, str) or SHARD_NAME.fullmatch(name) is None:
        raise ValueError(
            f"shard name {short_repr(name)} is not allowed: expected 1 to 128 ASCII letters, digits, '-' and '_', "
            "starting with a letter or digit (no path separators, no dots)"
        )
    return name


def is_sharded(backend: Backend) -> bool:
    """Whether ``backend`` is the root of a dataset of many writers (it holds the root marker)."""
    return backend.exists(MARKER_KEY)


def shard_backend(root: Backend, name: str) -> Backend:
    """The backend of shard ``name`` of the dataset at ``root`` (refusing a link in place of its directories)."""
    root.check_directory(SHARDS_DIR)
    root.check_directory(f"{SHARDS_DIR}/{name}")
    return root.child(f"{SHARDS_DIR}/{name}")


def parse_marker(raw: bytes, where: str) -> Schema:
    """The dataset's schema from the bytes of its root marker; anything but the marker of FORMAT.md raises
    CorruptStoreError naming the key, the value found and what was expected (FormatVersionError for a newer one).
    The spaces are built from JSON only: nothing in a marker is imported or run."""
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise CorruptStoreError(
            f"{where} is not JSON ({short_repr(e)}); expected the root marker of a sharded dataset (FORMAT.md)"
        ) from e
    keys = {"format", "version", "schema", "created_at"}
    if not isinstance(doc, dict) or doc.keys() != keys:
        got = sorted(doc) if isinstance(doc, dict) else short_repr(doc)
        raise CorruptStoreError(f"{where} has keys {short_repr(got)}, expected an object with keys {sorted(keys)}")
    if doc["format"] != MARKER_FORMAT:
        raise CorruptStoreError(f"{where}: format is {short_repr(doc['format'])}, expected {MARKER_FORMAT!r}")
    version = doc["version"]
    if not is_int(version) or version < 1:
        raise CorruptStoreError(f"{where}: version is {short_repr(version)}, expected an integer >= 1")
    if version > MARKER_VERSION:
        raise FormatVersionError(
            f"{where} is a sharded dataset of version {version}; this her_store reads version {MARKER_VERSION}: "
            "upgrade her_store (pip install -U her_store)"
        )
    if not is_number(doc["created_at"], finite=True):
        raise CorruptStoreError(f"{where}: created_at is {short_repr(doc['created_at'])}, expected unix seconds")
    try:
        return Schema.from_json(doc["schema"])
    except SchemaMismatchError as e:
        raise CorruptStoreError(f"{where}: schema is invalid: {e}") from e


def read_marker(backend: Backend) -> Schema | None:
    """The dataset's schema, or None when ``backend`` holds no root marker."""
    raw = backend.read_bytes(MARKER_KEY, limit=MARKER_LIMIT)
    return None if raw is None else parse_marker(raw, backend.key_path(MARKER_KEY))


def root_schema(location: Backend, given: Schema | None) -> Schema:
    """The schema of the dataset at ``location``: read from its root marker, or (with ``given``) the root created
    with ``given`` when there is none yet. Of two writers creating one root, the first marker written stays and the
    other writer is checked against it."""
    schema = read_marker(location)
    if schema is not None:
        return schema
    if given is None:
        raise NotAStoreError(
            f"{location} holds no sharded dataset (no {MARKER_KEY}); pass observation_space and action_space to "
            "create it"
        )
    if location.exists("zarr.json") or location.exists(COMMIT_KEY):
        raise StoreExistsError(
            f"{location} holds a plain store, not a sharded dataset; open it without shard=, or choose another "
            "root for the sharded dataset"
        )
    marker = {"format": MARKER_FORMAT, "version": MARKER_VERSION, "schema": given.to_json(), "created_at": time.time()}
    if location.create_once(MARKER_KEY, json.dumps(marker, indent=1, sort_keys=True).encode()):
        return given
    schema = read_marker(location)  # another writer created the root first
    if schema is None:
        raise CorruptStoreError(
            f"{location.key_path(MARKER_KEY)} existed a moment ago and is gone; it is never removed"
        )
    return schema


def list_shards(backend: Backend) -> list[str]:
    """The shard names under ``shards/``, sorted; entries that are not directories with a shard name are not shards
    (no writer makes them) and are left out, and so are shards whose create has not written a commit record yet
    (those are found by a later look)."""
    backend.check_directory(SHARDS_DIR)
    names = [n for n in backend.list_dirs(SHARDS_DIR) if SHARD_NAME.fullmatch(n)]
    return [n for n in names if backend.exists(f"{SHARDS_DIR}/{n}/{COMMIT_KEY}")]
