"""Horovod's module path: ``import syncdp.tensorflow.keras as hvd`` where
``horovod.tensorflow.keras`` was.

The Keras face for the Keras ``tf.keras`` stands for, as Horovod's module is: Keras 2 (tf-keras)
under ``TF_USE_LEGACY_KERAS=1``, Keras 3 otherwise. It re-exports :mod:`syncdp.keras`, with the
Keras-specific names built for that Keras (:mod:`syncdp.keras._face`; no second
implementation): ``callbacks``, ``elastic``, ``CheckpointCallback``, ``load_model`` and
``SyncBatchNormalization``. Where ``tf.keras`` is Keras 3 they are :mod:`syncdp.keras`'s own
objects, and ``syncdp.tensorflow.keras.callbacks`` and ``.elastic`` are
:mod:`syncdp.keras.callbacks` and :mod:`syncdp.keras.elastic` themselves (the same module
object under Horovod's path). ``DistributedOptimizer`` wraps an optimizer of either Keras.
"""

import sys

from syncdp.keras import *  # noqa: F403
from syncdp.keras import __all__, _face  # noqa: F401
from syncdp.tensorflow.keras2_names import package_behind_tf_keras

_names = _face.names(package_behind_tf_keras(), __name__)
DistributedOptimizer = _names["DistributedOptimizer"]
PartialDistributedOptimizer = _names["PartialDistributedOptimizer"]
load_model = _names["load_model"]
CheckpointCallback = _names["CheckpointCallback"]
SyncBatchNormalization = _names["SyncBatchNormalization"]
callbacks = _names["callbacks"]
elastic = _names["elastic"]

sys.modules[__name__ + ".callbacks"] = callbacks
sys.modules[__name__ + ".elastic"] = elastic
