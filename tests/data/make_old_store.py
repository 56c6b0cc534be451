"""Makes tests/data/v<N>_store: a store of an earlier format version N, a ring that has wrapped, with the content
:func:`episode` gives. Each was made once by the code of its version (on PYTHONPATH) and committed; tests/test_store.py
checks that today's code reads it and appends to it in its own layout.

- ``v1_store``: compressed images in Blosc chunks of several rows, unsharded (git commit 26ff8c2).
- ``v2_store``: compressed images sharded, one row per inner chunk, shard keys ``c/<i>/0/0/0`` (git commit 5276be0).

    PYTHONPATH=<a checkout of that commit> python tests/data/make_old_store.py tests/data/v2_store
"""

from __future__ import annotations

import sys

import numpy as np
from gymnasium import spaces

GOAL = spaces.Box(-10, 10, (3,), np.float32)
OBS = spaces.Dict(
    {
        "observation": spaces.Box(-np.inf, np.inf, (5,), np.float32),
        "achieved_goal": GOAL,
        "desired_goal": GOAL,
        "pixels": spaces.Box(0, 255, (3, 8, 8), np.uint8),
    }
)
ACT = spaces.Box(-1, 1, (2,), np.float32)
CAPACITY = 30
CHUNK_ROWS = 16
LENGTHS = [4, 7, 5, 6, 3, 8, 5, 6, 4]  # 48 transitions: the ring of 30 wraps and evicts the first episodes


def episode(i: int, T: int) -> dict[str, np.ndarray]:
    """Episode ``i`` of length ``T``: every value a formula of (episode, step), so any row can be checked."""
    k = np.arange(T + 1)
    pixels = (i * 37 + k[:, None] * 11 + np.arange(192)) % 256
    success = np.zeros(T, np.float32)
    success[-1] = float(i % 2 == 0)
    return {
        "observation": (i * 100 + k[:, None] + np.arange(5) / 10).astype(np.float32),
        "achieved_goal": np.stack([np.full(T + 1, i, float), k / 10, -k / 10], 1).astype(np.float32),
        "desired_goal": np.tile(np.array([i, T / 10, 0], np.float32), (T + 1, 1)),
        "pixels": pixels.reshape(T + 1, 3, 8, 8).astype(np.uint8),
        "action": np.stack([np.full(T, i / 10), np.arange(T) / 100], 1).astype(np.float32),
        "reward": -np.ones(T, np.float32),
        "terminated": np.zeros(T, bool),
        "truncated": np.arange(T) == T - 1,
        "is_success": success,
    }


if __name__ == "__main__":
    import her_store

    version = int(sys.argv[1].rstrip("/").rsplit("/v", 1)[1].split("_")[0])
    assert her_store.FORMAT_VERSION == version, f"run with the version {version} code on PYTHONPATH"
    with her_store.EpisodeStore.create(
        sys.argv[1], OBS, ACT, capacity=CAPACITY, chunk_rows=CHUNK_ROWS, info_keys=["is_success"], commit_interval=0
    ) as store:
        for i, T in enumerate(LENGTHS):
            store.append_episode(episode(i, T))
        print(store, store.episodes["start_row"].tolist())
