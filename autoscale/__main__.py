"""``python -m autoscale``: the same command line as ``autoscale``."""

import sys

from autoscale.cli import main

sys.exit(main())
