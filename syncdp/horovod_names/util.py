"""``horovod.common.util``: the helpers Horovod's programs and tests import from it."""

from __future__ import annotations

import contextlib
import importlib
import os

__all__ = [
    "is_version_greater_equal_than",
    "check_extension",
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
