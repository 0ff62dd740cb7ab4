"""``python -m mpiring``: see ``mpiring.cli``."""

import sys

from .cli import main

sys.exit(main())
