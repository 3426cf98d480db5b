"""``python -m bench``: the kvbench command (bench/cli.py)."""

import sys

from bench.cli import main

sys.exit(main())
