"""SB3's infos as a ZarrHerReplayBuffer stores them: end flags from ``TimeLimit.truncated``, and the info keys.

SB3 passes one info dict per env. Its ``TimeLimit.truncated`` entry tells a truncation from a termination (stored as
the step's flags, never as an info key); with ``copy_info_dict`` the numeric scalar entries are stored as info keys,
inferred from the first infos unless given, and numeric entries that appear only later are warned about, once each.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = [
    "BOOKKEEPING_KEYS",
    "TIMEOUT_KEY",
    "end_flags",
    "is_numeric_scalar",
    "numeric_info_keys",
    "warn_unstored_info",
]

TIMEOUT_KEY = "TimeLimit.truncated"
"""SB3's truncation flag: stored as the step's ``truncated`` field, not as an info."""

BOOKKEEPING_KEYS = frozenset({TIMEOUT_KEY, "terminal_observation"})
"""Info entries SB3 uses for its own bookkeeping: never stored as info keys."""

_FALSE = np.zeros(1, bool)
_FALSE.flags.writeable = False
_TRUE = np.ones(1, bool)
_TRUE.flags.writeable = False


def is_numeric_scalar(v: Any) -> bool:
    """Whether an info entry is a numeric scalar (bool, int, float, numpy's too), which a store can hold as an info.

    Examples
    --------
    >>> [is_numeric_scalar(v) for v in (True, np.float32(0.5), np.array(2), np.zeros(2), "x")]
    [True, True, True, False, False]
    """
    return isinstance(v, (bool, int, float, np.bool_, np.integer, np.floating)) or (
        isinstance(v, np.ndarray) and v.ndim == 0 and v.dtype.kind in "biuf"
    )


def end_flags(done: np.ndarray, infos: Sequence[Mapping[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
    """``(terminated, truncated)`` of SB3's ``done`` (one bool per env, one info dict each): an env whose info says
    ``TimeLimit.truncated`` was truncated, another that is done terminated.

    Examples
    --------
    >>> end_flags(np.array([True, True, False]), [{}, {"TimeLimit.truncated": True}, {}])
    (array([ True, False, False]), array([False,  True, False]))
    """
    if len(infos) == 1:  # one env: no array built per step
        if done[0] and infos[0].get(TIMEOUT_KEY, False):
            return _FALSE, _TRUE
        return done, _FALSE
    truncated = done & np.array([bool(info.get(TIMEOUT_KEY, False)) for info in infos])
    return done & ~truncated, truncated


def numeric_info_keys(infos: Sequence[Mapping[str, Any]]) -> list[str]:
    """The info entries of env 0 that are numeric scalars (bool, int, float), minus SB3's truncation flag.

    Examples
    --------
    >>> numeric_info_keys([{"is_success": 0.0, "TimeLimit.truncated": False, "name": "a"}])
    ['is_success']
    """
    return [k for k, v in infos[0].items() if k != TIMEOUT_KEY and isinstance(k, str) and is_numeric_scalar(v)]


def warn_unstored_info(infos: Sequence[Mapping[str, Any]], seen: set[Any], info_keys: Sequence[str] | None) -> None:
    """Warn, once per key, of numeric info entries that are not among the inferred ``info_keys`` (an env that
    reports ``is_success`` only at an episode's end): SB3 would pass them to ``compute_reward``. ``seen`` holds the
    keys already checked, and gains the new ones."""
    new = set().union(*infos) - seen
    if not new:
        return
    seen |= new
    stored = set(info_keys or ())
    unstored = sorted(k for k in new if k not in stored and any(k in i and is_numeric_scalar(i[k]) for i in infos))
    if unstored:
        warnings.warn(
            f"infos carry {unstored}, which are not stored: the buffer's info keys {list(info_keys or ())} "
            "were inferred from the first infos it was given, so compute_reward of relabelled transitions does "
            f"not get these entries (SB3's buffer passes them); for a new store pass "
            f"info_keys={sorted(stored | set(unstored))} with copy_info_dict=True",
            stacklevel=3,
        )
