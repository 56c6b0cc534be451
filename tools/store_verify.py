import sys

from her_store.cli import main

sys.exit(main(["verify", *sys.argv[1:]]))
