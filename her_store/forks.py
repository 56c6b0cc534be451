"""What a forked child starts afresh: objects that threads of the parent were changing when it forked.

A child has only the thread that forked. A lock another thread held at that moment stays held in the child forever,
and what the lock guarded may be half changed, so an object whose state threads share registers here and, in each
child, drops that state and makes its locks anew (:func:`reset_in_child`).
"""

from __future__ import annotations

import os
import weakref
from typing import Protocol

__all__ = ["ForkAware", "reset_in_child"]


class ForkAware(Protocol):
    def after_fork(self) -> None:
        """In a child, right after the fork (the child's only thread, before anything else runs there)."""


_REGISTERED: weakref.WeakSet[ForkAware] = weakref.WeakSet()


def reset_in_child(obj: ForkAware) -> None:
    """Call ``obj.after_fork()`` in every child this process forks from now on, for as long as ``obj`` lives.

    Examples
    --------
    >>> import threading
    >>> class Counter:
    ...     def __init__(self):
    ...         self.lock, self.n = threading.Lock(), 0
    ...         reset_in_child(self)
    ...     def after_fork(self):
    ...         self.lock, self.n = threading.Lock(), 0
    >>> counter = Counter()
    """
    _REGISTERED.add(obj)


def _after_fork_in_child() -> None:
    for obj in list(_REGISTERED):
        obj.after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)
