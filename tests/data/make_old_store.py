"""Makes tests/data/v<N>_store: a store of format version N, a ring that has wrapped, with the content
:func:`episode` gives. Each was made once by the code of its version (on PYTHONPATH) and committed; tests/store/
test_store.py checks that today's code reads it and appends to it in its own layout.

- ``v1_store``: compressed images in Blosc chunks of several rows, unsharded (git commit 26ff8c2).
- ``v2_store``: compressed images sharded, one row per inner chunk, shard keys ``c/<i>/0/0/0`` (git commit 5276be0).
- ``v3_store``: compressed images sharded, shard keys ``c.<i>.0.0.0`` (git commit 1c644e3, the code before the layer
  packages), with ``v3_store_expected.npz``: what that code read back from the store (:func:`record`: every live
  episode, and the batches of the :func:`samplers`). tests/store/test_v3_store.py checks that today's code reads and
  samples exactly that.

    PYTHONPATH=<a checkout of that commit> python tests/data/make_old_store.py tests/data/v3_store
"""

from __future__ import annotations

import io
import os
import sys
import zipfile
from typing import Any

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
BATCH_SIZE = 32
BATCHES = 2  # recorded per sampler: the second starts from the generator state the first left


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


def reward(achieved: np.ndarray, desired: np.ndarray, infos: Any) -> np.ndarray:
    """The recorded samplers' ``reward_fn``: -1 until the achieved goal is within 0.05 of the desired one, else 0."""
    return -(np.linalg.norm(np.asarray(achieved) - np.asarray(desired), axis=-1) > 0.05).astype(np.float32)


def samplers() -> dict[str, dict[str, Any]]:
    """The recorded samplers' options besides the store, the batch size and ``reward_fn``, by name: every goal
    strategy, with a seed of its own."""
    from her_store import GoalMixture

    return {
        "future": {"goal_selection_strategy": "future", "n_sampled_goal": 4, "seed": 1},
        "final": {"goal_selection_strategy": "final", "n_sampled_goal": 2, "seed": 2, "copy_info_dict": True},
        "episode": {"goal_selection_strategy": "episode", "n_sampled_goal": 4, "seed": 3, "relabel_terminated": True},
        "random": {"goal_selection_strategy": "random", "n_sampled_goal": 1, "seed": 4},
        "mixture": {"goal_selection_strategy": GoalMixture(0.2, 0.5, 0.3, discount=0.9), "seed": 5},
    }


def record(store: Any) -> dict[str, np.ndarray]:
    """What ``store`` reads back, by name: ``episode/<id>/<field>`` for every live episode, and
    ``batch/<sampler>/<b>/<field>[/<key>]`` for the first :data:`BATCHES` batches of each of the :func:`samplers`
    (a batch's every tensor as an array; ``source``, None from a HerSampler, has no entry)."""
    from her_store import HerSampler

    out = {}
    for i in range(store.first_episode, store.end_episode):
        out.update({f"episode/{i}/{k}": np.asarray(v) for k, v in store.episode(i).items()})
    for name, options in samplers().items():
        with HerSampler(store, BATCH_SIZE, reward_fn=reward, **options) as sampler:
            for b in range(BATCHES):
                for field, value in sampler.sample()._asdict().items():
                    if isinstance(value, dict):
                        out.update({f"batch/{name}/{b}/{field}/{k}": t.numpy() for k, t in value.items()})
                    elif value is not None:
                        out[f"batch/{name}/{b}/{field}"] = value.numpy()
    return out


def save_npz(path: str, arrays: dict[str, np.ndarray]) -> None:
    """``np.savez_compressed`` with fixed member times: the same arrays give the same bytes."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for key in sorted(arrays):
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.ascontiguousarray(arrays[key]), allow_pickle=False)
            z.writestr(zipfile.ZipInfo(f"{key}.npy", (1980, 1, 1, 0, 0, 0)), buf.getvalue(), zipfile.ZIP_DEFLATED)


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
    lock = os.path.join(sys.argv[1], "writer.lock")
    if os.path.exists(lock):  # a closed store's lock file, kept by a local writer: it names this host and process
        os.remove(lock)
    if version >= 3:  # read back through a reader's handle, as a reader of the committed store does
        with her_store.EpisodeStore.open(sys.argv[1]) as store:
            save_npz(sys.argv[1].rstrip("/") + "_expected.npz", record(store))
