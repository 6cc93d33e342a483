"""``python -m freescale`` is the ``freescale`` command."""

import sys

from .cli import main

sys.exit(main())
