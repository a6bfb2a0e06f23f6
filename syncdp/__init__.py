"""syncdp: synchronous data-parallel training for TensorFlow on MPI, with Horovod's API.

Example:
    >>> import syncdp
    >>> syncdp.init()
    >>> print(syncdp.rank(), syncdp.size())

Launch N ranks with ``syncdp-run -np N python train.py``.
"""

# The data and checkpoint layers, so `syncdp.data.tfrecord_dataset` works after `import syncdp`.
from syncdp import checkpoint as checkpoint
from syncdp import data as data
from syncdp._exceptions import (
    CheckpointError,
    CollectiveError,
    ConfigError,
    DataError,
    NotInitializedError,
    StallError,
    StepMismatchError,
    SyncdpError,
    VerificationError,
)
from syncdp.compression import Compression
from syncdp.ops import (
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
from syncdp.runtime import (
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
from syncdp.tape import DistributedGradientTape
from syncdp.verify import verify_synchronized

__version__ = "0.1.0"

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
    "StallError",
    "StepMismatchError",
    "VerificationError",
    "CheckpointError",
    "DataError",
]
