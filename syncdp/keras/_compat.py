"""Lets ``model.compile`` take the one Keras 2 argument Horovod's programs all pass.

Horovod's documentation told every Keras user to compile with
``experimental_run_tf_function=False`` (so that TensorFlow 2.0-2.1 called the distributed
optimizer's ``get_gradients``). Keras 2 accepted the argument and, from TensorFlow 2.2 on,
ignored it; Keras 3's ``Model.compile`` has no ``**kwargs`` and raises ``TypeError`` on it. So
a Horovod program that only swapped its import would stop at ``compile``, before syncdp runs.

:func:`accept_horovod_compile_argument` wraps ``keras.Model.compile`` once, when
:mod:`syncdp.keras` is imported: it drops that one argument, as Keras 2 did, and passes
everything else through unchanged (any other unknown argument still raises Keras' own error).
"""

from __future__ import annotations

import functools

import keras

__all__ = ["accept_horovod_compile_argument"]

_IGNORED = "experimental_run_tf_function"


def accept_horovod_compile_argument() -> None:
    """Makes ``keras.Model.compile`` drop ``experimental_run_tf_function``; idempotent."""
    compile_ = keras.Model.compile
    if getattr(compile_, "_syncdp_wrapped", False):
        return

    @functools.wraps(compile_)
    def compile(self, *args, **kwargs):  # noqa: A001 - the method it stands for
        kwargs.pop(_IGNORED, None)
        return compile_(self, *args, **kwargs)

    compile._syncdp_wrapped = True
    keras.Model.compile = compile
