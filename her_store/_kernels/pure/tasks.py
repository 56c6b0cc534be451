"""map_lz4 and encode_lz4 under way on threads of their own (:class:`Task`, started by :func:`map_lz4_start` and
:func:`encode_lz4_start`), as the compiled kernels' tasks: the caller's wait() does the rows not taken yet.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from her_store._kernels.pure.arguments import thread_count
from her_store._kernels.pure.lz4 import EncodeJob, MapJob

__all__ = ["Task", "encode_lz4_start", "map_lz4_start"]


def _run_then_leave(job: MapJob | EncodeJob, active: list[None]) -> None:
    try:
        job.run()
    finally:
        active.pop()


class Task:
    """map_lz4 or encode_lz4 under way on threads of their own (map_lz4_start, encode_lz4_start).

    wait() takes the rows the threads have not taken yet, joins them and returns what the call would have (every
    wait(); the first one raises what the call would have raised, the later ones a RuntimeError). The buffers are
    held until then, or until the task is dropped (its threads end first). In a forked child, which has none of the
    threads: if one was under way at the fork its rows may be lost, and the answer says so (a row failing with ESRCH,
    a RuntimeError); else wait() does the rows not taken yet.
    """

    def __init__(self, job: MapJob | EncodeJob, threads: int) -> None:
        self._job: Any = job
        self._pid = os.getpid()
        self._joining = threading.Lock()  # one wait() helps, joins and takes the result; the others wait for it
        self._active: list[None] = []  # one entry per run under way (list appends and pops hold the GIL: atomic)
        self._helped = False
        self._result: Any = None
        self._threads: list[threading.Thread] = []
        for _ in range(threads):  # threads that cannot be had leave their rows to the others and wait()
            self._active.append(None)
            thread = threading.Thread(target=_run_then_leave, args=(job, self._active), daemon=True)
            try:
                thread.start()
            except RuntimeError:
                self._active.pop()
                continue
            self._threads.append(thread)

    def _help(self) -> None:
        self._active.append(None)  # a run under way, as a thread's (a fork must tell)
        _run_then_leave(self._job, self._active)

    def _join(self, help: bool) -> Any:
        if self._pid != os.getpid():  # a forked child: none of the threads (nor a waiting one) is here
            self._threads = []
            if self._job is not None and self._active:
                self._job.lost()
            elif help and self._job is not None and not self._helped:
                self._help()
            self._helped = True
            self._active.clear()
            return self._take(help)
        with self._joining:
            if help and not self._helped:
                self._help()
            self._helped = True
            for thread in self._threads:
                thread.join()
            self._threads = []
            return self._take(help)

    def _take(self, help: bool) -> Any:
        job, self._job = self._job, None
        if job is not None:
            job.release()
            if help:
                self._result = job.result()  # raises what the call would have: this wait() raises it
        elif help and self._result is None:
            raise RuntimeError("the task failed, and its first wait() raised why")
        return self._result

    def wait(self) -> Any:
        """Do the rows its threads have not taken, wait for theirs, and return what the call would have."""
        return self._join(True)

    def done(self) -> bool:
        """Whether its threads are done (without waiting)."""
        return not self._active

    def __del__(self) -> None:
        if getattr(self, "_job", None) is not None:
            self._join(False)  # its threads use buffers it holds: never let them go before they end


def map_lz4_start(
    maps: tuple, slots: Any, offsets: Any, nbytes: Any, dst: Any, out: Any, row_nbytes: int, threads: int = 1, /
) -> Task:
    """map_lz4 on ``threads`` threads of its own, started before this returns."""
    count = thread_count(threads)
    return Task(MapJob(maps, slots, offsets, nbytes, dst, out, row_nbytes), count)


def encode_lz4_start(rows: Any, row_nbytes: int, acceleration: int, threads: int = 1, /) -> Task:
    """encode_lz4 on ``threads`` threads of its own, started before this returns; the rows must not change until
    the task is waited for."""
    count = thread_count(threads)
    return Task(EncodeJob(rows, row_nbytes, acceleration), count)
