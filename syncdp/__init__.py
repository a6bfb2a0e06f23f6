"""syncdp: synchronous data-parallel training for TensorFlow on MPI, with Horovod's API.

Importing syncdp starts no MPI; ``syncdp.init()`` does.

The layers, each importing only the ones above it in this list:

    syncdp.core        rank environment: settings, MPI, communicator, watchdog, topology
    syncdp.engine      the reduction engine: buckets, packing, reduce, unpack (NumPy + MPI)
    syncdp.tensorflow  the TensorFlow face: collectives on tensors, DistributedGradientTape
    syncdp.data        each rank's TFRecord shards, the same number of steps everywhere
    syncdp.checkpoint  rank 0 writes, every rank restores
    syncdp.keras       the Keras face: DistributedOptimizer, callbacks

Example:
    >>> import syncdp
    >>> syncdp.init()
    >>> print(syncdp.rank(), syncdp.size())

Launch N ranks with ``syncdp-run -np N python train.py``.
"""

# The data and checkpoint layers, so `syncdp.data.tfrecord_dataset` works after `import syncdp`.
from syncdp import checkpoint as checkpoint
from syncdp import data as data
from syncdp.tensorflow import *  # noqa: F403
from syncdp.tensorflow import __all__ as _tensorflow_all

__version__ = "0.1.0"

__all__ = list(_tensorflow_all)
