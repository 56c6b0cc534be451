import sys

from her_store.cli.main import main

sys.exit(main(["import", *sys.argv[1:]]))
