"""``python -m dedup`` runs the command line."""

import sys

from dedup.cli import main

sys.exit(main())
