"""`python -m specserve.server [flags]`: the same as `specserve serve [flags]`."""

import sys

from specserve.server.cli import main

if __name__ == "__main__":
    sys.exit(main())
