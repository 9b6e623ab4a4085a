"""``python -m tenantkv.cli``: the same entry point as the ``tenantkv`` script."""

import sys

from .commands import main

sys.exit(main())
