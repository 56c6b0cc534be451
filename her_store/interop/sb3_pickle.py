"""Import of stable-baselines3 replay buffers saved with ``model.save_replay_buffer`` (a pickle): SB3 -> store.

UNPICKLING RUNS CODE FROM THE FILE. This import is the only place her_store unpickles anything; it happens only
when a user asks for it (``her-store import BUFFER.pkl STORE``), and only pickles you trust should be imported.

A ``DictReplayBuffer`` or ``HerReplayBuffer`` (Dict observations with the goal keys) keeps ``(buffer_size, n_envs)``
ring arrays. Each env column is read in the order it was written (from ``pos`` on once the ring is ``full``) and cut
into episodes:

- ``HerReplayBuffer``: the episodes ``ep_start``/``ep_length`` describe (those the ring overwrote have length 0);
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
from her_store.interop import staged_store
from her_store.progress import progress as progress_bar
from her_store.schema import Schema

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
    with open(source, "rb") as f:
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
            length, start = a["ep_length"][:, env], a["ep_start"][:, env]
            spans = [(int(s), int(length[s])) for s in np.unique(start[length > 0])]
            current = int(a["current"][env])
            tail = (current, (pos - current) % size)
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
            if her and ended and (n == 0 or (start[rows] != s).any() or (length[rows] != n).any()):
                raise ValueError(f"ep_start/ep_length of env {env} disagree about the episode at row {s}")
            out.append((int(age[rows[-1]]), env, rows, ended))
    out.sort(key=lambda e: (e[0], e[1]))
    return out


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
