"""``python -m ngra ...``: the same command line as the ``ngra`` script."""

import sys

from .cli import main

sys.exit(main())
