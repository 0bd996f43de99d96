"""``python -m kvscope``: see ``kvscope.cli``."""

import sys

from kvscope.cli import main

if __name__ == "__main__":
    sys.exit(main())
