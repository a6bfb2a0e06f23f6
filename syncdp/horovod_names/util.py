"""``horovod.common.util``: the helpers Horovod's programs and tests import from it."""

from __future__ import annotations

import contextlib
import importlib
import os
import sysconfig

__all__ = [
    "is_version_greater_equal_than",
    "check_extension",
    "extension_available",
    "gpu_available",
    "get_ext_suffix",
    "is_iterable",
    "num_rank_is_power_2",
    "get_average_backwards_compatibility_fun",
    "env",
    "split_list",
    "mpi_built",
    "gloo_built",
    "nccl_built",
    "ddl_built",
    "ccl_built",
    "sycl_built",
    "cuda_built",
    "rocm_built",
]


def is_version_greater_equal_than(ver: str, target: str) -> bool:
    """Whether version ``ver`` is at least ``target`` (both "major.minor.patch" strings)."""

    def parts(text: str) -> tuple[int, ...]:
        numbers = []
        for piece in text.split(".")[:3]:
            digits = ""
            for ch in piece:
                if not ch.isdigit():
                    break
                digits += ch
            numbers.append(int(digits or 0))
        return tuple(numbers + [0] * (3 - len(numbers)))

    if any(not p for p in target.split(".")[:3]):
        raise ValueError(f"{target!r} is not a version of the form major.minor.patch")
    return parts(ver) >= parts(target)


def check_extension(ext_name: str, ext_env_var: str, pkg_path: str, *args) -> None:
    """Horovod checks here that its compiled extension exists; syncdp has none to check."""


def extension_available(ext_base_name: str, verbose: bool = False) -> bool:
    """Whether Horovod's extension for a framework is there: syncdp serves TensorFlow and
    Keras (``horovod.tensorflow``, ``horovod.keras``), no other."""
    return ext_base_name.split(".")[:2] in (["horovod", "tensorflow"], ["horovod", "keras"])


def gpu_available(ext_base_name: str, verbose: bool = False) -> bool:
    """Whether the extension has GPU kernels: syncdp's collectives run on the host."""
    return False


def get_ext_suffix() -> str:
    """The file name suffix of this Python's compiled extensions (``.cpython-311-...so``)."""
    return sysconfig.get_config_var("EXT_SUFFIX")


def is_iterable(x) -> bool:
    """Whether ``iter(x)`` works."""
    try:
        iter(x)
    except TypeError:
        return False
    return True


def num_rank_is_power_2(num_rank: int) -> bool:
    """Whether ``num_rank`` is a power of two (zero is not)."""
    return num_rank != 0 and num_rank & (num_rank - 1) == 0


def get_average_backwards_compatibility_fun(reduce_ops):
    """Horovod's reading of its deprecated ``average=`` beside ``op=``, for the module
    ``reduce_ops`` that names ``Average`` and ``Sum``: returns ``fn(op, average)``, the op
    meant (``Average`` when neither is given), as
    :func:`syncdp.tensorflow.util.handle_average_backwards_compatibility` reads them."""

    def op_of(op, average):
        read = importlib.import_module("syncdp.tensorflow.util")
        return read.handle_average_backwards_compatibility(op, average, ops=reduce_ops)

    return op_of


@contextlib.contextmanager
def env(**kwargs):
    """Sets environment variables for the ``with`` block, then restores them."""
    saved = {k: os.environ.get(k) for k in kwargs}
    os.environ.update({k: str(v) for k, v in kwargs.items()})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def split_list(values, n: int):
    """``values`` in ``n`` consecutive parts of nearly equal length."""
    return importlib.import_module("syncdp.tensorflow").split_list(values, n)


def _face(name: str):
    def built(verbose: bool = False) -> bool:
        return getattr(importlib.import_module("syncdp.tensorflow"), name)()

    built.__name__ = name
    built.__doc__ = f"syncdp.tensorflow.{name}()."
    return built


mpi_built = _face("mpi_built")
gloo_built = _face("gloo_built")
nccl_built = _face("nccl_built")
ddl_built = _face("ddl_built")
ccl_built = _face("ccl_built")
sycl_built = _face("sycl_built")
cuda_built = _face("cuda_built")
rocm_built = _face("rocm_built")
