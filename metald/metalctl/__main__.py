"""``python -m metald.metalctl``: the same program as ``metalctl``."""

import sys

from .main import main

sys.exit(main())
