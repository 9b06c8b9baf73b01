"""``python -m modelpatch.cli``: the ``modelpatch`` command."""

import sys

from .main import main

sys.exit(main())
