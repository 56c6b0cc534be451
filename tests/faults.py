"""Fault injection for the write path: make the n-th write into a store fail the way a failing machine does.

Counted are the calls that put bytes of the store somewhere: ``os.write``/``os.pwrite``/``os.fsync`` on a file
under the store's directory, zarr's local ``_put`` (array metadata, compressed chunks) under it, and s3fs PUTs
(``_pipe_file``) under the store's URL; with ``renames``, also the ``os.replace`` that puts a written temp file in
place (a whole-object write). ``under`` narrows all of these to one part of the store, such as one sharded array's
shards. Modes:

- ``short``: that call writes half of its bytes and returns the short count (a whole-object write raises ENOSPC
  instead); every later write raises ENOSPC: a disk filling up.
- ``enospc``: that call and every later one raise ENOSPC.
- ``eio``: that call raises EIO, once: a transient device error.
- ``kill``: the process SIGKILLs itself at that call (run it in a subprocess).

Usage as a script (the kill runs): ``python tests/faults.py CONFIG PATH AT MODE FIRST [STORAGE_OPTIONS_JSON]``.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import sys
from collections.abc import Callable
from typing import Any, Self

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

from tests.conftest import fetch_spaces, make_episode, random_rows

MODES = ("short", "enospc", "eio", "kill")


class WriteFaults:
    """Count (``at=None``) or fail (``at=n``) the writes into one store (or the part ``under`` it) while the context
    is active."""

    def __init__(self, root: str, at: int | None = None, mode: str = "enospc", under: str = "", renames: bool = False) -> None:
        if mode not in MODES:
            raise ValueError(mode)
        self.root = root.rstrip("/")
        self.prefix = f"{self.root}/{under}"  # a counted write's path starts with this
        self.renames = renames
        self.at = at
        self.mode = mode
        self.calls = 0
        self.kinds: list[str] = []  # per counted call: "bytes" (write/pwrite, may be short) or "object" (whole)
        self.full = False  # the disk filled up: every later write fails
        self._saved: list[tuple[Any, str, Any]] = []

    # -- the decision ------------------------------------------------------------------------------------------
    def _fault(self, whole_object: bool) -> str | None:
        """None to let the call through, "short" to write half, or raises."""
        self.calls += 1
        self.kinds.append("object" if whole_object else "bytes")
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        if self.at is None or self.calls != self.at:
            return None
        if self.mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.mode == "eio":
            raise OSError(errno.EIO, "Input/output error (injected)")
        self.full = True
        if self.mode == "short" and not whole_object:
            return "short"
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    def _ours_fd(self, fd: int) -> bool:
        try:
            return os.readlink(f"/proc/self/fd/{fd}").startswith(self.prefix)
        except OSError:
            return False

    # -- the patched calls ----------------------------------------------------------------------------------------
    def __enter__(self) -> Self:
        import s3fs
        import zarr.storage._local as zlocal

        write, pwrite, fsync, replace = os.write, os.pwrite, os.fsync, os.replace
        put, pipe = zlocal._put, s3fs.S3FileSystem._pipe_file

        def p_write(fd: int, data: Any) -> int:
            if self._ours_fd(fd) and self._fault(False) == "short":
                return write(fd, memoryview(data).cast("B")[: max(1, len(memoryview(data).cast("B")) // 2)])
            return write(fd, data)

        def p_pwrite(fd: int, data: Any, offset: int) -> int:
            if self._ours_fd(fd) and self._fault(False) == "short":
                return pwrite(fd, memoryview(data).cast("B")[: max(1, len(memoryview(data).cast("B")) // 2)], offset)
            return pwrite(fd, data, offset)

        def p_fsync(fd: int) -> None:
            if self._ours_fd(fd):
                self._fault(True)
            return fsync(fd)

        def p_replace(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
            if self.renames and os.path.abspath(dst).startswith(self.prefix):
                self._fault(True)
            return replace(src, dst, *args, **kwargs)

        def p_put(path: Any, *args: Any, **kwargs: Any) -> Any:
            if str(path).startswith(self.prefix):
                self._fault(True)
            return put(path, *args, **kwargs)

        async def p_pipe(fs: Any, path: str, *args: Any, **kwargs: Any) -> Any:
            if path.startswith(self.prefix):
                self._fault(True)
            return await pipe(fs, path, *args, **kwargs)

        self._patch(os, "write", p_write)
        self._patch(os, "pwrite", p_pwrite)
        self._patch(os, "fsync", p_fsync)
        self._patch(os, "replace", p_replace)
        self._patch(zlocal, "_put", p_put)
        self._patch(s3fs.S3FileSystem, "_pipe_file", p_pipe)
        # a filesystem instance binds its sync methods (fs.pipe_file) to _pipe_file when it is made: new ones only
        s3fs.S3FileSystem.clear_instance_cache()
        return self

    def _patch(self, owner: Any, name: str, fn: Callable[..., Any]) -> None:
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, fn)

    def __exit__(self, *exc: object) -> None:
        import s3fs

        for owner, name, fn in reversed(self._saved):
            setattr(owner, name, fn)
        self._saved.clear()
        s3fs.S3FileSystem.clear_instance_cache()


# -- the workloads ------------------------------------------------------------------------------------------------
OBS, ACT = fetch_spaces()
IMAGE_OBS = type(OBS)({**OBS.spaces, "pixels": __import__("gymnasium").spaces.Box(0, 255, (3, 6, 6), np.uint8)})

CONFIGS: dict[str, dict[str, Any]] = {
    # uncompressed packs written with pwrite, unbounded, flush
    "raw": {"obs": OBS, "kwargs": {"chunk_rows": 64, "info_keys": ["is_success"]}},
    # a compressed field (whole chunks through zarr) in a ring that wraps
    "ring-compressed": {"obs": IMAGE_OBS, "kwargs": {"chunk_rows": 32, "capacity": 120, "info_keys": ["is_success"]}},
    # the same with every commit fsync'ed (files and directories)
    "ring-compressed-fsync": {
        "obs": IMAGE_OBS,
        "kwargs": {"chunk_rows": 32, "capacity": 120, "durability": "fsync", "info_keys": ["is_success"]},
    },
}


def episode_for(config: str, i: int) -> dict[str, np.ndarray]:
    """Episode ``i`` of a workload: a function of ``i`` alone, so any process can check a stored one."""
    T = int(np.random.default_rng(1000 + i).integers(3, 30))
    ep = make_episode(CONFIGS[config]["obs"], ACT, T, seed=i, info_keys=("is_success",))
    if "pixels" in ep:
        ep["pixels"] = random_rows(CONFIGS[config]["obs"]["pixels"], T + 1, np.random.default_rng(i))
    return ep


def store_options(config: str, storage_options: dict[str, Any] | None) -> dict[str, Any]:
    kw = dict(CONFIGS[config]["kwargs"], commit_interval=0)
    if storage_options:
        kw["storage_options"] = storage_options
    return kw


def workload(config: str, path: str, first: int, count: int, storage_options: dict[str, Any] | None = None) -> list[int]:
    """Open (or create) the store and append episodes ``first .. first + count - 1`` with a commit after every
    second one; returns the ids appended before anything raised (then re-raises)."""
    from her_store import open_store

    done: list[int] = []
    store = open_store(path, CONFIGS[config]["obs"], ACT, **store_options(config, storage_options))
    try:
        for i in range(first, first + count):
            done.append(store.append_episode(episode_for(config, i)))
            if i % 2:
                store.flush()
    finally:
        store.close()
    return done


if __name__ == "__main__":
    config, path, at, mode, first = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
    opts = json.loads(sys.argv[6]) if len(sys.argv) > 6 else None
    root = os.path.abspath(path) if "://" not in path else path.split("://", 1)[1]
    with WriteFaults(root, at, mode):
        workload(config, path, first, 4, opts)
    print("finished", flush=True)
