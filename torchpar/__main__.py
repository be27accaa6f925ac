"""``python -m torchpar <command> [args]``: the same as the ``torchpar`` console script."""

import sys

from torchpar.commands import main

sys.exit(main())
