"""Import of stable-baselines3 replay buffers saved with ``model.save_replay_buffer`` (a pickle): SB3 -> store.

UNPICKLING RUNS CODE FROM THE FILE. This import is the only place her_store unpickles anything; it happens only
when a user asks for it (``her-store import BUFFER.pkl STORE``), and only pickles you trust should be imported.

A ``DictReplayBuffer`` or ``HerReplayBuffer`` (Dict observations with the goal keys) keeps ``(buffer_size, n_envs)``
ring arrays. Each env column is read in the order it was written (from ``pos`` on once the ring is ``full``) and cut
into episodes:

- ``HerReplayBuffer``: the episodes ``ep_start``/``ep_length`` describe (those the ring overwrote have length 0),
  which must tile each env column's rows as SB3's ``add`` leaves them and agree with ``dones`` (a buffer whose
  ``ep_length`` would cut an episode into fragments is refused, naming the env and row);
- ``DictReplayBuffer``: at ``dones``; once the ring is full, the rows before a column's first done are dropped (the
  start of that episode was overwritten);
- the steps after a column's last episode (its unfinished episode) become one more episode ending truncated, as
  SB3's ``load_replay_buffer(truncate_last_traj=True)`` does.

An episode's observations are its rows of ``observations`` and, last, the ``next_observations`` of its final step
(SB3 stores the terminal observation there); actions, rewards are as stored (SAC, TD3 and DDPG store actions
rescaled to [-1, 1]); the last step is ``truncated`` where ``timeouts`` is set, ``terminated`` otherwise. Episodes
are stored in the order they ended (then by env). Infos are not imported (SB3 keeps them only as Python dicts, with
``copy_info_dict``). The store's card says where the episodes came from.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import numpy as np

from her_store.extras import require
from her_store.format.schema import Schema
from her_store.interop.checks import open_input
from her_store.interop.staging import staged_store
from her_store.progress import progress as progress_bar

__all__ = ["import_sb3"]


def import_sb3(source: str | os.PathLike[str], store_path: str | os.PathLike[str], *, progress: bool = False) -> int:
    """Unpickle an SB3 replay buffer and import its episodes into a new store at ``store_path``; returns how many.

    This runs code from ``source`` (it is a pickle): import only files you trust.

    Raises
    ------
    ValueError
        ``source`` is not a readable pickle of a DictReplayBuffer/HerReplayBuffer, its arrays do not agree with
        each other, or it holds no episode.
    ImportError
        stable-baselines3 is not installed (its classes are needed to unpickle).
    FileExistsError
        ``store_path`` exists.

    Examples
    --------
    >>> model.save_replay_buffer("rb.pkl")  # doctest: +SKIP
    >>> import_sb3("rb.pkl", "runs/from_sb3")  # doctest: +SKIP
    37
    """
    require("stable_baselines3", "sb3")
    from stable_baselines3.common.buffers import DictReplayBuffer
    from stable_baselines3.her.her_replay_buffer import HerReplayBuffer

    source = os.fspath(source)
    with open_input(source, "an SB3 replay buffer pickle") as f:
        try:
            rb = pickle.load(f)  # the explicit import of a pickle the user trusts (module docstring)
        except Exception as e:  # noqa: BLE001 - a broken pickle can raise anything
            raise ValueError(f"{source} is not a readable pickle ({type(e).__name__}: {e})") from None
    if not isinstance(rb, DictReplayBuffer):
        raise ValueError(
            f"{source} holds a {type(rb).__module__}.{type(rb).__name__}; expected an SB3 DictReplayBuffer or "
            "HerReplayBuffer (save_replay_buffer of a model with Dict observations)"
        )
    schema = Schema(rb.observation_space, rb.action_space)
    her = isinstance(rb, HerReplayBuffer)
    arrays = _checked_arrays(rb, schema, her, source)
    try:
        episodes = _episodes(arrays, her)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None
    if not episodes:
        raise ValueError(f"{source}: the buffer holds no step")
    card = {"description": f"imported from a stable-baselines3 {type(rb).__name__} ({arrays['n_envs']} envs)"}
    bar = progress_bar(len(episodes), "importing sb3", progress, unit="episode")
    with staged_store(store_path, schema, card) as store, bar:
        for _, env, rows, ended in episodes:
            store.append_episode(_episode(arrays, schema, env, rows, ended))
            bar.update(1)
    return len(episodes)


def _checked_arrays(rb: Any, schema: Schema, her: bool, source: str) -> dict[str, Any]:
    """The buffer's arrays, each checked to be ``(buffer_size, n_envs, ...)`` (nothing in the pickle is trusted)."""
    try:
        size, n_envs, pos, full = int(rb.buffer_size), int(rb.n_envs), int(rb.pos), bool(rb.full)
        out: dict[str, Any] = {
            "size": size,
            "n_envs": n_envs,
            "pos": pos,
            "full": full,
            "observations": {k: np.asarray(rb.observations[k]) for k in schema.observation_keys},
            "next_observations": {k: np.asarray(rb.next_observations[k]) for k in schema.observation_keys},
            "actions": np.asarray(rb.actions),
            "rewards": np.asarray(rb.rewards),
            "dones": np.asarray(rb.dones),
            "timeouts": np.asarray(getattr(rb, "timeouts", np.zeros_like(rb.dones))),
        }
        if her:
            out.update(
                ep_start=np.asarray(rb.ep_start, np.int64),
                ep_length=np.asarray(rb.ep_length, np.int64),
                current=np.asarray(rb._current_ep_start, np.int64),
            )
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{source}: the buffer lacks SB3's arrays ({type(e).__name__}: {e})") from None
    if not (size >= 1 and n_envs >= 1 and 0 <= pos < size):
        raise ValueError(f"{source}: buffer_size {size}, n_envs {n_envs}, pos {pos} do not fit together")
    arrays = [*out["observations"].items(), *(("next " + k, v) for k, v in out["next_observations"].items())]
    arrays += [(k, out[k]) for k in ("actions", "rewards", "dones", "timeouts", "ep_start", "ep_length") if k in out]
    for name, a in arrays:
        if a.shape[:2] != (size, n_envs):
            raise ValueError(f"{source}: {name} has shape {a.shape}; expected ({size}, {n_envs}, ...)")
    if her and (
        out["current"].shape != (n_envs,)
        or (
            (out["ep_start"] < 0) | (out["ep_start"] >= size) | (out["ep_length"] < 0) | (out["ep_length"] > size)
        ).any()
        or ((out["current"] < 0) | (out["current"] >= size)).any()
    ):
        raise ValueError(f"{source}: ep_start, ep_length or _current_ep_start point outside the buffer of {size} rows")
    return out


def _episodes(a: dict[str, Any], her: bool) -> list[tuple[int, int, np.ndarray, bool]]:
    """Every episode as ``(when it ended, env, buffer rows in order, ended by a done)``, in the order they ended."""
    size, pos = a["size"], a["pos"]
    order = (pos + np.arange(size)) % size if a["full"] else np.arange(pos)  # rows in the order they were written
    age = np.zeros(size, np.int64)
    age[order] = np.arange(len(order))
    out = []
    for env in range(a["n_envs"]):
        if her:
            spans, tail = _her_spans(a, env, order)
        else:
            ends = order[a["dones"][order, env] > 0]
            begins = np.concatenate([order[:1], (ends[:-1] + 1) % size])
            spans = [(int(b), int(age[e] - age[b] + 1)) for b, e in zip(begins, ends)]
            spans = spans[1:] if a["full"] else spans  # once full, a column's first episode lost its first rows
            after = int(age[ends[-1]]) + 1 if len(ends) else (len(order) if a["full"] else 0)
            tail = (int(order[after]) if after < len(order) else 0, len(order) - after)
        for (s, n), ended in [*((span, True) for span in spans), (tail, False)]:
            if n < 1:
                continue
            rows = (s + np.arange(n)) % size
            out.append((int(age[rows[-1]]), env, rows, ended))
    out.sort(key=lambda e: (e[0], e[1]))
    return out


def _her_spans(a: dict[str, Any], env: int, order: np.ndarray) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """The ended episodes of a HerReplayBuffer's env column as ``(first row, length)``, and its unfinished tail,
    checked to tile the column's filled rows as SB3's ``add`` leaves them (nothing in the pickle is trusted).

    In the order rows were written (``order``): once the ring is full, the rest of the one episode whose start was
    overwritten (``ep_length`` 0, which ``add`` sets when it overwrites an episode's first row; its ``ep_start`` that
    overwritten row, a done on its last row only); then ended episodes back to back, each row of one holding its
    first row in ``ep_start`` and its length in ``ep_length``, ``dones`` set on its last row only; then the
    unfinished episode, from ``_current_ep_start`` to ``pos``, of length 0 and no done. Anything else (an
    ``ep_length`` that cuts an episode short or runs past it, a gap, a done inside an episode) is refused naming the
    env and row: importing it would make fragments of episodes.
    """
    size, pos = a["size"], a["pos"]
    start, length, dones = a["ep_start"][:, env], a["ep_length"][:, env], a["dones"][:, env]
    current = int(a["current"][env])
    filled = len(order)
    n_tail = (pos - current) % size
    if not a["full"] and current > pos:
        raise ValueError(f"env {env}: _current_ep_start {current} is past pos {pos} in a buffer that never wrapped")
    tail_at = filled - n_tail  # where the unfinished episode starts, in written order
    k = 0
    if a["full"]:
        while k < tail_at and length[order[k]] == 0:  # an overwritten episode's remaining rows
            k += 1
        rest = order[:k]
        second = (start[rest[1:]] != start[rest[:1]]) | (dones[rest[:-1]] > 0)  # row i + 1 begins another episode
        if second.any():
            j = 1 + int(np.argmax(second))
            at, before = int(rest[j]), int(rest[j - 1])
            raise ValueError(
                f"env {env}: rows {int(rest[0])}..{int(rest[-1])} have ep_length 0, as the rest of the one episode "
                f"the ring overwrote part of would, but a second episode begins at row {at} (ep_start "
                f"{int(start[at])}; row {before}: ep_start {int(start[before])}, done {bool(dones[before] > 0)})"
            )
        if k and np.isin(start[rest[0]], rest):
            raise ValueError(
                f"env {env}: rows {int(rest[0])}..{int(rest[-1])} have ep_length 0, as the rest of an episode the "
                f"ring overwrote part of would, but their first row, row {int(start[rest[0]])}, is among them"
            )
    spans = []
    while k < tail_at:
        r = int(order[k])
        n = int(length[r])
        rows = order[k : k + n]
        if n == 0 or start[r] != r or k + n > tail_at:
            raise ValueError(
                f"env {env}: the episode at row {r} has ep_start {int(start[r])} and ep_length {n}, which do not "
                f"tile the rows written before the unfinished episode at row {current} (an episode there must start "
                f"at row {r} and end by row {int(order[tail_at - 1])})"
            )
        bad = np.flatnonzero((start[rows] != r) | (length[rows] != n) | ((dones[rows] > 0) != (np.arange(n) == n - 1)))
        if len(bad):
            at = int(rows[bad[0]])
            raise ValueError(
                f"env {env}: row {at} of the episode at rows {r}..{int(rows[-1])} has ep_start {int(start[at])}, "
                f"ep_length {int(length[at])} and done {bool(dones[at] > 0)}; expected {r}, {n} and "
                f"{at == int(rows[-1])}"
            )
        spans.append((r, n))
        k += n
    tail = order[tail_at:]
    bad = np.flatnonzero((start[tail] != current) | (length[tail] != 0) | (dones[tail] > 0))
    if len(bad):
        at = int(tail[bad[0]])
        raise ValueError(
            f"env {env}: row {at} of the unfinished episode from row {current} has ep_start {int(start[at])}, "
            f"ep_length {int(length[at])} and done {bool(dones[at] > 0)}; expected {current}, 0 and False"
        )
    return spans, (current, n_tail)


def _episode(a: dict[str, Any], schema: Schema, env: int, rows: np.ndarray, ended: bool) -> dict[str, np.ndarray]:
    """One episode from the rows of one env column: observations ``T + 1`` rows (the last from next_observations)."""
    T = len(rows)
    ep: dict[str, np.ndarray] = {}
    for f in schema.fields:
        if not f.per_step:
            o = a["observations"][f.name][rows, env]
            last = a["next_observations"][f.name][rows[-1:], env]
            ep[f.name] = np.concatenate([o, last]).reshape(T + 1, *f.shape)
    ep["action"] = a["actions"][rows, env].reshape(T, *schema.by_name["action"].shape)
    ep["reward"] = a["rewards"][rows, env].astype(np.float32)
    timeout = bool(a["timeouts"][rows[-1], env] > 0) or not ended
    ep["terminated"] = np.zeros(T, bool)
    ep["truncated"] = np.zeros(T, bool)
    (ep["truncated"] if timeout else ep["terminated"])[-1] = True
    return ep
