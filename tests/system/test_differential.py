"""Every sampled row against a plain model of the committed episodes, whatever the storage and whoever samples.

The matrix: {uncompressed local (memory-mapped), sharded LZ4 images (the default: decoded in C, in batches split
across two threads; read with pread, then where the shards are mapped once gathers find them in the page cache),
sharded Zstd images and observations (decoded row by row in Python, in the calling thread), S3
on loopback (the default codec)} x {a sampler on the writer's own handle sampling between appends, a reader's
sampler in another process while this process appends} x {unbounded, a ring that wraps}. Images of 3x8x8 in shards
of 16 rows: most shards are filled by several commits, and a ring rewrites them as it wraps. Episode ``e`` is a
function of its id (each row encodes (e, step)), so the model is a formula: batches are checked by (episode id,
step) from ``batch.episode_ids`` / ``batch.steps``, in the reader process too, with nothing shared but the store.
Two read-only paths follow the uncompressed and LZ4 layouts: a store served over HTTP (tests/http_server.py) while
this process appends to its directory, read in this process between appends and by the reader process meanwhile
(uncompressed rows by ranged GETs, shards by GETs conditioned on their ETag), and a store packed into one zip
(``her-store pack``: uncompressed members memory-mapped inside the archive, shards read by byte range).

Run as ``python -m tests.system.test_differential``, this module is that reader process, one for the whole module (its
start, importing torch, costs more than most cases): ``open {"url": ..., "opts": ..., "io_threads": ...}`` opens a
store and a sampler and answers ``opened <gather paths>``; each line ``END`` (the writer has committed every episode
below END) samples two batches from a view that holds END, checks them and answers ``ok <rows checked>`` or ``bad
<what was wrong>``; ``close`` closes the store (answer ``closed``); end of input ends the process.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from gymnasium import spaces

from her_store import EpisodeStore, HerBatch, HerSampler, _kernels
from her_store.cli.main import main
from her_store.store import frame_rows as reader
from her_store.store import frame_writer as shard
from her_store.store.frame_rows import FrameArray
from tests.conftest import ROOT
from tests.http_server import serving
from tests.sampling.test_sampler import sparse_reward

OBS = spaces.Dict(
    {
        "observation": spaces.Box(-np.inf, np.inf, (4,), np.float32),
        "achieved_goal": spaces.Box(-np.inf, np.inf, (3,), np.float32),
        "desired_goal": spaces.Box(-np.inf, np.inf, (3,), np.float32),
        "pixels": spaces.Box(0, 255, (3, 8, 8), np.uint8),  # a small image: a sharded LZ4 array by default
    }
)
ACT = spaces.Box(-1.0, 1.0, (2,), np.float32)
OBS_KEYS = tuple(OBS.spaces)
CHUNK_ROWS = 16  # rows per chunk and per shard: many of each, most of them filled by several commits
RING = 48  # transitions: a ring of 64 rows, wrapped twice or more by every ring case below
BATCH = 64


@dataclass(frozen=True)
class Storage:
    """One storage of the matrix."""

    create: dict[str, Any]  # what EpisodeStore.create is given
    paths: set[str]  # the gather paths of its sampler: an array class, and the codec of a sharded one
    episodes: int  # appended by each case: 9 rows each on average
    io_threads: int | None = None  # of the samplers


STORAGES = {
    "mmap": Storage({"compressors": {"pixels": None}}, {"MappedArray"}, 48),
    "lz4": Storage({}, {"MappedArray", "FrameArray lz4"}, 48, io_threads=2),
    "zstd": Storage({"compressors": {"pixels": "zstd", "observation": "zstd"}}, {"MappedArray", "FrameArray"}, 48, 0),
    "s3": Storage({}, {"RangedArray", "FrameArray lz4"}, 16),
}
# the layouts also read over HTTP and from a packed store: {name in STORAGES: (gather paths over HTTP, from a zip)}
SERVED = {
    "mmap": ({"RangedArray"}, {"MappedArray"}),
    "lz4": ({"RangedArray", "FrameArray lz4"}, {"MappedArray", "FrameArray lz4"}),
}
HTTP_EPISODES = 16  # appended by each HTTP case (each refresh over HTTP costs tens of ms): 145 rows, a ring wraps twice


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


def gather_paths(sampler: HerSampler) -> set[str]:
    """How the sampler's reader gathers each array: its class, and "lz4" for a sharded array decoded in C."""
    arrays = sampler.reader.arrays.values()
    return {type(a).__name__ + (" lz4" if isinstance(a, FrameArray) and a.codec.is_lz4 else "") for a in arrays}


def mapped_gathers(sampler: HerSampler) -> int:
    """Gathers of the sampler's reader decoded from mapped shards (local LZ4 frames found in the page cache)."""
    return sum(a.mapped_gathers for a in sampler.reader.arrays.values() if isinstance(a, FrameArray))


def check_mapped(name: str, local: bool, mapped: int) -> None:
    """A local LZ4 case decoded most of its batches from mapped shards (after WARM_GATHERS read with pread); the
    others never map."""
    if name == "lz4" and local:
        assert mapped > 0, "no batch was decoded from the mapped shards"
    else:
        assert mapped == 0


@pytest.fixture(autouse=True)
def _split_small_batches(monkeypatch):
    """Mapped gathers of these small frames split across C threads as a batch of real frames does, and the writer
    encodes an episode's frames on C threads as it does real ones."""
    monkeypatch.setattr(reader, "SPLIT_BYTES", 1)
    monkeypatch.setattr(shard, "SPLIT_BYTES", 1)


@pytest.fixture
def encode_tasks(monkeypatch) -> list[Any]:
    """The C encoding tasks the writer starts (LZ4 frames on threads of their own)."""
    real, tasks = _kernels.encode_lz4_start, []

    def start(*args: Any) -> Any:
        tasks.append(real(*args))
        return tasks[-1]

    monkeypatch.setattr(_kernels, "encode_lz4_start", start)
    return tasks


# -- the reader process --------------------------------------------------------------------------------------
def reader_main() -> None:
    reader.SPLIT_BYTES = 1  # as _split_small_batches
    store: EpisodeStore | None = None
    sampler: HerSampler | None = None
    for line in sys.stdin:
        command, _, arg = line.strip().partition(" ")
        if command == "open":
            case = json.loads(arg)
            store = EpisodeStore.open(case["url"], storage_options=case["opts"] or None)
            sampler = HerSampler(
                store, 2 * BATCH, reward_fn=sparse_reward, seed=1, refresh_interval=0, io_threads=case["io_threads"]
            )
            paths = {"paths": sorted(gather_paths(sampler)), "decode_threads": sampler.reader.decode_threads}
            print(f"opened {json.dumps(paths)}", flush=True)
        elif command == "close":
            assert store is not None and sampler is not None
            mapped = mapped_gathers(sampler)
            sampler.close()
            store.close()
            print(f"closed {mapped}", flush=True)
        else:
            assert store is not None and sampler is not None
            target = int(command)
            view = sampler.refresh()
            if view.end < target:
                print(f"bad the reader sees episodes below {view.end}, committed below {target}", flush=True)
                continue
            # episodes below the view's first were evicted before it was taken: a batch never holds them
            problems = [p for p in (wrong_rows(sampler.sample(), view.first, store.end_episode) for _ in range(2)) if p]
            print(f"bad {problems[0]}" if problems else f"ok {4 * BATCH}", flush=True)


class ReaderProcess:
    """This module run as the reader process, started again when a case left it dead or mid-answer."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None

    def send(self, line: str) -> None:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.system.test_differential"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
            )
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def answer(self) -> str:
        assert self.proc is not None and self.proc.stdout is not None
        answer = self.proc.stdout.readline()
        if not answer:
            pytest.fail(f"the reader process died: {self.stop()}")
        return answer.strip()

    def ask(self, line: str) -> str:
        self.send(line)
        return self.answer()

    def stop(self) -> str:
        """End the process; its stderr."""
        if self.proc is None:
            return ""
        proc, self.proc = self.proc, None
        if proc.poll() is None:
            proc.kill()
        return proc.communicate()[1]


@pytest.fixture(scope="module")
def reader_process() -> Iterator[ReaderProcess]:
    reader = ReaderProcess()
    yield reader
    reader.stop()


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
    return EpisodeStore.create(
        url, OBS, ACT, capacity=capacity, chunk_rows=CHUNK_ROWS, commit_interval=0, storage_options=opts or None,
        **STORAGES[name].create,
    )


def _check_layout(store: EpisodeStore, name: str) -> None:
    """Images are in shards of CHUNK_ROWS rows, one row per inner chunk (mmap: one uncompressed array of rows)."""
    specs = {a.path: a for a in store.layout.arrays}
    if name == "mmap":
        assert "steps/pixels" not in specs and not any(a.compressed for a in specs.values())
        return
    array = store._root["steps/pixels"]
    assert specs["steps/pixels"].sharded and array.shards == (CHUNK_ROWS, 3, 8, 8) and array.chunks == (1, 3, 8, 8)


def _assert_wrapped(store: EpisodeStore, capacity: int | None) -> None:
    """A ring case wrapped its rows twice or more."""
    if capacity is not None:
        written = int((length(np.arange(store.end_episode)) + 1).sum())
        assert written >= 2 * store.commit_record.array_rows, (written, store.commit_record.array_rows)


@pytest.mark.slow
@pytest.mark.parametrize("prioritize", [None, "energy", "td"])
@pytest.mark.parametrize("capacity", [None, RING], ids=["unbounded", "ring"])
def test_a_sampler_on_the_writers_handle_between_appends(storage, capacity, prioritize, encode_tasks):
    name, url, opts = storage
    case = STORAGES[name]
    with _create(name, url, opts, capacity) as store:
        _check_layout(store, name)
        with HerSampler(
            store, BATCH, reward_fn=sparse_reward, seed=0, io_threads=case.io_threads, prioritize=prioritize
        ) as sampler:
            assert gather_paths(sampler) == case.paths
            if case.io_threads is not None:
                assert sampler.reader.decode_threads == case.io_threads
            for e in range(case.episodes):
                assert store.append_episode(episode(e)) == e
                batch = sampler.sample()
                problem = wrong_rows(batch, store.first_episode, store.end_episode)
                assert problem is None, f"after episode {e}: {problem}"
                if prioritize == "td":  # priorities that differ, so that later batches are drawn by them
                    sampler.update_priorities(batch.indices, batch.steps.double() + 0.5)
            check_mapped(name, name != "s3", mapped_gathers(sampler))
            lz4 = "FrameArray lz4" in case.paths
            assert bool(encode_tasks) == (lz4 and store._committer._sharded["steps/pixels"]._threads > 0)
        _assert_wrapped(store, capacity)


def _follow(
    reader: ReaderProcess,
    store: EpisodeStore,
    url: str,
    opts: dict[str, Any],
    name: str,
    paths: set[str],
    episodes: int,
) -> None:
    """The reader process samples ``url`` (``store`` as a reader sees it) each round while ``store`` appends."""
    case = STORAGES[name]
    per_round = 4  # about 36 rows: the writer is one round ahead of the reader
    for e in range(per_round):
        store.append_episode(episode(e))
    opened = reader.ask("open " + json.dumps({"url": url, "opts": opts, "io_threads": case.io_threads}))
    closed = ""
    try:
        assert opened.startswith("opened "), opened
        got = json.loads(opened.split(" ", 1)[1])
        assert set(got["paths"]) == paths, opened
        if case.io_threads is not None:
            assert got["decode_threads"] == case.io_threads
        for r in range(1, episodes // per_round):
            reader.send(str(store.end_episode))
            for e in range(r * per_round, (r + 1) * per_round):  # while the reader samples
                store.append_episode(episode(e))
            answer = reader.answer()
            assert answer.startswith("ok"), f"round {r}: {answer}"
        closed = reader.ask("close")
        assert closed.startswith("closed "), closed
    except BaseException:
        reader.stop()
        raise
    check_mapped(name, "://" not in url, int(closed.split()[1]))


@pytest.mark.slow
@pytest.mark.parametrize("capacity", [None, RING], ids=["unbounded", "ring"])
def test_a_readers_sampler_in_another_process_while_appending(storage, capacity, reader_process):
    name, url, opts = storage
    with _create(name, url, opts, capacity) as store:
        _follow(reader_process, store, url, opts, name, STORAGES[name].paths, STORAGES[name].episodes)
        _assert_wrapped(store, capacity)


# -- read-only paths: a store over HTTP, a packed store -----------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("capacity", [None, RING], ids=["unbounded", "ring"])
@pytest.mark.parametrize("name", sorted(SERVED))
def test_a_reader_over_http_between_appends(name, capacity, tmp_path):
    case = STORAGES[name]
    with serving(str(tmp_path)) as base, _create(name, str(tmp_path / "store"), {}, capacity) as store:
        store.append_episode(episode(0))
        with EpisodeStore.open(f"{base}/store") as remote:
            with HerSampler(remote, BATCH, reward_fn=sparse_reward, seed=0, io_threads=case.io_threads) as sampler:
                assert gather_paths(sampler) == SERVED[name][0]
                for e in range(1, HTTP_EPISODES):
                    assert store.append_episode(episode(e)) == e
                    view = sampler.refresh()
                    assert (view.first, view.end) == (store.first_episode, store.end_episode), f"after episode {e}"
                    problem = wrong_rows(sampler.sample(), store.first_episode, store.end_episode)
                    assert problem is None, f"after episode {e}: {problem}"
            for e in range(remote.first_episode, remote.end_episode):  # every live episode, read whole
                got = remote.episode(e, verify=True)
                for k, want in episode(e).items():
                    np.testing.assert_array_equal(got[k], want, err_msg=f"episode {e} {k}")
        _assert_wrapped(store, capacity)


@pytest.mark.parametrize("capacity", [None, RING], ids=["unbounded", "ring"])
@pytest.mark.parametrize("name", sorted(SERVED))
def test_a_reader_over_http_in_another_process_while_appending(name, capacity, tmp_path, reader_process):
    with serving(str(tmp_path)) as base, _create(name, str(tmp_path / "store"), {}, capacity) as store:
        _follow(reader_process, store, f"{base}/store", {}, name, SERVED[name][0], HTTP_EPISODES)
        _assert_wrapped(store, capacity)


@pytest.mark.parametrize("capacity", [None, RING], ids=["unbounded", "ring"])
@pytest.mark.parametrize("name", sorted(SERVED))
def test_a_packed_store_samples_as_the_model(name, capacity, tmp_path):
    source, archive = tmp_path / "store", tmp_path / "store.zip"
    n = STORAGES[name].episodes
    with _create(name, str(source), {}, capacity) as store:
        for e in range(n):
            store.append_episode(episode(e))
        _assert_wrapped(store, capacity)
        first, end = store.first_episode, store.end_episode
        assert main(["pack", str(source), str(archive), "--quiet"]) == 0  # beside the live writer
        for e in range(n, n + 8):  # a ring overwrites rows the archive holds: it has its own
            store.append_episode(episode(e))
    shutil.rmtree(source)  # the archive alone
    with EpisodeStore.open(archive) as packed:
        assert (packed.first_episode, packed.end_episode) == (first, end)
        with HerSampler(
            packed, BATCH, reward_fn=sparse_reward, seed=0, io_threads=STORAGES[name].io_threads
        ) as sampler:
            assert gather_paths(sampler) == SERVED[name][1]
            for i in range(16):  # members read with pread, then decoded where the archive is mapped
                problem = wrong_rows(sampler.sample(), first, end)
                assert problem is None, f"batch {i}: {problem}"
            check_mapped(name, True, mapped_gathers(sampler))
        for e in range(first, end):
            got = packed.episode(e, verify=True)
            for k, want in episode(e).items():
                np.testing.assert_array_equal(got[k], want, err_msg=f"episode {e} {k}")


if __name__ == "__main__":
    reader_main()
