"""Batches made ahead: a background producer thread filling a bounded queue.

A forked child never waits on that queue (its producer is the parent's) but replaces it with one of its own.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from typing import Any, Literal

from her_store.errors import StoreError

__all__ = ["Prefetcher"]


class Prefetcher:
    """Items made ahead by ``produce()`` in a background thread, ``depth`` at most waiting.

    ``produce()`` returns ``(item, state)``; an exception it raises is handed to :meth:`take` as ``(exception,
    None)``, after which the producer stops. The producer starts at the first :meth:`take` and runs until
    :meth:`stop`. It belongs to the process that started it: in a forked child, :attr:`inherited` is True, and the
    child's :meth:`stop` drops it unjoined (the child has no such thread) with the queue and the stop event, whose
    locks it may have held at the fork; the child's next :meth:`take` starts a producer of its own.

    Parameters
    ----------
    depth : int
        Items prepared ahead (the queue's size), >= 1.
    produce : callable
        Makes one item: ``produce() -> (item, state)``; called in the producer thread only.
    name : str
        The thread's name.

    Attributes
    ----------
    queue : queue.Queue or None
        The items made ahead; None while no producer runs.
    thread : threading.Thread or None
        The producer.
    stopping : threading.Event
        Set by :meth:`stop`: a ``produce()`` that waits on something may wait on this too.

    Examples
    --------
    >>> counter = iter(range(100))
    >>> ahead = Prefetcher(2, lambda: (next(counter), "state"))
    >>> ahead.take()
    (0, 'state')
    >>> ahead.stop()
    'stopped'
    """

    def __init__(self, depth: int, produce: Callable[[], tuple[Any, Any]], name: str = "her_store-prefetch") -> None:
        self.depth = depth
        self.produce = produce
        self.name = name
        self.queue: queue.Queue | None = None
        self.thread: threading.Thread | None = None
        self.stopping = threading.Event()
        self._pid = -1  # the process the producer runs in

    @property
    def inherited(self) -> bool:
        """A producer of the process this one was forked from is recorded (none runs here)."""
        return self.thread is not None and self._pid != os.getpid()

    def _run(self) -> None:
        q, stopping = self.queue, self.stopping
        assert q is not None
        while not stopping.is_set():
            try:
                item: tuple[Any, Any] = self.produce()
            except BaseException as e:  # handed to the consumer, raised there
                item = (e, None)
            while not stopping.is_set():
                try:
                    q.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item[1] is None:
                return

    def take(self) -> tuple[Any, Any]:
        """The next ``(item, state)``, starting the producer if none runs; ``(exception, None)`` when ``produce()``
        raised (the producer has then stopped: call :meth:`stop` before taking again).

        Raises
        ------
        StoreError
            Another thread stopped the producer while this one waited for an item.
        """
        if self.thread is None:
            self.queue = queue.Queue(maxsize=self.depth)
            self.stopping.clear()
            self.thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self.thread.start()
            self._pid = os.getpid()
        q = self.queue
        assert q is not None
        while True:
            try:
                return q.get(timeout=0.1)
            except queue.Empty:
                if self.queue is not q:  # stopped meanwhile by another thread: no item will come
                    raise StoreError(
                        "the sampler's prefetching was stopped (close() or load_state_dict() in another thread) while "
                        "sample() waited for a batch"
                    ) from None

    def stop(self) -> Literal["idle", "stopped", "inherited"]:
        """Stop the producer: ``"idle"`` when none was recorded, ``"stopped"`` when this process's was stopped and
        joined, ``"inherited"`` when it was the parent's (see the class)."""
        if self.thread is None:
            return "idle"
        if self._pid == os.getpid():
            self.stopping.set()
            self.thread.join()
            how: Literal["stopped", "inherited"] = "stopped"
        else:
            self.stopping = threading.Event()
            how = "inherited"
        self.thread = None
        self.queue = None
        return how
