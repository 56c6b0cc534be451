"""OGBench export and import: OGBench's npz dataset layout, which ``ogbench.utils.load_dataset`` reads.

OGBench stores trajectories back to back, one row per state: an episode of ``T`` transitions is ``T + 1`` rows,
``observations`` rows ``s_0 .. s_T``, ``actions`` rows ``a_0 .. a_{T-1}`` then one more (OGBench records the action
taken in ``s_T``; an export writes zeros there), and ``terminals`` (bool) 1 at row ``T`` only. ``load_dataset`` drops
the rows where ``terminals`` is 1 and takes ``next_observations`` from the row after, so it yields exactly the
store's transitions (``compact_dataset=True`` marks them with ``valids``).

An export also writes, with the same ``T + 1`` rows per episode (per-step arrays zero at row ``T``):
``achieved_goal``, ``desired_goal`` and every other observation key under its own name, ``rewards`` (float32),
``masks`` (float32, ``1 - terminated``, the convention of OGBench's reward-based agents), ``truncations`` (bool),
each info key under its own name, and ``her_store_header`` (uint8 JSON: spaces and dataset card), so that import
gives back the store bit-exactly.

Import splits episodes at ``terminals``. A file from elsewhere (no header) becomes a store whose
``observation`` is ``observations`` and whose other arrays of one row per state (``qpos``, ``qvel``,
``button_states``, ...) are extra observation keys; without ``achieved_goal``/``desired_goal`` arrays,
``achieved_goal`` is the observation and ``desired_goal`` the episode's final observation (on every row): the goal
each trajectory reaches at its end, as in OGBench's hindsight goal sampling. Rewards are ``rewards`` when the
file has them, else 0 on the last transition (it reaches that goal) and -1 before; ``terminated`` is where ``masks``
is 0 (never, without masks); the last step is ``truncated`` unless it terminated. Spaces of such a file are
unbounded Boxes in the file's dtypes (``[0, 255]`` for uint8 images; bool arrays as int8 0/1).

An array whose dtype is not the store's (``rewards`` in float64, ``truncations`` as 0/1 floats, a bool array kept
as int8) is cast only when every value survives the cast exactly (:func:`her_store.interop.checks.exact_cast`, which
the Minari import uses too): the cast is stated once per array as a warning; a value the cast would change is
refused, naming the file, the array and both dtypes.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
from gymnasium import spaces

from her_store.errors import SchemaMismatchError
from her_store.format.schema import Field, Schema
from her_store.interop.batches import read_batches
from her_store.interop.checks import check_episode_bytes, exact_cast
from her_store.interop.layout import HEADER_KEY, header_of
from her_store.interop.npz_members import NpzReader, read_npz_header, write_npz
from her_store.interop.staging import append_from, staged_file, staged_store
from her_store.progress import progress as progress_bar
from her_store.store.episode_store import EpisodeStore

__all__ = ["export_ogbench", "import_ogbench"]

_FIXED = {
    "observation": "observations",
    "action": "actions",
    "reward": "rewards",
    "terminated": "masks",
    "truncated": "truncations",
}
RESERVED = frozenset({*_FIXED.values(), "terminals", "next_observations", "valids", HEADER_KEY})


def _array_name(field: Field) -> str:
    return _FIXED.get(field.name, field.name)


def export_ogbench(
    store: EpisodeStore, episode_ids: np.ndarray, dest: str | os.PathLike[str], *, progress: bool = False
) -> tuple[int, int]:
    """Write episodes ``episode_ids`` of ``store`` to ``dest`` in OGBench's npz layout (module docstring); returns the
    episodes and transitions written.

    Raises
    ------
    ValueError
        An observation or info key is named like one of OGBench's arrays (``terminals``, ``masks``, ...).
    FileExistsError
        ``dest`` exists (nothing is overwritten; ``dest`` appears only when the whole file is written).

    Examples
    --------
    >>> with EpisodeStore.open("runs/point") as store:  # doctest: +SKIP
    ...     export_ogbench(store, np.arange(store.first_episode, store.end_episode), "point-v0.npz")
    >>> ogbench.utils.load_dataset("point-v0.npz")["next_observations"].shape  # doctest: +SKIP
    (5000, 4)
    """
    fields = store.schema.fields
    clash = sorted(f.name for f in fields if f.name not in _FIXED and f.name in RESERVED)
    if clash:
        raise ValueError(f"fields {clash} of {store.url} are named like OGBench's own arrays {sorted(RESERVED)}")
    ids = np.asarray(episode_ids, np.int64)
    members = {_array_name(f): (np.dtype("<f4") if f.name == "terminated" else f.dtype, f.shape) for f in fields}
    members["terminals"] = (np.dtype(bool), ())
    written = [0, 0]  # episodes, transitions (a ring's writer may evict some while they are read)

    def pieces() -> Any:
        for batch in read_batches(store, ids, progress, "exporting ogbench"):
            written[0] += len(batch.ids)
            written[1] += int(batch.lengths.sum())
            last = np.zeros(int(batch.lengths.sum()) + len(batch.lengths), bool)
            last[np.cumsum(batch.lengths + 1) - 1] = True  # row T of each episode
            piece = {"terminals": last}
            for f in fields:
                a = batch.fields[f.name]
                if f.name == "terminated":
                    a = 1.0 - a.astype(np.float32)
                if f.per_step:  # T + 1 rows: a zero row at T
                    padded = np.zeros((len(last), *f.shape), a.dtype)
                    padded[~last] = a
                    a = padded
                piece[_array_name(f)] = a
            yield piece

    small = {HEADER_KEY: np.frombuffer(json.dumps(header_of(store, "ogbench")).encode(), np.uint8)}
    with staged_file(dest) as tmp:
        write_npz(tmp, members, pieces(), lambda: small)
    return written[0], written[1]


def _box(dtype: np.dtype, shape: tuple[int, ...], path: str, name: str) -> spaces.Space:
    """The space of an array of a file with no header: unbounded in its dtype (uint8: [0, 255]; bool: 0/1 int8)."""
    if dtype == np.bool_:
        return spaces.Box(0, 1, shape, np.int8)
    if dtype == np.uint8:
        return spaces.Box(0, 255, shape, np.uint8)
    if dtype.kind in "iu":  # 64-bit bounds at +-2**53, which JSON's numbers (the store's spaces) hold exactly
        info = np.iinfo(dtype)
        return spaces.Box(max(info.min, -(2**53)), min(info.max, 2**53), shape, dtype)
    if dtype.kind == "f":
        return spaces.Box(-np.inf, np.inf, shape, dtype)
    raise ValueError(f"{path}: array {name!r} is of dtype {dtype}; expected numbers (bool, integers or floats)")


def _flags(values: np.ndarray, path: str, name: str, expected: str, trajectory: int | None = None) -> np.ndarray:
    """``values`` if every one is 0 or 1, else ValueError naming the first other (NaN, 0.5, -1, 2)."""
    bad = np.flatnonzero((values != 0) & (values != 1))
    if bad.size:
        where = f"row {int(bad[0])}" + ("" if trajectory is None else f" of trajectory {trajectory}")
        raise ValueError(f"{path}: {name} holds {values[bad[0]].item()!r} at {where}; expected {expected}")
    return values


def _foreign_schema(z: NpzReader, rows: int) -> tuple[Schema, dict[str, str], dict[str, Any]]:
    """Spaces, field -> array names and card of an OGBench file without a header (module docstring)."""
    known = {"observations", "actions", "terminals", "rewards", "masks", "truncations", "achieved_goal", "desired_goal",
             "next_observations", "valids"}  # the last two are OGBench's own, derived from the others: not stored
    obs_dtype, obs_shape = z.header("observations")
    obs: dict[str, spaces.Space] = {"observation": _box(obs_dtype, obs_shape[1:], z.path, "observations")}
    names = {"observation": "observations", "action": "actions"}
    goals = {"achieved_goal", "desired_goal"} <= set(z.keys)
    half = {"achieved_goal", "desired_goal"} & set(z.keys)
    if half and not goals:
        (have,), (lack,) = half, {"achieved_goal", "desired_goal"} - half
        raise ValueError(
            f"{z.path} has {have} but not {lack}; goals come from both arrays or, without either, from the observations"
        )
    if goals:
        for k in ("achieved_goal", "desired_goal"):
            dtype, shape = z.header(k)
            obs[k], names[k] = _box(dtype, shape[1:], z.path, k), k
    else:
        obs["achieved_goal"] = obs["desired_goal"] = obs["observation"]
    for k in sorted(set(z.keys) - known - {HEADER_KEY}):
        dtype, shape = z.header(k)
        if not shape:
            continue  # a scalar setting of the dataset (e.g. observation_interval), not a per-state array
        if shape[0] != rows:
            raise ValueError(f"{z.path}: array {k!r} has {shape[0]:,} rows; observations and terminals have {rows:,}")
        if k in obs:
            raise ValueError(
                f"{z.path}: array {k!r} would be stored as the observation key {k!r}, which "
                f"{names.get(k, 'observations')!r} gives; rename one of them"
            )
        obs[k], names[k] = _box(dtype, shape[1:], z.path, k), k
    act_dtype, act_shape = z.header("actions")
    try:
        schema = Schema(spaces.Dict(obs), _box(act_dtype, act_shape[1:], z.path, "actions"))
    except SchemaMismatchError as e:
        raise ValueError(f"{z.path}: its arrays give no store's spaces: {e}") from None
    for k in ("rewards", "masks", "truncations"):
        if k in z.keys:
            names[{"rewards": "reward", "masks": "terminated", "truncations": "truncated"}[k]] = k
    stem = os.path.splitext(os.path.basename(z.path))[0]
    how = (
        "from its achieved_goal/desired_goal arrays"
        if goals
        else ("achieved_goal = observation, desired_goal = the episode's final observation")
    )
    card = {
        "dataset_id": stem,
        "description": f"imported from the OGBench file {os.path.basename(z.path)}; goals {how}",
    }
    return schema, names, card


def import_ogbench(
    source: str | os.PathLike[str], store_path: str | os.PathLike[str], *, progress: bool = False
) -> int:
    """Read an OGBench npz (written by :func:`export_ogbench` or by OGBench) into a new store; returns the episodes.

    Episodes are split at ``terminals``; a file without a header gets the spaces, goals, rewards and flags the
    module docstring describes. Arrays are streamed (memory stays bounded).

    Raises
    ------
    ValueError
        The file is damaged or cut short, lacks ``observations``/``actions``/``terminals``, has arrays whose rows do
        not match, does not end with a terminal, or has a trajectory of a single state.
    FileExistsError
        ``store_path`` exists.

    Examples
    --------
    >>> import_ogbench("antmaze-large-navigate-v0.npz", "runs/antmaze")  # doctest: +SKIP
    1000
    """
    source = os.fspath(source)
    with NpzReader(source) as z:
        missing = [k for k in ("observations", "actions", "terminals") if k not in z.keys]
        if missing:
            raise ValueError(f"{source} lacks {missing}: OGBench's npz has observations, actions and terminals")
        terminals = z.read_all("terminals")
        if terminals.ndim != 1 or not len(terminals) or terminals.dtype.kind not in "biuf":
            raise ValueError(f"{source}: terminals is {terminals.dtype}{terminals.shape}; expected one flag per row")
        _flags(terminals, source, "terminals", "1 (a trajectory's last state) or 0")
        ends = np.flatnonzero(terminals)
        if not len(ends) or ends[-1] != len(terminals) - 1:
            raise ValueError(
                f"{source}: the last trajectory has no terminal (rows after {ends[-1] if len(ends) else -1})"
            )
        sizes = np.diff(ends, prepend=-1)
        if sizes.min() < 2:
            raise ValueError(f"{source}: trajectory {int(np.argmin(sizes))} is a single state; a transition needs two")
        if HEADER_KEY in z.keys:
            schema, card = read_npz_header(z, "ogbench")
            names = {f.name: _array_name(f) for f in schema.fields}
        else:
            schema, names, card = _foreign_schema(z, len(terminals))
        own = HEADER_KEY in z.keys  # written by export: dtypes are the header's spaces' (masks float32)
        for f in schema.fields:
            if f.name in names:
                dtype, shape = z.header(names[f.name])
                want = np.dtype("<f4") if f.name == "terminated" else f.dtype
                if shape != (len(terminals), *f.shape) or (own and dtype != want):
                    raise ValueError(
                        f"{source}: array {names[f.name]!r} is {dtype}{shape}; expected {len(terminals):,} rows of "
                        f"{f.shape}" + (f" {want}" if own else "")
                    )
        bar = progress_bar(len(sizes), "importing ogbench", progress, unit="episode")
        noted: set[str] = set()
        with staged_store(store_path, schema, card) as store, bar:
            for k, n in enumerate(sizes.tolist()):
                where = f"{source}: trajectory {k} ({n:,} rows)"
                check_episode_bytes(schema, n, where)
                append_from(store, _episode(z, schema, names, n, k, noted, bounded=not own), where)
                bar.update(1)
            for name in set(names.values()):
                z.finish(name)
    return len(sizes)


def _episode(
    z: NpzReader, schema: Schema, names: dict[str, str], n: int, k: int, noted: set[str], bounded: bool = False
) -> dict[str, np.ndarray]:
    """Trajectory ``k``, of ``n`` rows (``T = n - 1`` transitions), as a store episode in the store's dtypes.
    ``bounded``: the spaces are :func:`_box`'s, whose 64-bit integer bounds are +-2**53: a value past them is
    refused."""
    T = n - 1
    read = {f: z.read(a, n) for f, a in names.items()}
    for f, a in read.items() if bounded else ():
        if a.dtype.kind in "iu" and a.dtype.itemsize == 8:
            past = ((a > 2**53) | (a < -(2**53))).reshape(n, -1)
            if past.any():
                row = int(np.argmax(past.any(axis=1)))
                value = a.reshape(n, -1)[row][past[row]][0].item()
                raise ValueError(
                    f"{z.path}: array {names[f]!r} holds {value} at row {row} of trajectory {k}; a 64-bit "
                    "integer array of a file with no header is stored with bounds +-2**53 (JSON numbers, the store's "
                    "spaces, hold no more exactly)"
                )
    ep = {
        f.name: exact_cast(read[f.name][:T] if f.per_step else read[f.name], f.dtype, z.path, names[f.name], k, noted)
        for f in schema.fields
        if f.name in read and f.name != "terminated"  # masks: 1 - terminated, read below
    }
    if "achieved_goal" not in read:
        ep["achieved_goal"] = ep["observation"]
        ep["desired_goal"] = np.broadcast_to(ep["observation"][-1], ep["observation"].shape)
    if "reward" not in read:
        ep["reward"] = np.where(np.arange(T) == T - 1, 0.0, -1.0).astype(np.float32)
    if "terminated" in read:
        masks = _flags(read["terminated"][:T], z.path, names["terminated"], "1 (goes on) or 0 (ended)", k)
        ep["terminated"] = masks == 0
    else:
        ep["terminated"] = np.zeros(T, bool)
    if "truncated" not in read:
        ep["truncated"] = (np.arange(T) == T - 1) & ~ep["terminated"][-1]
    return ep
