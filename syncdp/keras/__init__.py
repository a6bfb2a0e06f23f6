"""syncdp for Keras 3: ``import syncdp.keras as hvd`` where ``horovod.keras`` was.

Everything in :mod:`syncdp` (``init``, ``rank``, ``size``, ``allreduce``, ...), plus
:class:`DistributedOptimizer`, :func:`load_model` and the :mod:`~syncdp.keras.callbacks`
module. Keras' progress output stays on rank 0 unless ``SYNCDP_LOG_ALL_RANKS`` is set.
Horovod's Keras 2 spellings ``compile(..., experimental_run_tf_function=False)`` and
``optimizer.lr`` work (:mod:`syncdp.tensorflow.keras2_names`).

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
from syncdp.keras import callbacks
import syncdp.keras.elastic as elastic  # noqa: F401, F811 - replaces the TensorFlow one
from syncdp.keras.checkpoint import CheckpointCallback
from syncdp.keras.optimizer import DistributedOptimizer  # noqa: F401 (in _core_all)
from syncdp.keras.optimizer import PartialDistributedOptimizer, load_model

__all__ = [
    *_core_all,  # includes "DistributedOptimizer", bound above to the Keras class
    "PartialDistributedOptimizer",
    "load_model",
    "callbacks",
    "CheckpointCallback",
]
