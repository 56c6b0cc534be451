"""The ``her-store`` command: one sub-command per job, each implemented in the module that owns it.

``demo`` (collect, commit, reopen, read back) lives here; the dataset commands (``inspect``, also named ``info``,
``verify``, ``card``, ``plot``, ``export``, ``import``, ``copy``, ``pack``) are in their own modules, which declare
their arguments (``add_arguments``) and run them (``run``); ``train`` parses its own options. Modules are imported
only when their command runs or shows its help, and a broken input ends as one line on stderr and a non-zero status.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
import warnings
from collections.abc import Sequence

import numpy as np

from her_store.datasets.opening import open_store
from her_store.errors import StoreError
from her_store.progress import progress as progress_bar
from her_store.store.episode_store import EpisodeStore

__all__ = ["collect", "main"]


def collect(
    store: EpisodeStore, env_id: str, n_envs: int, steps: int, seed: int = 0, progress: bool = True
) -> list[int]:
    """Run a uniformly random policy in ``n_envs`` copies of ``env_id`` for ``steps`` steps, writing every episode.

    Envs are stepped the way SB3 does: an env that ends reports its terminal observation as ``next_obs`` and is
    reset before the next step.
    """
    import gymnasium as gym

    envs = [gym.make(env_id) for _ in range(n_envs)]
    obs = [env.reset(seed=seed + i)[0] for i, env in enumerate(envs)]
    for i, env in enumerate(envs):
        env.action_space.seed(seed + i)
    writer = store.writer(n_envs)

    def stack(dicts):
        return {k: np.stack([d[k] for d in dicts]) for k in dicts[0]}

    bar = progress_bar(steps, "collecting", progress, unit="step")
    for _ in range(steps):
        actions = np.stack([env.action_space.sample() for env in envs])
        results = [env.step(a) for env, a in zip(envs, actions)]
        next_obs = [r[0] for r in results]
        writer.add(
            stack(obs), stack(next_obs), actions,
            np.array([r[1] for r in results], np.float32),
            np.array([r[2] for r in results]), np.array([r[3] for r in results]),
            [r[4] for r in results],
        )
        obs = [env.reset()[0] if r[2] or r[3] else o for env, r, o in zip(envs, results, next_obs)]
        bar.update(1)
    bar.close()
    return writer.episode_ids


def cmd_demo(args: argparse.Namespace) -> int:
    import gymnasium as gym

    from her_store.envs import ENV_ID

    env = gym.make(args.env or ENV_ID)
    assert isinstance(env.observation_space, gym.spaces.Dict), "a goal env has Dict observations"
    t = time.perf_counter()
    with open_store(
        args.path, env.observation_space, env.action_space, capacity=args.capacity, info_keys=["is_success"],
        metadata={"env_id": args.env or ENV_ID, "algorithm_name": "random policy", "description": "her-store demo"},
    ) as store:
        resumed_from = store.end_episode
        ids = collect(store, args.env or ENV_ID, args.n_envs, args.steps, seed=resumed_from, progress=not args.quiet)
    print(f"wrote {len(ids)} episodes ({args.steps * args.n_envs:,} steps) in {time.perf_counter() - t:.2f} s"
          f"{f', resuming after episode {resumed_from - 1}' if resumed_from else ''}")
    from her_store.ops.inspect import print_summary, summary

    with EpisodeStore.open(args.path) as store:
        print("the store, reopened read-only:")
        print_summary(summary(store))
        if store.num_episodes:  # (a few steps may end no episode)
            last = store.episode(store.end_episode - 1)
            print(f"last episode read back and checksum-verified: {last!r}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from her_store.integrations.train import main as train_main

    return train_main(args.train_args)


# command -> (module that runs it, one line of help). Each module has add_arguments(parser) and run(args) -> int.
DATASET_COMMANDS: dict[str, tuple[str, str]] = {
    "inspect": ("her_store.ops.inspect", "what a store holds: format, fields, episodes, statistics, the dataset card"),
    "verify": ("her_store.cli.verify", "check every invariant of FORMAT.md and every episode's crc32; --repair"),
    "card": ("her_store.ops.inspect", "show or edit the dataset card (--set key=value), with a commit"),
    "plot": ("her_store.ops.plot", "success, return, episode lengths and goals reached, as a PNG"),
    "export": ("her_store.cli.export", "write episodes as npz, hdf5, a Minari dataset or OGBench's npz"),
    "import": ("her_store.cli.import_", "read episodes from Minari, hdf5, npz, OGBench or an SB3 replay-buffer pickle"),
    "copy": ("her_store.ops.copy", "copy a store between local disk and object storage (consistent, resumable)"),
    "pack": ("her_store.ops.pack", "pack a store into one zip file that opens read-only in place"),
}
ALIASES: dict[str, list[str]] = {"inspect": ["info"]}  # "her-store info" is inspect
EXIT_ERROR = 2  # a broken input or a failed operation; verify exits 1 for a corrupt store


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``her-store``.

    Examples
    --------
    >>> main(["inspect", "runs/fetch", "--json"])  # doctest: +SKIP
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    # no option is taken for an abbreviation of another (--step is not --steps): every parser says allow_abbrev=False
    p = argparse.ArgumentParser(
        prog="her-store", description="Persistent episode stores for Hindsight Experience Replay", allow_abbrev=False
    )
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="collect episodes with a random policy into a store, reopen it, read it back",
                       allow_abbrev=False)
    d.add_argument("path", nargs="?", default="demo_store", help="store path or URL (default: ./demo_store)")
    d.add_argument("--env", help="gymnasium goal env id (default: her_store/PointGoal-v0)")
    d.add_argument("--steps", type=int, default=5_000, help="steps per env")
    d.add_argument("--n-envs", type=int, default=4)
    d.add_argument("--capacity", type=int, default=None, help="ring capacity in transitions (default: unbounded)")
    d.add_argument("--quiet", action="store_true", help="no progress bar")
    d.set_defaults(func=cmd_demo)
    # train's options are parsed by its own parser (her_store.integrations.train), imported only when it runs
    t = sub.add_parser("train", add_help=False, help="train an SB3 agent with HER on a store; run again to resume",
                       allow_abbrev=False)
    t.set_defaults(func=cmd_train)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (_, text) in DATASET_COMMANDS.items():
        aliases = ALIASES.get(name, [])
        c = sub.add_parser(name, help=text, description=text, aliases=aliases, allow_abbrev=False)
        if chosen in (name, *aliases):  # only the command that runs imports its module
            module = importlib.import_module(DATASET_COMMANDS[name][0])
            module.add_arguments(c, name)
            c.set_defaults(func=module.run)
    args, rest = p.parse_known_args(argv)
    if args.command != "train" and rest:  # said by the command's own parser: "her-store verify: error: ..."
        sub.choices[args.command].error(f"unrecognized arguments: {' '.join(rest)}")
    args.train_args = rest
    try:
        with warnings.catch_warnings():  # a library's warning (a cast stated, episodes left out) as one line
            warnings.showwarning = lambda message, *_: print(f"her-store {args.command}: {message}", file=sys.stderr)
            return int(args.func(args))
    except KeyboardInterrupt:
        print(f"her-store {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of stdout went away (`her-store inspect ... | head`): nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (Python's flush at exit would fail again)
        return 141  # 128 + SIGPIPE, as a shell's own commands end
    except (StoreError, OSError, ValueError, ImportError, KeyError, RecursionError, MemoryError) as e:
        if args.command == "train":  # the main job says what went wrong itself (integrations.train)
            raise
        message = e.args[0] if isinstance(e, KeyError) and e.args else e
        if isinstance(e, (RecursionError, MemoryError)):  # what a crafted input makes of a parser
            message = f"{type(e).__name__}: {e} (a damaged or crafted input?)"
        print(f"her-store {args.command}: {message}", file=sys.stderr)
        return EXIT_ERROR

