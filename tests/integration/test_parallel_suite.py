"""Runs tests/parallel through the real launcher at np=1, 2 and 3.

Every rank runs the same pytest session; ``-x`` makes a failing rank exit at once, and the
launcher then ends the others, so a failure can never leave a rank waiting.
"""

import pytest

from tests.launcher import check, pytest_on_ranks


@pytest.mark.parametrize("np", [1, 2, 3])
def test_parallel_suite(np):
    result = check(pytest_on_ranks(np, "tests/parallel", timeout=900))
    for rank in range(np):
        assert f"[{rank}]<stdout>:" in result.stdout
    assert " passed" in result.stdout and " failed" not in result.stdout
