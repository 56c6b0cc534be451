import sys

from her_store.cli import main

sys.exit(main(["copy", *sys.argv[1:]]))
