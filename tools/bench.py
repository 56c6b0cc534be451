"""Speed figures of her_store beside stable-baselines3's HerReplayBuffer, measured in one run on the same data.

    python tools/bench.py            # every figure
    python tools/bench.py --quick    # smaller sizes, a few minutes
    python tools/bench.py --full     # and a 1,000,000-transition image store, larger than SB3's buffer fits in RAM
    python tools/bench.py --only images   # image observations: warm vs SB3 per codec, decode threads, cold, writer
    python tools/bench.py --only add append resume
    python tools/bench.py --only prioritized   # PER and energy priorities vs TorchRL's PrioritizedReplayBuffer
    python tools/bench.py --only sb3_train sb3_add sb3_sample sb3_save   # the SB3 integration against SB3 itself
    python tools/bench.py --device cuda [--quick]   # batches on a GPU instead (tools/bench_device.py)

Every figure is a median over repeated, interleaved rounds (her_store and the baselines alternate, so a noisy
machine slows all alike). SB3 and TorchRL are optional: without them their columns say "not installed".
Data: FetchReach-shaped transitions (observation 10, goals 3, action 4, float32), 50-step episodes; sampling
is future, n_sampled_goal=4, with rewards recomputed for every relabelled row.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_writers import bench_writers  # tools/bench_writers.py
from frames import FRAME_KINDS, FrameKind, image_episode  # tools/frames.py
from gymnasium import spaces

from her_store import EpisodeStore
from her_store.errors import StoreError
from her_store.storage.files import drop_page_cache

OBS = spaces.Dict(
    {
        "observation": spaces.Box(-np.inf, np.inf, (10,), np.float32),
        "achieved_goal": spaces.Box(-np.inf, np.inf, (3,), np.float32),
        "desired_goal": spaces.Box(-np.inf, np.inf, (3,), np.float32),
    }
)
ACT = spaces.Box(-1.0, 1.0, (4,), np.float32)
EP_LEN = 50


def fetch_episode(rng: np.random.Generator, T: int = EP_LEN) -> dict[str, np.ndarray]:
    ep = {k: rng.standard_normal((T + 1, s.shape[0])).astype(np.float32) for k, s in OBS.spaces.items()}
    ep["action"] = rng.uniform(-1, 1, (T, 4)).astype(np.float32)
    ep["reward"] = -np.ones(T, np.float32)
    ep["terminated"] = np.zeros(T, bool)
    ep["truncated"] = np.arange(T) == T - 1
    return ep


def step_stream(n: int, seed: int = 0) -> list[tuple]:
    """n single-env steps as (obs, next_obs, action, reward, terminated, truncated), episodes of EP_LEN."""
    rng = np.random.default_rng(seed)
    o = {k: rng.standard_normal((n + 1, 1, s.shape[0])).astype(np.float32) for k, s in OBS.spaces.items()}
    a = rng.uniform(-1, 1, (n, 1, 4)).astype(np.float32)
    r = -np.ones((n, 1), np.float32)
    term = np.zeros((n, 1), bool)
    trunc = (np.arange(n) % EP_LEN == EP_LEN - 1)[:, None]
    return [
        ({k: v[i] for k, v in o.items()}, {k: v[i + 1] for k, v in o.items()}, a[i], r[i], term[i], trunc[i])
        for i in range(n)
    ]


def median_rate(rounds: list[float]) -> float:
    return statistics.median(rounds)


class FetchLikeEnv:
    """Just enough of a goal env for SB3's HerReplayBuffer (it needs compute_reward through a VecEnv)."""

    def __new__(cls):
        import gymnasium as gym

        class _Env(gym.Env):
            observation_space = OBS
            action_space = ACT

            def compute_reward(self, achieved_goal, desired_goal, info):
                return -(np.linalg.norm(achieved_goal - desired_goal, axis=-1) > 0.05).astype(np.float32)

            def reset(self, *, seed=None, options=None):
                return OBS.sample(), {}

            def step(self, action):
                return OBS.sample(), -1.0, False, False, {}

        return _Env()


def sb3_buffer(size: int, device: str = "cpu"):
    try:
        from stable_baselines3 import HerReplayBuffer
        from stable_baselines3.common.vec_env import DummyVecEnv
    except ImportError:
        return None
    return HerReplayBuffer(size, OBS, ACT, env=DummyVecEnv([FetchLikeEnv]), device=device, n_envs=1)


# -- figures ---------------------------------------------------------------------------------------------
def bench_add(workdir: str, quick: bool) -> dict[str, Any]:
    """StepWriter.add (n_envs=1) vs SB3 HerReplayBuffer.add, transitions/s."""
    n = 40_000 if quick else 200_000
    block = 2_000  # the two alternate every `block` steps, so a machine whose speed drifts slows both alike
    steps = step_stream(n)
    sb3_steps = [(o, no, a, r, te | tr, [{"TimeLimit.truncated": bool(tr[0])}]) for o, no, a, r, te, tr in steps]
    rb = sb3_buffer(n + 10)
    path = os.path.join(workdir, "add")
    spent = {"her_store": 0.0, "sb3": 0.0}
    with EpisodeStore.create(path, OBS, ACT) as store:
        w = store.writer(1)
        for lo in range(0, n, block):
            t = time.perf_counter()
            for st in steps[lo : lo + block]:
                w.add(*st)
            spent["her_store"] += time.perf_counter() - t
            if rb is not None:
                t = time.perf_counter()
                for st in sb3_steps[lo : lo + block]:
                    rb.add(*st)
                spent["sb3"] += time.perf_counter() - t
    shutil.rmtree(path)
    out: dict[str, Any] = {"her_store": n / spent["her_store"], "target": "2x SB3"}
    if rb is None:
        out["sb3"] = "not installed"
    else:
        out["sb3"] = n / spent["sb3"]
        out["ratio"] = out["her_store"] / out["sb3"]
    return out


def bench_append(workdir: str, quick: bool) -> dict[str, Any]:
    """append_episode of whole 50-step episodes, durability='flush', local disk; transitions/s incl. final commit."""
    n_eps = 4_000 if quick else 20_000
    rng = np.random.default_rng(1)
    pool = [fetch_episode(rng) for _ in range(500)]
    rates = []
    for i in range(3 if quick else 5):
        path = os.path.join(workdir, f"append{i}")
        with EpisodeStore.create(path, OBS, ACT, durability="flush") as store:
            t = time.perf_counter()
            for j in range(n_eps):
                store.append_episode(pool[j % len(pool)])
            store.flush()
            rates.append(n_eps * EP_LEN / (time.perf_counter() - t))
        shutil.rmtree(path)
    return {"her_store": median_rate(rates), "target": ">= 1,000,000"}


def bench_resume(workdir: str, quick: bool) -> dict[str, Any]:
    """Seconds to open a store of N episodes for append (lock, commit record, index load and checks)."""
    n_eps = 100_000 if quick else 1_000_000
    path = os.path.join(workdir, "resume")
    rng = np.random.default_rng(2)
    ep = fetch_episode(rng, T=2)
    with EpisodeStore.create(path, OBS, ACT, commit_interval=1.0) as store:
        for _ in range(n_eps):
            store.append_episode(ep)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        with EpisodeStore.open(path, mode="a") as store:
            opened = time.perf_counter() - t
            assert store.num_episodes == n_eps
        times.append(opened)
    shutil.rmtree(path)
    return {"episodes": n_eps, "seconds": statistics.median(times), "target": "< 1 s for 1,000,000"}


def fetch_reward(achieved_goal, desired_goal, info):
    """FetchReach's sparse reward, vectorised (the same function for every buffer)."""
    return -(np.linalg.norm(achieved_goal - desired_goal, axis=-1) > 0.05).astype(np.float32)


_FILLED: dict[str, Any] = {}


def filled_store(workdir: str, n_transitions: int, capacity: int | None = None) -> str:
    """A store of FetchReach-shaped 50-step episodes (built once per run); ``capacity`` as EpisodeStore.create's."""
    path = os.path.join(workdir, f"fetch{n_transitions}" + ("" if capacity is None else f"-ring{capacity}"))
    if path not in _FILLED:
        rng = np.random.default_rng(3)
        pool = [fetch_episode(rng) for _ in range(256)]
        with EpisodeStore.create(
            path, OBS, ACT, capacity=capacity, metadata={"env_id": "FetchReach-shaped"}
        ) as store:
            for i in range(n_transitions // EP_LEN):
                store.append_episode(pool[i % len(pool)] if i >= len(pool) else pool[i])
        _FILLED[path] = True
    return path


def sb3_filled(n_transitions: int, device: str = "cpu"):
    """SB3's HerReplayBuffer holding the same kind of episodes (filled through its own add), sampling to ``device``."""
    rb = sb3_buffer(n_transitions, device)
    if rb is None:
        return None
    steps = step_stream(min(n_transitions, 50_000), seed=3)
    sb3_steps = [(o, no, a, r, te | tr, [{"TimeLimit.truncated": bool(tr[0])}]) for o, no, a, r, te, tr in steps]
    for i in range(n_transitions):
        rb.add(*sb3_steps[i % len(sb3_steps)])
    return rb


def _torchrl_fill(rb: Any, n_transitions: int) -> Any:
    """Extends TorchRL buffer ``rb`` with n FetchReach-shaped transitions (in blocks) and returns it."""
    import logging

    import torch
    from tensordict import TensorDict

    logging.getLogger("torchrl").setLevel(logging.WARNING)
    block = 50_000
    rng = np.random.default_rng(4)

    def t(a):
        return torch.from_numpy(np.ascontiguousarray(a))

    for lo in range(0, n_transitions, block):
        n = min(block, n_transitions - lo)
        o = {k: rng.standard_normal((n, s.shape[0])).astype(np.float32) for k, s in OBS.spaces.items()}
        no = {k: rng.standard_normal((n, s.shape[0])).astype(np.float32) for k, s in OBS.spaces.items()}
        done = (np.arange(n) % EP_LEN == EP_LEN - 1)[:, None]
        td = TensorDict(
            {
                **{k: t(v) for k, v in o.items()},
                "action": t(rng.uniform(-1, 1, (n, 4)).astype(np.float32)),
                "next": {
                    **{k: t(v) for k, v in no.items()},
                    "reward": t(-np.ones((n, 1), np.float32)),
                    "done": t(done),
                    "terminated": t(np.zeros((n, 1), bool)),
                    "truncated": t(done),
                },
            },
            batch_size=[n],
        )
        rb.extend(td)
    return rb


def torchrl_filled(n_transitions: int):
    """TorchRL's HERReplayBuffer over LazyMemmapStorage, the same kind of episodes (extended in blocks)."""
    try:
        from torchrl.data import HERReplayBuffer, LazyMemmapStorage
    except ImportError:
        return None

    def reward_fn(td):
        d = (td["next", "achieved_goal"] - td["desired_goal"]).norm(dim=-1, keepdim=True)
        return -(d > 0.05).float()

    return _torchrl_fill(HERReplayBuffer(reward_fn=reward_fn, storage=LazyMemmapStorage(n_transitions)), n_transitions)


def _time_batches(fn: Callable[[], Any], n: int) -> float:
    """Seconds per call over n calls in a row: their total over n, what a training loop pays, slow calls included.
    (Not their median: SB3's image sampling is bimodal here, 3.3 ms or 12-15 ms a batch by how the allocator's state
    falls, and a median of a few calls lands on either mode from one run to the next.)"""
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n


def bench_sample_warm(workdir: str, quick: bool) -> dict[str, Any]:
    """Warm page cache: batch 256 / 1024 transitions/s (future, n_sampled_goal=4, rewards recomputed) vs SB3 and
    TorchRL."""
    from her_store import HerSampler

    n = 200_000 if quick else 1_000_000
    store = EpisodeStore.open(filled_store(workdir, n))
    sampler = HerSampler(store, reward_fn=fetch_reward, seed=0)
    rb = sb3_filled(n)
    trl = torchrl_filled(n)
    out: dict[str, Any] = {"stored transitions": n}
    rounds = 5 if quick else 9
    for B in (256, 1024):
        ours, sb3, torchrl = [], [], []
        for _ in range(rounds):  # interleaved, so drift in the machine's speed hits all alike
            ours.append(_time_batches(lambda B=B: sampler.sample(B), 20))
            if rb is not None:
                sb3.append(_time_batches(lambda B=B: rb.sample(B, env=None), 20))
            if trl is not None:
                torchrl.append(_time_batches(lambda B=B: trl.sample(B), 2))
        out[f"B={B} her_store"] = B / statistics.median(ours)
        if sb3:
            out[f"B={B} sb3"] = B / statistics.median(sb3)
            out[f"B={B} ratio vs sb3"] = out[f"B={B} her_store"] / out[f"B={B} sb3"]
        if torchrl:
            out[f"B={B} torchrl"] = B / statistics.median(torchrl)
    out["target"] = "B=1024: 3x SB3; B=256: 2x SB3"
    if rb is None:
        out["sb3"] = "not installed"
    if trl is None:
        out["torchrl"] = "not installed (pip install torchrl)"
    sampler.close()
    store.close()
    return out


def _device_reads(path: str) -> Callable[[], int]:
    """Reads completed by the block device holding ``path`` (/proc/diskstats), as a function to poll."""
    dev = os.stat(path).st_dev
    major, minor = os.major(dev), os.minor(dev)

    def reads() -> int:
        with open("/proc/diskstats") as f:
            for line in f:
                p = line.split()
                if int(p[0]) == major and int(p[1]) == minor:
                    return int(p[3])
        return 0

    return reads


def _disk_random_reads_per_s(workdir: str, size: int, threads: int, n: int, read_bytes: int = 4096) -> dict[str, float]:
    """Random reads/s of ``read_bytes`` each (page-aligned) of the disk under workdir, page cache evicted: threaded
    pread and threaded mmap touch (every page of each read)."""
    import mmap
    from concurrent.futures import ThreadPoolExecutor

    path = os.path.join(workdir, "randread.bin")
    if not os.path.exists(path) or os.path.getsize(path) != size:
        with open(path, "wb") as f:
            block = np.random.default_rng(0).integers(0, 255, 1 << 24, np.uint8).tobytes()
            f.writelines(block for _ in range(size >> 24))
            f.flush()
            os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    rng = np.random.default_rng(5)
    span = -(-read_bytes // 4096)  # pages a read covers
    out = {}
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        pages = size // 4096 - span

        def parts(a):
            return np.array_split(a, threads)

        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        offs = rng.choice(pages, n, replace=False) * 4096
        t = time.perf_counter()
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(lambda p: [os.pread(fd, read_bytes, int(o)) for o in p], parts(offs)))
        out["pread"] = n / (time.perf_counter() - t)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        m = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        m.madvise(mmap.MADV_RANDOM)
        view = np.frombuffer(m, np.uint8)
        idx = rng.choice(pages, n, replace=False) * 4096
        t = time.perf_counter()
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(lambda p, v=view: v[(p[:, None] + np.arange(0, span * 4096, 4096)).ravel()].sum(), parts(idx)))
        out["mmap"] = n / (time.perf_counter() - t)
        del view
        m.close()
    finally:
        os.close(fd)
    return out


def bench_sample_cold(workdir: str, quick: bool) -> dict[str, Any]:
    """Cold page cache (store files evicted before every batch): transitions/s vs the disk's random 4 KiB reads/s."""
    from her_store import HerSampler

    n = 200_000 if quick else 1_000_000
    threads = 32
    disk = _disk_random_reads_per_s(workdir, (256 if quick else 1024) << 20, threads, 20_000)
    disk_rate = max(disk.values())
    store = EpisodeStore.open(filled_store(workdir, n))
    reads = _device_reads(store.url)
    out: dict[str, Any] = {
        "stored transitions": n, "disk 4KiB reads/s (pread)": disk["pread"], "disk 4KiB reads/s (mmap)": disk["mmap"]
    }
    for io_threads in (threads, 0):
        sampler = HerSampler(store, 1024, reward_fn=fetch_reward, seed=1, io_threads=io_threads)
        sampler.sample()  # maps the chunk files
        spent, transitions, disk_reads = 0.0, 0, 0
        for _ in range(10 if quick else 30):
            sampler.reader.evict_page_cache()
            r0 = reads()
            t = time.perf_counter()
            sampler.sample()
            spent += time.perf_counter() - t
            disk_reads += reads() - r0
            transitions += 1024
        rate = transitions / spent
        key = f"io_threads={io_threads}"
        out[f"{key} transitions/s"] = rate
        out[f"{key} x disk reads/s"] = rate / disk_rate
        out[f"{key} disk reads/transition"] = disk_reads / transitions
        sampler.close()
    store.close()
    out["target"] = ">= 0.25 x disk reads/s (<= ~4 reads/transition)"
    return out


def _disk_usage(path: str) -> int:
    """Bytes a directory takes on disk (allocated blocks: chunk files are sparse until written)."""
    return sum(os.stat(os.path.join(d, f)).st_blocks * 512 for d, _, fs in os.walk(path) for f in fs)


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def bench_memory(workdir: str, quick: bool) -> dict[str, Any]:
    """Anonymous RSS growth over 1,000 batches of 1,024 from a store several times the 64 MiB budget."""
    from her_store import HerSampler

    n = 2_000_000 if quick else 4_000_000
    path = filled_store(workdir, n)
    store_bytes = _disk_usage(path)
    base = _rss_anon()
    store = EpisodeStore.open(path)
    index_bytes = sum(c.nbytes for c in store.index._cols.values()) + store.index._cum.nbytes
    sampler = HerSampler(store, 1024, reward_fn=fetch_reward, seed=2)
    for _ in range(1000):
        sampler.sample()
    grown = _rss_anon() - base
    sampler.close()
    store.close()
    return {
        "store bytes": store_bytes,
        "index bytes": index_bytes,
        "RssAnon growth": grown,
        "budget (64 MiB + index)": (64 << 20) + index_bytes,
        "within budget": grown < (64 << 20) + index_bytes,
    }


# -- prioritized replay: TD-error PER and energy-based episode priorities -------------------------------------
PER_ALPHA, PER_BETA = 0.6, 0.4


def torchrl_prioritized_filled(n_transitions: int) -> Any:
    """TorchRL's PrioritizedReplayBuffer (alpha 0.6, beta 0.4) over LazyMemmapStorage holding the same kind of
    transitions, or a string saying why there is none."""
    try:
        import torch
        from torchrl.data import LazyMemmapStorage, PrioritizedReplayBuffer
    except ImportError:
        return "not installed (pip install torchrl)"
    try:
        rb = PrioritizedReplayBuffer(alpha=PER_ALPHA, beta=PER_BETA, storage=LazyMemmapStorage(n_transitions))
    except RuntimeError:  # its sum and min trees are C++ (torchrl._torchrl), built for one torch version
        return f"its C++ segment trees do not load with torch {torch.__version__}"
    return _torchrl_fill(rb, n_transitions)


def _priority_nbytes(priorities: Any) -> int:
    """Bytes of the arrays a sampler's TD-priority state holds: its tree's and its own (the committed view it
    follows is the index every sampler holds, and is not counted)."""
    held = [v for k, v in vars(priorities).items() if k != "view"] + list(vars(priorities.tree).values())
    arrays = [a for v in held for a in (v if isinstance(v, tuple) else (v,)) if isinstance(a, np.ndarray)]
    return sum(a.nbytes for a in arrays)


def bench_prioritized(workdir: str, quick: bool) -> dict[str, Any]:
    """prioritize="td" sample and update_priorities vs TorchRL's PrioritizedReplayBuffer and uniform; "energy" too.

    Warm, transitions/s of batch 256 and 1024. "td" is proportional PER (alpha 0.6, beta 0.4), its update that of the
    batch just drawn, |TD errors| in [0, 2); TorchRL's buffer has the same alpha and beta and holds the same kind of
    transitions, but relabels nothing (its batch is stored rows and weights) where every her_store batch relabels
    (future, n_sampled_goal=4, rewards recomputed). The RAM figure is the bytes of the arrays the td sampler's
    priority state holds over the transitions stored."""
    import torch

    from her_store import HerSampler

    n = 200_000 if quick else 1_000_000
    store = EpisodeStore.open(filled_store(workdir, n))
    samplers = {
        mode: HerSampler(store, 256, reward_fn=fetch_reward, seed=0, **extra)
        for mode, extra in (
            ("uniform", {}),
            ("energy", {"prioritize": "energy"}),
            ("td", {"prioritize": "td", "alpha": PER_ALPHA, "beta": PER_BETA}),
        )
    }
    td_sampler = samplers["td"]
    trl = torchrl_prioritized_filled(n)
    out: dict[str, Any] = {"stored transitions": n}
    rounds, calls = (7, 20) if quick else (11, 40)
    gen = torch.Generator().manual_seed(0)
    for B in (256, 1024):
        errors = torch.rand(B, generator=gen) * 2  # the |TD errors| both write back
        ours_batch = td_sampler.sample(B)
        fns: dict[str, Callable[[], Any]] = {
            f"{mode} sample": lambda s=s, B=B: s.sample(B) for mode, s in samplers.items()
        }
        fns["td update_priorities"] = lambda b=ours_batch, e=errors: td_sampler.update_priorities(b.indices, e)
        if not isinstance(trl, str):
            trl_index = trl.sample(B, return_info=True)[1]["index"]
            fns["torchrl sample"] = lambda B=B: trl.sample(B, return_info=True)
            fns["torchrl update_priority"] = lambda i=trl_index, e=errors: trl.update_priority(i, e)
        warm_up(fns)
        rates = {k: B / v for k, v in interleaved_rounds(fns, rounds, calls).items()}
        for k, v in rates.items():
            out[f"B={B} {k} transitions/s"] = v
        out[f"B={B} td / uniform"] = rates["td sample"] / rates["uniform sample"]
        out[f"B={B} energy / uniform"] = rates["energy sample"] / rates["uniform sample"]
        if not isinstance(trl, str):
            out[f"B={B} td sample / torchrl"] = rates["td sample"] / rates["torchrl sample"]
            out[f"B={B} td update / torchrl"] = rates["td update_priorities"] / rates["torchrl update_priority"]
    if isinstance(trl, str):
        out["torchrl"] = trl
    assert td_sampler.priorities is not None
    out["td RAM bytes per stored transition"] = _priority_nbytes(td_sampler.priorities) / store.num_transitions
    out["target"] = "td >= 1x TorchRL (sample and update); energy >= 0.9x uniform"
    for s in samplers.values():
        s.close()
    store.close()
    return out


# -- images: 3x84x84 uint8 observations (tools/frames.py), compressed and uncompressed, beside SB3 -----------------
IMG_OBS = spaces.Dict(
    {
        "observation": spaces.Box(0, 255, (3, 84, 84), np.uint8),
        "achieved_goal": spaces.Box(-np.inf, np.inf, (3,), np.float32),
        "desired_goal": spaces.Box(-np.inf, np.inf, (3,), np.float32),
    }
)
IMG_POOL = 64  # distinct episodes per kind of frames, appended round-robin
IMG_BATCH = 256
# the image stores of the warm and decode figures: (kind of frames, label, compressors)
IMG_STORES = (
    ("rendered", "lz4 (default)", None),
    ("rendered", "uncompressed", {"observation": None}),
    ("rendered", "zstd", {"observation": "zstd"}),
    ("rendered", "jpeg (lossy)", {"observation": "jpeg"}),
    ("rendered", "blosc-lz4 bitshuffle", "blosc"),
    ("camera", "lz4 (default)", None),
    ("camera", "zstd", {"observation": "zstd"}),
)
WARM = ("lz4 (default)", "uncompressed", "zstd", "jpeg (lossy)")  # the codecs of the warm table
DECODE = ("lz4 (default)", "zstd", "blosc-lz4 bitshuffle", "jpeg (lossy)")  # the codecs of the decode scaling
OPTIONAL = ("jpeg (lossy)",)  # reported as not available if they raise


def image_pool(kind: FrameKind, n: int = IMG_POOL, seed: int = 6) -> list[dict[str, np.ndarray]]:
    """``n`` distinct 50-step image episodes of one kind of frames."""
    rng = np.random.default_rng(seed)
    return [image_episode(rng, kind, EP_LEN) for _ in range(n)]


def _image_goal_env():
    """Just enough of an image goal env for SB3's HerReplayBuffer (compute_reward through a VecEnv)."""
    import gymnasium as gym

    class _Env(gym.Env):
        observation_space = IMG_OBS
        action_space = ACT

        def compute_reward(self, achieved_goal, desired_goal, info):
            return fetch_reward(achieved_goal, desired_goal, info)

        def reset(self, *, seed=None, options=None):
            return IMG_OBS.sample(), {}

        def step(self, action):
            return IMG_OBS.sample(), -1.0, False, False, {}

    return _Env()


def sb3_image_filled(pool: list[dict[str, np.ndarray]], n: int, device: str = "cpu"):
    """SB3's HerReplayBuffer holding the n transitions an image store built from ``pool`` holds (its own add),
    sampling to ``device``."""
    try:
        from stable_baselines3 import HerReplayBuffer
        from stable_baselines3.common.vec_env import DummyVecEnv
    except ImportError:
        return None
    rb = HerReplayBuffer(n + 10, IMG_OBS, ACT, env=DummyVecEnv([_image_goal_env]), device=device, n_envs=1)
    keys = tuple(IMG_OBS.spaces)
    last = EP_LEN - 1
    for i in range(n // EP_LEN):  # SB3's buffer takes one step per add
        ep = pool[i % len(pool)]
        for s in range(EP_LEN):
            rb.add(
                {k: ep[k][s : s + 1] for k in keys},
                {k: ep[k][s + 1 : s + 2] for k in keys},
                ep["action"][s : s + 1],
                ep["reward"][s : s + 1],
                np.array([s == last]),
                [{"TimeLimit.truncated": s == last}],
            )
    return rb


def _image_compressors(spec: Any) -> Any:
    if spec == "blosc":
        import zarr.codecs

        return {"observation": zarr.codecs.BloscCodec(cname="lz4", clevel=5, shuffle="bitshuffle")}
    return spec


def build_image_store(
    path: str, pool: list[dict[str, np.ndarray]], n: int, compressors: Any = None, progress: bool = False
) -> str:
    """A store of n image transitions: the pool's episodes appended round-robin (append_episode)."""
    n_eps = n // EP_LEN
    t = time.perf_counter()
    with EpisodeStore.create(path, IMG_OBS, ACT, compressors=_image_compressors(compressors)) as store:
        for i in range(n_eps):
            store.append_episode(pool[i % len(pool)])
            if progress and (i + 1) % max(1, n_eps // 20) == 0:
                print(f"  built {i + 1:,}/{n_eps:,} episodes, {time.perf_counter() - t:.0f} s", file=sys.stderr)
    return path


def _frame_disk_bytes(store: EpisodeStore) -> float:
    """Bytes on disk per stored frame of a store's observation array (shard indexes included)."""
    return _disk_usage(os.path.join(store.url, "steps", "observation")) / (store.num_transitions + store.num_episodes)


def warm_up(fns: dict[str, Callable[[], Any]]) -> None:
    """Call each sampling function as often as a sampler needs to find its frames in the page cache and read them
    where their shards are mapped (WARM_GATHERS gathers), and once more."""
    from her_store.store.frame_rows import WARM_GATHERS

    for f in fns.values():
        for _ in range(WARM_GATHERS + 1):
            f()


def interleaved_rounds(fns: dict[str, Callable[[], Any]], rounds: int, calls: int) -> dict[str, float]:
    """Seconds per call of each function, medians over interleaved rounds (a drift of the machine's speed hits all
    alike: it doubles within a minute here)."""
    spent: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(rounds):
        order = list(fns) if r % 2 == 0 else list(reversed(fns))
        for name in order:
            spent[name].append(_time_batches(fns[name], calls))
    return {k: statistics.median(v) for k, v in spent.items()}


def _cold_image_rate(store: EpisodeStore, batches: int, io_threads: int = 32) -> tuple[float, float, float]:
    """(transitions/s, disk reads per transition, first batch's transitions/s) of a fresh sampler, made after the
    store's files were dropped from the page cache, whose every batch is drawn after they were dropped again. The
    first batch also opens the shards it needs (a read of each one's index); the sampler keeps their parsed indexes
    (16 bytes a frame of its own memory), so later batches read frames alone, as a long run over a store larger than
    RAM does."""
    from her_store import HerSampler

    reads = _device_reads(store.url)
    spent, disk_reads, first = [], 0, 0.0
    sampler = None
    for i in range(batches + 1):
        if sampler is None:
            for spec in store.layout.arrays:  # nothing of the store in the page cache when the sampler starts
                for d, _, files in os.walk(os.path.join(store.url, spec.path)):
                    for f in files:
                        drop_page_cache(os.path.join(d, f))
            sampler = HerSampler(store, IMG_BATCH, reward_fn=fetch_reward, seed=100, io_threads=io_threads)
        sampler.reader.evict_page_cache()
        r0 = reads()
        t = time.perf_counter()
        sampler.sample()
        dt = time.perf_counter() - t
        if i == 0:
            first = IMG_BATCH / dt
            continue
        spent.append(dt)
        disk_reads += reads() - r0
    assert sampler is not None
    sampler.close()
    return IMG_BATCH / statistics.median(spent), disk_reads / (batches * IMG_BATCH), first


def _cold_figures(
    workdir: str, store: EpisodeStore, frame_bytes: float, batches: int, file_size: int
) -> dict[str, Any]:
    """Cold sampling against the disk's random-read rate at the compressed frame size, measured now."""
    read_bytes = int(np.ceil(frame_bytes))
    disk = _disk_random_reads_per_s(workdir, file_size, 32, 20_000, read_bytes)
    disk_rate = max(disk.values())
    rate, per_transition, first = _cold_image_rate(store, batches)
    allowed = disk_rate / per_transition
    return {
        f"cold: disk random {read_bytes:,} B reads/s (best of pread, mmap)": disk_rate,
        "cold: transitions/s (io_threads=32, files evicted before every batch)": rate,
        "cold: first batch of a fresh sampler, transitions/s (opens its shards)": first,
        "cold: disk reads/transition": per_transition,
        "cold: x the rate the disk allows (reads/s / reads per transition)": rate / allowed,
    }


def _disk_write_bandwidth(workdir: str, nbytes: int = 1 << 30) -> float:
    """Sequential write bytes/s of the disk under workdir: nbytes written in 16 MiB blocks, then fsync."""
    path = os.path.join(workdir, "seqwrite.bin")
    block = np.random.default_rng(0).integers(0, 255, 1 << 24, np.uint8).tobytes()
    t = time.perf_counter()
    with open(path, "wb") as f:
        f.writelines(block for _ in range(nbytes >> 24))
        f.flush()
        os.fsync(f.fileno())
    rate = nbytes / (time.perf_counter() - t)
    os.remove(path)
    return rate


def _writer_figures(workdir: str, pool: list[dict[str, np.ndarray]], n: int) -> dict[str, Any]:
    """append_episode and StepWriter (8 envs) into default-codec stores: frames/s and compressed bytes/s from the first
    append through the final commit (durability "flush"), against the disk's sequential write bandwidth."""
    n_envs = 8
    disk = _disk_write_bandwidth(workdir)
    out: dict[str, Any] = {"writer: disk sequential write MB/s (1 GiB, fsync)": disk / 1e6}
    keys = tuple(IMG_OBS.spaces)
    groups = [
        {k: np.stack([pool[(g * n_envs + e) % len(pool)][k] for e in range(n_envs)], axis=1) for k in pool[0]}
        for g in range(max(1, len(pool) // n_envs))
    ]
    done = np.zeros(n_envs, bool)
    last = np.ones(n_envs, bool)

    def whole(store: EpisodeStore) -> int:
        for i in range(n // EP_LEN):
            store.append_episode(pool[i % len(pool)])
        return n // EP_LEN

    def stepwise(store: EpisodeStore) -> int:
        w = store.writer(n_envs)
        rounds = n // (EP_LEN * n_envs)
        for r in range(rounds):
            g = groups[r % len(groups)]
            for s in range(EP_LEN):
                w.add({k: g[k][s] for k in keys}, {k: g[k][s + 1] for k in keys}, g["action"][s], g["reward"][s], done,
                      last if s == EP_LEN - 1 else done)
        return rounds * n_envs

    for name, fill in (("append_episode", whole), (f"StepWriter({n_envs} envs)", stepwise)):
        path = os.path.join(workdir, "images-writer")
        t = time.perf_counter()
        store = EpisodeStore.create(path, IMG_OBS, ACT)
        created = time.perf_counter()
        with store:  # appending, through the last commit at close (creating the store, once, is reported apart)
            episodes = fill(store)
        seconds = time.perf_counter() - created
        out[f"writer: {name} creating the store, s"] = created - t
        written = _disk_usage(os.path.join(path, "steps", "observation"))
        shutil.rmtree(path)
        out[f"writer: {name} frames/s"] = episodes * (EP_LEN + 1) / seconds
        out[f"writer: {name} compressed MB/s"] = written / seconds / 1e6
        out[f"writer: {name} x disk bandwidth"] = written / seconds / disk
    out.update(_encode_ceiling(pool, disk))
    out["writer: target"] = ">= 0.25 x disk bandwidth in compressed bytes"
    return out


def _encode_ceiling(pool: list[dict[str, np.ndarray]], disk: float) -> dict[str, float]:
    """What the writer could reach if it did nothing but LZ4-encode frames (the C encoder, one thread per core, on
    the same frames): the ceiling the writer's compressed bytes/s are bounded by on this machine."""
    from concurrent.futures import ThreadPoolExecutor

    from her_store import _kernels

    frames = [ep["observation"] for ep in pool]
    nbytes = frames[0][0].nbytes
    threads = os.cpu_count() or 1
    out: dict[str, float] = {}
    with ThreadPoolExecutor(threads) as ex:
        for t in sorted({1, threads}):
            written, start = 0, time.perf_counter()
            for _ in range(4):
                def encode(f):
                    return sum(map(len, _kernels.encode_lz4(f, nbytes, 1)))

                written += sum(ex.map(encode, frames) if t > 1 else map(encode, frames))
            seconds = time.perf_counter() - start
            out[f"writer: LZ4 encode alone, {t} thread(s), compressed MB/s"] = written / seconds / 1e6
            out[f"writer: LZ4 encode alone, {t} thread(s), x disk bandwidth"] = written / seconds / disk
    return out


def bench_images(workdir: str, quick: bool) -> dict[str, Any]:
    """3x84x84 uint8 images, batch 256 future: warm vs SB3 in RAM per codec, decode scaling, cold, writer."""
    from her_store import HerSampler

    n = 20_000 if quick else 50_000
    threads = os.cpu_count() or 1
    pools = {kind: image_pool(kind) for kind in FRAME_KINDS}
    out: dict[str, Any] = {"stored transitions": n, "frames": "3x84x84 uint8, 3-D goals, 50-step episodes, 64 distinct"}
    stores: dict[tuple[str, str], EpisodeStore] = {}
    for kind, label, comp in IMG_STORES:
        path = os.path.join(workdir, f"images-{kind}-{label.split()[0]}")
        if label not in OPTIONAL:
            build_image_store(path, pools[kind], n, comp)
            stores[kind, label] = EpisodeStore.open(path)
            continue
        try:  # a codec missing its package, or not working yet: reported, not fatal
            build_image_store(path, pools[kind], n, comp)
            with EpisodeStore.open(path) as store, HerSampler(store, IMG_BATCH, reward_fn=fetch_reward) as probe:
                probe.sample()
        except (ImportError, StoreError) as e:
            out[f"{kind} {label}"] = f"not available ({type(e).__name__}: {e})"
            shutil.rmtree(path, ignore_errors=True)
        else:
            stores[kind, label] = EpisodeStore.open(path)
    raw = ("rendered", "uncompressed")
    raw_bytes = _disk_usage(stores[raw].url) if raw in stores else None

    # warm page cache, side by side with SB3's buffer holding the same transitions in RAM
    rb = sb3_image_filled(pools["rendered"], n)
    samplers = {
        key: HerSampler(store, IMG_BATCH, reward_fn=fetch_reward, seed=3)
        for key, store in stores.items()
        if key[1] in WARM
    }
    fns: dict[str, Callable[[], Any]] = {f"{kind} {label}": s.sample for (kind, label), s in samplers.items()}
    if rb is not None:
        fns["sb3"] = lambda: rb.sample(IMG_BATCH)
    warm_up(fns)
    per_call = interleaved_rounds(fns, 5 if quick else 9, 10)
    if rb is None:
        out["warm: SB3 HerReplayBuffer, in RAM"] = "not installed"
    else:
        out["warm: SB3 HerReplayBuffer transitions/s"] = IMG_BATCH / per_call["sb3"]
        out["warm: SB3 RAM of observations + next observations"] = 2 * n * sum(
            int(np.prod(s.shape)) * s.dtype.itemsize for s in IMG_OBS.spaces.values()
        )
    for (kind, label), s in samplers.items():
        name = f"{kind} {label}"
        out[f"warm: {name} transitions/s"] = rate = IMG_BATCH / per_call[name]
        if rb is not None:
            out[f"warm: {name} x SB3"] = rate / out["warm: SB3 HerReplayBuffer transitions/s"]
        used = _disk_usage(s.store.url)
        out[f"warm: {name} bytes on disk"] = used
        if raw_bytes is not None and (kind, label) != raw:
            out[f"warm: {name} x fewer bytes than uncompressed"] = raw_bytes / used
        s.close()
    rb = None  # SB3's buffer: gigabytes of RAM, freed before the next figures
    out["warm: target"] = "rendered lz4 (default) >= 2x SB3 with >= 3x fewer bytes than uncompressed"

    # decode scaling: the same warm batches decoded in the calling thread (io_threads=0), then across one thread per
    # core (the default; io_threads=2 would also split the low-dimensional gathers, which costs more than it saves)
    decoders = {
        f"{label} io_threads={t}": HerSampler(
            stores["rendered", label], IMG_BATCH, reward_fn=fetch_reward, seed=4, io_threads=t
        )
        for label in DECODE
        if ("rendered", label) in stores
        for t in (0, None)
    }
    fns = {name: s.sample for name, s in decoders.items()}
    warm_up(fns)
    per_call = interleaved_rounds(fns, 3 if quick else 5, 5)
    for label in DECODE:
        if ("rendered", label) in stores:
            one, many = per_call[f"{label} io_threads=0"], per_call[f"{label} io_threads=None"]
            out[f"decode: {label} io_threads=0 / default ({threads} threads) transitions/s"] = (
                f"{IMG_BATCH / one:,.0f} / {IMG_BATCH / many:,.0f}"
            )
            out[f"decode: {label} speed-up with {threads} threads"] = one / many
    for s in decoders.values():
        s.close()

    # cold: the default store, files dropped from the page cache and a fresh sampler before every batch
    default = stores.get(("rendered", "lz4 (default)"))
    if default is not None:
        frame_bytes = _frame_disk_bytes(default)
        out["cold: rendered lz4 bytes per frame on disk"] = frame_bytes
        out.update(_cold_figures(workdir, default, frame_bytes, 10 if quick else 30, 256 << 20))
        out["cold: target"] = ">= 0.25 x the rate the disk allows"
    for store in stores.values():
        path = store.url
        store.close()
        shutil.rmtree(path)

    out.update(_writer_figures(workdir, pools["rendered"], n))
    return out


def bench_images_large(workdir: str, quick: bool) -> dict[str, Any]:
    """Larger than SB3's RAM (--full): 1,000,000 rendered image transitions, default codec: bytes, cold, RSS."""
    from her_store import HerSampler

    n = 1_000_000
    path = os.path.join(workdir, "images-large")
    t = time.perf_counter()
    build_image_store(path, image_pool("rendered"), n, progress=True)
    out: dict[str, Any] = {"stored transitions": n, "build seconds (append_episode)": time.perf_counter() - t}
    try:
        out["bytes on disk"] = _disk_usage(path)
        out["RAM SB3's HerReplayBuffer needs (observations + next observations)"] = 2 * n * sum(
            int(np.prod(s.shape)) * s.dtype.itemsize for s in IMG_OBS.spaces.values()
        )
        out["RAM of this machine"] = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        with EpisodeStore.open(path) as store:
            out["bytes per frame on disk"] = frame_bytes = _frame_disk_bytes(store)
            out.update(_cold_figures(workdir, store, frame_bytes, 30, 1 << 30))
            base = _rss_anon()
            sampler = HerSampler(store, IMG_BATCH, reward_fn=fetch_reward, seed=5, io_threads=32)
            sampler.reader.evict_page_cache()
            t = time.perf_counter()
            for _ in range(500):
                sampler.sample()
            out["500 batches from cold: transitions/s"] = 500 * IMG_BATCH / (time.perf_counter() - t)
            out["RssAnon growth over 500 batches"] = _rss_anon() - base
            sampler.close()
        out["target"] = "RssAnon growth < 256 MiB; cold >= 0.25 x the rate the disk allows"
    finally:
        shutil.rmtree(path)
    return out


# -- SB3 integration: ZarrHerReplayBuffer against SB3's own HerReplayBuffer -------------------------------------

# -- datasets: inspect, verify, export, pack, sampling over HTTP and S3 ---------------------------------------------
def _disk_read_bandwidth(workdir: str, nbytes: int = 1 << 30) -> float:
    """Sequential read bytes/s of the disk under workdir: a file written, dropped from the page cache, read back in
    16 MiB blocks."""
    path = os.path.join(workdir, "seqread.bin")
    block = np.random.default_rng(1).integers(0, 255, 1 << 24, np.uint8).tobytes()
    with open(path, "wb") as f:
        f.writelines(block for _ in range(nbytes >> 24))
    drop_page_cache(path)
    buf = bytearray(1 << 24)
    t = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    rate = nbytes / (time.perf_counter() - t)
    os.remove(path)
    return rate


def _drop_store(path: str) -> None:
    for d, _, files in os.walk(path):
        for name in files:
            drop_page_cache(os.path.join(d, name))


def bench_inspect(workdir: str, quick: bool) -> dict[str, Any]:
    """her-store inspect --json of a store of 1,000,000 episodes: in-process, and as a fresh process (imports
    included)."""
    import contextlib
    import io
    import subprocess

    from her_store.cli.main import main as cli_main

    n_eps = 100_000 if quick else 1_000_000
    path = os.path.join(workdir, "inspect")
    ep = fetch_episode(np.random.default_rng(2), T=2)
    with EpisodeStore.create(path, OBS, ACT, commit_interval=1.0, metadata={"env_id": "FetchReach-shaped"}) as store:
        for _ in range(n_eps):
            store.append_episode(ep)
    # a fresh process as an installed package runs: with its compiled bytecode (a first run writes it)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    command = [sys.executable, "-m", "her_store.cli", "inspect", path, "--json"]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, env=env)
    inproc, fresh, libraries = [], [], []
    for _ in range(5):
        t = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()) as text:
            assert cli_main(["inspect", path, "--json"]) == 0
        inproc.append(time.perf_counter() - t)
        assert json.loads(text.getvalue())["episodes"] == n_eps
        t = time.perf_counter()
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, env=env)
        fresh.append(time.perf_counter() - t)
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import numpy, gymnasium, zarr"], check=True, env=env)
        libraries.append(time.perf_counter() - t)
    shutil.rmtree(path)
    return {"episodes": n_eps, "in-process s": statistics.median(inproc),
            "fresh process s (python start and imports included)": statistics.median(fresh),
            "of which python start + numpy, gymnasium, zarr imports s": statistics.median(libraries),
            "target": "< 1 s"}


def bench_verify(workdir: str, quick: bool) -> dict[str, Any]:
    """her-store verify of a ~1 GB image store (3x84x84, LZ4) and a ~1 GB low-dim one, files evicted first, against the
    disk's sequential read bandwidth measured in the same run."""
    from her_store.ops.verify import verify

    target = (1 << 27) if quick else (1 << 30)  # bytes on disk
    stores = {
        "images (lz4)": build_image_store(os.path.join(workdir, "verify-img"), image_pool("rendered"),
                                          int(target / 3_400) // EP_LEN * EP_LEN),
        "low-dim": filled_store(workdir, int(target / 86) // EP_LEN * EP_LEN),
    }
    out: dict[str, Any] = {}
    for label, path in stores.items():
        disk = _disk_read_bandwidth(workdir, target)
        _drop_store(path)
        report = verify(path)
        assert report.clean, report.summary()
        rate = report.bytes_read / report.seconds
        out[f"{label}: MB on disk"] = _disk_usage(path) / 1e6
        out[f"{label}: verify MB/s"] = rate / 1e6
        out[f"{label}: disk sequential read MB/s"] = disk / 1e6
        out[f"{label}: verify / disk"] = rate / disk
    out["target"] = "verify >= 0.5 x the disk's sequential read"
    shutil.rmtree(stores["images (lz4)"])
    return out


def bench_export(workdir: str, quick: bool) -> dict[str, Any]:
    """her-store export --to npz of a ~1 GB low-dim store and an image store (3x84x84, LZ4), files evicted first,
    against the disk's sequential read bandwidth measured in the same run."""
    from her_store.interop import export_store

    target = (1 << 27) if quick else (1 << 30)
    stores = {
        "low-dim": filled_store(workdir, int(target / 86) // EP_LEN * EP_LEN),
        "images (lz4)": build_image_store(os.path.join(workdir, "export-img"), image_pool("rendered"),
                                          int(target / 21_500) // EP_LEN * EP_LEN),
    }
    disk = _disk_read_bandwidth(workdir, target)
    out: dict[str, Any] = {"disk sequential read MB/s": disk / 1e6}
    for label, path in stores.items():
        with EpisodeStore.open(path) as s:
            field_bytes = sum((s.num_transitions + (0 if f.per_step else s.num_episodes)) * f.row_nbytes
                              for f in s.schema.fields)
        on_disk = _disk_usage(path)
        _drop_store(path)
        dest = os.path.join(workdir, "export.npz")
        t = time.perf_counter()
        export_store(path, "npz", dest)
        seconds = time.perf_counter() - t
        os.remove(dest)
        out[f"{label}: field MB (uncompressed)"] = field_bytes / 1e6
        out[f"{label}: store MB on disk"] = on_disk / 1e6
        out[f"{label}: export MB/s of fields"] = field_bytes / seconds / 1e6
        out[f"{label}: export MB/s of store bytes read"] = on_disk / seconds / 1e6
        out[f"{label}: store bytes read / disk"] = on_disk / seconds / disk
    shutil.rmtree(stores["images (lz4)"])
    return out


def bench_pack(workdir: str, quick: bool) -> dict[str, Any]:
    """Packed stores: pack MB/s, and warm sampling (batch 256, future) from the zip against the same store unpacked:
    low-dim (members memory-mapped) and 3x84x84 LZ4 images (frames read by range)."""
    from her_store import HerSampler
    from her_store.ops.pack import pack_store

    out: dict[str, Any] = {}
    n_low, n_img = (200_000, 20_000) if quick else (1_000_000, 50_000)
    stores = {
        "low-dim": filled_store(workdir, n_low),
        "images lz4": build_image_store(os.path.join(workdir, "pack-images"), image_pool("rendered"), n_img),
    }
    for label, path in stores.items():
        t = time.perf_counter()
        pack_store(path, path + ".zip")
        out[f"{label}: pack MB/s"] = os.path.getsize(path + ".zip") / 1e6 / (time.perf_counter() - t)
        opened = {where: EpisodeStore.open(p) for where, p in (("directory", path), ("zip", path + ".zip"))}
        samplers = {w: HerSampler(s, IMG_BATCH, reward_fn=fetch_reward, seed=11) for w, s in opened.items()}
        fns = {w: s.sample for w, s in samplers.items()}
        for f in fns.values():  # warm: every page and shard index read once
            for _ in range(20):
                f()
        per_call = interleaved_rounds(fns, 5 if quick else 9, 20)
        for w in fns:
            out[f"{label}: {w} transitions/s"] = IMG_BATCH / per_call[w]
        out[f"{label}: zip / directory"] = per_call["directory"] / per_call["zip"]
        for s in samplers.values():
            s.close()
        for s in opened.values():
            s.close()
        os.remove(path + ".zip")
    shutil.rmtree(stores["images lz4"])
    return out



def _serve_http(directory: str, port: Any) -> None:
    import functools

    from http_server import RangeHandler, Server  # tools/http_server.py

    server = Server(("127.0.0.1", 0), functools.partial(RangeHandler, directory=directory))
    port.put(server.server_address[1])
    server.serve_forever()


@contextlib.contextmanager
def moto_s3() -> Iterator[dict[str, Any]]:
    """moto's S3 server on loopback in its own process (tools/s3_server.py), with a bucket ``bench``: the storage
    options to reach it."""
    import s3fs
    from s3_server import moto_server  # tools/s3_server.py

    with moto_server() as endpoint:
        opts = {"client_kwargs": {"endpoint_url": endpoint}, "key": "testing", "secret": "testing"}
        s3fs.S3FileSystem(**opts).mkdir("bench")
        yield opts


def bench_remote(workdir: str, quick: bool) -> dict[str, Any]:
    """Sampling over HTTP and S3 (loopback, each server in its own process) through the cache, batch 256, against the
    same store on local disk: FetchReach-shaped and 3x84x84 LZ4 images; the first batch apart from the warm median."""
    import multiprocessing

    from her_store import HerSampler
    from her_store.ops.copy import copy_store

    ctx = multiprocessing.get_context("fork")
    port: Any = ctx.Queue()
    http_server = ctx.Process(target=_serve_http, args=(workdir, port), daemon=True)
    http_server.start()
    base = f"http://127.0.0.1:{port.get()}"
    out: dict[str, Any] = {}
    try:
        with moto_s3() as opts:
            n_low, n_img = (100_000, 10_000) if quick else (1_000_000, 50_000)
            stores = {
                "fetch": filled_store(workdir, n_low),
                "images": build_image_store(os.path.join(workdir, "remote-img"), image_pool("rendered"), n_img),
            }
            out.update({"fetch transitions": n_low, "image transitions": n_img, "batch": IMG_BATCH})
            for name, path in stores.items():
                copy_store(path, f"s3://bench/{name}", storage_options=opts)
                where = {"local": (path, None), "http": (f"{base}/{os.path.basename(path)}", None),
                         "s3": (f"s3://bench/{name}", opts)}
                for kind, (url, so) in where.items():
                    with EpisodeStore.open(url, storage_options=so) as store, HerSampler(
                        store, IMG_BATCH, reward_fn=fetch_reward, seed=0
                    ) as sampler:
                        first = time.perf_counter()
                        sampler.sample()
                        out[f"{name} {kind} first batch s"] = time.perf_counter() - first
                        seconds = _time_batches(sampler.sample, 10 if quick else 30)
                        out[f"{name} {kind} transitions/s"] = IMG_BATCH / seconds
                for kind in ("http", "s3"):
                    out[f"{name} {kind} / local"] = (
                        out[f"{name} {kind} transitions/s"] / out[f"{name} local transitions/s"]
                    )
            shutil.rmtree(stores["images"])
    finally:
        http_server.terminate()
    return out


def bench_working_set(workdir: str, quick: bool) -> dict[str, Any]:
    """Sampling stores on S3 (loopback) through a WorkingSetSampler holding a tenth of each, batch 256, for a fixed
    time, against the same store's warm local HerSampler: FetchReach-shaped and 3x84x84 LZ4 images; the background
    refill's rate (transitions loaded/s) beside the sampling rate."""
    from her_store import HerSampler
    from her_store.ops.copy import copy_store
    from her_store.sampling.working_set import WorkingSetSampler

    seconds = 3.0 if quick else 15.0
    n_low, n_img = (100_000, 10_000) if quick else (1_000_000, 50_000)
    stores = {
        "fetch": filled_store(workdir, n_low),
        "images": build_image_store(os.path.join(workdir, "ws-img"), image_pool("rendered"), n_img),
    }
    out: dict[str, Any] = {"fetch transitions": n_low, "image transitions": n_img, "batch": IMG_BATCH}

    def rate(sample: Callable[[], Any]) -> float:
        batches, t = 0, time.perf_counter()
        while time.perf_counter() - t < seconds:
            sample()
            batches += 1
        return batches * IMG_BATCH / (time.perf_counter() - t)

    with moto_s3() as opts:
        for name, path in stores.items():
            with (
                EpisodeStore.open(path) as store,
                HerSampler(store, IMG_BATCH, reward_fn=fetch_reward, seed=0) as local,
            ):
                for _ in range(20):
                    local.sample()
                out[f"{name} local warm transitions/s"] = rate(local.sample)
            copy_store(path, f"s3://bench/ws-{name}", storage_options=opts)
            with EpisodeStore.open(f"s3://bench/ws-{name}", storage_options=opts) as store:
                row_bytes = sum(spec.row_nbytes for spec in store.layout.arrays)
                budget = store.num_transitions // 10 * row_bytes  # a tenth of the store's rows, decoded
                with WorkingSetSampler(store, budget, IMG_BATCH, reward_fn=fetch_reward, seed=0) as ws:
                    t = time.perf_counter()
                    ws.sample()  # fills the set
                    out[f"{name} working set: first fill s"] = time.perf_counter() - t
                    out[f"{name} working set: MB"] = ws.nbytes / 1e6
                    loaded, refills, t = ws.loaded_transitions, ws.refills, time.perf_counter()
                    sampled = rate(ws.sample)
                    wall = time.perf_counter() - t
                    out[f"{name} s3 working set transitions/s"] = sampled
                    out[f"{name} s3 working set / local warm"] = sampled / out[f"{name} local warm transitions/s"]
                    out[f"{name} refill transitions loaded/s"] = (ws.loaded_transitions - loaded) / wall
                    out[f"{name} refills while sampling"] = ws.refills - refills
    shutil.rmtree(stores["images"])
    out["target"] = "batches near the warm local rate; the refill keeps rotating the set while the learner samples"
    return out


def _sb3_missing() -> dict[str, Any] | None:
    try:
        import stable_baselines3  # noqa: F401
    except ImportError:
        return {"skipped": 'stable-baselines3 not installed (pip install -e ".[bench]")'}
    return None


def bench_sb3_train(workdir: str, quick: bool) -> dict[str, Any]:
    """SAC+HER on her_store/PointGoal-v0, same seed: wall time with ZarrHerReplayBuffer / with SB3's HerReplayBuffer."""
    if (missing := _sb3_missing()) is not None:
        return missing
    import gymnasium as gym
    import torch
    from stable_baselines3 import SAC, HerReplayBuffer

    from her_store.integrations.sb3 import ZarrHerReplayBuffer
    from her_store.integrations.train import evaluate

    steps, chunk = (400, 200) if quick else (5_000, 500)
    torch.set_num_threads(1)  # both runs alike; a small MLP is fastest on one thread

    def make_env():
        return gym.make("her_store/PointGoal-v0")

    models = {
        name: SAC(
            "MultiInputPolicy", make_env(), replay_buffer_class=cls, learning_starts=200, seed=0, device="cpu",
            replay_buffer_kwargs={"n_sampled_goal": 4, "goal_selection_strategy": "future", **extra},
        )
        for name, cls, extra in (
            ("her_store", ZarrHerReplayBuffer, {"path": os.path.join(workdir, "sac")}),
            ("sb3", HerReplayBuffer, {}),
        )
    }
    spent = dict.fromkeys(models, 0.0)
    order = list(models)
    for _ in range(steps // chunk):  # the two runs advance in alternating chunks: machine drift slows both alike
        for name in order:
            t = time.perf_counter()
            models[name].learn(chunk, reset_num_timesteps=False)
            spent[name] += time.perf_counter() - t
        order.reverse()
    out: dict[str, Any] = {"steps": steps}
    for name, model in models.items():
        out[f"{name} seconds"] = spent[name]
        out[f"{name} success rate (deterministic, 50 episodes)"] = evaluate(model, make_env, 50, seed=10_000)
        out[f"{name} success rate (last 100 training episodes)"] = float(np.mean(model.ep_success_buffer))
    models["her_store"].replay_buffer.close()
    out["ratio her_store / sb3 (time)"] = spent["her_store"] / spent["sb3"]
    out["target"] = "ratio <= 1.1"
    return out


def _zarr_buffer(path: str, capacity: int):
    """ZarrHerReplayBuffer over the store at ``path`` (created or resumed), relabelling through a VecEnv as SB3's."""
    from stable_baselines3.common.vec_env import DummyVecEnv

    from her_store.integrations.sb3 import ZarrHerReplayBuffer

    return ZarrHerReplayBuffer(capacity, OBS, ACT, env=DummyVecEnv([FetchLikeEnv]), device="cpu", n_envs=1, path=path)


def bench_sb3_add(workdir: str, quick: bool) -> dict[str, Any]:
    """ZarrHerReplayBuffer.add vs SB3 HerReplayBuffer.add, both called as SB3's algorithms call them; transitions/s."""
    if (missing := _sb3_missing()) is not None:
        return missing
    n = 20_000 if quick else 200_000
    block = 2_000
    steps = step_stream(n)
    sb3_steps = [(o, no, a, r, te | tr, [{"TimeLimit.truncated": bool(tr[0])}]) for o, no, a, r, te, tr in steps]
    rb = sb3_buffer(n + 10)
    ours = _zarr_buffer(os.path.join(workdir, "sb3_add"), n + 10)
    spent = {"her_store": 0.0, "sb3": 0.0}
    for lo in range(0, n, block):  # alternating blocks: a drift in the machine's speed slows both alike
        for name, buf in (("her_store", ours), ("sb3", rb)):
            t = time.perf_counter()
            for st in sb3_steps[lo : lo + block]:
                buf.add(*st)
            spent[name] += time.perf_counter() - t
    ours.close()
    shutil.rmtree(os.path.join(workdir, "sb3_add"))
    out = {k: n / v for k, v in spent.items()}
    out["ratio"] = out["her_store"] / out["sb3"]
    out["target"] = ">= 1x SB3"
    return out


_SB3_PAIR: dict[int, tuple[Any, Any]] = {}


def _sb3_pair(workdir: str, n: int) -> tuple[Any, Any]:
    """(ZarrHerReplayBuffer, SB3 HerReplayBuffer), each holding n FetchReach-shaped transitions (built once per run)."""
    if n not in _SB3_PAIR:
        _SB3_PAIR[n] = (_zarr_buffer(filled_store(workdir, n, capacity=n), n), sb3_filled(n))
    return _SB3_PAIR[n]


def bench_sb3_sample(workdir: str, quick: bool) -> dict[str, Any]:
    """ZarrHerReplayBuffer.sample(256) vs SB3 HerReplayBuffer.sample(256), warm, as SB3's train() calls it."""
    if (missing := _sb3_missing()) is not None:
        return missing
    n = 100_000 if quick else 1_000_000
    ours, rb = _sb3_pair(workdir, n)
    ours.sample(256)  # opens the sampler and maps the chunk files
    rounds: dict[str, list[float]] = {"her_store": [], "sb3": []}
    for _ in range(5 if quick else 9):
        rounds["her_store"].append(_time_batches(lambda: ours.sample(256), 20))
        rounds["sb3"].append(_time_batches(lambda: rb.sample(256), 20))
    out: dict[str, Any] = {"stored transitions": n}
    out.update({f"{k} transitions/s": 256 / statistics.median(v) for k, v in rounds.items()})
    out["ratio"] = out["her_store transitions/s"] / out["sb3 transitions/s"]
    out["target"] = ">= 2x SB3"
    return out


def bench_sb3_save(workdir: str, quick: bool) -> dict[str, Any]:
    """save_replay_buffer (SB3's save_to_pkl), then load and first batch, of a full buffer: seconds and bytes, vs
    SB3."""
    if (missing := _sb3_missing()) is not None:
        return missing
    from stable_baselines3.common.save_util import load_from_pkl, save_to_pkl

    n = 100_000 if quick else 1_000_000
    ours, rb = _sb3_pair(workdir, n)
    out: dict[str, Any] = {"stored transitions": n}
    for name, buf in (("her_store", ours), ("sb3", rb)):
        path = os.path.join(workdir, f"{name}_buffer.pkl")
        t = time.perf_counter()
        save_to_pkl(path, buf)
        out[f"{name} save seconds"] = time.perf_counter() - t
        out[f"{name} pickle bytes"] = os.path.getsize(path)
        if name == "her_store":
            buf.close()  # the loaded handle reopens the store and needs its writer lock
        t = time.perf_counter()
        loaded = load_from_pkl(path)
        loaded.set_env(buf.env)  # as load_replay_buffer does
        loaded.sample(256)  # ready to train: a loaded handle opens its store at first use
        out[f"{name} load + first sample(256) seconds"] = time.perf_counter() - t
        if name == "her_store":
            loaded.close()
        os.remove(path)
    _SB3_PAIR.pop(n)
    out["her_store store bytes on disk"] = _disk_usage(filled_store(workdir, n, capacity=n))
    return out


# benches run only with --full, each when the bench it extends runs
FULL_ONLY = {"images_large": "images"}
BENCHES: dict[str, Callable[[str, bool], dict[str, Any]]] = {
    "add": bench_add,
    "append": bench_append,
    "resume": bench_resume,
    "sample_warm": bench_sample_warm,
    "sample_cold": bench_sample_cold,
    "memory": bench_memory,
    "prioritized": bench_prioritized,
    "images": bench_images,
    "images_large": bench_images_large,
    "sb3_train": bench_sb3_train,
    "sb3_add": bench_sb3_add,
    "sb3_sample": bench_sb3_sample,
    "sb3_save": bench_sb3_save,
    "inspect": bench_inspect,
    "verify": bench_verify,
    "export": bench_export,
    "pack": bench_pack,
    "remote": bench_remote,
    "working_set": bench_working_set,
    "writers": bench_writers,
}


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:,.3f}" if v < 100 else f"{v:,.0f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def report(results: dict[str, dict[str, Any]], benches: dict[str, Callable[..., Any]] = BENCHES) -> None:
    """The results as a table, each figure beside the first line of its function's docstring (from ``benches``)."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        for name, r in results.items():
            print(name, "  ".join(f"{k}={_fmt(v)}" for k, v in r.items()))
        return
    table = Table(title="her_store bench (medians over rounds)")
    table.add_column("figure")
    table.add_column("what")
    table.add_column("measured")
    for name, r in results.items():
        doc = (benches.get(name, pin_allocator).__doc__ or "").strip().splitlines()[0]
        table.add_row(name, doc, "\n".join(f"{k}: {_fmt(v)}" for k, v in r.items()))
    Console().print(table)


def pin_allocator() -> str:
    """Keep glibc's malloc from returning batch-sized buffers to the kernel between calls, for every library alike.

    With glibc's defaults, whether a library's batch tensors (5.4 MB each for 256 frames of 3x84x84) come back from
    the heap or from fresh pages depends on what else the process allocated before: SB3's image sampling measured
    21-24 k transitions/s in a fresh process (3,800 page faults a batch) and 41-98 k after other allocations, both
    on this machine on one day. Pinning the mmap and trim thresholds puts every library in the second, faster state,
    so no figure depends on the allocator's history. Returns what was done, for the report."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        # M_MMAP_THRESHOLD (-3) and M_TRIM_THRESHOLD (-1)
        pinned = libc.mallopt(-3, 64 << 20) == 1 and libc.mallopt(-1, 1 << 30) == 1
    except (OSError, AttributeError):
        pinned = False
    return "glibc malloc: mmap threshold 64 MiB, trim threshold 1 GiB" if pinned else "not glibc: allocator as it is"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="smaller sizes, about a minute")
    size.add_argument("--full", action="store_true", help="also the larger-than-RAM image store (several minutes)")
    p.add_argument("--only", nargs="+", choices=sorted(BENCHES), help="run only these figures")
    p.add_argument("--dir", help="where to put the stores (default: a temporary directory, removed after)")
    p.add_argument("--json", help="also write the results to this JSON file")
    p.add_argument(
        "--device", default="cpu", help="cuda or cuda:N: the figures of batches on that GPU (tools/bench_device.py) "
        "instead of these, with --quick, --dir and --json alone (default: cpu)"
    )
    args = p.parse_args(argv)
    benches: dict[str, Callable[..., dict[str, Any]]] = BENCHES
    if args.device != "cpu":
        import torch

        try:
            cuda = torch.device(args.device).type == "cuda"
        except RuntimeError:
            cuda = False
        if not cuda:
            p.error(f"--device takes cpu, cuda or cuda:N, not {args.device!r}")
        if args.only or args.full:
            p.error("--device cuda takes --quick, --dir and --json, not --only or --full")
        if not torch.cuda.is_available():
            print("CUDA not available: the --device cuda figures need a GPU")
            return 0
        from bench_device import DEVICE_BENCHES  # pragma: no cover - needs CUDA (tools/bench_device.py)

        benches = DEVICE_BENCHES  # pragma: no cover - needs CUDA
    workdir = args.dir or tempfile.mkdtemp(prefix="her_store_bench_")
    os.makedirs(workdir, exist_ok=True)
    results: dict[str, Any] = {"allocator": {"pinned": pin_allocator()}}
    try:
        if benches is BENCHES:
            names = list(args.only or (n for n in BENCHES if n not in FULL_ONLY))
            names += [n for n, parent in FULL_ONLY.items() if args.full and parent in names and n not in names]
        else:  # the device figures, in their order, each on the device
            names = list(benches)
        for name in names:
            t = time.perf_counter()
            extra = {} if benches is BENCHES else {"device": args.device}
            results[name] = benches[name](workdir, args.quick, **extra)
            print(f"{name}: done in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    finally:
        if not args.dir:
            shutil.rmtree(workdir, ignore_errors=True)
    report(results, benches)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
