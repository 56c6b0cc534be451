import sys

from her_store.cli import main

sys.exit(main(["export", *sys.argv[1:]]))
