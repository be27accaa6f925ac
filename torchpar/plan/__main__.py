"""python -m torchpar.plan: the same as ``torchpar plan``."""

import sys

from torchpar.console import run_command
from torchpar.plan.search import main

sys.exit(run_command(main))
