import sys

from her_store.cli import main

sys.exit(main(["import", *sys.argv[1:]]))
