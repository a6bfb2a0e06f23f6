"""Keras 2 through tf-keras: tests/parallel/test_keras2.py through the real launcher at np=1, 2
and 3, with ``TF_USE_LEGACY_KERAS=1`` (so ``tf.keras`` is tf-keras in every rank).

One pytest session per rank for the whole module (TensorFlow and tf-keras load once per rank);
``-x`` makes a failing rank exit at once, and the launcher then ends the others.
"""

import importlib.util

import pytest

from tests.launcher import check, pytest_on_ranks

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("tf_keras") is None,
    reason="tf-keras is not installed (pip install tf-keras): no Keras 2 to test",
)


@pytest.mark.parametrize("np", [1, 2, 3])
def test_keras2_suite(np):
    result = check(
        pytest_on_ranks(
            np,
            "-W",
            "ignore::UserWarning",  # tf-keras' notes on h5 files and lr=, once per rank
            "tests/parallel/test_keras2.py",
            env={"TF_USE_LEGACY_KERAS": "1"},
            timeout=600,
        )
    )
    for rank in range(np):
        assert f"[{rank}]<stdout>:" in result.stdout
    summaries = [line for line in result.stdout.splitlines() if " passed" in line]
    assert len(summaries) == np, result.stdout[-3000:]
    for line in summaries:  # nothing skipped: tf.keras was tf-keras in every rank
        assert "failed" not in line and "skipped" not in line and "error" not in line, line
