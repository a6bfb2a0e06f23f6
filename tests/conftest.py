"""Test tiers: unit tests run here; tests/parallel runs only under the launcher.

``tests/parallel`` holds tests that run unchanged at any number of ranks; the integration test
``tests/integration/test_parallel_suite.py`` runs them through ``syncdp-run`` at np=1 and np=2.
"""

import os

# The directory itself, not only its files: its conftest.py initializes MPI on import.
collect_ignore = [] if os.environ.get("SYNCDP_LAUNCHER") else ["parallel"]


def pytest_sessionstart(session):
    """Removes the Open MPI session directories killed mpiruns left (a test run kills many):
    one would stop a later mpirun that gets its process id. The launcher does this itself
    (:func:`syncdp.launch.cleanup.remove_stale_session_dirs`); this covers the tests that start
    mpirun directly."""
    if not os.environ.get("SYNCDP_LAUNCHER"):
        from syncdp.launch.cleanup import remove_stale_session_dirs

        remove_stale_session_dirs()
