"""``python -m nbkv.bench``."""

import sys

from nbkv.bench.cli import main

sys.exit(main())
