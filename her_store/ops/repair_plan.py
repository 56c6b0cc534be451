"""The plan a repair leaves beside a store while it moves good episodes, so that the next repair finishes it.

The plan says where the episodes wait and what is left to do: a repair killed half-way is finished by the next one
(and :func:`~her_store.ops.verify.verify` says so).
"""

from __future__ import annotations

import json
import os
from typing import Any

from her_store.errors import CorruptStoreError
from her_store.storage import open_backend
from her_store.storage.files import blocks_directory

__all__ = ["PLAN_KEY", "plan_of", "spill_dir"]

PLAN_KEY = "plan.json"


def spill_dir(url: str) -> str:
    """Where a repair keeps the good episodes it moves: beside the store, one per store, a directory of its own.

    Raises
    ------
    CorruptStoreError
        A link or a file is there: never followed, removed or written through.
    """
    path = os.path.join(os.path.dirname(url), f".{os.path.basename(url)}.repair")
    if blocks_directory(path):
        raise CorruptStoreError(
            f"{path} is a link or a file where a repair keeps the episodes it moves (a directory of its own); nothing "
            "was changed: move it away, then repair again"
        )
    return path


def plan_of(url: str) -> dict[str, Any] | None:
    """The plan of a repair that dropped a cut and has not appended all the episodes it moved yet, or None."""
    raw = open_backend(spill_dir(url)).read_bytes(PLAN_KEY, limit=1 << 26)
    if raw is None:
        return None
    try:
        plan = json.loads(raw)
        return {
            "cut": int(plan["cut"]), "count": int(plan["count"]), "ids": [int(i) for i in plan["ids"]],
            "generation": int(plan["generation"]),
        }
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptStoreError(f"{spill_dir(url)}/{PLAN_KEY} is not a repair plan ({e})") from e
