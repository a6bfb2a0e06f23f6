"""The TensorFlow face of syncdp, and Horovod's module path.

``import syncdp.tensorflow as hvd`` works where ``import horovod.tensorflow as hvd`` did. The
modules here adapt tensors to the engine (:mod:`syncdp.engine`) and the communicator
(:mod:`syncdp.core`); they hold no reduction logic of their own:

    graph         collectives as ordered graph nodes inside tf.function
    collectives   allreduce, grouped_allreduce, allgather, broadcast, ... on tensors
    compression   Compression.none / Compression.fp16
    tape          DistributedGradientTape and reduce_gradients (every gradient's path)
    verify        verify_synchronized: bit-identical replicas, checked

``syncdp.tensorflow.keras`` is Horovod's path for the Keras face, :mod:`syncdp.keras`.
"""

from syncdp.core.errors import (
    CheckpointError,
    CollectiveError,
    ConfigError,
    DataError,
    NotInitializedError,
    StepMismatchError,
    SyncdpError,
    UnsupportedError,
    VerificationError,
)
from syncdp.core.runtime import (
    cross_rank,
    cross_size,
    init,
    is_chief,
    is_initialized,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
)
from syncdp.tensorflow.collectives import (
    Average,
    Max,
    Min,
    ReduceOp,
    Sum,
    allgather,
    allgather_object,
    allreduce,
    barrier,
    broadcast,
    broadcast_object,
    broadcast_variables,
    grouped_allreduce,
    join,
)
from syncdp.tensorflow.compression import Compression
from syncdp.tensorflow.tape import DistributedGradientTape
from syncdp.tensorflow.verify import verify_synchronized

__all__ = [
    "init",
    "shutdown",
    "is_initialized",
    "rank",
    "size",
    "local_rank",
    "local_size",
    "cross_rank",
    "cross_size",
    "is_chief",
    "barrier",
    "allreduce",
    "grouped_allreduce",
    "allgather",
    "broadcast",
    "broadcast_variables",
    "broadcast_object",
    "allgather_object",
    "join",
    "ReduceOp",
    "Average",
    "Sum",
    "Min",
    "Max",
    "Compression",
    "DistributedGradientTape",
    "verify_synchronized",
    "SyncdpError",
    "NotInitializedError",
    "ConfigError",
    "CollectiveError",
    "StepMismatchError",
    "UnsupportedError",
    "VerificationError",
    "CheckpointError",
    "DataError",
]
