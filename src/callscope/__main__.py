"""`python -m callscope ...` runs the `callscope` command (see `callscope.cli`)."""

import sys

from callscope.cli import main

sys.exit(main())
