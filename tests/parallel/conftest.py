"""Every rank runs the same pytest session; syncdp is initialized once for all of it."""

import pytest
import tensorflow as tf

tf.config.threading.set_intra_op_parallelism_threads(1)

import syncdp  # noqa: E402

syncdp.init()


@pytest.fixture
def hvd():
    """The syncdp module, initialized."""
    return syncdp
