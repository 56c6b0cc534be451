"""Copy a store between local disk and object storage, up to one commit, resumable: ``her-store copy``.

    python tools/store_copy.py SRC DEST [--quiet]   (SRC may also be an http(s):// URL)
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from her_store.cli.main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["copy", *sys.argv[1:]]))
