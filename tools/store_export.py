import sys

from her_store.cli.main import main

sys.exit(main(["export", *sys.argv[1:]]))
