"""``python -m syncdp.launch`` is ``syncdp-run``."""

import sys

from syncdp.launch.run import main

sys.exit(main())
