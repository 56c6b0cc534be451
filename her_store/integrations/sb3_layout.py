"""SB3's buffer layout: a store's episodes as the arrays stable-baselines3's HerReplayBuffer holds after the same adds.

SB3 keeps ``(buffer_size, n_envs, ...)`` ring arrays written one row per ``add`` (``pos``), plus per row the start
position and length of its episode (``ep_start``, ``ep_length``); a length is set when the episode ends and reset
to 0 when the ring starts overwriting the episode. :func:`sb3_arrays` rebuilds all of them from a store (each
env's episodes in id order, then its unfinished episode) for code that reads those attributes, and for checking
that a store holds what SB3's own buffer would.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

from her_store.checks import check_bool, check_int
from her_store.integrations import require
from her_store.store.episode_store import EpisodeStore

__all__ = ["SB3Arrays", "env_columns", "sb3_arrays"]


class SB3Arrays(NamedTuple):
    """The attributes of SB3's HerReplayBuffer, in its layout (``current_ep_start`` is its ``_current_ep_start``).

    ``observations`` and ``next_observations`` map each observation key to ``(buffer_size, n_envs, *shape)``;
    ``actions`` is ``(buffer_size, n_envs, action_dim)``; ``rewards``, ``dones``, ``timeouts``, ``ep_start``,
    ``ep_length`` are ``(buffer_size, n_envs)``; ``current_ep_start`` is ``(n_envs,)``. Dtypes are SB3's.
    """

    observations: dict[str, np.ndarray]
    next_observations: dict[str, np.ndarray]
    actions: np.ndarray
    rewards: np.ndarray
    dones: np.ndarray
    timeouts: np.ndarray
    pos: int
    full: bool
    ep_start: np.ndarray
    ep_length: np.ndarray
    current_ep_start: np.ndarray


def env_columns(store: EpisodeStore, n_envs: int) -> tuple[np.ndarray, np.ndarray]:
    """The env column of SB3's layout each stored episode belongs to, and the steps each column holds.

    An episode belongs to the column of its ``env_index`` when that is in ``range(n_envs)``. Episodes of no such
    env (``env_index`` -1: appended whole, no env recorded; or of a run with more envs) are dealt to the columns
    in turn, in id order: the k-th of them to column ``k % n_envs``.

    Parameters
    ----------
    store : EpisodeStore
    n_envs : int
        Environments stepped together.

    Returns
    -------
    columns : numpy.ndarray
        int64, one per row of ``store.episodes`` (episodes in id order).
    steps : numpy.ndarray
        int64 ``(n_envs,)``: the transitions of each column's episodes.

    Raises
    ------
    ValueError
        A non-positive ``n_envs``.

    Examples
    --------
    >>> from her_store.integrations.sb3_layout import env_columns
    >>> columns, steps = env_columns(store, 2)  # doctest: +SKIP
    >>> int(steps.max())  # the add() calls of SB3's buffer that holds these episodes  # doctest: +SKIP
    120
    """
    n_envs = check_int(n_envs, "n_envs", low=1)
    table = store.episodes
    columns = table["env_index"].astype(np.int64)
    other = (columns < 0) | (columns >= n_envs)
    columns[other] = np.arange(int(other.sum())) % n_envs
    return columns, np.bincount(columns, table["length"].astype(np.int64), minlength=n_envs).astype(np.int64)


def sb3_arrays(
    store: EpisodeStore,
    buffer_size: int,
    n_envs: int,
    pending: Sequence[Mapping[str, np.ndarray]],
    *,
    handle_timeout_termination: bool = True,
    steps: int | None = None,
) -> SB3Arrays:
    """The arrays SB3's HerReplayBuffer would hold had it been given the store's steps, env by env.

    Env ``e``'s column holds the store's episodes that :func:`env_columns` gives it (those whose ``env_index`` is
    ``e``, and its turn of the episodes of no env in ``range(n_envs)``), in id order, then ``pending[e]``; envs are
    stepped together, so every column ends at row ``pos - 1``. Of each column only the newest
    ``buffer_size`` steps remain, at the rows SB3 puts them (step ``n`` at row ``n % buffer_size``). As in SB3:
    ``dones`` is ``terminated or truncated``; ``timeouts`` is ``truncated and not terminated`` (SB3's
    ``TimeLimit.truncated``) when ``handle_timeout_termination``, else 0; ``ep_start`` is the row where the step's
    episode began; ``ep_length`` is the episode's length for finished episodes whose rows are all still in the
    ring, 0 for the unfinished ones and for those the ring has begun to overwrite (SB3's formula, also for an
    episode longer than the ring: ``length % buffer_size`` on its first rows).

    Parameters
    ----------
    store : EpisodeStore
        Its episodes, placed by :func:`env_columns`.
    buffer_size : int
        Rows per env: SB3's ``buffer_size`` attribute (its constructor argument divided by ``n_envs``).
    n_envs : int
        Environments stepped together.
    pending : sequence of mappings
        One per env: its unfinished episode as :meth:`StepWriter.pending` gives it (observation keys with
        ``T + 1`` rows, the other fields ``T`` rows; all empty when ``T`` is 0).
    handle_timeout_termination : bool
        As SB3's argument of that name.
    steps : int, optional
        Adds made since the store began (SB3's ``pos`` before wrapping). By default the longest column, which is
        exact unless the capacity ring evicted episodes of every env; rows of evicted episodes are zeros (SB3
        keeps the unsampleable rows of an episode it has begun to overwrite).

    Returns
    -------
    SB3Arrays
        Fresh arrays; changing them changes nothing in the store.

    Raises
    ------
    TypeError
        ``store`` is no EpisodeStore; ``buffer_size``, ``n_envs`` or ``steps`` not an int, or
        ``handle_timeout_termination`` not a bool (:class:`~her_store.checks.ArgumentTypeError`, a ValueError too).
    ValueError
        A non-positive ``buffer_size`` or ``n_envs``, ``pending`` not one per env or not shaped as an episode, or
        ``steps`` fewer than a column holds.

    Notes
    -----
    Every step in the newest ``buffer_size`` per env is read, one :meth:`EpisodeStore.episode` call per episode
    (crc-checked) and one vectorised placement per env: the cost is a full read of up to
    ``buffer_size * n_envs`` transitions, a few seconds per million FetchReach-sized transitions in 50-step
    episodes on local disk (5 s measured on a loaded 2-core machine; half of it the 20,000 ``episode`` reads) and
    the memory of SB3's own arrays. It is an inspection path; sampling never builds these arrays.

    Examples
    --------
    >>> from her_store.integrations.sb3_layout import sb3_arrays
    >>> w = store.writer(n_envs=2)  # doctest: +SKIP
    >>> w.add(obs, next_obs, action, reward, terminated, truncated)  # doctest: +SKIP
    >>> a = sb3_arrays(store, 1000, 2, [w.pending(e) for e in range(2)])  # doctest: +SKIP
    >>> a.pos, a.ep_length.shape  # doctest: +SKIP
    (1, (1000, 2))
    """
    if not isinstance(store, EpisodeStore):
        raise TypeError(
            f"store must be an EpisodeStore (her_store.open_store(path) opens one), got {type(store).__name__}"
        )
    preprocessing = require("stable_baselines3.common.preprocessing", "sb3")
    bs, n_envs = check_int(buffer_size, "buffer_size", low=1), check_int(n_envs, "n_envs", low=1)
    handle_timeout_termination = check_bool(handle_timeout_termination, "handle_timeout_termination")
    if isinstance(pending, Mapping) or len(pending) != n_envs:
        raise ValueError(f"pending must be a sequence of {n_envs} episodes (one per env), got {_describe(pending)}")
    obs_space, act_space = store.observation_space, store.action_space
    keys = list(obs_space.spaces)
    table = store.episodes
    env_index, stored = env_columns(store, n_envs)
    lengths = table["length"].astype(np.int64)
    action_dim = preprocessing.get_action_dim(act_space)
    pend_t = np.array([_pending_steps(p, e, keys, store, action_dim) for e, p in enumerate(pending)], np.int64)
    columns = stored + pend_t
    n = int(columns.max())
    if steps is not None:
        n = check_int(steps, "steps", low=n)  # at least the longest env column

    action_dtype = np.float32 if act_space.dtype == np.float64 else act_space.dtype  # SB3's _maybe_cast_dtype
    shapes = preprocessing.get_obs_shape(obs_space)
    out = SB3Arrays(
        observations={k: np.zeros((bs, n_envs, *shapes[k]), obs_space[k].dtype) for k in keys},
        next_observations={k: np.zeros((bs, n_envs, *shapes[k]), obs_space[k].dtype) for k in keys},
        actions=np.zeros((bs, n_envs, action_dim), action_dtype),
        rewards=np.zeros((bs, n_envs), np.float32),
        dones=np.zeros((bs, n_envs), np.float32),
        timeouts=np.zeros((bs, n_envs), np.float32),
        pos=n % bs,
        full=n >= bs,
        ep_start=np.zeros((bs, n_envs), np.int64),
        ep_length=np.zeros((bs, n_envs), np.int64),
        current_ep_start=(n - pend_t) % bs,
    )
    window = max(n - bs, 0)  # the first step still in the ring
    for e in range(n_envs):
        mine = env_index == e
        ids, lens = table["episode_id"][mine], lengths[mine]
        first = n - columns[e] + np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)  # each start step
        keep = first + lens > window  # episodes with a step in the ring
        parts = [store.episode(int(i)) for i in ids[keep]]
        starts, lens = first[keep], lens[keep]
        if pend_t[e]:
            parts.append(pending[e])
            starts, lens = np.append(starts, n - pend_t[e]), np.append(lens, pend_t[e])
        if not parts:
            continue
        finished = np.arange(len(parts)) < keep.sum()
        _place(out, e, parts, keys, starts, lens, finished, n, bs, action_dim, handle_timeout_termination)
    return out


def _place(
    out: SB3Arrays,
    e: int,
    parts: list[Mapping[str, np.ndarray]],
    keys: list[str],
    starts: np.ndarray,
    lens: np.ndarray,
    finished: np.ndarray,
    n: int,
    bs: int,
    action_dim: int,
    handle_timeout_termination: bool,
) -> None:
    """Write env ``e``'s steps (episodes ``parts`` starting at steps ``starts``) into the rows SB3 gives them."""
    step = np.repeat(starts, lens) + np.concatenate([np.arange(t) for t in lens])  # global step of each row
    tail = step >= max(n - bs, 0)
    rows = step[tail] % bs

    def put(dst: np.ndarray, chunks: list[np.ndarray]) -> None:
        dst[rows, e] = np.concatenate(chunks)[tail].reshape(len(rows), *dst.shape[2:])

    for k in keys:
        put(out.observations[k], [p[k][:-1] for p in parts])
        put(out.next_observations[k], [p[k][1:] for p in parts])
    put(out.actions, [np.reshape(p["action"], (len(p["action"]), action_dim)) for p in parts])
    put(out.rewards, [p["reward"] for p in parts])
    term = np.concatenate([p["terminated"] for p in parts]).astype(bool)
    trunc = np.concatenate([p["truncated"] for p in parts]).astype(bool)
    out.dones[rows, e] = (term | trunc)[tail]
    if handle_timeout_termination:
        out.timeouts[rows, e] = (trunc & ~term)[tail]
    out.ep_start[rows, e] = np.repeat(starts % bs, lens)[tail]
    # _compute_episode_length sets length % bs on the episode's first length % bs rows when it ends; the first add
    # that reaches the episode's start row again (step start + bs * ceil(length / bs)) zeroes them.
    set_len = lens % bs
    valid = finished & (starts + bs * -(-lens // bs) > n - 1)
    offset = step - np.repeat(starts, lens)
    value = np.repeat(np.where(valid, set_len, 0), lens)
    out.ep_length[rows, e] = np.where(offset % bs < np.repeat(set_len, lens), value, 0)[tail]


def _describe(v: object) -> str:
    return f"{type(v).__name__} of {len(v)}" if hasattr(v, "__len__") else type(v).__name__


def _pending_steps(p: object, e: int, keys: list[str], store: EpisodeStore, action_dim: int) -> int:
    """Steps in env ``e``'s unfinished episode, after checking it is shaped as StepWriter.pending gives it."""
    names = [*keys, "action", "reward", "terminated", "truncated"]
    if not isinstance(p, Mapping) or any(k not in p for k in names):
        missing = [k for k in names if not isinstance(p, Mapping) or k not in p]
        raise ValueError(
            f"pending[{e}] must be a mapping with the store's fields (as StepWriter.pending gives it); "
            f"missing {missing}"
        )
    t = len(np.asarray(p["action"]))
    if t and int(np.prod(np.shape(p["action"])[1:])) != action_dim:
        raise ValueError(
            f"pending[{e}]['action'] has shape {np.shape(p['action'])}, expected {t} actions of {action_dim} "
            f"value(s) each (the store's action space {store.action_space})"
        )
    for k in names:
        want = (t + 1 if t else 0) if k in keys else t
        shape = np.shape(p[k])
        row = store.observation_space[k].shape if k in keys else None
        if not shape or shape[0] != want or (row is not None and t and tuple(shape[1:]) != tuple(row)):
            raise ValueError(
                f"pending[{e}][{k!r}] has shape {shape}, expected {want} rows"
                + (f" of shape {tuple(row)}" if row is not None else "")
                + f" ({'T + 1' if k in keys else 'T'} with T={t} from 'action')"
            )
    return t
