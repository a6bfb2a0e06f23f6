"""``python -m launch`` is ``syncdp-run``."""

import sys

from launch.run import main

sys.exit(main())
