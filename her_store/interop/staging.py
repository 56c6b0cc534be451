"""Staged outputs: an import's new store and an export's file, renamed to their destination once complete.

Each is written under a temporary name beside its destination and renamed to it only when the whole operation
succeeded; nothing is left at the destination otherwise (:func:`her_store.storage.files.staged_output`). Export
and import write local files only (:func:`local_path`): a store reaches object storage afterwards through
``her-store copy``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from her_store.errors import EpisodeValidationError
from her_store.format.card import check_card
from her_store.format.schema import Schema
from her_store.storage.files import staged_output
from her_store.store.episode_store import EpisodeStore

__all__ = ["append_from", "local_path", "staged_file", "staged_store"]


def local_path(path: str | os.PathLike[str], what: str) -> str:
    """``path`` as a string, which must name a local file (``what`` names it in the error).

    Raises
    ------
    ValueError
        ``path`` is a URL, or empty.

    Examples
    --------
    >>> local_path("s3://bucket/point.npz", "the destination")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: the destination 's3://bucket/point.npz' is a URL; export and import write local files ...
    """
    path = os.fspath(path)
    if not path:
        raise ValueError(f"{what} is an empty path; name a file to write")
    if "://" in path:
        raise ValueError(
            f"{what} {path!r} is a URL; export and import write local files (copy a store to object storage "
            "afterwards with her-store copy)"
        )
    return path


@contextlib.contextmanager
def staged_store(store_path: str | os.PathLike[str], schema: Schema, card: Mapping[str, Any]) -> Iterator[EpisodeStore]:
    """A new store, created under a temporary name beside ``store_path`` and renamed to it when the block succeeds.

    On any exception the temporary store is removed: nothing is left at ``store_path``. Episodes are committed in
    groups (not every append), and all of them at the end.

    Raises
    ------
    FileExistsError
        ``store_path`` exists (an import never writes into an existing store).

    Examples
    --------
    >>> with staged_store("imported", schema, {"env_id": "PointGoal-v0"}) as store:  # doctest: +SKIP
    ...     store.append_episode(episode)
    """
    card = check_card(card, "the dataset card")
    with staged_output(local_path(store_path, "the new store")) as tmp:
        store = EpisodeStore.create(
            tmp,
            schema.observation_space,
            schema.action_space,
            info_keys=schema.info_spaces,
            metadata=card,
            commit_interval=60.0,
        )
        try:
            yield store
        except BaseException:
            with contextlib.suppress(Exception):
                store.close()
            raise
        store.close()


def staged_file(dest: str | os.PathLike[str]) -> contextlib.AbstractContextManager[str]:
    """:func:`her_store.storage.files.staged_output` for an export's destination, refusing a URL."""
    return staged_output(local_path(dest, "the destination"))


def append_from(store: EpisodeStore, episode: Mapping[str, np.ndarray], where: str) -> int:
    """``store.append_episode(episode)``; a refusal names the episode's place in the file read (``where``)."""
    try:
        return store.append_episode(episode)
    except EpisodeValidationError as e:
        raise EpisodeValidationError(f"{where}: {e}") from None
