"""Every error her_store raises: one class per way a store can be misused or damaged."""

from __future__ import annotations

import reprlib
from typing import Any

__all__ = [
    "StoreError",
    "NotAStoreError",
    "StoreExistsError",
    "FormatVersionError",
    "CorruptStoreError",
    "SchemaMismatchError",
    "EpisodeValidationError",
    "ReadOnlyStoreError",
    "StoreLockedError",
    "StoreTimeoutError",
    "EpisodeNotFoundError",
    "short_repr",
]

_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 60


def short_repr(value: Any) -> str:
    """``repr`` cut short, for values read from a store in error messages: a crafted one may be huge.

    Examples
    --------
    >>> short_repr(list(range(100)))
    '[0, 1, 2, 3, 4, 5, ...]'
    """
    return _REPR.repr(value)


class StoreError(Exception):
    """Base class of all her_store errors."""


class NotAStoreError(StoreError, FileNotFoundError):
    """The path holds no her_store store (no group, or a group without her_store attributes)."""


class StoreExistsError(StoreError, FileExistsError):
    """``EpisodeStore.create`` was asked to create a store where one already exists."""


class FormatVersionError(StoreError):
    """The store was written by a newer her_store format than this library reads."""


class CorruptStoreError(StoreError):
    """A file of the store does not hold what the format says it must (commit record, index, checksums)."""


class SchemaMismatchError(StoreError):
    """The spaces given on open differ from the spaces the store was created with."""


class EpisodeValidationError(StoreError, ValueError):
    """An episode or step handed to the store has a missing/extra key, a wrong shape, dtype or length."""


class ReadOnlyStoreError(StoreError, PermissionError):
    """A write was attempted on a store opened with ``mode="r"``."""


class StoreLockedError(StoreError):
    """Another live writer holds the store's writer lock (local) or lease (object storage)."""


class StoreTimeoutError(StoreError, TimeoutError):
    """A server holding the store sent nothing for the idle timeout, or did not finish an answer within the request
    deadline (``storage_options["request_deadline"]`` over HTTP)."""


class EpisodeNotFoundError(StoreError, KeyError):
    """The episode id was never committed, or was evicted by the capacity ring."""

    def __str__(self) -> str:  # KeyError quotes its message; show it plainly
        return str(self.args[0]) if self.args else ""
