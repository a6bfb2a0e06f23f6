"""Every public name of Horovod 0.28.1's TensorFlow modules exists in syncdp, by the same path.

The lists are kept here (Horovod is never imported): the functions, classes and constants a
program reaches as ``hvd.NAME`` after ``import horovod.tensorflow as hvd``,
``import horovod.tensorflow.keras as hvd`` and ``hvd.callbacks``. Left out: Horovod's
module-level leftovers (``tf``, ``K``, ``keras``, ``inspect`` ...), private names, and the two
internal helpers ``check_extension`` and ``support_non_legacy_keras_optimizers``.
"""

import inspect

import pytest

HOROVOD_TENSORFLOW = """
init shutdown is_initialized start_timeline stop_timeline size local_size cross_size rank
local_rank cross_rank is_homogeneous rank_op local_rank_op size_op local_size_op
process_set_included_op mpi_threads_supported mpi_enabled mpi_built gloo_enabled gloo_built
nccl_built ddl_built ccl_built sycl_built cuda_built rocm_built gpu_available ProcessSet
global_process_set
add_process_set remove_process_set Average Sum Adasum Min Max Product
handle_average_backwards_compatibility check_num_rank_power_of_2 split_list join
allreduce grouped_allreduce allgather grouped_allgather broadcast broadcast_ alltoall
reducescatter grouped_reducescatter broadcast_variables broadcast_global_variables
broadcast_object broadcast_object_fn allgather_object BroadcastGlobalVariablesHook
DistributedOptimizer DistributedGradientTape PartialDistributedGradientTape
SyncBatchNormalization LocalGradientAggregationHelper Compression
""".split()

HOROVOD_TENSORFLOW_KERAS = """
init shutdown is_initialized start_timeline stop_timeline size local_size cross_size rank
local_rank cross_rank mpi_threads_supported mpi_enabled mpi_built gloo_enabled gloo_built
nccl_built ddl_built ccl_built cuda_built rocm_built ProcessSet global_process_set
add_process_set remove_process_set Average Sum Compression DistributedOptimizer
PartialDistributedOptimizer broadcast_global_variables allreduce allgather broadcast
reducescatter load_model callbacks
""".split()

HOROVOD_KERAS_CALLBACKS = """
BroadcastGlobalVariablesCallback MetricAverageCallback LearningRateScheduleCallback
LearningRateWarmupCallback BestModelCheckpoint
""".split()

HOROVOD_TENSORFLOW_ELASTIC = """
run run_fn State ObjectState TensorFlowState TensorFlowKerasState broadcast_object
broadcast_object_fn
""".split()

HOROVOD_KERAS_ELASTIC = """
run State ObjectState KerasState CommitStateCallback UpdateBatchStateCallback
UpdateEpochStateCallback
""".split()

NOT_YET: set[str] = set()


@pytest.mark.parametrize(
    "module, names",
    [
        ("syncdp.tensorflow", HOROVOD_TENSORFLOW),
        ("syncdp.tensorflow.keras", HOROVOD_TENSORFLOW_KERAS),
        ("syncdp.tensorflow.keras.callbacks", HOROVOD_KERAS_CALLBACKS),
        ("syncdp.tensorflow.elastic", HOROVOD_TENSORFLOW_ELASTIC),
        ("syncdp.tensorflow.keras.elastic", HOROVOD_KERAS_ELASTIC),
    ],
)
def test_every_horovod_name_exists(module, names):
    import importlib

    mod = importlib.import_module(module)
    missing = [n for n in names if n not in NOT_YET and not hasattr(mod, n)]
    assert not missing, f"{module} lacks Horovod's {missing}"


def test_horovod_keyword_arguments_are_accepted():
    import syncdp.tensorflow as hvd

    expected = {
        hvd.allreduce: [
            "average",
            "device_dense",
            "device_sparse",
            "compression",
            "op",
            "prescale_factor",
            "postscale_factor",
            "name",
            "process_set",
            "ignore_name_scope",
        ],
        hvd.grouped_allreduce: [
            "average",
            "compression",
            "op",
            "prescale_factor",
            "postscale_factor",
            "process_set",
            "ignore_name_scope",
        ],
        hvd.allgather: ["name", "ignore_name_scope", "process_set"],
        hvd.broadcast: ["root_rank", "name", "ignore_name_scope", "process_set"],
        hvd.alltoall: ["splits", "name", "ignore_name_scope", "process_set"],
        hvd.reducescatter: [
            "device_dense",
            "compression",
            "op",
            "name",
            "process_set",
            "prescale_factor",
            "postscale_factor",
        ],
        hvd.broadcast_variables: ["root_rank", "process_set", "inplace"],
        hvd.broadcast_object: ["root_rank", "session", "name", "process_set"],
        hvd.allgather_object: ["session", "name", "process_set"],
        hvd.DistributedOptimizer: [
            "name",
            "use_locking",
            "compression",
            "sparse_as_dense",
            "backward_passes_per_step",
            "op",
            "gradient_predivide_factor",
            "average_aggregated_gradients",
            "num_groups",
            "groups",
            "process_set",
            "scale_local_gradients",
        ],
        hvd.DistributedGradientTape: [
            "compression",
            "sparse_as_dense",
            "op",
            "gradient_predivide_factor",
            "num_groups",
            "groups",
            "process_set",
            "scale_local_gradients",
        ],
        hvd.PartialDistributedGradientTape: ["local_layers", "scale_local_gradients"],
        hvd.size_op: ["process_set_id", "name"],
        hvd.start_timeline: ["file_path", "mark_cycles"],
    }
    expected[hvd.elastic.broadcast_object] = ["root_rank", "session", "name", "process_set"]
    expected[hvd.elastic.broadcast_object_fn] = ["root_rank", "session", "name", "process_set"]
    expected[hvd.elastic.run_fn] = ["func", "reset"]
    for fn, keywords in expected.items():
        params = inspect.signature(fn).parameters
        missing = [k for k in keywords if k not in params]
        assert not missing, f"{fn.__name__} lacks {missing}"


# Horovod 0.28.1's positional parameters, in order (horovod/tensorflow/__init__.py and
# mpi_ops.py): a program that passes them by position means the same thing in syncdp.
HOROVOD_POSITIONAL = {
    "allreduce": "tensor average device_dense device_sparse compression op prescale_factor "
    "postscale_factor name process_set ignore_name_scope",
    "grouped_allreduce": "tensors average device_dense device_sparse compression op "
    "prescale_factor postscale_factor process_set ignore_name_scope name",
    "reducescatter": "tensor device_dense compression op name process_set ignore_name_scope "
    "prescale_factor postscale_factor",
    "grouped_reducescatter": "tensors device_dense compression op process_set prescale_factor "
    "postscale_factor",
    "allgather": "tensor name ignore_name_scope process_set",
    "grouped_allgather": "tensors name ignore_name_scope process_set",
    "broadcast": "tensor root_rank name ignore_name_scope process_set",
    "alltoall": "tensor splits name ignore_name_scope process_set",
    "broadcast_variables": "variables root_rank process_set inplace",
}


@pytest.mark.parametrize("name", sorted(HOROVOD_POSITIONAL))
def test_horovod_positional_arguments_keep_their_order(name):
    import syncdp.tensorflow as hvd

    positional = [
        p.name
        for p in inspect.signature(getattr(hvd, name)).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    horovods = HOROVOD_POSITIONAL[name].split()
    assert positional[: len(horovods)] == horovods


def test_helpers_behave_as_horovods():
    import syncdp.tensorflow as hvd

    assert hvd.handle_average_backwards_compatibility(None, None) is hvd.Average
    with pytest.warns(DeprecationWarning):
        assert hvd.handle_average_backwards_compatibility(None, False) is hvd.Sum
    with pytest.raises(ValueError):
        hvd.handle_average_backwards_compatibility(hvd.Sum, True)
    assert [hvd.check_num_rank_power_of_2(k) for k in (0, 1, 2, 3, 4, 6, 8)] == [
        False,
        True,
        True,
        False,
        True,
        False,
        True,
    ]
    assert hvd.split_list(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert hvd.nccl_built() == 0 and hvd.mpi_built()
    with pytest.raises(ValueError, match="list of process ranks"):
        hvd.ProcessSet(["a"])
    assert hvd.ProcessSet([2, 0]).ranks == [0, 2]
    assert hvd.ProcessSet([0]).size() is None  # not registered yet, as in Horovod
