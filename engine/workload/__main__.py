"""``python -m engine.workload FILE [options]``: see cli.py."""

import sys

from .cli import main

sys.exit(main())
