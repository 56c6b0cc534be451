"""What counts as an integer and as a number, in an argument or in what a store holds: a bool is neither.

Python's ``bool`` is an ``int`` (``True + 1 == 2``), so ``capacity=True``, or a JSON ``true`` where a count belongs,
would pass a plain ``isinstance(v, int)``. Every such check in the package goes through these two.

Examples
--------
>>> is_int(3), is_int(np.int64(3)), is_int(True), is_int(3.0)
(True, True, False, False)
>>> is_number(2.5), is_number(np.float32(1)), is_number(False), is_number(float("inf"), finite=True)
(True, True, False, False)
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["is_int", "is_number"]


def is_int(v: Any) -> bool:
    """An int, or a numpy integer; not a bool.

    Examples
    --------
    >>> is_int(np.uint8(7)), is_int(np.bool_(True))
    (True, False)
    """
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def is_number(v: Any, finite: bool = False) -> bool:
    """An int or a float (numpy's too), not a bool; with ``finite``, neither infinite nor NaN.

    Examples
    --------
    >>> is_number(float("nan")), is_number(float("nan"), finite=True)
    (True, False)
    """
    real = isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)
    return real and (not finite or math.isfinite(v))
