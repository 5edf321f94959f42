"""python -m benchmarks.learning: the learning benchmark's one entry point (cli.py)."""

import sys

from benchmarks.learning.cli import main

sys.exit(main())
