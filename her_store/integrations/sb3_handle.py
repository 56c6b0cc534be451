"""The saved handle of a ZarrHerReplayBuffer: what its pickle holds, checks of it, and its unfinished episodes restored.

SB3's ``save_replay_buffer`` pickles the buffer; its pickle is a handle of a few KB: the store's URL, the buffer's
configuration, the unfinished episodes (one per env, with the store's ``end_episode`` at the save), counters and the
sampler's generator state, never the data. A loaded handle reopens the store at first use and stages its unfinished
episodes again, but for those the store holds already (:func:`restore_unfinished`).
"""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from her_store import _kernels
from her_store.errors import StoreError
from her_store.integrations.sb3_resources import TEMP_PREFIX
from her_store.store.episode_store import EpisodeStore
from her_store.store.step_writer import StepWriter

__all__ = ["HANDLE_VERSION", "check_handle", "check_picklable", "copy_to_temporary", "restore_unfinished"]

HANDLE_VERSION = 1
"""The version of the handle's layout; a handle of another version is refused."""

_LOCK_FILE = "writer.lock"  # the writer's lock (FORMAT.md): never copied with a store


def check_handle(state: Any) -> dict[str, Any]:
    """``state`` if it is a handle of :data:`HANDLE_VERSION`, else StoreError naming what it is.

    Examples
    --------
    >>> check_handle({"her_store_handle": 0})
    Traceback (most recent call last):
    ...
    her_store.errors.StoreError: not a ZarrHerReplayBuffer handle of version 1 (got 0)
    """
    if not isinstance(state, dict) or state.get("her_store_handle") != HANDLE_VERSION:
        raise StoreError(
            f"not a ZarrHerReplayBuffer handle of version {HANDLE_VERSION} (got "
            f"{state.get('her_store_handle') if isinstance(state, dict) else type(state).__name__})"
        )
    return state


def check_picklable(state: dict[str, Any], strategy: Any) -> None:
    """Refuse (pickle.PicklingError, saying why) a handle that cannot be pickled; ``strategy`` is the buffer's
    goal selection strategy, named in the message when it is the part that cannot be (a lambda, a local function)."""
    why = _unpicklable(state)
    if why is None:
        return
    if callable(strategy) and _unpicklable(strategy) is not None:
        raise pickle.PicklingError(
            f"cannot save a handle of this ZarrHerReplayBuffer: its goal_selection_strategy {strategy!r} "
            f"cannot be pickled ({why}); a handle keeps the strategy, so pass a function defined at module "
            "level (importable by name) instead of a lambda or a local function"
        )
    raise pickle.PicklingError(f"cannot save a handle of this ZarrHerReplayBuffer: {why}")


def copy_to_temporary(url: str) -> tuple[str, str]:
    """A copy of the local store at ``url`` (its writer's lock left out) in a fresh temporary directory: the
    directory and the copy's path. Nothing is copied when there is no store at ``url`` yet.

    Raises
    ------
    StoreError
        The store is on object storage (copy it with the storage's own tools and open a buffer on the copy).
    """
    src = url.removeprefix("file://")
    if "://" in src:
        raise StoreError(
            f"copy.deepcopy copies a buffer's store to a local temporary directory; {url} is on object "
            "storage: copy it with the storage's tools and open a buffer on the copy (path=...)"
        )
    tmpdir = tempfile.mkdtemp(prefix=TEMP_PREFIX)
    copy = os.path.join(tmpdir, "store")
    if os.path.isdir(src):
        shutil.copytree(src, copy, ignore=shutil.ignore_patterns(_LOCK_FILE))
    return tmpdir, copy


def restore_unfinished(
    store: EpisodeStore, writer: StepWriter, pending: Sequence[dict[str, np.ndarray]], end_episode: int
) -> None:
    """Stage in ``writer`` a loaded handle's unfinished episodes (one per env, saved when the store's
    ``end_episode`` was ``end_episode``) that the store does not hold; warn of those dropped.

    An env's unfinished episode is staged again when the store holds no episode of that env committed after the
    save. When the first such episode starts with its rows (observations, actions, rewards, infos), the run that
    saved the handle went on and ended it: it is in the store, and is not staged twice (and nothing is said). When
    episodes committed after the save have been evicted since, its continuation may be among them: it is not staged
    either. Otherwise its steps are nowhere but in the handle, and it is dropped with a warning (its env has
    episodes after the save that another writer made). A store holding fewer episode ids than at the save was
    replaced: every unfinished episode is dropped, with a warning.
    """
    if store.end_episode < end_episode:
        warnings.warn(
            f"{store.url} holds {store.end_episode} episode ids, fewer than the {end_episode} this buffer "
            "saw when it was saved (the store was replaced, or was in memory); the unfinished episodes the "
            "saved buffer held are dropped",
            stacklevel=4,
        )
        return
    staged, lost = _unfinished_to_stage(store, pending, end_episode)
    writer.restore_pending(staged)
    if lost:
        steps = sum(len(pending[e]["action"]) for e in lost)
        warnings.warn(
            f"{store.url} holds episodes of envs {lost} committed after this buffer was saved (episode "
            f"ids {end_episode}..{store.end_episode - 1}) that do not continue the unfinished episodes it "
            "held for them, as the run that saved it would have (another writer appended to the store "
            f"since?); those unfinished episodes ({steps} steps), which the store does not hold, are "
            "dropped",
            stacklevel=4,
        )


def _unfinished_to_stage(
    store: EpisodeStore, pending: Sequence[dict[str, np.ndarray]], end_episode: int
) -> tuple[list[dict[str, np.ndarray]], list[int]]:
    """What to stage again of the unfinished episodes ``pending`` (empty for an env whose episode is not staged),
    and the envs whose unfinished episode is dropped though nothing holds it (see :func:`restore_unfinished`)."""
    table = store.episodes
    ids, envs = table["episode_id"], table["env_index"]
    evicted = store.first_episode > end_episode
    staged, lost = [], []
    for e, episode in enumerate(pending):
        later = ids[(envs == e) & (ids >= end_episode)]
        if len(episode["action"]) == 0 or (not len(later) and not evicted):
            staged.append(episode)
            continue
        staged.append({k: v[:0] for k, v in episode.items()})
        if not evicted and not _starts_with(store.episode(int(later[0])), episode):
            lost.append(e)
    return staged, lost


def _starts_with(episode: Mapping[str, np.ndarray], start: Mapping[str, np.ndarray]) -> bool:
    """Whether ``episode`` begins with the rows of the unfinished episode ``start``, byte for byte (NaNs by their
    bits), its end flags aside: the last step of ``start`` may have ended the episode as truncated since."""
    if len(episode["action"]) < len(start["action"]):
        return False
    heads = {k: episode[k][: len(rows)] for k, rows in start.items() if k not in ("terminated", "truncated")}
    return all(
        h.shape == start[k].shape and h.dtype == start[k].dtype
        and _kernels.same_bytes(np.ascontiguousarray(h), np.ascontiguousarray(start[k]))
        for k, h in heads.items()
    )


def _unpicklable(obj: Any) -> str | None:
    """Why ``obj`` cannot be pickled (the pickling error's text), or None if it can."""
    try:
        pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return None
