"""syncdp for Keras 3: ``import syncdp.keras as hvd`` where ``horovod.keras`` was.

Everything in :mod:`syncdp` (``init``, ``rank``, ``size``, ``allreduce``, ...), plus
:class:`DistributedOptimizer`, :func:`load_model` and the :mod:`~syncdp.keras.callbacks`
module. Keras' progress output stays on rank 0 unless ``SYNCDP_LOG_ALL_RANKS`` is set.
Horovod's Keras 2 spellings ``compile(..., experimental_run_tf_function=False)`` and
``optimizer.lr`` work (:mod:`syncdp.tensorflow.keras2_names`).

``allreduce`` and ``reducescatter`` take the arguments of Horovod's Keras modules, in their
order (:mod:`syncdp.keras.collectives`).

Keras 2 (tf-keras, ``tf.keras`` under ``TF_USE_LEGACY_KERAS=1``) is served by the same code:
``DistributedOptimizer`` wraps an optimizer of either Keras (the wrapper follows the optimizer
given), and :mod:`syncdp.tensorflow.keras` is the face whose callbacks, ``elastic``,
``load_model`` and ``SyncBatchNormalization`` are built for ``tf.keras``'s Keras
(:mod:`syncdp.keras._face`). The ones here are Keras 3's.

Example:
    >>> import keras
    >>> import syncdp.keras as hvd
    >>> hvd.init()
    >>> opt = hvd.DistributedOptimizer(keras.optimizers.Adam(1e-3 * hvd.size()))
    >>> model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    >>> model.fit(dataset, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
    ...                               hvd.callbacks.MetricAverageCallback()])
"""

# ruff: noqa: I001 - the TensorFlow face's names come first: the Keras ones below replace
# some of them (DistributedOptimizer is the Keras class here).
from syncdp.tensorflow import *  # noqa: F403
from syncdp.tensorflow import __all__ as _core_all
import keras as _keras
from syncdp.keras import callbacks
import syncdp.keras.elastic as elastic  # noqa: F401, F811 - replaces the TensorFlow one
from syncdp.keras.checkpoint import CheckpointCallback
from syncdp.keras.collectives import allreduce, reducescatter  # noqa: F401, F811 - Keras order
from syncdp.keras.optimizer import DistributedOptimizer  # noqa: F401 (in _core_all)
from syncdp.keras.optimizer import PartialDistributedOptimizer
from syncdp.keras.saving import load_model
from syncdp.tensorflow.sync_batch_norm import for_package as _sync_batch_norm_for

SyncBatchNormalization = _sync_batch_norm_for(_keras)  # Keras 3's, where tf.keras may be Keras 2

__all__ = [
    *_core_all,  # includes "DistributedOptimizer", bound above to the Keras class
    "PartialDistributedOptimizer",
    "load_model",
    "callbacks",
    "CheckpointCallback",
]
