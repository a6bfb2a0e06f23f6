"""The base of syncdp's Keras callbacks, built for one Keras package.

A Keras callback belongs to one Keras: ``model.fit`` of Keras 2 (tf-keras) calls methods that
Keras 3's callbacks lack, and the other way round. So each of syncdp's callback modules builds
its classes per package (``for_package(keras)``), on :func:`base_for`'s class, which also turns
a callback given to the other Keras' model into a clear error instead of an
``AttributeError`` from deep inside ``fit``.
"""

from __future__ import annotations

import functools
from types import ModuleType

from syncdp.tensorflow.keras2_names import package_of

__all__ = ["base_for", "check_same_keras"]


def check_same_keras(callback, model) -> None:
    """Raises TypeError when ``callback`` and ``model`` are of different Kerases.

    Raises:
        TypeError: One is Keras 3's, the other Keras 2's (tf-keras).
    """
    mine, theirs = package_of(callback), package_of(model)
    if mine is None or theirs is None or mine is theirs:
        return
    raise TypeError(
        f"{type(callback).__name__} is a {mine.__name__} callback (Keras "
        f"{mine.__version__}), and the model is a {theirs.__name__} model (Keras "
        f"{theirs.__version__}): a callback works with its own Keras only. Take the callbacks "
        "from syncdp.tensorflow.keras (horovod.tensorflow.keras) for tf.keras models, and "
        "from syncdp.keras (horovod.keras) for models of Keras 3's keras."
    )


@functools.cache
def base_for(keras: ModuleType) -> type:
    """``keras.callbacks.Callback``, refusing a model of the other Keras (once per package)."""

    class Callback(keras.callbacks.Callback):
        def set_model(self, model):
            check_same_keras(self, model)
            super().set_model(model)

    Callback.__qualname__ = Callback.__name__
    return Callback
