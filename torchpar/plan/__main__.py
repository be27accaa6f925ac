"""python -m torchpar.plan: the same as ``torchpar plan``."""

import sys

from torchpar.plan.search import main

sys.exit(main())
