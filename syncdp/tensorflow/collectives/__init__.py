"""TensorFlow collectives: allreduce, allgather, broadcast on tensors, eagerly and in tf.function.

One module per family, all re-exported here:

    _common     reduce operations, call signatures, a process set's communicator, dtype checks
    allreduce   allreduce, grouped_allreduce, fused_allreduce (the engine's buckets), Adasum
    gather      allgather, grouped_allgather, broadcast
    alltoall    alltoall, reducescatter, grouped_reducescatter
    objects     broadcast_, broadcast_variables, broadcast_object(_fn), allgather_object,
                barrier, join

The TensorFlow face of the engine: each function here turns tensors into NumPy arrays and hands
them to :mod:`syncdp.engine` (allreduces) or the communicator (the rest), eagerly or from an
ordered graph node (:mod:`syncdp.tensorflow.graph`), so the collectives of a traced step run in
the same order on every rank. The communicator is looked up when the collective runs, not when
it is traced.

Every function here is a synchronization point: all ranks of its process set (the whole job by
default) must call it, in the same order, with tensors of the same dtype and (except the first
dimension of allgather and alltoall) the same shape. Before any data moves, the ranks agree on
each call's signature (one integer collective): ranks that passed different dtypes, shapes,
ops, roots or names get :class:`~syncdp.tensorflow.graph.MismatchError` (TensorFlow's
``FailedPreconditionError``, as in Horovod) on every rank, and the job can go on.
"""

from syncdp.job.process_sets import global_process_set  # noqa: F401 - the default set
from syncdp.tensorflow.collectives._common import (
    Adasum,
    Average,
    Max,
    Min,
    NotInProcessSetError,
    Product,
    ReduceOp,
    Sum,
    _comm,  # noqa: F401 - DistributedGradientTape's communicator
    reduce_op,  # noqa: F401 - the tapes' and optimizers' reading of op
)
from syncdp.tensorflow.collectives.allreduce import (
    adasum_tree,  # noqa: F401
    allreduce,
    fused_allreduce,  # noqa: F401 - DistributedGradientTape's buckets
    grouped_allreduce,
)
from syncdp.tensorflow.collectives.alltoall import alltoall, grouped_reducescatter, reducescatter
from syncdp.tensorflow.collectives.gather import allgather, broadcast, grouped_allgather
from syncdp.tensorflow.collectives.objects import (
    allgather_object,
    barrier,
    broadcast_,
    broadcast_global_variables,
    broadcast_object,
    broadcast_object_fn,
    broadcast_variables,
    join,
)

__all__ = [
    "ReduceOp",
    "Average",
    "Sum",
    "Min",
    "Max",
    "Product",
    "Adasum",
    "NotInProcessSetError",
    "allreduce",
    "grouped_allreduce",
    "allgather",
    "grouped_allgather",
    "broadcast",
    "broadcast_",
    "alltoall",
    "reducescatter",
    "grouped_reducescatter",
    "broadcast_variables",
    "broadcast_global_variables",
    "broadcast_object_fn",
    "broadcast_object",
    "allgather_object",
    "barrier",
    "join",
]
