"""Horovod's module path: ``import syncdp.tensorflow.keras as hvd`` where
``horovod.tensorflow.keras`` was.

A thin re-export of :mod:`syncdp.keras`; there is no second implementation here.
``syncdp.tensorflow.keras.callbacks`` and ``.elastic`` are :mod:`syncdp.keras.callbacks` and
:mod:`syncdp.keras.elastic` themselves (the same module
object under Horovod's path), whichever of the two names is imported first.
"""

import sys

from syncdp.keras import *  # noqa: F403
from syncdp.keras import (
    __all__,  # noqa: F401
    callbacks,
    elastic,
)

sys.modules[__name__ + ".callbacks"] = callbacks
sys.modules[__name__ + ".elastic"] = elastic
