"""``python -m bench ...``: the same as ``prefixserve bench ...``."""

import sys

from bench.cli import main

sys.exit(main())
