"""Pack a store into one zip file that opens read-only in place: ``her-store pack STORE ARCHIVE.zip``."""

import sys

from her_store.cli.main import main

sys.exit(main(["pack", *sys.argv[1:]]))
