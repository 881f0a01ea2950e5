"""``python -m tileops.cli``: the same as the ``tileops`` command."""

import sys

from .main import main

sys.exit(main())
