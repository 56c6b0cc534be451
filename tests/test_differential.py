"""Every sampled row against a plain model of the committed episodes, whatever the storage and whoever samples.

The matrix: {uncompressed local (memory-mapped), compressed local (decoded-chunk cache), S3 on loopback} x {a
sampler on the writer's own handle sampling between appends, a reader's sampler in another process while this
process appends} x {unbounded, a ring that wraps several times}. Episode ``e`` is a function of its id (each row
encodes (e, step)), so the model is a formula: batches are checked by (episode id, step) from
``batch.episode_ids`` / ``batch.steps``, in the reader process too, with nothing shared but the store.

Run as ``python -m tests.test_differential URL STORAGE_OPTIONS_JSON``, this module is that reader process: for
each line ``END`` on stdin (the writer has committed every episode below END) it samples two batches from a view
that holds END, checks them and answers ``ok <rows checked>`` or ``bad <what was wrong>``; ``quit`` ends it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import zarr.codecs
from gymnasium import spaces

from her_store import EpisodeStore, HerBatch, HerSampler
from her_store.reader import CachedArray, MappedArray
from tests.test_sampler import sparse_reward

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OBS = spaces.Dict(
    {
        "observation": spaces.Box(-np.inf, np.inf, (4,), np.float32),
        "achieved_goal": spaces.Box(-np.inf, np.inf, (3,), np.float32),
        "desired_goal": spaces.Box(-np.inf, np.inf, (3,), np.float32),
        "pixels": spaces.Box(0, 255, (3, 8, 8), np.uint8),  # a small image: Blosc-compressed by default
    }
)
ACT = spaces.Box(-1.0, 1.0, (2,), np.float32)
OBS_KEYS = tuple(OBS.spaces)
CHUNK_ROWS = 16  # many chunks, most of them filled by several commits
RING = 48  # transitions: a ring of 64 rows, wrapped four times or more by every ring case below
BATCH = 64
# what each storage passes to EpisodeStore.create, and the gather paths its sampler takes
STORAGES: dict[str, tuple[dict[str, Any], set[type]]] = {
    "mmap": ({"compressors": {"pixels": None}}, {MappedArray}),
    "compressed": ({"compressors": {"observation": zarr.codecs.ZstdCodec()}}, {MappedArray, CachedArray}),
    "s3": ({}, {CachedArray}),
}


# -- the model -----------------------------------------------------------------------------------------------
def length(e: np.ndarray | int) -> np.ndarray:
    """Transitions of episode ``e``: 3..13."""
    return 3 + (np.asarray(e, np.int64) * 7) % 11


def rows(e: np.ndarray, s: np.ndarray) -> dict[str, np.ndarray]:
    """Every field at rows ``s`` of episodes ``e`` (1-D arrays of one length), as the model says."""
    e, s = np.asarray(e, np.int64), np.asarray(s, np.int64)
    one = np.ones(len(e))

    def f32(*cols: np.ndarray) -> np.ndarray:
        return np.stack(cols, axis=-1).astype(np.float32)

    pixels = ((e[:, None] * 13 + s[:, None] * 29 + np.arange(192)) % 251).astype(np.uint8).reshape(-1, 3, 8, 8)
    pixels[:, 0, 0, 0], pixels[:, 0, 0, 1], pixels[:, 0, 0, 2] = e % 256, e // 256, s
    last = s == length(e) - 1
    return {
        "observation": f32(e, s, e + s / 16, one),
        "achieved_goal": f32(e, s, one),
        "desired_goal": f32(e, s, 2 * one),
        "pixels": pixels,
        "action": f32((e % 997) / 997, s / 64),
        "reward": (e * 100 + s).astype(np.float32),
        "terminated": last & (e % 2 == 0),
        "truncated": last & (e % 2 == 1),
    }


def episode(e: int) -> dict[str, np.ndarray]:
    """Episode ``e`` in the store's episode shape."""
    T = int(length(e))
    r = rows(np.full(T + 1, e), np.arange(T + 1))
    return {k: v if k in OBS_KEYS else v[:T] for k, v in r.items()}


def wrong_rows(b: HerBatch, first: int, end: int) -> str | None:
    """None when every row of ``b`` is what the model holds for its (episode, step), else how many were not.

    Relabelled rows: the desired goal is the achieved goal of a row ``j`` in ``t + 1 .. T`` of the same episode
    (future), the reward is the sparse reward of reaching it; the other rows hold the stored values.
    """
    e, t = b.episode_ids.numpy(), b.steps.numpy()
    rel = b.is_relabeled.numpy()
    if not ((e >= first) & (e < end) & (t >= 0) & (t < length(e))).all():
        return f"(episode, step) outside the committed episodes {first}..{end - 1}: {sorted(set(zip(e, t)))}"
    now, nxt = rows(e, t), rows(e, t + 1)
    goal = b.observations["desired_goal"].numpy()
    j = goal[:, 1].astype(np.int64)
    at_goal = rows(e, np.clip(j, 0, length(e)))["achieved_goal"]
    reached = -(j != t + 1).astype(np.float32)
    stored = {k: ~rel if k == "desired_goal" else None for k in OBS_KEYS}  # which rows hold the stored value
    checks = [(f"observations[{k!r}]", b.observations[k].numpy(), now[k], stored[k]) for k in OBS_KEYS]
    checks += [(f"next_observations[{k!r}]", b.next_observations[k].numpy(), nxt[k], stored[k]) for k in OBS_KEYS]
    checks += [
        ("actions", b.actions.numpy(), now["action"], None),
        ("rewards", b.rewards.numpy()[:, 0], np.where(rel, reached, now["reward"]), None),
        ("terminated", b.terminated.numpy()[:, 0], now["terminated"].astype(np.float32), None),
        ("truncated", b.truncated.numpy()[:, 0], now["truncated"].astype(np.float32), None),
        ("relabelled goal (an achieved goal of the same episode)", goal, at_goal, rel),
        ("relabelled goal step (future: t + 1 <= j <= T)", (j >= t + 1) & (j <= length(e)), True, rel),
        ("next desired goal of relabelled rows", b.next_observations["desired_goal"].numpy(), goal, rel),
    ]
    bad = []
    for name, got, want, only in checks:
        wrong = ~np.all((got == want).reshape(len(e), -1), axis=1)
        if only is not None:
            wrong &= only
        if wrong.any():
            bad.append(f"{name}: {int(wrong.sum())} of {len(e) if only is None else int(only.sum())} rows wrong")
    return "; ".join(bad) or None


# -- the reader process --------------------------------------------------------------------------------------
def reader_main(url: str, storage_options: dict[str, Any]) -> None:
    store = EpisodeStore.open(url, storage_options=storage_options or None)
    with store, HerSampler(store, 2 * BATCH, reward_fn=sparse_reward, seed=1, refresh_interval=0) as sampler:
        for line in sys.stdin:
            if line.strip() == "quit":
                return
            target = int(line)
            seen = sampler.refresh().end
            if seen < target:
                print(f"bad the reader sees episodes below {seen}, committed below {target}", flush=True)
                continue
            problems = [p for p in (wrong_rows(sampler.sample(), 0, store.end_episode) for _ in range(2)) if p]
            print(f"bad {problems[0]}" if problems else f"ok {4 * BATCH}", flush=True)


# -- the matrix ----------------------------------------------------------------------------------------------
@pytest.fixture(params=sorted(STORAGES))
def storage(request, tmp_path) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(storage name, url, storage options)."""
    if request.param == "s3":
        url, opts = request.getfixturevalue("s3_url")
        yield request.param, url, opts
    else:
        yield request.param, str(tmp_path / "store"), {}


def _create(name: str, url: str, opts: dict[str, Any], capacity: int | None) -> EpisodeStore:
    kwargs, _ = STORAGES[name]
    return EpisodeStore.create(
        url, OBS, ACT, capacity=capacity, chunk_rows=CHUNK_ROWS, commit_interval=0, storage_options=opts or None,
        **kwargs,
    )


def _episodes(name: str) -> int:
    """Episodes a case appends: 9 rows each on average, so a ring (64 rows) wraps four times or more."""
    return 64 if name != "s3" else 32


def _assert_wrapped(store: EpisodeStore, capacity: int | None) -> None:
    """A ring case wrapped its rows four times or more."""
    if capacity is not None:
        written = int((length(np.arange(store.end_episode)) + 1).sum())
        assert written >= 4 * store.commit_record.array_rows, (written, store.commit_record.array_rows)


@pytest.mark.parametrize("capacity", [None, RING], ids=["unbounded", "ring"])
def test_a_sampler_on_the_writers_handle_between_appends(storage, capacity):
    name, url, opts = storage
    with _create(name, url, opts, capacity) as store:
        with HerSampler(store, BATCH, reward_fn=sparse_reward, seed=0) as sampler:
            assert {type(a) for a in sampler.reader.arrays.values()} == STORAGES[name][1]
            for e in range(_episodes(name)):
                assert store.append_episode(episode(e)) == e
                problem = wrong_rows(sampler.sample(), store.first_episode, store.end_episode)
                assert problem is None, f"after episode {e}: {problem}"
        _assert_wrapped(store, capacity)


@pytest.mark.parametrize("capacity", [None, RING], ids=["unbounded", "ring"])
def test_a_readers_sampler_in_another_process_while_appending(storage, capacity):
    name, url, opts = storage
    per_round = 4  # about 32 transitions: the writer is one round ahead of the reader
    rounds = _episodes(name) // per_round - 1
    with _create(name, url, opts, capacity) as store:
        for e in range(per_round):
            store.append_episode(episode(e))
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.test_differential", url, json.dumps(opts)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        )
        try:
            assert proc.stdin is not None and proc.stdout is not None
            for r in range(1, rounds + 1):
                proc.stdin.write(f"{store.end_episode}\n")
                proc.stdin.flush()
                for e in range(r * per_round, (r + 1) * per_round):  # while the reader samples
                    store.append_episode(episode(e))
                answer = proc.stdout.readline()
                if not answer:
                    pytest.fail(f"the reader process died: {proc.communicate(timeout=60)[1]}")
                assert answer.startswith("ok"), f"round {r}: {answer}"
            _, err = proc.communicate("quit\n", timeout=60)
            assert proc.returncode == 0, err
            _assert_wrapped(store, capacity)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


if __name__ == "__main__":
    reader_main(sys.argv[1], json.loads(sys.argv[2]))
