"""``python -m omnibal_compile.cli``: the ``omnibal-compile`` command."""

import sys

from omnibal_compile.cli import main

sys.exit(main())
