"""``python -m vmlab up|down|status``: the same command line as ``vm-lab``."""

import sys

from .cli import main

sys.exit(main())
