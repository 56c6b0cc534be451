"""Show or edit a store's dataset card: ``her-store card``.

    python tools/store_card.py STORE [--json] [--set KEY=VALUE ...]   (KEY= removes a field)
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from her_store.cli.main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["card", *sys.argv[1:]]))
