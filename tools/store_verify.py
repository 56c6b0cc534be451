import sys

from her_store.cli.main import main

sys.exit(main(["verify", *sys.argv[1:]]))
