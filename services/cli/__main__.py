"""``python -m services.cli``: the `xtoken` console script run by the interpreter (how launchers
start a run's processes)."""

import sys

from services.cli import main

sys.exit(main())
