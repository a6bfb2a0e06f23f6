"""The TensorFlow face of syncdp, and Horovod's module path.

``import syncdp.tensorflow as hvd`` works where ``import horovod.tensorflow as hvd`` did. The
modules here adapt tensors to the engine (:mod:`syncdp.engine`) and the communicator
(:mod:`syncdp.transport`); they hold no reduction logic of their own:

    graph         collectives as ordered graph nodes inside tf.function
    collectives   allreduce, grouped_allreduce, allgather, broadcast, ... on tensors
    compression   Compression.none / Compression.fp16
    introspection mpi_built(), nccl_built(), rank_op() ...: what this build is, answered truly
    tape          DistributedGradientTape and reduce_gradients (every gradient's path)
    verify        verify_synchronized: bit-identical replicas, checked
    keras2_names  which Keras an object belongs to (Keras 3 or Keras 2's tf-keras), and
                  Horovod's Keras 2 spellings (compile(experimental_run_tf_function=...),
                  optimizer.lr, lr=) on both

``syncdp.tensorflow.keras`` is Horovod's path for the Keras face, :mod:`syncdp.keras`.
"""

import importlib

import tensorflow as tf

from syncdp.base.errors import (
    CheckpointError,
    CollectiveError,
    ConfigError,
    DataError,
    ElasticAbortError,
    HorovodInternalError,
    HostsUpdatedInterrupt,
    MismatchError,
    NotInitializedError,
    RankFailureError,
    StepMismatchError,
    SyncdpError,
    UnsupportedError,
    VerificationError,
)
from syncdp.job.process_sets import (
    ProcessSet,
    add_process_set,
    comm_process_set_id,
    get_process_set_ids_and_ranks,
    global_process_set,
    remove_process_set,
)
from syncdp.job.runtime import (
    cross_rank,
    cross_size,
    init,
    is_chief,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
    timing,
)
from syncdp.tensorflow import (
    elastic,  # noqa: F401 - hvd.elastic, a module (not in __all__)
    keras2_names,
)
from syncdp.tensorflow.collectives import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    ReduceOp,
    Sum,
    allgather,
    allgather_object,
    allreduce,
    alltoall,
    barrier,
    broadcast,
    broadcast_,
    broadcast_global_variables,
    broadcast_object,
    broadcast_object_fn,
    broadcast_variables,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    join,
    reduce_op,
    reducescatter,
)
from syncdp.tensorflow.compression import Compression
from syncdp.tensorflow.introspection import (
    ccl_built,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    gpu_available,
    local_rank_op,
    local_size_op,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    process_set_included_op,
    rank_op,
    rocm_built,
    size_op,
    sycl_built,
)
from syncdp.tensorflow.legacy import BroadcastGlobalVariablesHook, LegacyDistributedOptimizer
from syncdp.tensorflow.tape import (
    DistributedGradientTape,
    LocalGradientAggregationHelper,
    PartialDistributedGradientTape,
)
from syncdp.tensorflow.tape import check_groups as _check_groups
from syncdp.tensorflow.util import (
    _executing_eagerly,  # noqa: F401 - Horovod tests use it
    check_num_rank_power_of_2,
    handle_average_backwards_compatibility,
    split_list,
)
from syncdp.tensorflow.verify import verify_synchronized

keras2_names.install()

__all__ = [
    "init",
    "shutdown",
    "is_initialized",
    "timing",
    "rank",
    "size",
    "local_rank",
    "local_size",
    "cross_rank",
    "cross_size",
    "is_chief",
    "is_homogeneous",
    "start_timeline",
    "stop_timeline",
    "barrier",
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
    "broadcast_object",
    "broadcast_object_fn",
    "allgather_object",
    "join",
    "ProcessSet",
    "global_process_set",
    "add_process_set",
    "remove_process_set",
    "get_process_set_ids_and_ranks",
    "comm_process_set_id",
    "ReduceOp",
    "Average",
    "Sum",
    "Min",
    "Max",
    "Product",
    "Adasum",
    "handle_average_backwards_compatibility",
    "check_num_rank_power_of_2",
    "split_list",
    "LocalGradientAggregationHelper",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "gloo_built",
    "gloo_enabled",
    "nccl_built",
    "ddl_built",
    "ccl_built",
    "sycl_built",
    "cuda_built",
    "rocm_built",
    "gpu_available",
    "rank_op",
    "size_op",
    "local_rank_op",
    "local_size_op",
    "process_set_included_op",
    "Compression",
    "DistributedGradientTape",
    "PartialDistributedGradientTape",
    "DistributedOptimizer",
    "BroadcastGlobalVariablesHook",
    "broadcast_global_variables",
    "SyncBatchNormalization",
    "verify_synchronized",
    "SyncdpError",
    "NotInitializedError",
    "ConfigError",
    "CollectiveError",
    "StepMismatchError",
    "MismatchError",
    "UnsupportedError",
    "VerificationError",
    "CheckpointError",
    "DataError",
    "RankFailureError",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "ElasticAbortError",
]


def DistributedOptimizer(  # noqa: N802 - Horovod's name for a factory
    optimizer,
    name=None,
    use_locking=False,
    device_dense="",
    device_sparse="",
    compression=Compression.none,
    sparse_as_dense=False,
    backward_passes_per_step=1,
    op=Average,
    gradient_predivide_factor=1.0,
    average_aggregated_gradients=False,
    num_groups=0,
    groups=None,
    process_set=global_process_set,
    scale_local_gradients=True,
):
    """Horovod's ``hvd.DistributedOptimizer``: wraps a TF1, Keras 3 or Keras 2 optimizer.

    A ``tf.compat.v1.train.Optimizer`` becomes a :class:`LegacyDistributedOptimizer` (TF1 graph
    programs, ``MonitoredTrainingSession``); a Keras optimizer becomes a
    :class:`syncdp.keras.DistributedOptimizer`, from the Keras face, which this layer names in
    :data:`_OPTIMIZER_FACES` and loads on first use rather than importing it. Either way the
    gradients are averaged over the ranks of ``process_set`` before every update.

    Raises:
        ValueError: ``optimizer`` is neither, or an argument does not apply to it.
    """
    op = reduce_op(op)
    if gradient_predivide_factor != 1.0 and op is not Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average.")
    _check_groups(num_groups, groups)
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        return LegacyDistributedOptimizer(
            optimizer,
            name=name,
            use_locking=use_locking,
            compression=compression,
            sparse_as_dense=sparse_as_dense,
            op=op,
            gradient_predivide_factor=gradient_predivide_factor,
            backward_passes_per_step=backward_passes_per_step,
            process_set=process_set,
            scale_local_gradients=scale_local_gradients,
        )
    face = _face_for(optimizer)
    if face is not None:
        return face(
            optimizer,
            name=name,
            compression=compression,
            sparse_as_dense=sparse_as_dense,
            gradient_predivide_factor=gradient_predivide_factor,
            op=op,
            backward_passes_per_step=backward_passes_per_step,
            average_aggregated_gradients=average_aggregated_gradients,
            process_set=process_set,
            scale_local_gradients=scale_local_gradients,
        )
    raise ValueError(
        "Provided optimizer doesn't inherit from either a TF1 optimizer "
        "(tf.compat.v1.train.Optimizer) or a Keras optimizer (Keras 3, or tf-keras's): "
        f"{type(optimizer).__module__}.{type(optimizer).__name__}."
    )


# Horovod's hvd.DistributedOptimizer also takes a Keras optimizer, which the Keras face (the
# layer above this one) wraps. It is named here, by the package of the optimizer's class, and
# loaded when the first such optimizer arrives, so that no import runs up the layers.
_OPTIMIZER_FACES = {
    "keras": ("syncdp.keras", "DistributedOptimizer"),
    "tf_keras": ("syncdp.keras", "DistributedOptimizer"),  # Keras 2: wraps by the optimizer
}


def _face_for(optimizer):
    """The DistributedOptimizer of the face that wraps ``optimizer``'s kind; None if none does."""
    for cls in type(optimizer).__mro__:
        face = _OPTIMIZER_FACES.get(cls.__module__.partition(".")[0])
        if face is not None:
            module, name = face
            return getattr(importlib.import_module(module), name)
    return None


def __getattr__(name):
    # SyncBatchNormalization is a Keras layer: build it (and import Keras) only when asked.
    if name == "SyncBatchNormalization":
        from syncdp.tensorflow.sync_batch_norm import SyncBatchNormalization

        return SyncBatchNormalization
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
