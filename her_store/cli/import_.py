"""The ``her-store import`` command: its arguments, its help and its run.

It reads a Minari dataset, an npz, HDF5 or OGBench file or an SB3 replay-buffer pickle into a new store
(:func:`her_store.interop.import_.import_source`).
"""

from __future__ import annotations

import argparse

from her_store.interop.formats import IMPORTS
from her_store.interop.import_ import import_source

__all__ = ["add_arguments", "run"]

HELP = """\
Reads SOURCE into a NEW store at STORE (refused if STORE exists; nothing is left there unless the whole import
succeeds). Formats: a Minari dataset (its id in the local Minari root, or its directory); an npz or HDF5 file written
by her-store export (spaces and dataset card come back exactly); an OGBench npz (observations, actions, terminals:
episodes are split at terminals); an SB3 save_replay_buffer pickle of a DictReplayBuffer or HerReplayBuffer.

An OGBench file without achieved_goal/desired_goal arrays imports with achieved_goal = the observation and
desired_goal = the episode's final observation (every row), reward 0 on the last transition and -1 before it (unless
it has rewards), terminated where masks is 0 (none without masks) and the last step truncated.

WARNING: an SB3 pickle is unpickled, and unpickling runs code from the file. This import (--from sb3, or a
.pkl/.pickle SOURCE) is the only place her_store does that: import only pickles you trust. Opening a store never
runs code."""


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    """Declare the arguments of ``her-store import`` (``name``, the command's name, is ``"import"``).

    Examples
    --------
    >>> p = argparse.ArgumentParser(); add_arguments(p, "import")
    >>> p.parse_args(["episodes.npz", "runs/point", "--from", "npz"]).fmt
    'npz'
    """
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = HELP
    parser.add_argument("source", metavar="SOURCE", help="a file, a Minari dataset id or directory")
    parser.add_argument("store", metavar="STORE", help="the new store's directory; must not exist")
    parser.add_argument(
        "--from",
        dest="fmt",
        choices=list(IMPORTS),
        help="the format of SOURCE (default: guessed from its name and arrays); sb3 unpickles, which runs code",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    """Run ``her-store import``; returns the exit status."""
    n = import_source(args.source, args.store, args.fmt, progress=not args.quiet)
    print(f"imported {n:,} episodes into {args.store}")
    return 0
