"""``her-store verify [--repair]``: the command line of verify and repair.

It runs :func:`~her_store.ops.verify.verify`, and :func:`~her_store.ops.repair.repair` with ``--repair``.
"""

from __future__ import annotations

import argparse

from her_store.errors import CorruptStoreError
from her_store.ops.repair import repair
from her_store.ops.verify import verify

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    """The options of ``her-store verify``."""
    parser.add_argument("path", help="store path or URL (s3://bucket/name, https://...)")
    parser.add_argument(
        "--repair",
        action="store_true",
        help="local stores: drop episodes that fail their crc32 or miss rows, and any uncommitted tail, with a new "
        "commit (every dropped or renumbered episode is printed)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.epilog = "Exit status: 0 clean, 1 corrupt (the problems are listed), 2 not a store or not readable."


def run(args: argparse.Namespace) -> int:
    """Run ``her-store verify``: 0 when the store is clean (after a repair, when repaired), 1 when it is corrupt."""
    show = not args.quiet
    if args.repair:
        try:
            report = repair(args.path, progress=show)
        except CorruptStoreError as e:
            print(f"her-store verify: {e}")
            return 1
        return 0 if report.clean else 1
    report = verify(args.path, progress=show)
    print(report.summary())
    return 0 if report.clean else 1
