"""Fields of a store derived from gymnasium spaces (name, dtype, row shape, rows per episode), and space <-> JSON."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from gymnasium import spaces

from her_store.checks import check_mapping, check_names, is_int, is_number
from her_store.errors import EpisodeValidationError, SchemaMismatchError, short_repr

__all__ = [
    "GOAL_KEYS", "STEP_KEYS", "Field", "Schema", "conform", "space_from_json", "space_to_json", "validate_episode"
]

GOAL_KEYS = ("observation", "achieved_goal", "desired_goal")
STEP_KEYS = ("action", "reward", "terminated", "truncated")
_SUPPORTED = (spaces.Box, spaces.Discrete, spaces.MultiBinary, spaces.MultiDiscrete)
# Plain numeric dtypes only: a store never holds objects, strings or structured records.
DTYPES = frozenset(
    ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "float32", "float64")
)
# One row of one field; a 4K RGB frame is 25 MB. Bounds what reading a space from a store allocates.
MAX_ROW_BYTES = 1 << 26
# A field's name: an image field is a directory named after it (a file name holds 255 bytes, staging names more).
MAX_NAME_BYTES = 200
_INT64_MAX = np.iinfo(np.int64).max
_MAX_DICT_DEPTH = 8


@dataclass(frozen=True)
class Field:
    """One stored quantity.

    Attributes
    ----------
    name : str
        Key in an episode mapping (``"observation"``, ``"action"``, an info key, ...).
    dtype : numpy.dtype
        Stored dtype (little-endian).
    shape : tuple of int
        Shape of one row; ``()`` for scalars.
    per_step : bool
        False for observation keys, which hold ``T + 1`` rows per episode (the last row is the final
        next-observation); True for action, reward, flags and infos, which hold ``T`` rows.
    role : str
        ``"observation"``, ``"action"``, ``"reward"``, ``"flag"`` or ``"info"``.
    """

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    per_step: bool
    role: str

    @property
    def width(self) -> int:
        """Number of scalar values in one row."""
        return int(math.prod(self.shape))

    @property
    def row_nbytes(self) -> int:
        """Bytes of one row."""
        return self.width * self.dtype.itemsize

    @property
    def is_image(self) -> bool:
        """uint8 with two or more dimensions: stored compressed by default."""
        return self.dtype == np.uint8 and len(self.shape) >= 2

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dtype": self.dtype.str,
            "shape": list(self.shape),
            "per_step": self.per_step,
            "role": self.role,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Field:
        return cls(d["name"], _le(d["dtype"]), tuple(d["shape"]), bool(d["per_step"]), d["role"])


def _le(dtype: Any) -> np.dtype:
    """Little-endian dtype, as numpy's canonical instance (so that ``a.dtype is field.dtype`` holds on hot paths)."""
    return np.dtype(np.dtype(dtype).newbyteorder("<").str)


def _space_field(name: str, space: spaces.Space, per_step: bool, role: str) -> Field:
    if not isinstance(space, _SUPPORTED):
        raise SchemaMismatchError(
            f"field {name!r}: unsupported space {type(space).__name__}; expected one of "
            "Box, Discrete, MultiBinary, MultiDiscrete"
        )
    if isinstance(space, spaces.Discrete):
        return Field(name, np.dtype("<i8"), (), per_step, role)
    dtype = np.dtype(space.dtype)
    return Field(name, _le(dtype), _row_shape(list(space.shape), dtype, f"field {name!r}"), per_step, role)


def _row_shape(shape: Any, dtype: np.dtype, what: str) -> tuple[int, ...]:
    """A field's row shape: positive dimensions, a plain numeric dtype, at most MAX_ROW_BYTES a row."""
    if dtype.name not in DTYPES:
        raise SchemaMismatchError(f"{what}: dtype {dtype} is not supported; expected one of {sorted(DTYPES)}")
    if not isinstance(shape, list) or len(shape) > 32 or not all(_fits_int64(d) and d >= 1 for d in shape):
        raise SchemaMismatchError(f"{what}: shape {short_repr(shape)} is not a list of positive integers")
    if math.prod(shape) * dtype.itemsize > MAX_ROW_BYTES:
        raise SchemaMismatchError(
            f"{what}: rows of shape {tuple(shape)} and dtype {dtype} exceed {MAX_ROW_BYTES} bytes, the most a "
            "field row may hold"
        )
    return tuple(shape)


def _fits_int64(v: Any) -> bool:
    """A JSON integer that fits int64 (bools are not integers here)."""
    return is_int(v) and bool(-_INT64_MAX <= v <= _INT64_MAX)


def _value_range(space: spaces.Space) -> tuple[Any, Any] | None:
    """Inclusive (low, high) of a space whose values are a finite set of integers; None for Box.

    Box bounds are not enforced: gymnasium envs may step outside them and SB3 stores what they return.
    """
    if isinstance(space, spaces.Discrete):
        return int(space.start), int(space.start + space.n - 1)
    if isinstance(space, spaces.MultiBinary):
        return 0, 1
    if isinstance(space, spaces.MultiDiscrete):
        return np.asarray(space.start), np.asarray(space.start + space.nvec - 1)
    return None


class Schema:
    """The ordered fields of a store: observation keys, then action, reward, terminated, truncated, info keys.

    Parameters
    ----------
    observation_space : gymnasium.spaces.Dict
        Must hold ``observation``, ``achieved_goal`` and ``desired_goal``; other keys are stored too.
    action_space : gymnasium.spaces.Space
        Box, Discrete, MultiBinary or MultiDiscrete.
    info_keys : sequence of str or mapping of str to Space
        Numeric info entries stored per step. A bare name is a float32 scalar.

    Examples
    --------
    >>> from gymnasium import spaces
    >>> obs = spaces.Dict({k: spaces.Box(-1, 1, (3,)) for k in ("observation", "achieved_goal", "desired_goal")})
    >>> schema = Schema(obs, spaces.Box(-1, 1, (4,)), info_keys=["is_success"])
    >>> [f.name for f in schema.fields]  # gymnasium's Dict orders its keys
    ['achieved_goal', 'desired_goal', 'observation', 'action', 'reward', 'terminated', 'truncated', 'is_success']
    """

    def __init__(
        self,
        observation_space: spaces.Space,
        action_space: spaces.Space,
        info_keys: Sequence[str] | Mapping[str, spaces.Space] = (),
    ) -> None:
        if not isinstance(observation_space, spaces.Dict):
            raise SchemaMismatchError(
                f"observation_space must be a gymnasium Dict with keys {GOAL_KEYS}, "
                f"got {type(observation_space).__name__}"
            )
        missing = [k for k in GOAL_KEYS if k not in observation_space.spaces]
        if missing:
            raise SchemaMismatchError(
                f"observation_space is missing {missing}; a goal-conditioned store needs {list(GOAL_KEYS)}"
            )
        if isinstance(info_keys, Mapping):
            info_keys = check_mapping(info_keys, "info_keys", or_none=False)
        else:  # names of scalar float32 fields (a str would be its characters)
            info_keys = {k: spaces.Box(-np.inf, np.inf, (), np.float32) for k in check_names(info_keys, "info_keys")}
        self.observation_space = observation_space
        self.action_space = action_space
        self.info_spaces: dict[str, spaces.Space] = dict(info_keys)
        fields = [_space_field(k, s, False, "observation") for k, s in observation_space.spaces.items()]
        fields.append(_space_field("action", action_space, True, "action"))
        fields.append(Field("reward", np.dtype("<f4"), (), True, "reward"))
        fields.append(Field("terminated", np.dtype("bool"), (), True, "flag"))
        fields.append(Field("truncated", np.dtype("bool"), (), True, "flag"))
        fields.extend(_space_field(k, s, True, "info") for k, s in self.info_spaces.items())
        names = [f.name for f in fields]
        clashes = sorted({n for n in names if names.count(n) > 1})
        if clashes:
            raise SchemaMismatchError(
                f"field names {clashes} are used twice; observation keys and info keys must differ from "
                f"each other and from {list(STEP_KEYS)}"
            )
        bad = [
            n for n in names
            if not n
            or any(c in n for c in "/\\\0")
            or n.startswith(("__", "."))
            or len(n.encode("utf-8", "replace")) > MAX_NAME_BYTES
        ]
        if bad:
            raise SchemaMismatchError(
                f"field names {short_repr(bad)} cannot be Zarr array names (no '/', backslash or NUL, no leading "
                f"'__' or '.', at most {MAX_NAME_BYTES} bytes of UTF-8: an image field is a directory named after it)"
            )
        ag, dg = (observation_space.spaces[k] for k in ("achieved_goal", "desired_goal"))
        if ag.shape != dg.shape or ag.dtype != dg.dtype:
            raise SchemaMismatchError(
                f"achieved_goal {ag.shape} {ag.dtype} and desired_goal {dg.shape} {dg.dtype} must have the same "
                "shape and dtype"
            )
        self.fields: tuple[Field, ...] = tuple(fields)
        self.by_name: dict[str, Field] = {f.name: f for f in fields}
        named = {**observation_space.spaces, "action": action_space, **self.info_spaces}
        # the allowed values of Discrete, MultiDiscrete and MultiBinary fields, for conform
        self.value_ranges: dict[str, tuple[Any, Any]] = {
            k: r for k, r in ((k, _value_range(s)) for k, s in named.items()) if r is not None
        }

    @property
    def observation_keys(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields if not f.per_step)

    @property
    def info_keys(self) -> tuple[str, ...]:
        return tuple(self.info_spaces)

    def to_json(self) -> dict[str, Any]:
        return {
            "observation_space": space_to_json(self.observation_space),
            "action_space": space_to_json(self.action_space),
            "info_spaces": {k: space_to_json(s) for k, s in self.info_spaces.items()},
            "fields": [f.to_json() for f in self.fields],
        }

    @classmethod
    def from_json(cls, d: Any) -> Schema:
        """Inverse of :meth:`to_json`, for JSON read from a store: anything but a valid schema raises
        SchemaMismatchError naming the value (``fields``, when present, must be the fields of the spaces).

        Examples
        --------
        >>> obs = spaces.Dict({k: spaces.Box(-1, 1, (3,)) for k in GOAL_KEYS})
        >>> Schema.from_json(Schema(obs, spaces.Discrete(2)).to_json()).action_space
        Discrete(2)
        """
        if not isinstance(d, Mapping) or not isinstance(d.get("info_spaces"), Mapping):
            raise SchemaMismatchError(
                f"schema {short_repr(d)} is not an object with observation_space, action_space and info_spaces"
            )
        if not all(isinstance(k, str) for k in d["info_spaces"]):
            raise SchemaMismatchError(f"info_spaces keys {short_repr(list(d['info_spaces']))} are not all strings")
        schema = cls(
            space_from_json(d.get("observation_space")),
            space_from_json(d.get("action_space")),
            {k: space_from_json(s) for k, s in d["info_spaces"].items()},
        )
        if "fields" in d and d["fields"] != [f.to_json() for f in schema.fields]:
            raise SchemaMismatchError(
                f"schema fields {short_repr(d['fields'])} are not the fields of its spaces "
                f"{short_repr([f.to_json() for f in schema.fields])}"
            )
        return schema

    def check_same(self, other: Schema, where: str) -> None:
        """Raise SchemaMismatchError naming the first difference between two schemas."""
        mine, theirs = self.to_json(), other.to_json()
        for key in ("observation_space", "action_space", "info_spaces"):
            if mine[key] != theirs[key]:
                raise SchemaMismatchError(
                    f"{where}: {key} differs from the one the store was created with: "
                    f"store has {theirs[key]}, got {mine[key]}"
                )


def conform(value: np.ndarray, field: Field, value_range: tuple[Any, Any] | None, label: str) -> np.ndarray:
    """``value`` in the field's dtype, or EpisodeValidationError if storing it would change or misplace a value.

    Refused: a dtype that does not cast to the field's within its kind (float for an integer field, an integer
    for a flag); integers the field's dtype cannot hold (uint16 300 for uint8; int64 2**24 + 1 for float32, which
    would store 2**24); finite floats that a narrower float dtype would turn into inf (float64 1e39 for float32); values
    outside ``value_range`` (a Discrete, MultiDiscrete or MultiBinary space: see ``Schema.value_ranges``). NaN and inf
    given as such are kept. Shapes are the caller's to check.

    Parameters
    ----------
    value : numpy.ndarray
        Rows of the field (any leading axes).
    field : Field
        The field they are stored in.
    value_range : tuple, optional
        Inclusive (low, high), scalars or arrays of the row shape.
    label : str
        How errors name the value, e.g. ``"field 'action'"``.

    Examples
    --------
    >>> conform(np.array([7], np.uint16), Field("n", np.dtype("u1"), (), True, "info"), None, "field 'n'")
    array([7], dtype=uint8)
    """
    dtype, v = field.dtype, value
    if v.dtype != dtype:
        if not np.can_cast(v.dtype, dtype, casting="same_kind"):
            raise EpisodeValidationError(f"{label} has dtype {v.dtype}, expected {dtype} (or one that casts to it)")
        if np.can_cast(v.dtype, dtype) and not (v.dtype.kind in "iu" and dtype.kind == "f"):
            v = v.astype(dtype)
        elif dtype.kind in "iu":  # checked before the cast, which would wrap (300 -> 44 in uint8)
            info = np.iinfo(dtype)
            if v.size and (v.min() < info.min or v.max() > info.max):
                at = _first((v < info.min) | (v > info.max))
                raise EpisodeValidationError(
                    f"{label} has {v[at].item()} at {at}, which {dtype} cannot hold ({info.min}..{info.max})"
                )
            v = v.astype(dtype)
        else:
            with np.errstate(over="ignore"):  # overflow is what the check below reports
                narrowed = v.astype(dtype)
            if v.dtype.kind in "iu" and v.size:
                rounded = _rounded(v, narrowed)
                if rounded.any():
                    at = _first(rounded)
                    raise EpisodeValidationError(
                        f"{label} has {v[at].item()} at {at}, which {dtype} cannot hold exactly (it would store "
                        f"{narrowed[at].item()!r})"
                    )
            if not np.isfinite(narrowed).all():
                overflow = np.isinf(narrowed) & np.isfinite(v)
                if overflow.any():
                    at = _first(overflow)
                    raise EpisodeValidationError(
                        f"{label} has {v[at].item()} at {at}, which overflows {dtype} (largest {np.finfo(dtype).max})"
                    )
            v = narrowed
    if value_range is not None:
        outside = (v < value_range[0]) | (v > value_range[1])
        if outside.any():
            at = _first(outside)
            low, high = (np.broadcast_to(b, v.shape)[at] for b in value_range)
            raise EpisodeValidationError(f"{label} has {v[at].item()} at {at}, outside its space's range {low}..{high}")
    return v


def _rounded(v: np.ndarray, narrowed: np.ndarray) -> np.ndarray:
    """Where the floats ``narrowed`` are not the integers ``v`` they were cast from (past 2**(mantissa + 1) a float
    dtype holds only some integers)."""
    signed = v.dtype.kind == "i"
    wide = v.astype(np.int64 if signed else np.uint64)
    f = narrowed.astype(np.float64)  # exact: every float16 or float32 value is a float64 value
    fits = (f >= (-(2.0**63) if signed else 0.0)) & (f < (2.0**63 if signed else 2.0**64))
    return ~fits | (np.where(fits, f, 0).astype(wide.dtype) != wide)


def _first(bad: np.ndarray) -> tuple[int, ...]:
    """Index of the first True of ``bad``, as plain ints (for error messages)."""
    return tuple(int(i) for i in np.unravel_index(np.argmax(bad), bad.shape))


def _floats_to_json(a: np.ndarray) -> Any:
    """Bounds as JSON: one scalar when uniform (image spaces), infinities as strings (strict JSON); a bool Box's as 0
    and 1 (numbers, as every other bound)."""
    a = np.asarray(a)
    if a.dtype == np.bool_:
        a = a.astype(np.uint8)
    flat = a.reshape(-1)
    vals = [flat[0]] if flat.size and np.all(flat == flat[0]) else flat
    out = [v.item() if np.isfinite(v) else ("inf" if v > 0 else "-inf") for v in vals]
    return out[0] if len(out) == 1 else out


def _floats_from_json(v: Any, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Bounds written by :func:`_floats_to_json`: one number, or one per element; infinities as strings."""
    values = v if isinstance(v, list) else [v]
    if len(values) != (math.prod(shape) if isinstance(v, list) else 1) or not all(
        is_number(x) or x in ("inf", "-inf") for x in values
    ):
        raise SchemaMismatchError(
            f"bounds {short_repr(v)} are not a number or {math.prod(shape)} numbers for shape {shape}"
        )
    if dtype.kind in "iu" and all(isinstance(x, int) for x in values):  # exact: int64 bounds past 2**53 survive
        info = np.iinfo(dtype)
        if not all(info.min <= x <= info.max for x in values):
            raise SchemaMismatchError(f"bounds {short_repr(v)} do not fit {dtype} ({info.min}..{info.max})")
        arr = np.array(values, dtype=dtype)
    else:
        arr = np.array([float(x) for x in values], dtype=np.float64)
    return arr.reshape(shape).astype(dtype) if isinstance(v, list) else np.broadcast_to(arr[0], shape).astype(dtype)


def _dtype_from_json(v: Any, d: Any) -> np.dtype:
    if not isinstance(v, str) or v not in DTYPES:
        raise SchemaMismatchError(f"space {short_repr(d)}: dtype {short_repr(v)} is not one of {sorted(DTYPES)}")
    return np.dtype(v)


def _ints_from_json(v: Any, dtype: np.dtype, d: Any) -> np.ndarray:
    """MultiDiscrete counts or starts: a (nested) list of integers of a row shape."""
    arr = np.array(v) if isinstance(v, list) else np.zeros(0, object)
    if arr.dtype.kind not in "iu" or arr.size == 0:
        raise SchemaMismatchError(
            f"MultiDiscrete space {short_repr(d)}: {short_repr(v)} is not a nested list of integers"
        )
    _row_shape(list(arr.shape), dtype, f"MultiDiscrete space {short_repr(d)}")
    return arr


def space_to_json(space: spaces.Space) -> dict[str, Any]:
    """Serialise a gymnasium space to plain JSON (no pickle: opening a store never runs code).

    Examples
    --------
    >>> space_to_json(spaces.Discrete(3))
    {'type': 'Discrete', 'n': 3, 'start': 0}
    """
    if isinstance(space, spaces.Dict):
        return {"type": "Dict", "spaces": {k: space_to_json(s) for k, s in space.spaces.items()}}
    if isinstance(space, spaces.Box):
        return {
            "type": "Box",
            "shape": list(space.shape),
            "dtype": np.dtype(space.dtype).name,
            "low": _floats_to_json(space.low),
            "high": _floats_to_json(space.high),
        }
    if isinstance(space, spaces.Discrete):
        return {"type": "Discrete", "n": int(space.n), "start": int(space.start)}
    if isinstance(space, spaces.MultiBinary):
        n = np.asarray(space.n)
        return {"type": "MultiBinary", "n": int(n) if n.ndim == 0 else [int(x) for x in n]}
    if isinstance(space, spaces.MultiDiscrete):
        return {
            "type": "MultiDiscrete",
            "nvec": np.asarray(space.nvec).tolist(),
            "start": np.asarray(space.start).tolist(),
            "dtype": np.dtype(space.dtype).name,
        }
    raise SchemaMismatchError(
        f"unsupported space {type(space).__name__}; expected Dict, Box, Discrete, MultiBinary or MultiDiscrete"
    )


def space_from_json(d: Any) -> spaces.Space:
    """Inverse of :func:`space_to_json`. JSON read from a store is untrusted: anything but a valid space of a
    supported kind raises SchemaMismatchError naming the value, before any array of its shape is allocated.

    Examples
    --------
    >>> space_from_json({'type': 'Discrete', 'n': 3, 'start': 0})
    Discrete(3)
    """
    return _space_from_json(d, 0)


def _space_from_json(d: Any, depth: int) -> spaces.Space:
    kind = d.get("type") if isinstance(d, Mapping) else None
    if kind == "Dict":
        subs = d.get("spaces")
        if not isinstance(subs, Mapping) or not all(isinstance(k, str) for k in subs) or depth >= _MAX_DICT_DEPTH:
            raise SchemaMismatchError(
                f"Dict space {short_repr(d)} needs 'spaces', an object of named spaces (nested at most "
                f"{_MAX_DICT_DEPTH} deep)"
            )
        return spaces.Dict({k: _space_from_json(s, depth + 1) for k, s in subs.items()})
    try:
        if kind == "Box":
            dtype = _dtype_from_json(d.get("dtype"), d)
            shape = _row_shape(d.get("shape"), dtype, f"Box space {short_repr(d)}")
            low, high = (_floats_from_json(d.get(k), shape, dtype) for k in ("low", "high"))
            return spaces.Box(low, high, shape, dtype)
        if kind == "Discrete":
            n, start = d.get("n"), d.get("start", 0)
            if not (_fits_int64(n) and _fits_int64(start)):
                raise SchemaMismatchError(f"Discrete space {short_repr(d)}: n and start must be integers")
            return spaces.Discrete(n, start=start)
        if kind == "MultiBinary":
            n = d.get("n")
            _row_shape([n] if _fits_int64(n) else n, np.dtype("int8"), f"MultiBinary space {short_repr(d)}")
            return spaces.MultiBinary(n)
        if kind == "MultiDiscrete":
            dtype = _dtype_from_json(d.get("dtype", "int64"), d)
            nvec, start = _ints_from_json(d.get("nvec"), dtype, d), _ints_from_json(d.get("start"), dtype, d)
            return spaces.MultiDiscrete(nvec, dtype=dtype, start=start)
    except (ValueError, TypeError, OverflowError) as e:  # gymnasium's own checks of bounds, counts and dtypes
        raise SchemaMismatchError(f"{kind} space {short_repr(d)} is invalid: {e}") from e
    raise SchemaMismatchError(f"unknown space type {short_repr(kind)} in store metadata ({short_repr(d)})")


def validate_episode(schema: Schema, episode: Mapping[str, Any]) -> tuple[int, dict[str, np.ndarray]]:
    """Check an episode against the schema; return ``(T, arrays in stored dtypes)`` or raise EpisodeValidationError."""
    if not isinstance(episode, Mapping):
        raise EpisodeValidationError(f"an episode is a mapping of field name -> array, got {type(episode).__name__}")
    names = schema.by_name
    if episode.keys() != names.keys():
        missing = [n for n in names if n not in episode]
        extra = sorted(set(episode) - set(names))
        raise EpisodeValidationError(
            f"episode keys do not match the store: missing {missing}, unexpected {extra}; expected {list(names)}"
        )
    action = np.asarray(episode["action"])
    T = len(action) if action.ndim else 0
    if T < 1:
        raise EpisodeValidationError(f"an episode needs at least one step; 'action' has shape {action.shape}")
    out = {}
    for f in schema.fields:
        a = np.asarray(episode[f.name])
        rows = T if f.per_step else T + 1
        if a.shape[:1] != (rows,) or a.shape[1:] != f.shape:
            what = "T" if f.per_step else "T + 1"
            raise EpisodeValidationError(
                f"field {f.name!r} has shape {a.shape}, expected {(rows, *f.shape)} "
                f"({what} rows with T={T} from 'action')"
            )
        a = conform(a, f, schema.value_ranges.get(f.name), f"field {f.name!r}")
        out[f.name] = a if a.flags.c_contiguous else np.ascontiguousarray(a)
    return T, out
