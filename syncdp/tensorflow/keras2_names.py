"""The two Kerases side by side: which one an object belongs to, and Keras 2's spellings.

syncdp serves Keras 3 (``import keras``) and Keras 2 (the ``tf_keras`` package of tf-keras, which
``tf.keras`` is under ``TF_USE_LEGACY_KERAS=1``) in one process: every Keras-facing piece is
built for the package of the object the user passes (:func:`package_of`), and
``syncdp.tensorflow``'s Keras names follow ``tf.keras`` (:func:`package_behind_tf_keras`).
tf_keras is never imported here: an object's package is loaded already, and ``tf.keras`` is
tf_keras only where TensorFlow itself imported it.

Where the two Kerases name the same thing differently and the TensorFlow layer needs it (the
elastic state), one function hides the difference: :func:`create_optimizer_variables`,
:func:`optimizer_variables` and :func:`optimizer_state` work on Keras 3's optimizers,
tf-keras's, and tf-keras's legacy ``OptimizerV2`` (``tf.keras.optimizers.legacy``).

And Horovod's Keras 2 spellings, which Horovod programs use everywhere:

- ``model.compile(..., experimental_run_tf_function=False)``: Horovod's documentation told every
  Keras user to pass it (so that TensorFlow 2.0-2.1 called the distributed optimizer). Keras 2
  accepts it and ignores it; Keras 3's ``compile`` raises ``TypeError``.
- ``optimizer.lr``: Keras 2's name for the learning rate, used as ``opt.lr.assign(x)`` (Horovod's
  elastic TF2 example) and ``tf.keras.backend.set_value(model.optimizer.lr, x)``. Keras 3 has
  only ``learning_rate``.
- ``tf.keras.optimizers.Adam(lr=0.01)``: Keras 2's optimizers took ``lr=`` for the rate (Horovod's
  examples pass it). tf-keras's legacy optimizers still do; its current ones log a warning and
  train at the default rate instead, silently 10 or 100 times off.

And one that Keras 3 cannot take, explained where it fails:

- ``optimizer.variables()``: a method in Keras 2 (Horovod's TF2 examples broadcast
  ``opt.variables()``), a list in Keras 3. Calling it raises the ``TypeError`` Python would
  (``'list' object is not callable``), with what to do instead: run the program under Keras 2
  (``TF_USE_LEGACY_KERAS=1``, with tf-keras installed), or write ``opt.variables``.

Without them a Horovod program that only swapped its import would stop, or train wrongly,
before or after syncdp ever ran. :func:`install` (run when :mod:`syncdp.tensorflow` is imported)
adds exactly these, once per Keras, and changes nothing else: ``compile`` drops that one
argument and passes the rest through (any other unknown argument still raises Keras' own error;
Keras 2's ``compile`` takes it already),
``lr`` is added only where Keras' optimizer has no attribute of that name, and ``lr=`` is the
rate only where tf-keras would otherwise drop it (as in Keras 2, it wins over
``learning_rate=``).
"""

from __future__ import annotations

import functools
import inspect
import sys
import weakref
from types import ModuleType

__all__ = [
    "install",
    "package_of",
    "package_behind_tf_keras",
    "create_optimizer_variables",
    "optimizer_variables",
    "optimizer_state",
]

_IGNORED_COMPILE_ARGUMENT = "experimental_run_tf_function"
_KERAS_PACKAGES = ("keras", "tf_keras")


def package_of(obj) -> ModuleType | None:
    """The Keras package that defines ``obj``'s class (or ``obj``, a class), if any.

    Args:
        obj: A Keras object (optimizer, model, layer, callback) or class, or anything else.

    Returns:
        The ``keras`` module (Keras 3) or the ``tf_keras`` module (Keras 2), whichever the
        first Keras class in the class's MRO comes from; None for an object of neither (a
        subclass written by a user counts as its Keras base's).

    Example:
        >>> package_of(tf.keras.optimizers.Adam()).__name__  # TF_USE_LEGACY_KERAS=1
        'tf_keras'
    """
    cls = obj if isinstance(obj, type) else type(obj)
    for klass in cls.__mro__:
        top = klass.__module__.partition(".")[0]
        if top in _KERAS_PACKAGES:
            return sys.modules[top]
    return None


def package_behind_tf_keras() -> ModuleType | None:
    """The Keras package ``tf.keras`` stands for: tf_keras under ``TF_USE_LEGACY_KERAS=1``
    (which TensorFlow then imports itself), Keras 3 otherwise; None where there is none."""
    try:
        import tensorflow as tf

        return package_of(tf.keras.Model)
    except (ImportError, AttributeError):
        return None


def create_optimizer_variables(optimizer, var_list) -> None:
    """Creates a Keras optimizer's variables (slots, step count) for ``var_list``, once.

    Args:
        optimizer: A Keras 3 or tf-keras optimizer, current or legacy.
        var_list: The variables it will update (the model's trainable variables).
    """
    if hasattr(optimizer, "_create_all_weights"):  # tf-keras's legacy OptimizerV2
        optimizer._create_all_weights(var_list)  # idempotent: existing slots are kept
    elif not getattr(optimizer, "built", getattr(optimizer, "_built", False)):
        optimizer.build(var_list)


def optimizer_variables(optimizer) -> list:
    """A Keras optimizer's variables, in its own order (a property in Keras 3 and tf-keras's
    current optimizers, a method in its legacy ones)."""
    variables = optimizer.variables
    return list(variables if isinstance(variables, list) else variables())


def optimizer_state(optimizer) -> list:
    """Every variable a rank needs to step as rank 0 does: :func:`optimizer_variables` and the
    hyperparameters tf-keras keeps in variables outside them (its current optimizers' learning
    rate, its legacy ones' ``_hyper``), also of the optimizers a wrapper holds. Keras 3 lists its
    learning rate among its variables already. What the ranks broadcast and a checkpoint
    restores: without them a rank that restored a lowered learning rate would step at another
    rate than the rest.

    Args:
        optimizer: A Keras 3 or tf-keras optimizer, current or legacy, or a wrapper of one.
    """
    variables = optimizer_variables(optimizer)
    seen = {id(v) for v in variables}
    for hyper in _hyperparameters(optimizer):
        if id(hyper) not in seen:
            seen.add(id(hyper))
            variables.append(hyper)
    return variables


def _hyperparameters(optimizer):
    """tf-keras's hyperparameter variables of ``optimizer`` and those it wraps, in a fixed order."""
    import tensorflow as tf

    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is not None and inner is not optimizer:
        yield from _hyperparameters(inner)
    hyper = getattr(optimizer, "_hyper", None)  # legacy OptimizerV2
    if isinstance(hyper, dict):
        for key in sorted(hyper):
            if isinstance(hyper[key], tf.Variable):
                yield hyper[key]
    rate = getattr(optimizer, "_learning_rate", None)  # current optimizers
    if isinstance(rate, tf.Variable):
        yield rate


def install(keras: ModuleType | None = None) -> None:
    """Accepts Keras 2's spellings on ``keras`` from here on; idempotent.

    Args:
        keras: The Keras package to adapt. Defaults to Keras 3's ``keras`` and, where it is
            another package, the one ``tf.keras`` stands for. Nothing happens where Keras
            cannot be imported (TensorFlow works without it, and so does syncdp.tensorflow).
    """
    if keras is None:
        try:
            import keras
        except ImportError:
            return
        behind = package_behind_tf_keras()
        if behind is not None and behind is not keras:
            install(behind)
            _give_tf_keras_a_version(behind)
    _accept_compile_argument(keras)
    _explain_variables_call(keras)
    if not hasattr(keras.optimizers.Optimizer, "lr"):
        keras.optimizers.Optimizer.lr = property(_get_lr, _set_lr, doc=_get_lr.__doc__)
    _accept_lr_argument(keras)


def _give_tf_keras_a_version(package) -> None:
    """``tf.keras.__version__`` under ``TF_USE_LEGACY_KERAS=1``: Keras 2 programs (Horovod's
    tests among them) read it, and tf-keras's API module lacks it; the package's own version."""
    import tensorflow as tf

    if not hasattr(tf.keras, "__version__") and hasattr(package, "__version__"):
        tf.keras.__version__ = package.__version__


def _owner(cls: type, name: str) -> type:
    """The class in ``cls``'s MRO that defines ``name``: a method is replaced where it lives,
    so that Keras' own checks that a method is still the base class's keep working."""
    return next(c for c in cls.__mro__ if name in vars(c))


def _accept_compile_argument(keras) -> None:
    # Replaced where it is defined (Keras' Trainer), not on keras.Model: Keras compiles a
    # loaded model only when the class's compile is still the Trainer's own.
    owner = _owner(keras.Model, "compile")
    compile_ = owner.compile
    if getattr(compile_, "_syncdp_wrapped", False) or _takes_any_keyword(compile_):
        return  # wrapped already, or a Keras (2) that accepts it

    @functools.wraps(compile_)
    def compile(self, *args, **kwargs):  # noqa: A001 - the method it stands for
        kwargs.pop(_IGNORED_COMPILE_ARGUMENT, None)
        return compile_(self, *args, **kwargs)

    compile._syncdp_wrapped = True
    owner.compile = compile


_VARIABLES_CALLED = (
    "'list' object is not callable: optimizer.variables is a list in Keras 3, and "
    "optimizer.variables() is Keras 2's spelling. This program is written for Keras 2: run it "
    "under Keras 2 with TF_USE_LEGACY_KERAS=1 (pip install tf-keras), or write "
    "optimizer.variables for Keras 3."
)


class _VariablesList(list):
    """What Keras 3's ``optimizer.variables`` returns, a list, that says what to do when it is
    called as Keras 2's method.

    ``keras.tree`` (optree) would take a list subclass for a leaf; registered with it, it
    flattens as the list it is (Keras' export flattens ``optimizer.variables``).
    """

    def __call__(self, *args, **kwargs):
        raise TypeError(_VARIABLES_CALLED)

    def tree_flatten(self):
        return list(self), None

    @classmethod
    def tree_unflatten(cls, metadata, children):
        return cls(children)


def _register_with_keras_tree() -> None:
    try:  # Keras' own registry for its tree functions: private, so a Keras that moved it
        from keras.src.tree.tree_api import register_tree_node_class
    except ImportError:  # pragma: no cover - leaves the list a leaf of keras.tree
        return
    try:
        register_tree_node_class(_VariablesList)
    except ValueError:  # pragma: no cover - registered already
        pass


def _explain_variables_call(keras) -> None:
    base = keras.optimizers.Optimizer
    owner = _owner(base, "variables")
    variables = vars(owner)["variables"]
    if not isinstance(variables, property) or getattr(variables.fget, "_syncdp_wrapped", False):
        return  # Keras 2's legacy method, or wrapped already
    get = variables.fget

    @functools.wraps(get)
    def fget(self):
        found = get(self)
        # tf-keras returns a callable list of its own: only a plain list is Keras 3's.
        return _VariablesList(found) if type(found) is list else found

    fget._syncdp_wrapped = True
    owner.variables = property(fget, variables.fset, variables.fdel, variables.__doc__)
    if keras.__name__ == "keras":
        _register_with_keras_tree()


def _takes_any_keyword(function) -> bool:
    return any(
        p.kind is inspect.Parameter.VAR_KEYWORD
        for p in inspect.signature(function).parameters.values()
    )


# tf-keras optimizer -> the lr= it was built with, between its base class's __init__ (which
# reads the keyword arguments) and its own (which builds the learning rate afterwards).
_lr_arguments: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _accept_lr_argument(keras) -> None:
    # tf-keras's current optimizers read their extra keyword arguments in _process_kwargs,
    # where lr= is dropped with a warning; Keras 3 has no such hook (it refuses lr=).
    base = keras.optimizers.Optimizer
    if not hasattr(base, "_process_kwargs") or not hasattr(base, "_build_learning_rate"):
        return
    process_owner = _owner(base, "_process_kwargs")
    process = process_owner._process_kwargs
    if getattr(process, "_syncdp_wrapped", False):
        return
    build_owner = _owner(base, "_build_learning_rate")
    build = build_owner._build_learning_rate

    @functools.wraps(process)
    def _process_kwargs(self, kwargs):
        lr = kwargs.pop("lr", None)
        if lr is not None:
            _lr_arguments[self] = lr
        return process(self, kwargs)

    @functools.wraps(build)
    def _build_learning_rate(self, learning_rate):
        return build(self, _lr_arguments.pop(self, learning_rate))

    _process_kwargs._syncdp_wrapped = True
    process_owner._process_kwargs = _process_kwargs
    build_owner._build_learning_rate = _build_learning_rate


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
