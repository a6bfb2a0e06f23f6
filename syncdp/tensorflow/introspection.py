"""What this build of syncdp is and can do: the questions Horovod programs ask, answered truly.

syncdp runs every collective through MPI (mpi4py and Open MPI) on host memory; it has no Gloo,
NCCL, DDL, oneCCL, CUDA or ROCm code of its own, so those report False. Tensors on a GPU are
still reduced correctly: they are copied to the host and back.

The ``*_op`` functions return the answer as an int32 tensor, as Horovod's do.
"""

from __future__ import annotations

import tensorflow as tf

from syncdp.base import mpi
from syncdp.job import process_sets, runtime

__all__ = [
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
]


def mpi_built(verbose: bool = False) -> bool:
    """True: syncdp's collectives are MPI's."""
    return True


def mpi_enabled() -> bool:
    """True: every collective runs on MPI."""
    return True


def mpi_threads_supported() -> bool:
    """Whether MPI was started with ``MPI_THREAD_MULTIPLE`` (syncdp asks for it)."""
    runtime.communicator()
    MPI = mpi.load()
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def gloo_built(verbose: bool = False) -> bool:
    """False: syncdp has no Gloo controller."""
    return False


def gloo_enabled() -> bool:
    """False: syncdp has no Gloo controller."""
    return False


def nccl_built(verbose: bool = False) -> int:
    """0 (Horovod returns the NCCL version it was built with): syncdp has no NCCL."""
    return 0


def ddl_built(verbose: bool = False) -> bool:
    """False: syncdp has no IBM DDL."""
    return False


def ccl_built(verbose: bool = False) -> bool:
    """False: syncdp has no oneCCL."""
    return False


def sycl_built(verbose: bool = False) -> bool:
    """False: syncdp has no SYCL kernels (Horovod's newer releases ask)."""
    return False


def cuda_built(verbose: bool = False) -> bool:
    """False: syncdp has no CUDA kernels (GPU tensors are reduced through host memory)."""
    return False


def rocm_built(verbose: bool = False) -> bool:
    """False: syncdp has no ROCm kernels."""
    return False


def gpu_available(ext_base_name: str = "tensorflow", verbose: bool = False) -> bool:
    """Whether TensorFlow sees a GPU on this host."""
    return bool(tf.config.list_physical_devices("GPU"))


def _int_op(value: int, name) -> tf.Tensor:
    return tf.constant(value, dtype=tf.int32, name=name)


def rank_op(name=None) -> tf.Tensor:
    """This process's rank as an int32 tensor."""
    return _int_op(runtime.rank(), name)


def local_rank_op(name=None) -> tf.Tensor:
    """This process's local rank as an int32 tensor."""
    return _int_op(runtime.local_rank(), name)


def local_size_op(name=None) -> tf.Tensor:
    """The number of ranks on this host as an int32 tensor."""
    return _int_op(runtime.local_size(), name)


def _set_by_id(process_set_id: int):
    for ps in process_sets.registered():
        if ps.process_set_id == process_set_id:
            return ps
    raise ValueError(f"No process set has id {process_set_id}.")


def size_op(process_set_id: int = 0, name=None) -> tf.Tensor:
    """The number of ranks in the process set (the job by default) as an int32 tensor."""
    return _int_op(_set_by_id(process_set_id).size(), name)


def process_set_included_op(process_set_id: int = 0, name=None) -> tf.Tensor:
    """1 if this rank is in the process set, 0 if not, as an int32 tensor.

    Raises:
        ValueError: No set has that id.
    """
    return _int_op(int(_set_by_id(process_set_id).included()), name)
