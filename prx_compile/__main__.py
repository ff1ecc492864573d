"""``python -m prx_compile``: the ``prx-compile`` command."""

import sys

from .cli import main

sys.exit(main())
