"""``python -m nbkv.bench``."""

import sys

from .cli import main

sys.exit(main())
