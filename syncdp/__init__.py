"""syncdp: synchronous data-parallel training for TensorFlow on MPI, with Horovod's API.

Importing syncdp starts no MPI (``syncdp.init()`` does) and loads no TensorFlow until a name
that needs it is used.

The layers, each importing only the ones above it in this list:

    syncdp.base        who this rank is: settings, errors, MPI, topology
    syncdp.watch       reports to the launcher, time accounting, timeline, watchdog
    syncdp.transport   how bytes move: the communicator, shared memory, the ring among hosts
    syncdp.membership  elastic membership: recovery, warm spares, commits on disk
    syncdp.job         init(), shutdown(), the job's communicator, process sets
    syncdp.engine      the reduction engine: buckets, packing, reduce, unpack (NumPy + MPI)
    syncdp.elastic     elastic training's state and recovery loop (hvd.elastic's core)
    syncdp.tensorflow  the TensorFlow face: collectives on tensors, DistributedGradientTape
    syncdp.data        each rank's TFRecord shards, the same number of steps everywhere
    syncdp.checkpoint  rank 0 writes, every rank restores
    syncdp.keras       the Keras face: DistributedOptimizer, callbacks
    syncdp.horovod_names  ``import horovod...`` answered by the layers above
    syncdp.launch      the launcher (``syncdp-run``, ``horovodrun``): starts and watches the
                       ranks; under syncdp, so a user's own ``launch`` module never shadows it

Example:
    >>> import syncdp
    >>> syncdp.init()
    >>> print(syncdp.rank(), syncdp.size())

Launch N ranks with ``syncdp-run -np N python train.py``.
"""

import importlib

__version__ = "0.1.0"

# Importing syncdp loads nothing else: the public names are the TensorFlow face's (its
# __all__ is the one list of them), fetched from syncdp.tensorflow on first use, and the layers
# are imported when first named, so that `syncdp-run` (which reads syncdp.base.settings) starts
# without TensorFlow.
_LAYERS = (
    "base",
    "watch",
    "transport",
    "membership",
    "job",
    "engine",
    "elastic",
    "tensorflow",
    "data",
    "checkpoint",
    "keras",
    "launch",
)


def __getattr__(name: str):
    if name in _LAYERS:
        return importlib.import_module(f"syncdp.{name}")
    face = importlib.import_module("syncdp.tensorflow")
    if name == "__all__" or name in face.__all__:
        value = getattr(face, name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'syncdp' has no attribute {name!r}")


def __dir__() -> list[str]:
    face = importlib.import_module("syncdp.tensorflow")
    return sorted(set(globals()) | set(face.__all__) | set(_LAYERS))
