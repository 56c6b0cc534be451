"""The ``her-store export`` command: its arguments, its help and its run.

It writes a store's episodes as npz, HDF5, a Minari dataset or OGBench's npz
(:func:`her_store.interop.export.export_store`).
"""

from __future__ import annotations

import argparse

from her_store.interop.export import export_store
from her_store.interop.formats import EXPORTS
from her_store.interop.layout import HEADER_KEY

__all__ = ["add_arguments", "run"]

HELP = f"""\
Writes whole episodes of a store (local path or URL) to DEST with the store's spaces and dataset card, bit-exact.
DEST must not exist; nothing is left there unless the whole export succeeds.
  npz      one file: per-field arrays, episodes concatenated (observations/<key>: T+1 rows per episode; actions,
           rewards, terminations, truncations, infos/<key>: T rows), episode_lengths, episode_ids and {HEADER_KEY}
           (JSON); numpy.load(DEST, allow_pickle=False) reads it
  hdf5     Minari's episode layout: groups episode_<id>/observations/<key>, actions, rewards, terminations,
           truncations, infos/<key>; spaces and card in the root attribute {HEADER_KEY}
  minari   a local Minari dataset directory that minari.load_dataset opens, the card as its metadata; DEST is
           named name-v<version> unless the card has a dataset_id, and the directories above it are made
  ogbench  OGBench's npz layout (observations, actions, terminals; T+1 rows per episode, the last action zero,
           terminals 1 on it) that ogbench.utils.load_dataset reads, plus achieved_goal, desired_goal, rewards,
           masks, truncations and info keys"""


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    """Declare the arguments of ``her-store export`` (``name``, the command's name, is ``"export"``).

    Examples
    --------
    >>> p = argparse.ArgumentParser(); add_arguments(p, "export")
    >>> p.parse_args(["runs/point", "--to", "npz", "point.npz"]).to
    'npz'
    """
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = HELP
    parser.add_argument("source", metavar="PATH_OR_URL", help="the store to export")
    parser.add_argument("--to", required=True, choices=list(EXPORTS), help="the format to write")
    parser.add_argument("dest", metavar="DEST", help="the file (or Minari dataset) to write; must not exist")
    parser.add_argument(
        "--episodes",
        metavar="SELECTION",
        help="episode ids and ranges, e.g. '0:100,250' (default: all live episodes); a selection starting with '-' "
        "is written --episodes=-10:",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    """Run ``her-store export``; returns the exit status."""
    n, transitions = export_store(args.source, args.to, args.dest, args.episodes, progress=not args.quiet)
    print(f"exported {n:,} episodes ({transitions:,} transitions) to {args.dest} as {args.to}")
    return 0
