"""Learning check of prioritized replay: SAC+HER on her_store/PointGoal-v0, uniform against energy-prioritized episodes.

    python tools/learning_check.py                                  # both modes, 3 seeds each, 2 processes at once
    python tools/learning_check.py --modes uniform --seeds 1 --steps 2000 --eval-every 500   # a quick look

Every run is SB3's SAC with :class:`~her_store.integrations.sb3.ZarrHerReplayBuffer` (future, n_sampled_goal=4) over
a store of its own in a temporary directory; the modes differ only in the buffer's ``prioritize`` option. The
success radius is 0.01 rather than the env's 0.1, which SAC+HER with uniform replay solves in about 3,000 steps:
at 0.01 the success rate climbs from 0 to 1 over about 4,000-14,000 steps, where a mode's lead can show. Every
``--eval-every`` steps the deterministic policy plays ``--eval-episodes`` evaluation episodes in a separate env (the
same goals for every run and every evaluation), and the success rate is recorded. Each run is one process with one
torch thread; ``--jobs`` of them run at once. A check, not a benchmark: its figures depend on the seeds it ran.

Writes ``<out>/learning_check.json`` (configuration, every run's curve, wall times, and the energies of the episodes
it stored: quantiles, and the mean over each tenth of them from oldest to newest) and ``<out>/learning_check.png``
(success against steps: the mean over seeds, and a band from the lowest to the highest seed, per mode), and prints
a table of the mean, standard deviation and range over seeds at every evaluation.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ENV_ID = "her_store/PointGoal-v0"
MODES: dict[str, dict[str, Any]] = {"uniform": {}, "energy": {"prioritize": "energy"}}
EVAL_SEED = 1_000_000  # evaluation episodes are reset with seeds from here: the same goals for every run


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--modes", nargs="+", choices=sorted(MODES), default=["uniform", "energy"])
    p.add_argument("--seeds", type=int, default=3, help="seeds per mode (0, 1, ...)")
    p.add_argument("--steps", type=int, default=16_000, help="environment steps per run")
    p.add_argument("--eval-every", type=int, default=500, help="steps between evaluations")
    p.add_argument("--eval-episodes", type=int, default=100, help="episodes per evaluation")
    p.add_argument("--learning-starts", type=int, default=500, help="SAC's random steps before learning")
    p.add_argument("--distance-threshold", type=float, default=0.01,
                   help="PointGoal's success radius (the env's own 0.1 is solved in about 3,000 steps)")
    p.add_argument("--jobs", type=int, default=2, help="runs at once, one process each")
    p.add_argument("--out", default="bench_results", help="folder of the JSON and the PNG")
    return p


def make_env(distance_threshold: float) -> Any:
    import gymnasium as gym

    import her_store  # noqa: F401  (registers her_store/PointGoal-v0)

    return gym.make(ENV_ID, distance_threshold=distance_threshold)


def run_one(mode: str, seed: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """One SAC+HER run: the success rate of its deterministic policy at step 0 and every ``eval_every`` steps."""
    import torch
    from stable_baselines3 import SAC
    from stable_baselines3.common.callbacks import BaseCallback

    from her_store.integrations.sb3 import ZarrHerReplayBuffer
    from her_store.integrations.train import evaluate

    torch.set_num_threads(1)

    def env_factory() -> Any:
        return make_env(cfg["distance_threshold"])

    steps: list[int] = []
    success: list[float] = []
    eval_seconds = [0.0]

    def record(model: Any, step: int) -> None:
        t = time.perf_counter()
        steps.append(step)
        success.append(evaluate(model, env_factory, cfg["eval_episodes"], seed=EVAL_SEED))
        eval_seconds[0] += time.perf_counter() - t

    class Evaluations(BaseCallback):
        def _on_training_start(self) -> None:
            record(self.model, 0)

        def _on_step(self) -> bool:
            if self.num_timesteps % cfg["eval_every"] == 0:
                record(self.model, self.num_timesteps)
            return True

    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="learning_check_") as tmp:
        model = SAC(
            "MultiInputPolicy", env_factory(), replay_buffer_class=ZarrHerReplayBuffer, seed=seed, device="cpu",
            learning_starts=cfg["learning_starts"],
            replay_buffer_kwargs={
                "path": os.path.join(tmp, "store"), "n_sampled_goal": 4, "goal_selection_strategy": "future",
                **MODES[mode],
            },
        )
        try:
            model.learn(cfg["steps"], callback=Evaluations())
            # every stored episode's energy (committed at append whatever the mode), oldest first
            priority = np.asarray(model.replay_buffer.store.episodes["priority"], np.float64)
        finally:
            model.replay_buffer.close()
    seconds = time.perf_counter() - start
    return {"mode": mode, "seed": seed, "steps": steps, "success": success, "seconds": seconds,
            "eval_seconds": eval_seconds[0], "episodes": len(priority),
            "priority_quantiles": np.quantile(priority, [0, 0.1, 0.5, 0.9, 1]).tolist(),
            "priority_by_tenth": [float(p.mean()) for p in np.array_split(priority, 10)]}


def summarise(runs: list[dict[str, Any]], modes: list[str]) -> dict[str, dict[str, list[float]]]:
    """Per mode: the evaluation steps and, at each, the mean, standard deviation (ddof=1), min and max over seeds."""
    out: dict[str, dict[str, list[float]]] = {}
    for mode in modes:
        curves = [r for r in sorted(runs, key=lambda r: r["seed"]) if r["mode"] == mode]
        s = np.array([r["success"] for r in curves], np.float64)
        out[mode] = {
            "steps": curves[0]["steps"],
            "mean": s.mean(0).tolist(),
            "std": (s.std(0, ddof=1) if len(s) > 1 else np.zeros(s.shape[1])).tolist(),
            "min": s.min(0).tolist(),
            "max": s.max(0).tolist(),
            "per_seed_mean": s.mean(1).tolist(),
        }
    return out


def first_reaching(steps: list[int], success: list[float], level: float) -> int | None:
    """The first evaluation step whose success rate is at least ``level`` (None: never)."""
    return next((s for s, v in zip(steps, success) if v >= level), None)


def print_tables(runs: list[dict[str, Any]], summary: dict[str, dict[str, list[float]]], cfg: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    modes = list(summary)
    n = cfg["seeds"]
    console = Console()
    console.print(f"SAC+HER on {ENV_ID}, distance_threshold={cfg['distance_threshold']}: success rate of the "
                  f"deterministic policy over {cfg['eval_episodes']} evaluation episodes")
    table = Table(title=f"mean ± std over {n} seeds [min–max]")
    table.add_column("steps", justify="right")
    for mode in modes:
        table.add_column(mode, justify="right")
    for i, step in enumerate(summary[modes[0]]["steps"]):
        cells = []
        for mode in modes:
            m = summary[mode]
            cells.append(f"{m['mean'][i]:.2f} ± {m['std'][i]:.2f} [{m['min'][i]:.2f}–{m['max'][i]:.2f}]")
        table.add_row(f"{step:,}", *cells)
    console.print(table)

    per_seed = Table(title="per seed: mean success over the evaluations, first step at 0.5 and 0.9, final; "
                           "the energies of its stored episodes; wall seconds")
    per_seed.add_column("mode")
    per_seed.add_column("seed", justify="right")
    per_seed.add_column("mean", justify="right")
    per_seed.add_column("≥0.5 at", justify="right")
    per_seed.add_column("≥0.9 at", justify="right")
    per_seed.add_column("final", justify="right")
    per_seed.add_column("energy p10/50/90", justify="right")
    per_seed.add_column("s", justify="right")
    for r in sorted(runs, key=lambda r: (modes.index(r["mode"]), r["seed"])):
        reach = [first_reaching(r["steps"], r["success"], level) for level in (0.5, 0.9)]
        per_seed.add_row(r["mode"], str(r["seed"]), f"{np.mean(r['success']):.3f}",
                         *("never" if s is None else f"{s:,}" for s in reach), f"{r['success'][-1]:.2f}",
                         "/".join(f"{q:.1f}" for q in r["priority_quantiles"][1:4]), f"{r['seconds']:.0f}")
    console.print(per_seed)


def plot(summary: dict[str, dict[str, list[float]]], cfg: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, m in summary.items():
        (line,) = ax.plot(m["steps"], m["mean"], label=f"{mode} (mean of {cfg['seeds']} seeds)", lw=2)
        ax.fill_between(m["steps"], m["min"], m["max"], color=line.get_color(), alpha=0.2, label=f"{mode} min–max")
    ax.set_xlabel("environment steps")
    ax.set_ylabel(f"success rate ({cfg['eval_episodes']} eval episodes)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"SAC+HER, {ENV_ID}, distance_threshold={cfg['distance_threshold']}")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("seeds", "steps", "eval_every", "eval_episodes", "jobs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.learning_starts < 0 or not args.distance_threshold > 0:
        parser.error(f"--learning-starts must be at least 0 and --distance-threshold above 0, got "
                     f"{args.learning_starts} and {args.distance_threshold}")
    cfg = {k: getattr(args, k) for k in ("modes", "seeds", "steps", "eval_every", "eval_episodes", "learning_starts",
                                         "distance_threshold", "jobs")}
    os.makedirs(args.out, exist_ok=True)
    start = time.perf_counter()
    runs: list[dict[str, Any]] = []
    # seeds interleaved across modes, so that a machine slowing down mid-check slows both modes alike
    tasks = [(mode, seed) for seed in range(args.seeds) for mode in args.modes]
    with ProcessPoolExecutor(max_workers=args.jobs, mp_context=get_context("spawn")) as pool:
        futures = [pool.submit(run_one, mode, seed, cfg) for mode, seed in tasks]
        for f in as_completed(futures):
            r = f.result()
            runs.append(r)
            print(f"{r['mode']} seed {r['seed']}: final success {r['success'][-1]:.2f}, {r['seconds']:.0f} s "
                  f"({r['eval_seconds']:.0f} s evaluating)", flush=True)
    total = time.perf_counter() - start
    summary = summarise(runs, args.modes)
    json_path = os.path.join(args.out, "learning_check.json")
    png_path = os.path.join(args.out, "learning_check.png")
    with open(json_path, "w") as f:
        json.dump({"config": cfg, "env": ENV_ID, "total_seconds": total, "summary": summary,
                   "runs": sorted(runs, key=lambda r: (r["mode"], r["seed"]))}, f, indent=1)
    plot(summary, cfg, png_path)
    print_tables(runs, summary, cfg)
    print(f"{len(runs)} runs in {total:.0f} s; wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
