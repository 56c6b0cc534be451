"""Collect episodes of a goal env into a store, reopen it read-only and read them back: ``her-store demo``.

    python tools/demo.py [PATH] [--steps N] [--n-envs K] [--capacity C]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from her_store.cli.main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["demo", *sys.argv[1:]]))
