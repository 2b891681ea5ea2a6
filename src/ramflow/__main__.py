"""``python -m ramflow``: the same as the ``ramflow`` command."""

import sys

from .cli import main

sys.exit(main())
