"""A ZarrHerReplayBuffer's store, sampler and temporary directory, released by a finalizer; its store's opening.

The resources are held apart from the buffer so that a finalizer can release them when the buffer is garbage
collected: SB3's ``load_replay_buffer`` drops the old buffer before the new one opens the store, and
:func:`open_buffer_store` collects garbage first when a dropped buffer of this process may still hold the store's lock.
A buffer builds the backend of its store's place once; whether a store is there (:func:`holds_store`) and the store
itself (:func:`open_buffer_store`, one :func:`her_store.open_store`) are asked of that backend.
"""

from __future__ import annotations

import gc
import shutil
import weakref
from typing import Any

from gymnasium import spaces

from her_store.datasets.opening import open_store
from her_store.errors import NotAStoreError, StoreLockedError
from her_store.format.keys import COMMIT_KEY
from her_store.storage import Backend
from her_store.store.episode_store import EpisodeStore

__all__ = ["TEMP_PREFIX", "BufferResources", "holds_store", "open_buffer_store"]

TEMP_PREFIX = "her_store_sb3_"
"""The prefix of a buffer's temporary directory (``path=None``, and the copies ``copy.deepcopy`` makes)."""


class BufferResources:
    """A buffer's store, its sampler and (for ``path=None``) its temporary directory, released by :meth:`close`.

    Attributes
    ----------
    store : EpisodeStore or None
        The open store.
    sampler : HerSampler or None
        The sampler drawing the buffer's batches.
    tmpdir : str or None
        The temporary directory of a buffer made with ``path=None``.
    keep_tmpdir : bool
        A handle of the buffer was saved: the temporary directory stays for the handle to reopen.
    """

    def __init__(self) -> None:
        self.store: EpisodeStore | None = None
        self.sampler: Any = None
        self.tmpdir: str | None = None
        self.keep_tmpdir = False
        _RESOURCES.add(self)

    def close(self) -> None:
        """Close the sampler and the store (committing what is staged); remove the temporary directory unless kept."""
        if self.sampler is not None:
            self.sampler.close()
            self.sampler = None
        if self.store is not None:
            self.store.close()
            self.store = None
        if self.tmpdir is not None and not self.keep_tmpdir:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            self.tmpdir = None


_RESOURCES: weakref.WeakSet[BufferResources] = weakref.WeakSet()  # of every buffer of this process not yet released


def holds_store(backend: Backend) -> bool:
    """Whether a store is at ``backend``: its commit record, which every store has (FORMAT.md), is there."""
    return backend.exists(COMMIT_KEY)


def _held_here(url: str) -> bool:
    """Whether a buffer of this process, in use or dropped and not yet collected, holds the store at ``url``."""
    return any(r.store is not None and r.store.url == url for r in list(_RESOURCES))


def open_buffer_store(
    backend: Backend,
    observation_space: spaces.Dict,
    action_space: spaces.Space,
    must_exist: bool = False,
    **kwargs: Any,
) -> EpisodeStore:
    """The store at ``backend`` created or resumed by one :func:`~her_store.open_store`, garbage collected first
    when a buffer of this process holds it.

    A buffer releases its store when it is garbage collected, and SB3 keeps dropped buffers alive in a reference
    cycle (its callbacks hold the locals of ``learn``) until the cycle collector runs: ``del model`` then
    ``SAC.load(...)``, or ``load_replay_buffer`` into the same model, would find the store still locked. A store
    locked though no buffer of this process held it at this URL (another spelling of its place) is opened again
    once after a collection. A lock held by a buffer still in use, or by another process, is refused. With
    ``must_exist`` (a buffer loaded from a handle of a store that existed) a missing store is an error, never
    replaced by an empty one: a handle holds no data.

    Raises
    ------
    NotAStoreError
        ``must_exist``, and there is no store at ``backend``.
    StoreLockedError
        The store is still locked after the collection; the message says to close a buffer of this process.
    """
    if must_exist and not holds_store(backend):
        raise NotAStoreError(
            f"this buffer was loaded from a handle of the store {backend.url}, which holds no store any more (no "
            f"commit record {COMMIT_KEY}); a handle holds no data: restore the store there, or build a new buffer"
        )
    if _held_here(backend.url):
        gc.collect()
        return _opened_after_collection(backend, observation_space, action_space, **kwargs)
    try:
        return open_store(backend, observation_space, action_space, **kwargs)
    except StoreLockedError:
        if not any(r.store is not None for r in list(_RESOURCES)):
            raise
    gc.collect()
    return _opened_after_collection(backend, observation_space, action_space, **kwargs)


def _opened_after_collection(
    backend: Backend, observation_space: spaces.Dict, action_space: spaces.Space, **kwargs: Any
) -> EpisodeStore:
    """``open_store`` once garbage was collected; still locked, the message says to close a buffer of this process."""
    try:
        return open_store(backend, observation_space, action_space, **kwargs)
    except StoreLockedError as e:
        raise StoreLockedError(
            f"{e}; if that is a buffer of this process, close it first (model.replay_buffer.close())"
        ) from None
