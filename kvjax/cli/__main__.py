"""`python -m kvjax.cli`: the `kvjax` command."""

import sys

from kvjax.cli import main

sys.exit(main())
