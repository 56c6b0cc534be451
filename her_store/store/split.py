"""Work shared between the calling thread and a pool's threads, the pool's share moved by who finishes first.

Encoding an episode's frames (the writer) and decoding a batch's frames (the sampler) are CPU work done in C without
the GIL: the calling thread hands the pool's threads a share of the rows and takes the rest itself. An even split
leaves the calling thread waiting (a pool thread starts some tens of microseconds late), or the threads idle (the
calling thread has other work in between). :class:`Balance` keeps the pool's share where both finish together: up a
step each time the threads were done when their results were asked for, down a step each time the caller waited.

Examples
--------
>>> b = Balance()
>>> b.edges(100, threads=1, min_rows=8)  # rows 0..50 to the pool's thread, 50..100 to the calling thread
[0, 50, 100]
>>> b.observe(threads_first=True)
>>> b.edges(100, threads=1, min_rows=8)
[0, 52, 100]
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

__all__ = ["CORES", "SPLIT_BYTES", "Balance", "done", "start_split"]

MIN_SHARE, MAX_SHARE, STEP = 0.1, 0.95, 0.02  # bounds of the pool's share of the rows, and its step
CORES = os.cpu_count() or 1  # (os.cpu_count() costs tens of microseconds a call)
# decoded bytes per C thread of an LZ4 encode or mapped gather, at least (a start costs tens of us)
SPLIT_BYTES = 256 << 10


class Balance:
    """The pool's share of work split between the calling thread and a pool's threads (an even split to start with).

    Examples
    --------
    >>> Balance().edges(10, threads=3, min_rows=3)  # too few rows for three threads: two threads and the caller
    [0, 3, 7, 10]
    """

    def __init__(self) -> None:
        self.share: float | None = None

    def edges(self, n: int, threads: int, min_rows: int) -> list[int]:
        """Where ``n`` rows are cut: pieces ``edges[i]..edges[i + 1]`` of at least ``min_rows`` rows for up to
        ``threads`` pool threads, then the last piece for the calling thread; that piece alone (``[0, n]``) when
        there are fewer than ``2 * min_rows`` rows."""
        min_rows = max(1, min_rows)
        if threads <= 0 or n < 2 * min_rows:
            return [0, n]
        if self.share is None:
            self.share = threads / (threads + 1)
        # at least one thread's minimum: a share that shrank below it must still be split, or it could not grow back
        pooled = max(int(n * self.share), min_rows)
        parts = min(threads, pooled // min_rows)
        return [pooled * i // parts for i in range(parts + 1)] + [n]

    def observe(self, threads_first: bool) -> None:
        """Move the pool's share a step: up when its threads had finished when their results were asked for, down
        when the calling thread waited for them."""
        if self.share is not None:
            self.share = min(MAX_SHARE, max(MIN_SHARE, self.share + (STEP if threads_first else -STEP)))


def done() -> None:
    """A gather's finish when there is nothing left to do."""


def start_split(
    work: Callable[[int, int], None],
    n: int,
    pool: ThreadPoolExecutor | None,
    parts: int,
    balance: Balance | None = None,
) -> Callable[[], None]:
    """``work(a, b)`` over ``parts`` consecutive pieces of ``range(n)``, started: the pool's pieces are submitted
    (each begins once its thread has the GIL), and the returned function runs the calling thread's piece (the
    last, rather than wait idle), then waits for the pool's; it raises the first exception raised, after every
    piece ran. With ``balance``, the pool's share follows who finished first (decoding, where the calling thread
    has less of the batch to do than its threads once they start late); else the pieces are even."""
    if pool is None or parts <= 1:
        return lambda: work(0, n)
    if balance is not None:
        edges = balance.edges(n, parts - 1, n // parts // 2)
    else:
        edges = np.linspace(0, n, parts + 1).astype(np.int64).tolist()
    futures = [pool.submit(work, a, b) for a, b in itertools.pairwise(edges[:-1])]

    def finish() -> None:
        try:
            work(edges[-2], edges[-1])
        finally:
            if balance is not None and futures:
                balance.observe(all(f.done() for f in futures))
            for f in futures:
                f.result()

    return finish
