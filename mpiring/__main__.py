"""``python -m mpiring``: see ``mpiring.cli``."""

import sys

from mpiring.cli import main

sys.exit(main())
