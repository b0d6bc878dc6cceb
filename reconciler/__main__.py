"""`python -m reconciler`: the same as the `reconciler` command."""

import sys

from reconciler.cli import main

sys.exit(main())
