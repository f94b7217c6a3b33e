"""``python -m cluster`` is ``prefixserve``."""

from cluster.cli import main

raise SystemExit(main())
