"""Test tiers: unit tests run here; tests/parallel runs only under the launcher.

``tests/parallel`` holds tests that run unchanged at any number of ranks; the integration test
``tests/integration/test_parallel_suite.py`` runs them through ``syncdp-run`` at np=1 and np=2.
"""

import os

collect_ignore_glob = [] if os.environ.get("SYNCDP_LAUNCHER") else ["parallel/*"]
