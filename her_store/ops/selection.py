"""Episode selections as users type them (``--episodes 0:100,250,-10:``): parsed into sorted, unique episode ids."""

from __future__ import annotations

import re

import numpy as np

__all__ = ["parse_selection"]

_ITEM = re.compile(r"^\s*(-?\d+)?\s*(:)?\s*(-?\d+)?\s*$")


def parse_selection(text: str | None, first: int, end: int) -> np.ndarray:
    """The live episode ids a selection names, sorted and unique.

    A selection is comma-separated items, each an episode id ``N`` or a range ``A:B`` (``B`` excluded; either side
    may be left out). Negative numbers count from the end of the live episodes, as in Python: ``-10:`` is the last
    ten. Ranges are clipped to the live episodes ``first .. end - 1``; a single id outside them is an error.

    Parameters
    ----------
    text : str or None
        The selection; None or ``""`` selects every live episode.
    first, end : int
        The live episodes are ``first .. end - 1``.

    Raises
    ------
    ValueError
        An item is not ``N`` or ``A:B``, or names an episode that is not live.

    Examples
    --------
    >>> parse_selection("0:3,7,-1:", 0, 10).tolist()
    [0, 1, 2, 7, 9]
    """
    if text is None or not text.strip():
        return np.arange(first, end, dtype=np.int64)
    parts: list[np.ndarray] = []
    for item in text.split(","):
        m = _ITEM.match(item)
        if m is None or (m.group(1) is None and m.group(2) is None):
            raise ValueError(
                f"episode selection item {item.strip()!r} is not an id N or a range A:B (e.g. '0:100,250,-10:')"
            )
        a, colon, b = m.groups()
        if colon is None:
            i = int(a)
            eid = end + i if i < 0 else i
            if not first <= eid < end:
                raise ValueError(f"episode {i} is not live; the store holds episodes {first}..{end - 1}")
            parts.append(np.array([eid], np.int64))
            continue

        def at(v, default):
            return default if v is None else (end + int(v) if int(v) < 0 else int(v))

        lo, hi = max(first, at(a, first)), min(end, at(b, end))
        parts.append(np.arange(lo, max(lo, hi), dtype=np.int64))
    return np.unique(np.concatenate(parts)) if parts else np.empty(0, np.int64)
