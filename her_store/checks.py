"""Argument checks: what counts as an int and as a number (a bool is neither), and the one way an option is checked.

Python's ``bool`` is an ``int`` (``True + 1 == 2``), so ``capacity=True``, or a JSON ``true`` where a count belongs,
would pass a plain ``isinstance(v, int)``. Every such test in the package goes through :func:`is_int` and
:func:`is_number`; every option an API takes goes through :func:`check_int`, :func:`check_number`,
:func:`check_bool`, :func:`check_callable`, :func:`check_mapping`, :func:`check_names` or :func:`check_path`, which
return the value as the API keeps it and raise an error naming the argument, what it must be and what was given.

Examples
--------
>>> is_int(3), is_int(np.int64(3)), is_int(True), is_int(3.0)
(True, True, False, False)
>>> is_number(2.5), is_number(np.float32(1)), is_number(False), is_number(float("inf"), finite=True)
(True, True, False, False)
>>> check_int(np.int64(8), "batch_size", low=1)
8
>>> check_int(True, "batch_size", low=1)
Traceback (most recent call last):
...
her_store.checks.ArgumentTypeError: batch_size must be an int >= 1, not a bool: got True
"""

from __future__ import annotations

import math
import operator
import os
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeVar, overload

import numpy as np

from her_store.errors import short_repr

__all__ = [
    "ArgumentTypeError",
    "check_bool",
    "check_bounds",
    "check_callable",
    "check_int",
    "check_mapping",
    "check_names",
    "check_number",
    "check_path",
    "is_int",
    "is_number",
]

_F = TypeVar("_F", bound=Callable[..., Any])


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type (a bool or a float where an int belongs): a TypeError, and a ValueError too,
    since it is a bad value of that argument and callers catching either must see it."""


def is_int(v: Any) -> bool:
    """An int, a numpy integer, or another integer scalar Python can index with (``operator.index``: a 0-d integer
    tensor, such as an element of a batch's ``episode_ids``); not a bool, of any of those kinds.

    Examples
    --------
    >>> is_int(np.uint8(7)), is_int(np.bool_(True)), is_int(np.array(3)), is_int(np.array([3]))
    (True, False, True, False)
    """
    if isinstance(v, (bool, np.bool_)) or "bool" in str(getattr(v, "dtype", "")) or getattr(v, "ndim", 0) != 0:
        return False
    if isinstance(v, (int, np.integer)):
        return True
    try:
        operator.index(v)
    except TypeError:
        return False
    return True


def is_number(v: Any, finite: bool = False) -> bool:
    """An int or a float (numpy's too), not a bool; with ``finite``, neither infinite nor NaN.

    Examples
    --------
    >>> is_number(float("nan")), is_number(float("nan"), finite=True)
    (True, False)
    """
    real = isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)
    return real and (not finite or math.isfinite(v))


def _bounds(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    """The range as a message writes it: ``>= 1``, ``< 1``, ``in (0, 0.5]``, or nothing."""
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    if low is not None:
        return f"{'>' if low_open else '>='} {low}"
    if high is not None:
        return f"{'<' if high_open else '<='} {high}"
    return ""


def _expected(kind: str, bounds: str, or_none: bool) -> str:
    return " ".join(filter(None, (kind, bounds))) + (" or None" if or_none else "")


def _not_a(value: Any) -> str:
    """What ``value`` is, after "not": ``a bool``, ``an int``, ``None``."""
    if value is None:
        return "None"
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def check_bounds(
    value: Any,
    name: str,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    kind: str = "",
    or_none: bool = False,
) -> Any:
    """``value``, a number already checked for its type, within ``[low, high]`` (``low_open``, ``high_open``:
    excluding that end); NaN is within no range.

    Raises
    ------
    ValueError
        ``"<name> must be <kind> <range>: got <value>"``.

    Examples
    --------
    >>> check_bounds(0.9, "refill_fraction", low=0, high=0.5, low_open=True)
    Traceback (most recent call last):
    ...
    ValueError: refill_fraction must be in (0, 0.5]: got 0.9
    """
    ok = (low is None or (value > low if low_open else value >= low)) and (
        high is None or (value < high if high_open else value <= high)
    )
    if not ok:
        expected = _expected(kind, _bounds(low, high, low_open, high_open), or_none)
        raise ValueError(f"{name} must be {expected}: got {short_repr(value)}")
    return value


@overload
def check_int(
    value: Any, name: str, *, low: int | None = ..., high: int | None = ..., or_none: Literal[False] = ...
) -> int: ...
@overload
def check_int(
    value: Any, name: str, *, low: int | None = ..., high: int | None = ..., or_none: Literal[True]
) -> int | None: ...
def check_int(
    value: Any, name: str, *, low: int | None = None, high: int | None = None, or_none: bool = False
) -> int | None:
    """``value`` as an ``int`` within ``[low, high]``: an int or a numpy integer, not a bool nor a float; with
    ``or_none``, None too (returned as is).

    Raises
    ------
    ArgumentTypeError
        Not an int: ``"<name> must be an int >= 1, not a float: got 2.5"``.
    ValueError
        Out of range: ``"<name> must be an int >= 1: got 0"``.

    Examples
    --------
    >>> check_int(None, "io_threads", low=0, or_none=True) is None
    True
    >>> check_int(2**70, "seed", low=0, high=2**64 - 1)
    Traceback (most recent call last):
    ...
    ValueError: seed must be an int in [0, 18446744073709551615]: got 1180591620717411303424
    """
    if value is None and or_none:
        return None
    if not is_int(value):
        expected = _expected("an int", _bounds(low, high, False, False), or_none)
        raise ArgumentTypeError(f"{name} must be {expected}, not {_not_a(value)}: got {short_repr(value)}")
    check_bounds(value, name, low=low, high=high, kind="an int", or_none=or_none)
    return int(value)


@overload
def check_number(
    value: Any,
    name: str,
    *,
    low: float | None = ...,
    high: float | None = ...,
    low_open: bool = ...,
    high_open: bool = ...,
    finite: bool = ...,
    or_none: Literal[False] = ...,
) -> float: ...
@overload
def check_number(
    value: Any,
    name: str,
    *,
    low: float | None = ...,
    high: float | None = ...,
    low_open: bool = ...,
    high_open: bool = ...,
    finite: bool = ...,
    or_none: Literal[True],
) -> float | None: ...
def check_number(
    value: Any,
    name: str,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    finite: bool = False,
    or_none: bool = False,
) -> float | None:
    """``value`` as a ``float`` within the range (see :func:`check_bounds`): an int or a float (numpy's too), not a
    bool nor a string; with ``finite``, neither infinite nor NaN; with ``or_none``, None too (returned as is).

    Raises
    ------
    ArgumentTypeError
        Not a number: ``"<name> must be a real number >= 0, not a str: got '1'"``.
    ValueError
        Out of range, NaN, or (``finite``) infinite.

    Examples
    --------
    >>> check_number(np.float32(0.25), "refill_fraction", low=0, high=0.5, low_open=True)
    0.25
    >>> check_number(float("inf"), "discount", finite=True)
    Traceback (most recent call last):
    ...
    ValueError: discount must be a finite real number: got inf
    """
    if value is None and or_none:
        return None
    kind = "a finite real number" if finite else "a real number"
    bounds = _bounds(low, high, low_open, high_open)
    if not is_number(value):
        raise ArgumentTypeError(
            f"{name} must be {_expected(kind, bounds, or_none)}, not {_not_a(value)}: got {short_repr(value)}"
        )
    if finite and not math.isfinite(value):
        raise ValueError(f"{name} must be {_expected(kind, bounds, or_none)}: got {short_repr(float(value))}")
    check_bounds(value, name, low=low, high=high, low_open=low_open, high_open=high_open, kind=kind, or_none=or_none)
    return float(value)


@overload
def check_bool(value: Any, name: str, *, or_none: Literal[False] = ...) -> bool: ...
@overload
def check_bool(value: Any, name: str, *, or_none: Literal[True]) -> bool | None: ...
def check_bool(value: Any, name: str, *, or_none: bool = False) -> bool | None:
    """``value`` as a ``bool``: True or False (numpy's too), not 0 or 1; with ``or_none``, None too.

    Raises
    ------
    ArgumentTypeError
        ``"<name> must be True or False, not an int: got 1"``.

    Examples
    --------
    >>> check_bool(np.bool_(True), "background")
    True
    """
    if value is None and or_none:
        return None
    if not isinstance(value, (bool, np.bool_)):
        expected = "True, False or None" if or_none else "True or False"
        raise ArgumentTypeError(f"{name} must be {expected}, not {_not_a(value)}: got {short_repr(value)}")
    return bool(value)


@overload
def check_callable(value: _F, name: str, *, or_none: bool = ...) -> _F: ...
@overload
def check_callable(value: None, name: str, *, or_none: Literal[True]) -> None: ...
def check_callable(value: Any, name: str, *, or_none: bool = False) -> Any:
    """``value``, a callable; with ``or_none``, None too.

    Raises
    ------
    ArgumentTypeError
        ``"<name> must be a callable, not a str: got 'sparse'"``.

    Examples
    --------
    >>> check_callable(None, "reward_fn", or_none=True) is None
    True
    """
    if value is None and or_none:
        return None
    if not callable(value):
        expected = "a callable or None" if or_none else "a callable"
        raise ArgumentTypeError(f"{name} must be {expected}, not {_not_a(value)}: got {short_repr(value)}")
    return value


def check_mapping(value: Any, name: str, *, or_none: bool = True) -> dict[str, Any] | None:
    """``value``, a mapping with string keys, as a dict; with ``or_none`` (the default), None too.

    Raises
    ------
    ArgumentTypeError
        ``"<name> must be a mapping (a dict) or None, not an int: got 5"``.

    Examples
    --------
    >>> check_mapping({"anon": True}, "storage_options")
    {'anon': True}
    """
    if value is None and or_none:
        return None
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        expected = "a mapping (a dict) of names" + (" or None" if or_none else "")
        raise ArgumentTypeError(f"{name} must be {expected}, not {_not_a(value)}: got {short_repr(value)}")
    return dict(value)


def check_names(value: Any, name: str) -> tuple[str, ...]:
    """``value``, a sequence of distinct non-empty strings (not one string, which would be its characters), as a tuple.

    Raises
    ------
    ArgumentTypeError
        ``"<name> must be a list of names, not a str: got 'is_success'"``.
    ValueError
        An empty or repeated name.

    Examples
    --------
    >>> check_names(["is_success"], "info_keys")
    ('is_success',)
    """
    if isinstance(value, (str, bytes, Mapping)) or not hasattr(value, "__iter__"):
        raise ArgumentTypeError(f"{name} must be a list of names, not {_not_a(value)}: got {short_repr(value)}")
    names = tuple(value)
    wrong = [n for n in names if not isinstance(n, str) or not n]
    if wrong:
        raise ArgumentTypeError(f"{name} must hold non-empty strings: got {short_repr(wrong[0])}")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"{name} names {repeated} more than once")
    return names


def check_path(value: Any, name: str) -> str:
    """``value``, a non-empty path or URL (a str or an os.PathLike), as a str.

    Raises
    ------
    ArgumentTypeError
        Neither a str nor a PathLike.
    ValueError
        An empty path (it would name the current directory).

    Examples
    --------
    >>> check_path("runs/fetch", "path_or_url")
    'runs/fetch'
    """
    if not isinstance(value, (str, os.PathLike)):
        raise ArgumentTypeError(f"{name} must be a path or URL (a str), not {_not_a(value)}: got {short_repr(value)}")
    path = os.fspath(value)
    if not isinstance(path, str):
        raise ArgumentTypeError(f"{name} must be a path or URL (a str), not bytes: got {short_repr(path)}")
    if not path:
        raise ValueError(f"{name} is empty; name a directory or URL (an empty path would be the current directory)")
    return path
