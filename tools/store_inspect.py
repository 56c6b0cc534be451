"""Show what a store holds (format, fields, episodes, statistics, the dataset card): ``her-store inspect``.

    python tools/store_inspect.py PATH_OR_URL [--json] [--episodes [SELECTION]] [--page N] [--page-size K]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from her_store.cli.main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["inspect", *sys.argv[1:]]))
