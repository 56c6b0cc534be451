"""Export by format name: the selected episodes of a store written to a local file by the format's module.

The format's module and function are :data:`~her_store.interop.formats.EXPORTS`'s.
"""

from __future__ import annotations

import os

from her_store.interop.formats import EXPORTS, format_function
from her_store.interop.staging import local_path
from her_store.ops.selection import parse_selection
from her_store.store.episode_store import EpisodeStore

__all__ = ["export_store"]


def export_store(
    source: str | os.PathLike[str],
    fmt: str,
    dest: str | os.PathLike[str],
    episodes: str | None = None,
    *,
    progress: bool = False,
) -> tuple[int, int]:
    """Export the episodes ``episodes`` names (a selection, :func:`her_store.ops.selection.parse_selection`; None: all)
    of the store at ``source`` to ``dest`` as ``fmt``. Returns ``(episodes, transitions)`` written (fewer than
    selected when a ring's writer evicted some while they were read:
    :func:`~her_store.interop.batches.read_batches`).

    Examples
    --------
    >>> export_store("runs/point", "npz", "point.npz", "-100:")  # doctest: +SKIP
    (100, 5000)
    """
    export = format_function(EXPORTS, fmt, "export")
    local_path(dest, "the destination")
    with EpisodeStore.open(source, mode="r") as store:
        ids = parse_selection(episodes, store.first_episode, store.end_episode)
        if not len(ids):
            raise ValueError(
                f"no episode to export: {store.url} holds episodes {store.first_episode}..{store.end_episode - 1}"
                + (f", the selection {episodes!r} names none of them" if episodes else "")
            )
        return tuple(export(store, ids, dest, progress=progress))
