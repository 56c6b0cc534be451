"""A writer process for the crash tests: appends seed-determined episodes until killed.

Usage: python tests/crash_writer.py PATH CAPACITY [KILL_ON KILL_AT]

Episode ``i`` is ``episode_for(i)`` (with a small image, a sharded array), so any reader can check every committed
episode bit for bit. After each ``flush()`` the writer prints ``committed <end>``: every id below ``end`` is
committed. With KILL_ON (``data``, ``index`` or ``commit``) and KILL_AT = N, the process SIGKILLs itself during the
N-th such write of the commit protocol, a kill point chosen rather than timed; ``shard`` dies half-way through
writing the N-th image shard's temp file, ``rename`` with that temp file whole but not yet renamed into place.
"""

from __future__ import annotations

import os
import signal
import sys

import numpy as np
from gymnasium import spaces

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from her_store import open_store
from her_store.storage import LocalBackend
from her_store.storage import local as local_backend
from her_store.store.chunk_io import RawChunkFile
from tests.conftest import fetch_spaces, make_episode, random_rows

OBS, ACT = fetch_spaces()
OBS = type(OBS)({**OBS.spaces, "pixels": spaces.Box(0, 255, (3, 8, 8), np.uint8)})  # shards of 64 rows


def episode_for(i: int) -> dict:
    T = int(np.random.default_rng(i).integers(1, 40))
    ep = make_episode(OBS, ACT, T, seed=i, info_keys=("is_success",))
    ep["pixels"] = random_rows(OBS["pixels"], T + 1, np.random.default_rng(i))
    return ep


def _kill_in_shard(kind: str, at: int) -> None:
    calls = {"n": 0}

    def due(path: str) -> bool:
        if "/steps/pixels/" not in path:
            return False
        calls["n"] += 1
        return calls["n"] == at

    if kind == "rename":
        replace = os.replace

        def p_replace(src, dst, *args, **kwargs):
            if due(str(dst)):
                os.kill(os.getpid(), signal.SIGKILL)
            return replace(src, dst, *args, **kwargs)

        os.replace = p_replace
    else:
        write_all = local_backend.write_all

        def p_write_all(fd, data, offset=None):
            if due(os.readlink(f"/proc/self/fd/{fd}")):
                write_all(fd, memoryview(data)[: len(data) // 2], offset)
                os.kill(os.getpid(), signal.SIGKILL)
            return write_all(fd, data, offset)

        local_backend.write_all = p_write_all  # what a local backend's atomic writes (frame files) write with


def _kill_on(kind: str, at: int) -> None:
    if kind in ("shard", "rename"):
        _kill_in_shard(kind, at)
        return
    calls = {"n": 0}

    def wrap(fn):
        def inner(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == at:
                if kind == "data":  # die half-way through writing the rows
                    row0, rows = args[1], args[2]
                    fn(args[0], row0, rows[: len(rows) // 2])
                os.kill(os.getpid(), signal.SIGKILL)
            return fn(*args, **kwargs)

        return inner

    if kind == "commit":  # the commit record's writes (a create writes its Zarr metadata through write_atomic too)
        orig_atomic = LocalBackend.write_atomic
        wrapped_atomic = wrap(orig_atomic)

        def commit_only(self, key, *args, **kwargs):
            return (wrapped_atomic if key == "commit.json" else orig_atomic)(self, key, *args, **kwargs)

        LocalBackend.write_atomic = commit_only
    elif kind == "data":
        RawChunkFile.write = wrap(RawChunkFile.write)
    elif kind == "index":
        orig = RawChunkFile.write

        def index_only(self, row0, rows):
            return (wrapped if self.path.startswith("episodes/") else orig)(self, row0, rows)

        wrapped = wrap(orig)
        RawChunkFile.write = index_only


def main() -> None:
    path, capacity = sys.argv[1], int(sys.argv[2])
    if len(sys.argv) > 3:
        _kill_on(sys.argv[3], int(sys.argv[4]))
    store = open_store(
        path, OBS, ACT, capacity=capacity or None, info_keys=["is_success"], chunk_rows=64, commit_interval=0.005
    )
    i = store.end_episode
    print("start", i, flush=True)
    while True:
        assert store.append_episode(episode_for(i)) == i
        i += 1
        if i % 7 == 0:
            store.flush()
            print("committed", i, flush=True)


if __name__ == "__main__":
    main()
