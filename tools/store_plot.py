"""Draw a store's success, return, episode lengths and final goals as one PNG: ``her-store plot``.

    python tools/store_plot.py PATH_OR_URL -o out.png [--window N] [--goal-episodes N]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from her_store.cli.main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["plot", *sys.argv[1:]]))
