"""DistributedOptimizer: a Keras 3 optimizer whose gradients are averaged over all ranks.

It wraps any Keras 3 optimizer the way Keras' own ``LossScaleOptimizer`` does: it *is* a
``keras.optimizers.Optimizer`` and hands the averaged gradients to the optimizer it wraps, which
keeps its own variables, learning rate and config. So ``model.compile(optimizer=...)`` +
``model.fit``, ``optimizer.apply_gradients`` in a custom loop, Keras' learning-rate callbacks,
``model.save`` and ``tf.train.Checkpoint`` all work unchanged.

Keras' train step calls ``optimizer.apply_gradients(zip(grads, weights))`` (through
``apply``); that is where the gradients are reduced, in fused collectives
(:func:`syncdp.tape.reduce_gradients`), before clipping, weight decay and the update itself,
so every rank applies the same update and the replicas stay identical.

syncdp's collectives run on the host (``tf.numpy_function`` nodes), which XLA cannot compile:
a train step compiled with ``jit_compile=True`` cannot contain them. The callbacks in
:mod:`syncdp.keras.callbacks` turn ``jit_compile`` off with a warning, and this optimizer
raises a clear error if it is traced inside an XLA-compiled function anyway.
"""

from __future__ import annotations

import warnings

import keras
import tensorflow as tf

from syncdp.core.errors import UnsupportedError
from syncdp.keras import _display
from syncdp.tensorflow import collectives as ops
from syncdp.tensorflow import graph
from syncdp.tensorflow.compression import Compression
from syncdp.tensorflow.tape import local_positions, reduce_gradients

try:  # Private, but the only way to know at trace time that XLA will compile the graph.
    from tensorflow.python.ops.control_flow_util import GraphOrParentsInXlaContext
except ImportError:  # pragma: no cover - a TensorFlow that moved it: the check is skipped.
    GraphOrParentsInXlaContext = None

__all__ = [
    "DistributedOptimizer",
    "PartialDistributedOptimizer",
    "load_model",
    "is_distributed",
    "turn_off_jit",
]

_COMPRESSION_NAMES = {Compression.none: "none", Compression.fp16: "fp16"}


@keras.saving.register_keras_serializable(package="syncdp")
class DistributedOptimizer(keras.optimizers.Optimizer):
    """Wraps a Keras 3 optimizer so that gradients are averaged over all ranks before use.

    Every ``apply``/``apply_gradients`` is a synchronization point: all ranks must call it,
    with gradients of the same shapes, once per step. Broadcast the initial state first
    (:class:`syncdp.keras.callbacks.BroadcastGlobalVariablesCallback`, or
    ``syncdp.broadcast_variables``) so that all replicas start, and stay, identical.

    The wrapped optimizer does the update: its learning rate (``optimizer.learning_rate``, also
    settable), ``iterations``, variables and config are reachable through this object, and
    other public attributes (``momentum``, ``beta_1``, ...) are read from it.

    Args:
        optimizer: The Keras 3 optimizer to wrap (``keras.optimizers.SGD(...)``, ``Adam``, ...).
        name: This optimizer's name. Defaults to ``"distributed_" + optimizer.name``.
        device_dense: Accepted for Horovod compatibility; placement follows the gradients.
        device_sparse: Accepted for Horovod compatibility.
        compression: ``Compression.none`` or ``Compression.fp16`` (gradients travel as
            float16). Defaults to ``Compression.none``.
        sparse_as_dense: Reduce ``IndexedSlices`` gradients (embeddings) as dense tensors.
            Defaults to False.
        gradient_predivide_factor: Divide gradients by this before the sum and by
            ``size / factor`` after it. Defaults to 1.
        op: ``syncdp.Average`` or ``syncdp.Sum``. Defaults to ``syncdp.Average``.
        backward_passes_per_step: Accumulate this many local gradients before one allreduce
            and one update; the wrapped optimizer's ``iterations`` counts updates. Defaults
            to 1.
        average_aggregated_gradients: With ``backward_passes_per_step > 1``, divide the
            accumulated gradients by ``backward_passes_per_step`` (so k passes on k batches
            equal one step on the k batches together). Defaults to True.
        num_groups: Accepted for Horovod compatibility; fusion follows the threshold.
        groups: Accepted for Horovod compatibility.
        process_set: The ranks that average together; a rank outside it keeps its own
            gradients. Defaults to the whole job.
        scale_local_gradients: Divide the gradients of variables registered with
            :meth:`register_local_var` by the set's size. Defaults to True.
        **kwargs: Only for deserialization; must be empty otherwise.

    Raises:
        TypeError: ``optimizer`` is not a Keras 3 optimizer.
        ValueError: An argument is out of range.

    Example:
        >>> opt = keras.optimizers.SGD(0.01 * syncdp.size(), momentum=0.9)
        >>> opt = syncdp.keras.DistributedOptimizer(opt)
        >>> model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    """

    def __init__(
        self,
        optimizer,
        name: str | None = None,
        device_dense: str = "",
        device_sparse: str = "",
        compression=Compression.none,
        sparse_as_dense: bool = False,
        gradient_predivide_factor: float = 1.0,
        op=ops.Average,
        backward_passes_per_step: int = 1,
        average_aggregated_gradients: bool = True,
        num_groups: int = 0,
        groups=None,
        process_set=ops.global_process_set,
        scale_local_gradients: bool = True,
        **kwargs,
    ):
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise TypeError(
                "DistributedOptimizer wraps a Keras 3 optimizer (keras.optimizers.Optimizer); "
                f"got {type(optimizer).__module__}.{type(optimizer).__name__}. Pass an "
                "instance such as keras.optimizers.Adam(1e-3)."
            )
        if isinstance(optimizer, DistributedOptimizer):
            raise ValueError(
                "The optimizer is already a DistributedOptimizer; wrap the "
                "plain Keras optimizer once."
            )
        if op not in (ops.Average, ops.Sum):
            raise ValueError(f"op must be syncdp.Average or syncdp.Sum; got {op!r}.")
        if (
            int(backward_passes_per_step) != backward_passes_per_step
            or backward_passes_per_step < 1
        ):
            raise ValueError(
                "backward_passes_per_step must be an integer >= 1; got "
                f"{backward_passes_per_step!r}."
            )
        if compression not in _COMPRESSION_NAMES:
            raise ValueError(
                "compression must be syncdp.Compression.none or "
                f"syncdp.Compression.fp16; got {compression!r}."
            )
        if kwargs:
            raise TypeError(
                f"DistributedOptimizer got unexpected arguments {sorted(kwargs)}; "
                "set learning rate, clipping, weight decay and the like on the "
                "wrapped optimizer."
            )
        # The base class wants a learning rate; the wrapped optimizer's is the one used.
        super().__init__(learning_rate=0.0, name=name or f"distributed_{optimizer.name}")
        self.inner_optimizer = optimizer
        self.compression = compression
        self.sparse_as_dense = sparse_as_dense
        self.gradient_predivide_factor = gradient_predivide_factor
        self.op = op
        self.backward_passes_per_step = int(backward_passes_per_step)
        self.average_aggregated_gradients = average_aggregated_gradients
        self.process_set = process_set
        self.scale_local_gradients = scale_local_gradients
        self._local_vars: list = []
        self._reduced: tuple | None = None  # ids of gradients _compute_gradients reduced
        self._accumulators = []
        self._passes = None
        _display.quiet_other_ranks()

    def build(self, var_list):
        """Creates the wrapped optimizer's variables and, when accumulating, the accumulators.

        Args:
            var_list: The model's trainable variables.
        """
        if self.built:
            return
        # Built outside any trace: the first apply may be traced after the function's first
        # trace (Horovod's elastic example traces its step once without syncdp), where
        # tf.function refuses new variables.
        with graph.creating_variables():
            if not self.inner_optimizer.built:
                self.inner_optimizer.build(var_list)
            if self.backward_passes_per_step > 1:
                self._accumulators = [
                    self.add_variable_from_reference(v, "syncdp_accumulator") for v in var_list
                ]
                self._passes = self.add_variable(
                    shape=(), dtype="int64", initializer="zeros", name="syncdp_passes"
                )
        super().build(var_list)

    @property
    def variables(self):
        """The wrapped optimizer's variables, then the gradient accumulators (if any)."""
        own = self._accumulators + ([self._passes] if self._passes is not None else [])
        return self.inner_optimizer.variables + own

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    def __getattr__(self, name):
        # Called only when ordinary lookup fails: hyperparameters of the wrapped optimizer
        # (momentum, beta_1, ...), which Horovod-era code reads from model.optimizer.
        inner = self.__dict__.get("inner_optimizer")
        if inner is None or name.startswith("_"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(inner, name)

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    def apply_gradients(self, grads_and_vars):
        """Averages the gradients over all ranks, then applies them (a collective).

        Args:
            grads_and_vars: Pairs of (gradient, variable), as for any Keras optimizer.

        Returns:
            The wrapped optimizer's ``iterations``.
        """
        grads, variables = zip(*grads_and_vars, strict=True)
        self.apply(grads, variables)
        return self.iterations

    def apply(self, grads, trainable_variables=None):
        """Averages ``grads`` over all ranks, then lets the wrapped optimizer apply them.

        A synchronization point: every rank must call it once per step. With
        ``backward_passes_per_step = k`` the gradients are accumulated locally and reduced and
        applied on every k-th call.

        Args:
            grads: Gradients, one per variable (None for a variable without one).
            trainable_variables: The variables. Defaults to those the optimizer was built with.

        Raises:
            UnsupportedError: Traced inside an XLA-compiled function (``jit_compile=True``).
            StepMismatchError: Ranks are at different updates (``iterations``); see
                :func:`syncdp.tape.reduce_gradients`, which also runs the
                ``SYNCDP_VERIFY_EVERY`` replica check on the variables.
        """
        grads = list(grads)
        if not grads:
            return
        if trainable_variables is None:
            if not self.built:
                raise ValueError(
                    "apply() without trainable_variables needs a built "
                    "optimizer; call optimizer.build(model.trainable_variables) "
                    "first, or pass the variables."
                )
            trainable_variables = self._trainable_variables
        trainable_variables = list(trainable_variables)
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
        _check_not_xla()
        if self.backward_passes_per_step == 1:
            if self._reduced is not None and self._reduced == tuple(id(g) for g in grads):
                reduced = grads  # from _compute_gradients, reduced already
            else:
                reduced = self._reduce(grads, trainable_variables)
            self._reduced = None
            self.inner_optimizer.apply(reduced, trainable_variables)
        else:
            self._accumulate(grads, trainable_variables)

    def register_local_var(self, var) -> None:
        """Keeps ``var``'s gradient on this rank: it is never reduced (Horovod's local var)."""
        self._local_vars.append(var)

    def _compute_gradients(self, loss, var_list, grad_loss=None, tape=None):
        """Horovod's (Keras 2) hook: ``(gradient, variable)`` pairs, gradients reduced.

        Args:
            loss: A callable returning the loss, or (with ``tape``) the loss tensor.
            var_list: The variables.
            grad_loss: Optional gradient of the loss. Defaults to None.
            tape: A tape that recorded ``loss``. Defaults to a new one around ``loss()``.

        Returns:
            Pairs ready for :meth:`apply_gradients`, which then does not reduce them again.
            With ``backward_passes_per_step > 1`` the gradients are returned as computed and
            accumulated by :meth:`apply_gradients`.
        """
        var_list = list(var_list)
        if tape is None:
            tape = tf.GradientTape()
            with tape:
                tape.watch(var_list)
                value = loss()
        else:
            value = loss() if callable(loss) else loss
        grads = tape.gradient(value, var_list, grad_loss)
        if self.backward_passes_per_step == 1:
            if not self.built:
                with keras.name_scope(self.name, caller=self):
                    self.build(var_list)
            grads = self._reduce(list(grads), var_list)
            self._reduced = tuple(id(g) for g in grads)
        return list(zip(grads, var_list))

    @property
    def _agg_helper(self):
        """Horovod's view of the accumulation: ``counter`` = passes since the last update."""
        if self.backward_passes_per_step == 1:
            return None
        return _PassCounter(self)

    def _reduce(self, grads, variables):
        # step= is the update about to be made: ranks that disagree fail before any exchange.
        return reduce_gradients(
            grads,
            process_set=self.process_set,
            local=local_positions(variables, self._local_vars),
            scale_local_gradients=self.scale_local_gradients,
            op=self.op,
            compression=self.compression,
            sparse_as_dense=self.sparse_as_dense,
            gradient_predivide_factor=self.gradient_predivide_factor,
            name=self.name,
            variables=variables,
            step=self.iterations,
        )

    def _accumulate(self, grads, variables):
        k = self.backward_passes_per_step
        accumulators = [self._accumulators[self._get_variable_index(v)] for v in variables]
        for acc, grad in zip(accumulators, grads, strict=True):
            if grad is not None:
                acc.assign_add(tf.cast(tf.convert_to_tensor(grad), acc.dtype))
        self._passes.assign_add(1)

        def reduce_and_apply():
            summed = [
                None if g is None else tf.convert_to_tensor(acc)
                for acc, g in zip(accumulators, grads, strict=True)
            ]
            if self.average_aggregated_gradients:
                summed = [None if s is None else s / tf.cast(k, s.dtype) for s in summed]
            self.inner_optimizer.apply(self._reduce(summed, variables), variables)
            for acc in accumulators:
                acc.assign(tf.zeros_like(acc))

        # Every rank counts the same passes, so every rank takes the same branch and the
        # collectives inside it stay in step.
        tf.cond(
            tf.equal(tf.math.floormod(tf.convert_to_tensor(self._passes), k), 0),
            reduce_and_apply,
            lambda: None,
        )

    def get_config(self):
        # Only this wrapper's settings and the wrapped optimizer; the base class's arguments
        # (clipping, weight decay, ...) belong to the wrapped optimizer.
        return {
            "name": self.name,
            "optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "compression": _COMPRESSION_NAMES[self.compression],
            "sparse_as_dense": self.sparse_as_dense,
            "gradient_predivide_factor": self.gradient_predivide_factor,
            "op": self.op.value,
            "backward_passes_per_step": self.backward_passes_per_step,
            "average_aggregated_gradients": self.average_aggregated_gradients,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        optimizer = keras.saving.deserialize_keras_object(
            config.pop("optimizer"), custom_objects=custom_objects
        )
        config["compression"] = getattr(Compression, config.get("compression", "none"))
        config["op"] = ops.ReduceOp(config.get("op", ops.Average.value))
        return cls(optimizer, **config)


class _PassCounter:
    def __init__(self, optimizer):
        self._optimizer = optimizer

    @property
    def counter(self):
        passes = self._optimizer._passes
        k = self._optimizer.backward_passes_per_step
        return tf.math.floormod(tf.convert_to_tensor(0 if passes is None else passes), k)


def PartialDistributedOptimizer(  # noqa: N802 - Horovod's name for a factory
    optimizer, name=None, *args, local_layers=None, **kwargs
) -> DistributedOptimizer:
    """A :class:`DistributedOptimizer` whose ``local_layers`` keep their gradients local.

    Args:
        optimizer: The Keras 3 optimizer to wrap.
        name: The optimizer's name.
        local_layers: A Keras layer or a list of them: their trainable weights are registered
            with :meth:`DistributedOptimizer.register_local_var`.
        *args, **kwargs: As for :class:`DistributedOptimizer`.

    Raises:
        ValueError: ``local_layers`` holds something that is not a Keras layer.
    """
    if local_layers is None:
        local_layers = []
    elif isinstance(local_layers, keras.layers.Layer):
        local_layers = [local_layers]
    if not all(isinstance(layer, keras.layers.Layer) for layer in local_layers):
        raise ValueError("All local layers must be of keras.layers.Layer type.")
    opt = DistributedOptimizer(optimizer, name, *args, **kwargs)
    for layer in local_layers:
        for weight in layer.trainable_weights:
            opt.register_local_var(weight)
    return opt


def _check_not_xla() -> None:
    if GraphOrParentsInXlaContext is None or tf.executing_eagerly():
        return
    if GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
        raise UnsupportedError(
            "DistributedOptimizer cannot run inside an XLA-compiled function: syncdp's "
            "collectives run on the host, which XLA cannot compile, and this step was traced "
            "with jit_compile=True. Compile the model with model.compile(..., "
            "jit_compile=False), or pass a syncdp.keras callback to fit() (it turns "
            "jit_compile off), or drop jit_compile=True from your tf.function."
        )


def is_distributed(optimizer) -> bool:
    """Whether ``optimizer`` is, or wraps (e.g. in a LossScaleOptimizer), a DistributedOptimizer.

    Args:
        optimizer: A Keras optimizer, or None.
    """
    while optimizer is not None:
        if isinstance(optimizer, DistributedOptimizer):
            return True
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return False


def turn_off_jit(model) -> bool:
    """Turns a compiled model's ``jit_compile`` off, with a warning, if it uses syncdp.

    XLA cannot compile syncdp's host-side collectives, so a train step that reduces gradients
    through a DistributedOptimizer must not be XLA-compiled. The syncdp callbacks and
    :func:`load_model` call this for you.

    Args:
        model: A Keras model.

    Returns:
        Whether it changed the model.
    """
    if not (
        getattr(model, "compiled", False)
        and model.jit_compile
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


def load_model(
    filepath, custom_optimizers=None, custom_objects=None, compression=Compression.none, **kwargs
):
    """Loads a saved Keras model whose optimizer averages gradients over all ranks.

    A model saved with a DistributedOptimizer comes back with one (``import syncdp.keras``
    registers the class with Keras, so ``keras.saving.load_model`` works too). A model saved
    with a plain optimizer gets it wrapped here, as Horovod's ``load_model`` does. Not a
    collective; broadcast the state afterwards if only rank 0 read the file.

    Args:
        filepath: The ``.keras`` file.
        custom_optimizers: Optimizer classes the file needs that Keras does not know.
            Defaults to none.
        custom_objects: Other custom objects, as for ``keras.saving.load_model``. Defaults to
            none.
        compression: Compression for a plain optimizer wrapped here. Defaults to
            ``Compression.none``.
        **kwargs: Passed on to ``keras.saving.load_model`` (e.g. ``compile``, ``safe_mode``).

    Returns:
        The model, compiled with a DistributedOptimizer if it was saved compiled.

    Example:
        >>> model = syncdp.keras.load_model("model.keras")
    """
    objects = dict(custom_objects or {})
    for cls in custom_optimizers or ():
        objects[cls.__name__] = cls
    model = keras.saving.load_model(filepath, custom_objects=objects, **kwargs)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and not is_distributed(optimizer):
        model.optimizer = DistributedOptimizer(optimizer, compression=compression)
        model.train_function = None  # the next fit() traces a step with the new optimizer
    turn_off_jit(model)
    return model
