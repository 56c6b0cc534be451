"""``python -m her_store.cli``: the ``her-store`` command."""

import sys

from her_store.cli.main import main

sys.exit(main())
