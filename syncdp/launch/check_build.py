"""``syncdp-run --check-build``: what this install supports, in horovodrun's layout.

horovodrun's ``--check-build`` lists the frameworks, controllers and tensor operations Horovod
was built with. syncdp builds nothing: it lists what it can use here, found without starting
MPI or loading TensorFlow (so it answers in well under a second)::

    syncdp v0.1.0:

    Available Frameworks:
        [X] TensorFlow 2.21.0
        [X] Keras 3.15.1
        [X] Keras 2 (tf-keras 2.21.0, with TF_USE_LEGACY_KERAS=1)
        [ ] PyTorch
        [ ] MXNet

    Available Controllers:
        [X] MPI (Open MPI 5.0.11, /usr/bin/mpirun)
        [ ] Gloo (--gloo is accepted and runs on MPI)

    Available Tensor Operations:
        [ ] NCCL
        [ ] DDL
        [ ] CCL
        [X] MPI
        [ ] Gloo

    Elastic Mode:
        [X] ULFM (Open MPI's fault tolerance; --min-np, --max-np, --elastic)

    GPUs:
        [ ] CUDA (no NVIDIA GPU visible)

PyTorch, MXNet, Gloo, NCCL, DDL and CCL are never available: syncdp drives TensorFlow through
MPI only. Keras 2 is there when tf-keras is installed (``pip install tf-keras``); a program
selects it with ``TF_USE_LEGACY_KERAS=1``.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
from collections.abc import Mapping

__all__ = ["report"]


def _box(available: bool) -> str:
    return "[X]" if available else "[ ]"


def _version(*distributions: str) -> str | None:
    """The installed version of the first of ``distributions`` that is installed."""
    for name in distributions:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _open_mpi_version(mpirun: str) -> str | None:
    """Open MPI's version from the ``ompi_info`` beside ``mpirun`` (None: not Open MPI)."""
    here = os.path.join(os.path.dirname(os.path.realpath(mpirun)), "ompi_info")
    ompi_info = here if os.path.exists(here) else shutil.which("ompi_info")
    if ompi_info is None:
        return None
    try:
        out = subprocess.run(
            [ompi_info, "--parsable"], capture_output=True, text=True, timeout=60
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in out.splitlines():
        if line.startswith("ompi:version:full:"):
            return line.split(":", 3)[3]
    return None


def _gpus(environ: Mapping[str, str]) -> str:
    """The CUDA line: how many NVIDIA GPUs the driver lists, and whether they are hidden."""
    try:
        count = len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        count = 0
    if not count:
        return f"{_box(False)} CUDA (no NVIDIA GPU visible)"
    hidden = environ.get("CUDA_VISIBLE_DEVICES")
    if hidden is not None and hidden.strip() in ("", "-1"):
        return (
            f"{_box(False)} CUDA ({count} NVIDIA GPUs, hidden by CUDA_VISIBLE_DEVICES={hidden!r})"
        )
    return f"{_box(True)} CUDA ({count} NVIDIA GPU{'s' if count > 1 else ''} for TensorFlow)"


def report(mpirun: str | None, environ: Mapping[str, str] | None = None) -> str:
    """The ``--check-build`` text.

    Args:
        mpirun: The mpirun on PATH, or None when there is none.
        environ: The environment (for ``CUDA_VISIBLE_DEVICES``). Defaults to ``os.environ``.

    Returns:
        The lines, joined.
    """
    from syncdp import __version__
    from syncdp.launch.elastic import check_ulfm

    environ = os.environ if environ is None else environ
    tensorflow = _version("tensorflow", "tensorflow-cpu", "tf-nightly")
    keras = _version("keras")
    tf_keras = _version("tf-keras", "tf_keras")
    keras2 = (
        f"Keras 2 (tf-keras {tf_keras}, with TF_USE_LEGACY_KERAS=1)"
        if tf_keras
        else "Keras 2 (tf-keras is not installed: pip install tf-keras)"
    )
    ompi = _open_mpi_version(mpirun) if mpirun else None
    if mpirun is None:
        mpi = f"{_box(False)} MPI (no mpirun on PATH)"
    elif ompi is None:
        mpi = f"{_box(False)} MPI ({mpirun} is not Open MPI's)"
    else:
        mpi = f"{_box(True)} MPI (Open MPI {ompi}, {mpirun})"
    ulfm = ompi is not None and check_ulfm(mpirun) is None
    lines = [
        f"syncdp v{__version__}:",
        "",
        "Available Frameworks:",
        f"    {_box(bool(tensorflow))} TensorFlow{' ' + tensorflow if tensorflow else ''}",
        f"    {_box(bool(keras))} Keras{' ' + keras if keras else ''}",
        f"    {_box(bool(tf_keras))} {keras2}",
        f"    {_box(False)} PyTorch",
        f"    {_box(False)} MXNet",
        "",
        "Available Controllers:",
        f"    {mpi}",
        f"    {_box(False)} Gloo (--gloo is accepted and runs on MPI)",
        "",
        "Available Tensor Operations:",
        f"    {_box(False)} NCCL",
        f"    {_box(False)} DDL",
        f"    {_box(False)} CCL",
        f"    {_box(ompi is not None)} MPI",
        f"    {_box(False)} Gloo",
        "",
        "Elastic Mode:",
        f"    {_box(ulfm)} ULFM (Open MPI's fault tolerance; --min-np, --max-np, --elastic)",
        "",
        "GPUs:",
        f"    {_gpus(environ)}",
    ]
    return "\n".join(lines)
