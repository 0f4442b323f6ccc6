"""`python -m callscope ...` runs the `callscope` command (see `callscope.cli`)."""

import sys

from callscope.cli import main

if __name__ == "__main__":
    sys.exit(main())
