"""Minari's metadata.json to and from a store's dataset card and spaces, read checked, nothing run or built.

A card becomes Minari's metadata as Minari's own fields under their own names (``author`` and ``author_email`` as
lists), every other entry beside them (``env_id``, ``reward_function``, ``goal_keys``, ``success_threshold``,
``versions``, ...), and the store's info spaces as :data:`INFO_SPACES_KEY`. An import takes the card back from every
key Minari does not keep for itself (:data:`MINARI_OWN_KEYS`), and the spaces from their JSON, parsed by her_store's
own checked parser: Minari would otherwise build the environment to find them, running its code.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np
from gymnasium import spaces

from her_store.errors import SchemaMismatchError
from her_store.format.card import check_card
from her_store.format.schema import space_from_json, space_to_json

__all__ = [
    "INFO_SPACES_KEY",
    "MINARI_OWN_KEYS",
    "card_from_metadata",
    "declared_space",
    "env_id_of",
    "metadata_from_card",
    "minari_dataset_id",
]

INFO_SPACES_KEY = "her_store_info_spaces"
# Keys of metadata.json that Minari writes itself (or that describe the data, not the dataset): never card entries.
MINARI_OWN_KEYS = frozenset(
    ("observation_space", "action_space", "total_episodes", "total_steps", "data_format", "jpeg_encoding",
     "minari_version", "dataset_size", INFO_SPACES_KEY)
)
_AUTHOR_KEYS = ("author", "author_email")
_MAX_SPACE_DEPTH = 8


def minari_dataset_id(dataset_id: Any, what: str) -> str:
    """``dataset_id`` checked against Minari's syntax, ``(namespace/)name-v<version>``, else a ValueError naming
    ``what``.

    Examples
    --------
    >>> minari_dataset_id("point/random-v0", "the card's dataset_id")
    'point/random-v0'
    >>> minari_dataset_id("point", "the destination's name")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: the destination's name 'point' is not a Minari dataset id: expected (namespace/)name-v<version>, ...
    """
    from minari.dataset.minari_dataset import DATASET_ID_RE

    m = DATASET_ID_RE.fullmatch(dataset_id) if isinstance(dataset_id, str) else None
    if m is None or m.group("version") is None:  # Minari's loader needs the version
        raise ValueError(
            f"{what} {dataset_id!r} is not a Minari dataset id: expected (namespace/)name-v<version>, "
            "e.g. 'point/random-v0'"
        )
    return dataset_id


def metadata_from_card(
    card: Mapping[str, Any], dataset_id: str, minari_version: str, info_spaces: Mapping[str, spaces.Space]
) -> dict[str, Any]:
    """The entries of Minari's metadata.json a card gives: every card entry, authors as lists, the info spaces."""
    clash = sorted(MINARI_OWN_KEYS & card.keys())
    if clash:
        raise ValueError(f"the dataset card holds {clash}, which Minari's metadata keeps for itself; remove them first")
    out = {k: v for k, v in card.items() if v is not None}
    for key in _AUTHOR_KEYS:
        if isinstance(out.get(key), str):
            out[key] = [out[key]]
    if "env_spec" in out:
        env_id_of(out["env_spec"], "the dataset card")  # Minari's loader reads it: one it cannot read would stop it
    out["dataset_id"] = dataset_id
    out["minari_version"] = minari_version
    out[INFO_SPACES_KEY] = {k: space_to_json(s) for k, s in info_spaces.items()}
    return out


def card_from_metadata(meta: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The dataset card of a Minari dataset's metadata (``meta``, read from ``where``): every key Minari does not keep
    for itself, a one-name author list as that name, and, for a dataset her_store did not write, its env's id from
    ``env_spec`` (for reward lookups); checked by :func:`her_store.format.card.check_card`.

    Raises
    ------
    ValueError
        An ``env_spec`` gymnasium cannot read, or a card :func:`~her_store.format.card.check_card` refuses.
    """
    card = {k: v for k, v in meta.items() if k not in MINARI_OWN_KEYS}
    for key in _AUTHOR_KEYS:
        if isinstance(card.get(key), list) and len(card[key]) == 1:
            card[key] = card[key][0]
    if INFO_SPACES_KEY not in meta and "env_id" not in card and "env_spec" in card:
        card["env_id"] = env_id_of(card["env_spec"], where)
    return check_card(card, f"{where}: its metadata")


def env_id_of(env_spec: str, where: str) -> str:
    """The id of an EnvSpec given as JSON (read, never made)."""
    from gymnasium.envs.registration import EnvSpec

    try:
        return str(EnvSpec.from_json(env_spec).id)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where}: its env_spec is not a gymnasium EnvSpec as JSON: {e}") from None


def declared_space(meta: Mapping[str, Any], key: str, where: str) -> spaces.Space:
    """A space metadata.json declares, checked by her_store's parser (bounded sizes, supported kinds)."""
    text = meta.get(key)
    if not isinstance(text, str):
        raise ValueError(
            f"{where} declares no {key} in metadata.json; her_store does not build the environment to find it"
        )
    try:
        return space_from_json(_from_minari_space(json.loads(text), 0))
    except (ValueError, SchemaMismatchError) as e:
        raise ValueError(f"{where}: its {key} is not a space a store holds: {e}") from None


def _from_minari_space(d: Any, depth: int) -> Any:
    """Minari's space JSON in her_store's form: a Dict's ``subspaces`` as ``spaces``, Box bounds flattened."""
    if not isinstance(d, dict) or depth > _MAX_SPACE_DEPTH:
        return d  # her_store's parser names what is wrong
    if d.get("type") == "Dict" and isinstance(d.get("subspaces"), dict):
        return {"type": "Dict", "spaces": {k: _from_minari_space(s, depth + 1) for k, s in d["subspaces"].items()}}
    if d.get("type") == "Box":
        out = dict(d)
        for k in ("low", "high"):
            if isinstance(d.get(k), list):
                try:
                    out[k] = np.array(d[k], dtype=object).reshape(-1).tolist()
                except ValueError:  # ragged: left as is, and refused
                    pass
        return out
    return d
