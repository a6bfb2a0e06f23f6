"""load_model: a saved Keras model, back with an optimizer that averages over all ranks.

:func:`for_package` builds ``load_model`` for a Keras package (Horovod's ``horovod.keras`` loads
with Keras 3's ``keras``, ``horovod.tensorflow.keras`` with the Keras ``tf.keras`` stands for,
Keras 2 under ``TF_USE_LEGACY_KERAS=1``); ``load_model`` here is Keras 3's.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType

import keras as _keras3
import tensorflow as tf

from syncdp.keras import optimizer as _optimizer
from syncdp.tensorflow.compression import Compression, is_compressor
from syncdp.tensorflow.keras2_names import create_optimizer_variables

__all__ = ["load_model"]


@functools.cache
def for_package(keras: ModuleType):
    """The ``load_model`` that loads with ``keras`` (Keras 3's ``keras`` or tf-keras's
    ``tf_keras``), built once per package."""
    distributed = _optimizer.for_package(keras)  # registered with keras before any load

    def load_model(
        filepath,
        custom_optimizers=None,
        custom_objects=None,
        compression=None,
        **kwargs,
    ):
        """Loads a saved Keras model whose optimizer averages gradients over all ranks.

        A model saved with a DistributedOptimizer comes back with one (importing syncdp's Keras
        face registers the class with Keras, so Keras' own ``load_model`` works too). A model
        saved with a plain optimizer gets it wrapped here, as Horovod's ``load_model`` does.
        The optimizer's state (step count, slots) comes back too, from a SavedModel directory
        as well (Keras 2 itself leaves it there). Not a collective; broadcast the state
        afterwards if only rank 0 read the file.

        Args:
            filepath: The saved model: a ``.keras`` file, an ``.h5`` file, or (Keras 2) a
                SavedModel directory.
            custom_optimizers: Optimizer classes the file needs that Keras does not know.
                Defaults to none.
            custom_objects: Other custom objects, as for Keras' ``load_model``. Defaults to
                none.
            compression: The optimizer's compression, as Horovod's ``load_model`` sets it
                (``Compression.fp16``, ...). Defaults to the one the file saved (a
                DistributedOptimizer's), else ``Compression.none``.
            **kwargs: Passed on to Keras' ``load_model`` (e.g. ``compile``, ``safe_mode``).

        Returns:
            The model, compiled with a DistributedOptimizer if it was saved compiled.

        Example:
            >>> model = syncdp.keras.load_model("model.keras")
        """
        if compression is not None and not is_compressor(compression):
            raise ValueError(
                "compression must be a compressor: syncdp.Compression.none, "
                "syncdp.Compression.fp16, or an object with compress() and decompress(); got "
                f"{compression!r}."
            )
        objects = dict(custom_objects or {})
        for cls in custom_optimizers or ():
            objects[cls.__name__] = cls
        model = keras.models.load_model(filepath, custom_objects=objects, **kwargs)
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None and tf.saved_model.contains_saved_model(os.fspath(filepath)):
            _restore_optimizer(model, os.fspath(filepath))
        if optimizer is not None and not _optimizer.is_distributed(optimizer):
            model.optimizer = distributed(optimizer, compression=compression or Compression.none)
            model.train_function = None  # the next fit() traces a step with the new optimizer
        elif optimizer is not None and compression is not None:
            while not isinstance(optimizer, _optimizer.Distributed):  # a LossScaleOptimizer's
                optimizer = optimizer.inner_optimizer
            optimizer.compression = compression
            model.train_function = None
        _optimizer.turn_off_jit(model)
        return model

    return load_model


def _restore_optimizer(model, directory: str) -> None:
    """Reads the optimizer's variables from the SavedModel at ``directory``.

    Keras 2 restores a SavedModel's weights but not its optimizer's (they are restored only
    into variables that exist, and the loaded optimizer has none yet): create them, then read
    the SavedModel's checkpoint, whose root is the model.
    """
    create_optimizer_variables(model.optimizer, model.trainable_variables)
    prefix = os.path.join(directory, tf.saved_model.VARIABLES_DIRECTORY, "variables")
    tf.train.Checkpoint(root=model).read(prefix).expect_partial()


load_model = for_package(_keras3)
