"""Test tiers: unit tests run here; tests/parallel runs only under the launcher.

``tests/parallel`` holds tests that run unchanged at any number of ranks; the integration test
``tests/integration/test_parallel_suite.py`` runs them through ``syncdp-run`` at np=1 and np=2.
"""

import os

# The directory itself, not only its files: its conftest.py initializes MPI on import.
collect_ignore = [] if os.environ.get("SYNCDP_LAUNCHER") else ["parallel"]
