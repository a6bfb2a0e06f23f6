"""A Keras face of syncdp for one Keras package: the names of :mod:`syncdp.keras`, built for it.

``syncdp.keras`` is Keras 3's face (Horovod's ``horovod.keras``, for ``import keras``), and
``syncdp.tensorflow.keras`` the face of the Keras ``tf.keras`` stands for (Horovod's
``horovod.tensorflow.keras``: Keras 2 under ``TF_USE_LEGACY_KERAS=1``, Keras 3 otherwise). Each
Keras-facing module builds its classes for a package (its ``for_package``); :func:`names`
gathers them into a face, with ``callbacks`` and ``elastic`` modules of that package's classes.
Both faces share every object that does not depend on the package (``DistributedOptimizer``
classes wrap by the optimizer they are given, whichever face is used).
"""

from __future__ import annotations

import functools
import types
from types import ModuleType

import keras as _keras3

from syncdp.keras import callbacks, checkpoint, elastic, optimizer, saving
from syncdp.tensorflow import sync_batch_norm

__all__ = ["names"]


@functools.cache
def names(package: ModuleType, face: str) -> dict[str, object]:
    """The Keras-specific names of the face ``face`` (a module name), built for ``package``.

    Args:
        package: Keras 3's ``keras`` or tf-keras's ``tf_keras``.
        face: The face's module name; its ``callbacks`` and ``elastic`` are named under it.

    Returns:
        ``DistributedOptimizer``, ``PartialDistributedOptimizer``, ``load_model``,
        ``CheckpointCallback``, ``SyncBatchNormalization``, and the ``callbacks`` and
        ``elastic`` modules: Keras 3's own modules for Keras 3, modules of the same names
        (``face + ".callbacks"``, ...) holding the package's classes otherwise.
    """
    return {
        "DistributedOptimizer": optimizer.for_package(package),
        "PartialDistributedOptimizer": optimizer.PartialDistributedOptimizer,
        "load_model": saving.for_package(package),
        "CheckpointCallback": checkpoint.for_package(package),
        "SyncBatchNormalization": sync_batch_norm.for_package(package),
        "callbacks": _module(callbacks, package, f"{face}.callbacks"),
        "elastic": _module(elastic, package, f"{face}.elastic"),
    }


def _module(real: ModuleType, package: ModuleType, name: str) -> ModuleType:
    """``real``'s names, its classes built for ``package``, as the module ``name``."""
    if package is _keras3:  # real's own classes are Keras 3's
        return real
    built = real.for_package(package)
    module = types.ModuleType(name, real.__doc__)
    module.__all__ = list(real.__all__)
    for attribute in real.__all__:
        setattr(module, attribute, getattr(built, attribute, getattr(real, attribute)))
    return module
