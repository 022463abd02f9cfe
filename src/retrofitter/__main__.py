"""``python -m retrofitter`` = the ``retrofitter`` command."""

import sys

from .cli import main

sys.exit(main())
