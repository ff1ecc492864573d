"""``python -m prx_compile``: the ``prx-compile`` command."""

import sys

from .tools.cli import main

sys.exit(main())
