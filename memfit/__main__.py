"""``python -m memfit``: the ``memfit`` command, for an environment whose scripts directory is not on PATH."""
import sys

from memfit.cli import main

sys.exit(main())
