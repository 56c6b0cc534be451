"""The committed episodes a sampler draws from: a snapshot of the store's index, refreshed at an interval.

The snapshot is taken again at most every ``refresh_interval`` seconds.
"""

from __future__ import annotations

import time

import numpy as np

from her_store.store.episode_store import EpisodeStore
from her_store.store.index import IndexView
from her_store.store.rows import ChunkReader

__all__ = ["CommittedView", "default_refresh_interval"]


def default_refresh_interval(store: EpisodeStore) -> float:
    """Seconds between looks for new commits when none is given: 0 for a writing handle (its commits are in
    memory), else what suits the store's backend (0.1 s on local disk, where commit.json is re-read; 1 s on object
    storage, a GET each)."""
    return 0.0 if store.mode == "a" else store.backend.defaults.refresh_interval


class CommittedView:
    """A store's committed episodes as a sampler sees them, refreshed at an interval.

    Parameters
    ----------
    store : EpisodeStore
        A writer's handle (its own commits) or a reader's (which :meth:`refresh` re-reads).
    reader : ChunkReader
        The reader gathering the view's rows: it records each view's episodes before the view is used.
    interval : float, optional
        Seconds between refreshes by :meth:`current`; default :func:`default_refresh_interval`.

    Attributes
    ----------
    view : IndexView or None
        The latest view, None before the first refresh.
    interval : float
        May be changed any time (``math.inf``: only :meth:`refresh` refreshes).
    """

    def __init__(self, store: EpisodeStore, reader: ChunkReader, interval: float | None = None) -> None:
        self.store = store
        self.reader = reader
        self.interval = default_refresh_interval(store) if interval is None else float(interval)
        self.view: IndexView | None = None
        self._refreshed = -np.inf

    def refresh(self, *, reread: bool = True) -> IndexView:
        """Look for new commits now; returns the view. ``reread=False`` takes what the store's handle already holds
        (its owner, a sharded dataset's view, has just refreshed it)."""
        if self.store.mode == "r" and reread:
            self.store.refresh()
        view = self.store.snapshot()
        self.reader.observe(view)  # before the view is published: a gather under it must find its episodes recorded
        self.view = view
        self._refreshed = time.monotonic()
        return view

    def current(self) -> IndexView:
        """The view, refreshed first when ``interval`` seconds have passed since the last refresh."""
        if self.view is None or time.monotonic() - self._refreshed >= self.interval:
            return self.refresh()
        return self.view
