"""The ``her-store train`` command: an SB3 off-policy agent with HER on a disk store, checkpointed and resumable.

:func:`main` parses the options into a :class:`TrainConfig`, runs :func:`train` and prints the summary table; every
failure is one line. A run lives in a run directory (``--out``, :mod:`~her_store.integrations.train_run_dir`) and,
unless ``--store`` says otherwise, its store in ``<out>/store``; running the same command again resumes it
(:mod:`~her_store.integrations.train_loop`). The job's parts: the options (:mod:`~her_store.integrations.train_config`),
the env (:mod:`~her_store.integrations.train_env`), the evaluation (:mod:`~her_store.integrations.train_eval`), the
summary (:mod:`~her_store.integrations.train_report`) and the failures (:mod:`~her_store.integrations.train_errors`).
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence
from typing import Any

from her_store.format.card import json_object
from her_store.integrations.train_config import OFF_POLICY_ALGOS, TrainConfig
from her_store.integrations.train_env import DEFAULT_ENV, DEFAULT_N_BITS
from her_store.integrations.train_errors import CLEAR_ERRORS, Terminated, one_line
from her_store.integrations.train_eval import evaluate
from her_store.integrations.train_loop import train
from her_store.integrations.train_report import TrainResult
from her_store.integrations.train_run_dir import latest_checkpoint, save_checkpoint

__all__ = [
    "DEFAULT_ENV",
    "OFF_POLICY_ALGOS",
    "Terminated",
    "TrainConfig",
    "TrainResult",
    "build_parser",
    "evaluate",
    "latest_checkpoint",
    "main",
    "save_checkpoint",
    "train",
]


def build_parser(prog: str = "her-store train") -> argparse.ArgumentParser:
    """The options of ``her-store train`` (and ``tools/train.py``).

    Examples
    --------
    >>> build_parser().parse_args(["--algo", "sac", "--steps", "5000"]).algo
    'sac'
    """
    d = TrainConfig()
    p = argparse.ArgumentParser(
        prog=prog,
        description="Train an SB3 off-policy agent with HER on a disk-backed episode store; run again to resume.",
        allow_abbrev=False,
    )
    p.add_argument("--env", default=d.env,
                   help="registered gymnasium goal env id (default: SB3's BitFlippingEnv, "
                        f"{DEFAULT_N_BITS} bits, continuous actions for sac/td3/ddpg)")
    p.add_argument("--algo", default=d.algo, help=f"off-policy algorithm: {', '.join(OFF_POLICY_ALGOS)} (default: dqn)")
    p.add_argument("--out", default=d.out, help=f"run directory: checkpoints, run.json, the store (default: ./{d.out})")
    p.add_argument("--store", default=None, help="store path or fsspec URL (default: <out>/store)")
    p.add_argument("--storage-options", type=json_object, default=None, help="fsspec options of a store URL, as JSON")
    p.add_argument("--steps", type=int, default=d.steps, help=f"total environment steps (default: {d.steps:,})")
    p.add_argument("--capacity", type=int, default=d.capacity,
                   help="replay capacity in transitions (default: 1,000,000)")
    p.add_argument("--strategy", default=d.strategy,
                   help="goal selection: future, final, episode, random (default: future)")
    p.add_argument("--n-sampled-goal", type=int, default=d.n_sampled_goal,
                   help="relabelled goals per transition (default: 4)")
    p.add_argument("--prioritize", choices=["energy"], default=None,
                   help="draw episodes by the energy of their achieved-goal path (default: uniformly)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--n-envs", type=int, default=d.n_envs, help="environments stepped together (default: 1)")
    p.add_argument("--eval-episodes", type=int, default=d.eval_episodes,
                   help=f"episodes of the deterministic policy measuring the success rate (default: {d.eval_episodes})")
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every,
                   help=f"steps between checkpoints (default: {d.checkpoint_every:,})")
    p.add_argument("--algo-kwargs", type=json_object, default={},
                   help="extra algorithm arguments as JSON, e.g. '{\"learning_rate\": 0.001}'")
    p.add_argument("--device", default=d.device, help="torch device (default: auto)")
    p.add_argument("--threads", type=int, default=d.threads,
                   help="torch intra-op threads (default: 1, fastest for small networks; 0: torch's default)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def _terminate(signum: int, frame: Any) -> None:
    raise Terminated


def main(argv: Sequence[str] | None = None, prog: str = "her-store train") -> int:
    """Run ``her-store train`` with ``argv``; print the summary table; return the exit status.

    Every failure prints one line, never a traceback: the job's own checks their message, other errors
    ``her-store train: error: <what failed>: <Type>: <message>``. Bad options and unusable stores or files
    (ValueError, TypeError, ImportError, StoreError, OSError) return 2, any other error 1. Ctrl-C saves a
    checkpoint and returns 130; SIGTERM does the same and returns 143.

    Examples
    --------
    >>> main(["--steps", "5000", "--out", "runs/bits"])  # doctest: +SKIP
    0
    """
    from her_store.ops.inspect import print_table

    args = build_parser(prog).parse_args(argv)
    cfg = TrainConfig(
        env=args.env, algo=args.algo.lower(), out=args.out, store=args.store, steps=args.steps,
        capacity=args.capacity, strategy=args.strategy, n_sampled_goal=args.n_sampled_goal, seed=args.seed,
        n_envs=args.n_envs, eval_episodes=args.eval_episodes, checkpoint_every=args.checkpoint_every,
        algo_kwargs=args.algo_kwargs, storage_options=args.storage_options, device=args.device,
        threads=args.threads, progress=not args.quiet, prioritize=args.prioritize,
    )
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        result = train(cfg, log=lambda msg: print(msg, flush=True))
    except Terminated:
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 -- one line, never a traceback: what failed, and the error
        print(f"{prog}: error: {one_line(e)}", file=sys.stderr)
        return 2 if isinstance(e, CLEAR_ERRORS) else 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    print_table(f"her-store train: {cfg.env}, {cfg.algo.upper()}+HER ({cfg.strategy})", result.rows())
    return 0
