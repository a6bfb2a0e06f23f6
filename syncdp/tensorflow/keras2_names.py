"""Two Keras 2 spellings that Horovod's programs use everywhere, accepted again on Keras 3.

- ``model.compile(..., experimental_run_tf_function=False)``: Horovod's documentation told every
  Keras user to pass it (so that TensorFlow 2.0-2.1 called the distributed optimizer). Keras 2
  accepted it and, from TensorFlow 2.2 on, ignored it; Keras 3's ``compile`` raises
  ``TypeError``.
- ``optimizer.lr``: Keras 2's name for the learning rate, used as ``opt.lr.assign(x)`` (Horovod's
  elastic TF2 example) and ``tf.keras.backend.set_value(model.optimizer.lr, x)``. Keras 3 has
  only ``learning_rate``.

Without them a Horovod program that only swapped its import would stop before or after syncdp
ever ran. :func:`install` (run when :mod:`syncdp.tensorflow` is imported) adds exactly these
two, once, and changes nothing else: ``compile`` drops that one argument and passes the rest
through (any other unknown argument still raises Keras' own error), and ``lr`` is added only
where Keras' optimizer has no attribute of that name.
"""

from __future__ import annotations

import functools

__all__ = ["install"]

_IGNORED_COMPILE_ARGUMENT = "experimental_run_tf_function"


def install() -> None:
    """Accepts both spellings from here on; idempotent. Nothing happens where Keras cannot
    be imported (TensorFlow works without it, and so does syncdp.tensorflow)."""
    try:
        import keras
    except ImportError:
        return
    _accept_compile_argument(keras)
    if not hasattr(keras.optimizers.Optimizer, "lr"):
        keras.optimizers.Optimizer.lr = property(_get_lr, _set_lr, doc=_get_lr.__doc__)


def _accept_compile_argument(keras) -> None:
    # Replaced where it is defined (Keras' Trainer), not on keras.Model: Keras compiles a
    # loaded model only when the class's compile is still the Trainer's own.
    owner = next(c for c in keras.Model.__mro__ if "compile" in vars(c))
    compile_ = owner.compile
    if getattr(compile_, "_syncdp_wrapped", False):
        return

    @functools.wraps(compile_)
    def compile(self, *args, **kwargs):  # noqa: A001 - the method it stands for
        kwargs.pop(_IGNORED_COMPILE_ARGUMENT, None)
        return compile_(self, *args, **kwargs)

    compile._syncdp_wrapped = True
    owner.compile = compile


def _get_lr(optimizer):
    """The learning rate under Keras 2's name.

    ``assign``, ``set_value`` and ``get_value`` on it need a TensorFlow variable, so where the
    rate is a Keras 3 variable this is the TensorFlow variable behind it (assigning it sets the
    rate); otherwise (a schedule) it is ``learning_rate`` itself.
    """
    import keras

    rate = optimizer.learning_rate
    return rate.value if isinstance(rate, keras.Variable) else rate


def _set_lr(optimizer, learning_rate) -> None:
    optimizer.learning_rate = learning_rate
