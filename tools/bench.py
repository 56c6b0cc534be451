"""Speed figures of her_store beside stable-baselines3's HerReplayBuffer, measured in one run on the same data.

    python tools/bench.py            # full run
    python tools/bench.py --quick    # about 30 s
    python tools/bench.py --only add append resume

Every figure is a median over repeated, interleaved rounds (her_store and the baseline alternate, so a noisy
machine slows both alike). SB3 is optional: without it its columns say "not installed".
Data: FetchReach-shaped transitions (observation 10, goals 3, action 4, float32), 50-step episodes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gymnasium import spaces  # noqa: E402

from her_store import EpisodeStore  # noqa: E402

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
    return [({k: v[i] for k, v in o.items()}, {k: v[i + 1] for k, v in o.items()}, a[i], r[i], term[i], trunc[i]) for i in range(n)]


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


def sb3_buffer(size: int):
    try:
        from stable_baselines3 import HerReplayBuffer
        from stable_baselines3.common.vec_env import DummyVecEnv
    except ImportError:
        return None
    return HerReplayBuffer(size, OBS, ACT, env=DummyVecEnv([FetchLikeEnv]), device="cpu", n_envs=1)


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


BENCHES: dict[str, Callable[[str, bool], dict[str, Any]]] = {
    "add": bench_add,
    "append": bench_append,
    "resume": bench_resume,
}


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:,.3f}" if v < 100 else f"{v:,.0f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def report(results: dict[str, dict[str, Any]]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        for name, r in results.items():
            print(name, "  ".join(f"{k}={_fmt(v)}" for k, v in r.items()))
        return
    table = Table(title="her_store bench (medians)")
    table.add_column("figure")
    table.add_column("what")
    table.add_column("measured")
    for name, r in results.items():
        doc = (BENCHES[name].__doc__ or "").strip().splitlines()[0]
        table.add_row(name, doc, "\n".join(f"{k}: {_fmt(v)}" for k, v in r.items()))
    Console().print(table)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smaller sizes, about 30 s")
    p.add_argument("--only", nargs="+", choices=sorted(BENCHES), help="run only these figures")
    p.add_argument("--dir", help="where to put the stores (default: a temporary directory, removed after)")
    p.add_argument("--json", help="also write the results to this JSON file")
    args = p.parse_args(argv)
    workdir = args.dir or tempfile.mkdtemp(prefix="her_store_bench_")
    os.makedirs(workdir, exist_ok=True)
    results = {}
    try:
        for name in args.only or BENCHES:
            t = time.perf_counter()
            results[name] = BENCHES[name](workdir, args.quick)
            print(f"{name}: done in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    finally:
        if not args.dir:
            shutil.rmtree(workdir, ignore_errors=True)
    report(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
