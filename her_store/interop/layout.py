"""What every export writes beside the rows: the JSON header of spaces and card, and the fields' names.

The npz, HDF5 and OGBench exports carry the store's spaces (:meth:`Schema.to_json`) and dataset card as one JSON
header (:data:`HEADER_KEY`: an npz member of uint8 bytes, an HDF5 root attribute), which their imports read back
checked (:func:`parse_header`), so that a round trip gives back the same store. The npz, HDF5 and Minari exports name
a store's fields as Minari's episodes do (:func:`minari_name`).
"""

from __future__ import annotations

import json
from typing import Any

from her_store.checks import is_int
from her_store.errors import SchemaMismatchError, short_repr
from her_store.format.card import check_card
from her_store.format.schema import Field, Schema
from her_store.storage.base import METADATA_LIMIT
from her_store.store.episode_store import EpisodeStore

__all__ = ["HEADER_KEY", "HEADER_VERSION", "MINARI_NAMES", "header_of", "minari_name", "parse_header"]

HEADER_KEY = "her_store_header"  # the npz member / HDF5 attribute holding spaces and card as JSON
HEADER_VERSION = 1
# a store's per-step fields under Minari's names; observation keys are observations/<key>, info keys infos/<key>
MINARI_NAMES = {"action": "actions", "reward": "rewards", "terminated": "terminations", "truncated": "truncations"}


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
