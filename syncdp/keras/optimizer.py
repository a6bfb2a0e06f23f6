"""DistributedOptimizer: a Keras optimizer whose gradients are averaged over all ranks.

It wraps any Keras optimizer the way Keras' own ``LossScaleOptimizer`` does: it *is* an
optimizer of the same Keras and hands the averaged gradients to the optimizer it wraps, which
keeps its own variables, learning rate and config. So ``model.compile(optimizer=...)`` +
``model.fit``, ``optimizer.apply_gradients`` in a custom loop, Keras' learning-rate callbacks,
``model.save`` and ``tf.train.Checkpoint`` all work unchanged.

One implementation serves both Kerases. The wrapper's behaviour is written once
(:mod:`syncdp.keras._distributed`); :func:`for_package` puts it on a Keras package's
``optimizers.Optimizer`` (Keras 3's ``keras``, or tf-keras's ``tf_keras`` for Keras 2, whose
wrapper takes its current and its legacy ``tf.keras.optimizers.legacy`` optimizers alike), once
per package. Every such class wraps by the optimizer it is given: ``DistributedOptimizer(opt)``
returns the wrapper of ``opt``'s own Keras, so ``syncdp.keras.DistributedOptimizer`` (Keras 3's
class) also wraps a ``tf.keras`` optimizer of Keras 2, in the same process.

Keras' train step hands the gradients to ``optimizer.apply_gradients`` (Keras 3 through
``apply``, Keras 2 through ``minimize``); that is where they are reduced, in fused collectives
(:func:`syncdp.tape.reduce_gradients`), before clipping, weight decay and the update itself,
so every rank applies the same update and the replicas stay identical.

syncdp's collectives run on the host (``tf.numpy_function`` nodes), which XLA cannot compile:
a train step compiled with ``jit_compile=True`` cannot contain them. The callbacks in
:mod:`syncdp.keras.callbacks` turn ``jit_compile`` off with a warning, and this optimizer
raises a clear error if it is traced inside an XLA-compiled function anyway.
"""

from __future__ import annotations

import functools
import warnings
from types import ModuleType

import keras as _keras3

from syncdp.keras._distributed import Distributed
from syncdp.tensorflow import keras2_names
from syncdp.tensorflow.keras2_names import package_of

__all__ = [
    "DistributedOptimizer",
    "PartialDistributedOptimizer",
    "is_distributed",
    "turn_off_jit",
]


@functools.cache
def for_package(keras: ModuleType) -> type:
    """The DistributedOptimizer class for ``keras``, built once per Keras package.

    Args:
        keras: Keras 3's ``keras`` or tf-keras's ``tf_keras`` (Keras 2).

    Returns:
        A subclass of ``keras.optimizers.Optimizer``, registered with that Keras as
        ``syncdp>DistributedOptimizer`` (so saved models load with it). Like every such
        class, it wraps an optimizer of another Keras with that Keras' class.
    """
    keras2_names.install(keras)  # Keras 2's lr= from here on, if not yet

    @keras.saving.register_keras_serializable(package="syncdp")
    class DistributedOptimizer(Distributed, keras.optimizers.Optimizer):
        __doc__ = Distributed.__doc__
        _keras = keras
        _for_package = staticmethod(for_package)
        # Keras 3's base class needs a learning rate; Keras 2's takes none.
        _base_arguments = {"learning_rate": 0.0} if _major(keras) >= 3 else {}

    DistributedOptimizer.__qualname__ = DistributedOptimizer.__name__
    if _major(keras) < 3:
        # tf-keras' LossScaleOptimizerV3 (compile's, under mixed_float16) saves the optimizer it
        # wraps by its bare class name, and an .h5 file's loader looks that up as it is.
        keras.utils.get_custom_objects().setdefault("DistributedOptimizer", DistributedOptimizer)
    return DistributedOptimizer


def _major(keras: ModuleType) -> int:
    return int(keras.__version__.split(".")[0])


DistributedOptimizer = for_package(_keras3)


def PartialDistributedOptimizer(  # noqa: N802 - Horovod's name for a factory
    optimizer, name=None, *args, local_layers=None, **kwargs
):
    """A DistributedOptimizer whose ``local_layers`` keep their gradients local.

    Args:
        optimizer: The Keras optimizer to wrap (Keras 3 or Keras 2).
        name: The optimizer's name.
        local_layers: A Keras layer or a list of them, of the optimizer's Keras: their
            trainable weights are registered with ``register_local_var``.
        *args, **kwargs: As for :class:`DistributedOptimizer`.

    Returns:
        The DistributedOptimizer of the optimizer's Keras.

    Raises:
        ValueError: ``local_layers`` holds something that is not a Keras layer.
    """
    layer_type = (package_of(optimizer) or _keras3).layers.Layer
    if local_layers is None:
        local_layers = []
    elif isinstance(local_layers, layer_type):
        local_layers = [local_layers]
    if not all(isinstance(layer, layer_type) for layer in local_layers):
        raise ValueError("All local layers must be of keras.layers.Layer type.")
    opt = DistributedOptimizer(optimizer, name, *args, **kwargs)
    for layer in local_layers:
        for weight in layer.trainable_weights:
            opt.register_local_var(weight)
    return opt


def is_distributed(optimizer) -> bool:
    """Whether ``optimizer`` is, or wraps (e.g. in a LossScaleOptimizer), a DistributedOptimizer
    of either Keras.

    Args:
        optimizer: A Keras optimizer, or None.
    """
    while optimizer is not None:
        if isinstance(optimizer, Distributed):
            return True
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return False


def turn_off_jit(model) -> bool:
    """Turns a compiled model's ``jit_compile`` off, with a warning, if it uses syncdp.

    XLA cannot compile syncdp's host-side collectives, so a train step that reduces gradients
    through a DistributedOptimizer must not be XLA-compiled. The syncdp callbacks and
    ``load_model`` call this for you.

    Args:
        model: A Keras model (Keras 3 or Keras 2).

    Returns:
        Whether it changed the model.
    """
    compiled = getattr(model, "compiled", None)
    if compiled is None:  # Keras 2 keeps it private
        compiled = getattr(model, "_is_compiled", False)
    if not (
        compiled
        and getattr(model, "jit_compile", False)
        and is_distributed(getattr(model, "optimizer", None))
    ):
        return False
    warnings.warn(
        "syncdp: turning jit_compile off for this model: its DistributedOptimizer reduces "
        "gradients on the host, which XLA cannot compile. Pass jit_compile=False to "
        "model.compile() to silence this warning.",
        stacklevel=3,
    )
    model.jit_compile = False
    model.train_function = None  # rebuilt, without XLA, by the next fit()
    return True
