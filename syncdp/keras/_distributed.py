"""The behaviour of every DistributedOptimizer, whatever Keras it belongs to.

:class:`Distributed` is written once and put by :func:`syncdp.keras.optimizer.for_package` on a
Keras package's ``optimizers.Optimizer`` (Keras 3's, or Keras 2's from tf-keras): it reduces the
gradients (:func:`syncdp.tape.reduce_gradients`), accumulates them over backward passes, and
hands them to the optimizer it wraps, to which it also forwards the learning rate, the step
count, the variables and the config. What differs between the Kerases is read from the package
and the wrapped optimizer (:mod:`syncdp.tensorflow.keras2_names`), never copied.

syncdp's collectives run on the host (``tf.numpy_function`` nodes), which XLA cannot compile:
traced inside an XLA-compiled function, the wrapper raises a clear error.
"""

from __future__ import annotations

import copy
import sys
import warnings
from collections.abc import Callable
from types import ModuleType

import numpy as np
import tensorflow as tf

from syncdp.base.errors import UnsupportedError
from syncdp.keras import _display, _loss_scale
from syncdp.tensorflow import collectives as ops
from syncdp.tensorflow import compression as _compression
from syncdp.tensorflow import graph
from syncdp.tensorflow.compression import Compression
from syncdp.tensorflow.keras2_names import (
    create_optimizer_variables,
    optimizer_variables,
    package_of,
)
from syncdp.tensorflow.tape import (
    check_groups,
    local_positions,
    reduce_gradients,
    reduced_by_a_tape,
)

try:  # Private, but the only way to know at trace time that XLA will compile the graph.
    from tensorflow.python.ops.control_flow_util import GraphOrParentsInXlaContext
except ImportError:  # pragma: no cover - a TensorFlow that moved it: the check is skipped.
    GraphOrParentsInXlaContext = None

__all__ = ["Distributed", "keras_of_optimizer"]


class _WrappedSetting:
    """A setting the Keras base class keeps on the wrapper and acts on in its own ``build()``
    (an EMA of the weights, gradient accumulation): read from and set on the wrapped optimizer,
    which does the update. The base class's ``__init__`` and ``build()`` see the wrapper's own
    default instead, so that the wrapper makes no EMA or accumulators of its own."""

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, wrapper, owner=None):
        if wrapper is None:
            return self
        state = wrapper.__dict__
        inner = state.get("inner_optimizer")
        if inner is not None and not state.get("_base_building") and hasattr(inner, self.name):
            return getattr(inner, self.name)
        if self.name in state:
            return state[self.name]  # the base class's default
        raise AttributeError(f"{type(wrapper).__name__!r} object has no attribute {self.name!r}")

    def __set__(self, wrapper, value):
        inner = wrapper.__dict__.get("inner_optimizer")
        if inner is None or not hasattr(inner, self.name):
            wrapper.__dict__[self.name] = value  # the base class's __init__
            return
        if self.name == "gradient_accumulation_steps" and value:
            _check_one_accumulation(wrapper.backward_passes_per_step, value)
        setattr(inner, self.name, value)


def _check_one_accumulation(backward_passes_per_step: int, gradient_accumulation_steps) -> None:
    if backward_passes_per_step > 1 and gradient_accumulation_steps:
        raise ValueError(
            f"backward_passes_per_step ({backward_passes_per_step}) and the wrapped optimizer's "
            f"gradient_accumulation_steps ({gradient_accumulation_steps}) both accumulate "
            "gradients over several steps; use one of them."
        )


class Distributed:
    """Wraps a Keras optimizer so that gradients are averaged over all ranks before use.

    Every ``apply``/``apply_gradients`` is a synchronization point: all ranks must call it,
    with gradients of the same shapes, once per step. Broadcast the initial state first
    (:class:`syncdp.keras.callbacks.BroadcastGlobalVariablesCallback`, or
    ``syncdp.broadcast_variables``) so that all replicas start, and stay, identical.

    The wrapped optimizer does the update: its learning rate (``optimizer.learning_rate``, and
    Keras 2's ``optimizer.lr``, both settable), ``iterations``, variables and config are
    reachable through this object, and other public attributes (``momentum``, ``beta_1``, ...)
    are read from it and set on it (``opt.momentum = 0.5`` changes the update, as on Horovod's
    optimizer, which is the wrapped class itself). The wrapper is an optimizer of the wrapped
    one's Keras: Keras 3's ``keras.optimizers.Optimizer``, or Keras 2's
    ``tf.keras.optimizers.Optimizer`` (tf-keras, for its current and legacy optimizers).

    Args:
        optimizer: The Keras optimizer to wrap (``keras.optimizers.SGD(...)``, ``Adam``, ...;
            under ``TF_USE_LEGACY_KERAS=1`` also ``tf.keras.optimizers.legacy.SGD(...)``).
        name: This optimizer's name. Defaults to ``"distributed_" + optimizer.name``.
        device_dense: Accepted for Horovod compatibility; placement follows the gradients.
        device_sparse: Accepted for Horovod compatibility.
        compression: ``Compression.none``, ``Compression.fp16`` (gradients travel as
            float16), or any compressor the gradient tape takes (an object or class with
            ``compress`` and ``decompress``, as :class:`syncdp.tensorflow.compression.Compressor`).
            The config names a custom compressor by its dotted path (``"pkg.module.TopK"``),
            which loading looks up among the modules already imported (import it before
            loading) or in ``custom_objects``; one no path reaches (a class defined inside a
            function, an instance) is saved as no compression, with a warning, and comes back
            as ``Compression.none``. Defaults to ``Compression.none``.
        sparse_as_dense: Reduce ``IndexedSlices`` gradients (embeddings) as dense tensors.
            Defaults to False.
        gradient_predivide_factor: Divide gradients by this before the sum and by
            ``size / factor`` after it. Defaults to 1.
        op: ``syncdp.Average`` or ``syncdp.Sum``. Defaults to ``syncdp.Average``.
        backward_passes_per_step: Accumulate this many local gradients before one allreduce
            and one update. ``iterations`` counts every call, applied or not, as Horovod's
            does (after 4 calls with 2 passes per step it is 4), so schedules keyed to it
            move per pass. Defaults to 1.
        average_aggregated_gradients: With ``backward_passes_per_step > 1``, divide the
            accumulated gradients by ``backward_passes_per_step``, so that k passes on k
            batches equal one step on the k batches together. Otherwise the update applies
            the sum of the k (rank-averaged) gradients, as Horovod's does. Defaults to False
            (Horovod's default).
        num_groups: Accepted for Horovod compatibility; fusion follows the threshold.
        groups: Accepted for Horovod compatibility (a positive integer or a list, as Horovod
            checks); fusion follows the threshold.
        process_set: The ranks that average together; a rank outside it keeps its own
            gradients. Defaults to the whole job.
        scale_local_gradients: Divide the gradients of variables registered with
            :meth:`register_local_var` by the set's size. Defaults to True.
        **kwargs: Only for deserialization; must be empty otherwise.

    Raises:
        TypeError: ``optimizer`` is not a Keras optimizer.
        ValueError: An argument is out of range.

    Example:
        >>> opt = keras.optimizers.SGD(0.01 * syncdp.size(), momentum=0.9)
        >>> opt = syncdp.keras.DistributedOptimizer(opt)
        >>> model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    """

    # Set by syncdp.keras.optimizer.for_package on each class it builds:
    _keras: ModuleType  # the Keras package served
    _base_arguments: dict  # what that Keras' base class's __init__ needs besides the name
    _for_package: Callable[[ModuleType], type]  # the class for another Keras' optimizer

    use_ema = _WrappedSetting()
    ema_momentum = _WrappedSetting()
    ema_overwrite_frequency = _WrappedSetting()
    gradient_accumulation_steps = _WrappedSetting()

    def __new__(cls, optimizer=None, *args, **kwargs):
        # Keras' compile takes only its own Keras' optimizers: wrap with the class of the
        # optimizer's Keras, whichever package's class was called.
        keras_ = keras_of_optimizer(optimizer)
        if keras_ is not None and keras_ is not cls._keras:
            return cls._for_package(keras_)(optimizer, *args, **kwargs)
        scaler = _loss_scale.loss_scale_class(keras_)
        if scaler is not None and isinstance(optimizer, scaler):
            return _loss_scale.inside_loss_scale(cls, optimizer, scaler, args, kwargs)
        return super().__new__(cls)

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
        average_aggregated_gradients: bool = False,
        num_groups: int = 0,
        groups=None,
        process_set=ops.global_process_set,
        scale_local_gradients: bool = True,
        **kwargs,
    ):
        if keras_of_optimizer(optimizer) is None:
            raise TypeError(
                "DistributedOptimizer wraps a Keras optimizer (Keras 3's "
                "keras.optimizers.Optimizer, or Keras 2's tf.keras.optimizers.Optimizer or "
                "tf.keras.optimizers.legacy.Optimizer from tf-keras); got "
                f"{type(optimizer).__module__}.{type(optimizer).__name__}. Pass an "
                "instance such as keras.optimizers.Adam(1e-3)."
            )
        if isinstance(optimizer, Distributed):
            raise ValueError(
                "The optimizer is already a DistributedOptimizer; wrap the "
                "plain Keras optimizer once."
            )
        op = ops.reduce_op(op)
        check_groups(num_groups, groups)
        if op not in (ops.Average, ops.Sum):
            raise ValueError(f"op must be syncdp.Average or syncdp.Sum; got {op!r}.")
        if gradient_predivide_factor != 1.0 and op is not ops.Average:
            # Refused here, as Horovod does, not at the first training step.
            raise ValueError("gradient_predivide_factor not supported with op != Average.")
        if (
            int(backward_passes_per_step) != backward_passes_per_step
            or backward_passes_per_step < 1
        ):
            raise ValueError(
                "backward_passes_per_step must be an integer >= 1; got "
                f"{backward_passes_per_step!r}."
            )
        _check_one_accumulation(
            backward_passes_per_step, getattr(optimizer, "gradient_accumulation_steps", None)
        )
        if not _compression.is_compressor(compression):
            raise ValueError(
                "compression must be a compressor: syncdp.Compression.none, "
                "syncdp.Compression.fp16, or an object with compress() and decompress(); got "
                f"{compression!r}."
            )
        if kwargs:
            raise TypeError(
                f"DistributedOptimizer got unexpected arguments {sorted(kwargs)}; "
                "set learning rate, clipping, weight decay and the like on the "
                "wrapped optimizer."
            )
        if _loss_scale.is_keras2_loss_scale(optimizer):
            raise UnsupportedError(
                "DistributedOptimizer cannot wrap Keras 2's LossScaleOptimizer: compile() would "
                "wrap the result in a second one, which unscales the gradients twice. Wrap the "
                "plain optimizer (under the mixed_float16 policy compile adds the "
                "LossScaleOptimizer around it), or use Keras 3, where "
                "DistributedOptimizer(LossScaleOptimizer(opt)) is supported."
            )
        # The base class may want a learning rate; the wrapped optimizer's is the one used.
        super().__init__(name=name or _default_name(optimizer), **self._base_arguments)
        # What the collectives are called must be the same on every rank: not the name Keras 3
        # numbers per process (sgd, sgd_1, ...: a rank that made one more optimizer, for an
        # evaluation copy, would call its collectives differently), but the class's, as
        # Horovod's "Distributed" + class name.
        self._collective_name = name or f"distributed_{type(optimizer).__name__.lower()}"
        self._given_name = name  # what the config keeps: a default is made again on loading
        self.built = False
        self.inner_optimizer = optimizer
        for setting in _READ_FROM_INNER:
            if hasattr(optimizer, setting):
                # The base class's copy is a default the update never uses: read (through
                # __getattr__) and set the wrapped optimizer's instead.
                self.__dict__.pop(setting, None)
        self.compression = compression
        self.sparse_as_dense = sparse_as_dense
        self.gradient_predivide_factor = gradient_predivide_factor
        self.op = op
        self.backward_passes_per_step = int(backward_passes_per_step)
        self.average_aggregated_gradients = average_aggregated_gradients
        self.process_set = process_set
        self.scale_local_gradients = scale_local_gradients
        self._local_vars: list = []
        # The gradients _compute_gradients or aggregate_gradients reduced, until applied.
        self._reduced: list | None = None
        self._accumulators = []
        # Positions (in build()'s order) whose accumulator ever received a gradient; see
        # _accumulate.
        self._summed = self._no_dependency(set())
        self._passes = None
        self._built_for = self._no_dependency([])  # the variables build() was given
        self._track_for_graph_session()
        _display.quiet_other_ranks(self._keras)

    def build(self, var_list):
        """Creates the wrapped optimizer's variables and, when accumulating, the accumulators.

        Args:
            var_list: The model's trainable variables.
        """
        _loss_scale.agree_on_overflow(self, sys._getframe(1))
        if self.built:
            return
        var_list = tf.nest.flatten(var_list)  # Keras 2 takes nested lists too
        # Built outside any trace: the first apply may be traced after the function's first
        # trace (Horovod's elastic example traces its step once without syncdp), where
        # tf.function refuses new variables.
        with graph.creating_variables():
            create_optimizer_variables(self.inner_optimizer, var_list)
            if self.backward_passes_per_step > 1:
                self._accumulators = [
                    self.add_variable_from_reference(v, "syncdp_accumulator") for v in var_list
                ]
                self._passes = self.add_variable(
                    shape=(), dtype="int64", initializer="zeros", name="syncdp_passes"
                )
        self.__dict__["_base_building"] = True  # see _WrappedSetting
        try:
            super().build(var_list)
        finally:
            self.__dict__["_base_building"] = False
        self._built_for = self._no_dependency(var_list)  # the model's, not this optimizer's
        self._track_for_graph_session()
        self.built = True

    def _track_for_graph_session(self) -> None:
        """In a TF1 graph (Keras 2 with eager execution turned off), Keras' session initializes
        only the variables it tracks: this wrapper's own (the base class's step count, never
        used but saved with the model, and the accumulators) are plain ``tf.Variable``s."""
        if not _in_a_tf1_graph():
            return
        backend = getattr(getattr(self._keras, "__internal__", None), "backend", None)
        track = getattr(backend, "track_variable", None)
        if track is None:
            return
        for variable in self.__dict__.get("_variables", ()):
            track(variable)

    @property
    def variables(self):
        """The wrapped optimizer's variables, then the gradient accumulators (if any); also
        callable, as Keras 2's ``optimizer.variables()``."""
        own = list(self._accumulators) + ([self._passes] if self._passes is not None else [])
        return _VariableList(optimizer_variables(self.inner_optimizer) + own)

    def share_pending_gradients(self) -> None:
        """Gives every rank of the process set the ranks' mean of the gradients accumulated
        since the last update (``backward_passes_per_step`` > 1, partway through a window).

        The next update reduces the accumulators across the ranks, and the reduction is linear,
        so it is unchanged; but each rank then holds what every rank needs, and a checkpoint
        that rank 0 writes now resumes the window as it was (rank 0's own gradients alone, on
        every rank, would not). :meth:`syncdp.checkpoint.CheckpointManager.save` calls it. A
        collective of the set's ranks when a window is open (every rank counts the same
        passes); nothing otherwise. Call it eagerly. Variables registered as local keep their
        own accumulators.
        """
        if not self._accumulators:
            return
        if self.process_set.included() is False:  # a removed set (None) is refused below
            return
        if int(tf.convert_to_tensor(self._passes)) % self.backward_passes_per_step == 0:
            return  # no window open: the accumulators are zeros on every rank
        local = set(local_positions(self._built_for, self._local_vars))
        shared = [acc for i, acc in enumerate(self._accumulators) if i not in local]
        means = ops.grouped_allreduce(
            [tf.convert_to_tensor(acc) for acc in shared],
            op=ops.Average,
            process_set=self.process_set,
            name=f"{self._collective_name}.pending",
        )
        for acc, mean in zip(shared, means, strict=True):
            acc.assign(mean)

    def get_weights(self) -> list:
        """The values of :attr:`variables`, as arrays (Keras 2's optimizer API)."""
        if _in_a_tf1_graph():  # read in Keras 2's session
            return self._keras.backend.batch_get_value(list(self.variables))
        return [v.numpy() for v in self.variables]

    def set_weights(self, weights) -> None:
        """Sets :attr:`variables` from ``weights``, in order (Keras 2's ``.h5`` loading).

        Raises:
            ValueError: ``weights`` do not match the variables in number or shape.
        """
        variables = self.variables
        if len(weights) != len(variables):
            raise ValueError(
                f"{self.name} has {len(variables)} variables; got {len(weights)} values. Load "
                "weights saved from the same optimizer, with the same backward_passes_per_step."
            )
        for variable, value in zip(variables, weights, strict=True):
            if tuple(variable.shape) != np.shape(value):
                raise ValueError(
                    f"{self.name}'s variable {variable.name} has shape {tuple(variable.shape)}; "
                    f"got a value of shape {np.shape(value)}."
                )
        if _in_a_tf1_graph():  # assigned in Keras 2's session
            self._keras.backend.batch_set_value(list(zip(variables, weights, strict=True)))
            return
        for variable, value in zip(variables, weights, strict=True):
            variable.assign(value)

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    @property
    def loss_scale_factor(self):
        """The wrapped optimizer's (Keras 3): its update divides the gradients by it. A
        LossScaleOptimizer around this one (compile's, under mixed_float16) sets it to None
        here, as it scales the loss itself, so that must reach the wrapped optimizer, or the
        gradients would be divided by it once more."""
        return getattr(self.__dict__.get("inner_optimizer"), "loss_scale_factor", None)

    @loss_scale_factor.setter
    def loss_scale_factor(self, factor):
        inner = self.__dict__.get("inner_optimizer")
        if inner is not None:  # the base class's __init__ sets it before the inner exists
            inner.loss_scale_factor = factor

    def __getattr__(self, name):
        # Called only when ordinary lookup fails: hyperparameters of the wrapped optimizer
        # (momentum, beta_1, ...), which Horovod-era code reads from model.optimizer.
        inner = self.__dict__.get("inner_optimizer")
        if inner is None or name.startswith("_"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(inner, name)

    def __setattr__(self, name, value):
        # The wrapped optimizer does the update: a setting of its (momentum, nesterov, epsilon,
        # clipnorm, weight_decay, ...) set here goes to it, or the update would silently
        # ignore it. Everything else (this wrapper's own arguments, Keras' private state, a
        # name the wrapped optimizer lacks) stays here.
        inner = self.__dict__.get("inner_optimizer")
        if inner is None or not _settable_on(inner, name, type(self)):
            super().__setattr__(name, value)
            return
        setattr(inner, name, value)
        # The Keras base class keeps copies of some settings here, unused since the wrapped
        # optimizer updates: kept equal so that reading them here agrees.
        if name in self.__dict__:
            super().__setattr__(name, value)

    def exclude_from_weight_decay(self, var_list=None, var_names=None):
        """The wrapped optimizer's: it decays the weights (Keras 3, and Keras 2's current
        optimizers)."""
        self.inner_optimizer.exclude_from_weight_decay(var_list=var_list, var_names=var_names)

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list):
        finalize = getattr(self.inner_optimizer, "finalize_variable_values", None)
        if finalize is not None:  # Keras 2's legacy optimizers have nothing to finalize
            finalize(var_list)

    def apply_gradients(self, grads_and_vars, name=None, **kwargs):
        """Averages the gradients over all ranks, then applies them (a collective).

        Args:
            grads_and_vars: Pairs of (gradient, variable), as for any Keras optimizer.
            name: Accepted for Keras 2; the wrapped optimizer names its own ops.
            **kwargs: Keras 2's ``skip_gradients_aggregation`` and
                ``experimental_aggregate_gradients``. The gradients are reduced over the ranks
                here, unless :meth:`aggregate_gradients` reduced them since the last update
                and either these say they were aggregated or they are the very tensors it
                returned (its result, clipped, say, is not reduced twice).

        Returns:
            The wrapped optimizer's ``iterations``.
        """
        grads_and_vars = list(grads_and_vars)
        # Keras 2's word that the gradients were aggregated already: taken only when they were
        # aggregated here (aggregate_gradients), never as a reason to skip the ranks' reduction.
        aggregated = kwargs.get("skip_gradients_aggregation", False) or not kwargs.get(
            "experimental_aggregate_gradients", True
        )
        grads = [g for g, _ in grads_and_vars]
        self._apply(grads, [v for _, v in grads_and_vars], aggregated)
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
        self._apply(grads, trainable_variables, aggregated=False)

    def _apply(self, grads, trainable_variables, aggregated: bool) -> None:
        grads = list(grads)
        reduced_before, self._reduced = self._reduced, None
        if not grads:
            return
        if trainable_variables is None:
            if not self.built:
                raise ValueError(
                    "apply() without trainable_variables needs a built "
                    "optimizer; call optimizer.build(model.trainable_variables) "
                    "first, or pass the variables."
                )
            trainable_variables = self._built_for
        trainable_variables = list(trainable_variables)
        self._build_once(trainable_variables)
        _check_not_xla()
        if self.backward_passes_per_step == 1:
            if reduced_before is not None and (aggregated or _same(reduced_before, grads)):
                reduced = grads  # from _compute_gradients or aggregate_gradients
            elif reduced_by_a_tape(grads):
                reduced = grads  # a DistributedGradientTape's, as it returned them
            else:
                reduced = self._reduce(grads, trainable_variables)
            self._apply_inner(reduced, trainable_variables)
        else:
            self._accumulate(grads, trainable_variables)

    def register_local_var(self, var) -> None:
        """Keeps ``var``'s gradient on this rank: it is never reduced (Horovod's local var)."""
        self._local_vars.append(var)

    def _compute_gradients(self, loss, var_list, grad_loss=None, tape=None):
        """Horovod's (Keras 2) hook: ``(gradient, variable)`` pairs, gradients reduced.

        Keras 2's legacy optimizers compute their gradients here in ``minimize``.

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
        var_list = tf.nest.flatten(var_list)  # Keras 2 takes nested lists too
        if tape is None:
            tape = tf.GradientTape()
            with tape:
                tape.watch(var_list)
                value = loss()
        else:
            value = loss() if callable(loss) else loss
        grads = tape.gradient(value, var_list, grad_loss)
        if self.backward_passes_per_step == 1:
            self._build_once(var_list)
            grads = self._reduce(list(grads), var_list)
            self._reduced = list(grads)
        return list(zip(grads, var_list))

    def get_gradients(self, loss, params):
        """Keras 2's graph mode (a TF1 graph, ``disable_eager_execution()``): the wrapped
        optimizer's gradients of ``loss``, reduced over the ranks (a collective when run).

        Args:
            loss: The loss tensor.
            params: The variables.

        Returns:
            The reduced gradients, one per variable.

        Raises:
            UnsupportedError: The wrapped optimizer is not one of Keras 2's legacy ones, the
                only ones Keras 2 trains with in a TF1 graph.
        """
        if self.backward_passes_per_step != 1:
            raise UnsupportedError(
                "backward_passes_per_step > 1 needs eager execution (TensorFlow 2's default); "
                "in a TF1 graph (disable_eager_execution) use backward_passes_per_step=1."
            )
        if not hasattr(self.inner_optimizer, "get_gradients"):
            raise UnsupportedError(
                f"{type(self.inner_optimizer).__name__} cannot train in a TF1 graph "
                "(disable_eager_execution): Keras 2 trains there only with its legacy "
                "optimizers. Wrap tf.keras.optimizers.legacy."
                f"{type(self.inner_optimizer).__name__}(...) instead, or run eagerly."
            )
        grads = self.inner_optimizer.get_gradients(loss, params)
        self._build_once(params)
        return self._reduce(list(grads), list(params))

    def get_updates(self, loss, params):
        """Keras 2's graph mode: the update ops, made from :meth:`get_gradients`.

        Args:
            loss: The loss tensor.
            params: The variables.

        Returns:
            A list of one op: the wrapped optimizer's update with the reduced gradients.
        """
        grads = self.get_gradients(loss, params)
        return [self.inner_optimizer.apply_gradients(list(zip(grads, params, strict=True)))]

    def aggregate_gradients(self, grads_and_vars):
        """Keras 2's loss scale's hook: the gradients every rank's overflow check sees.

        tf-keras' ``LossScaleOptimizer`` (which ``compile()`` puts around this optimizer under
        the ``mixed_float16`` policy) calls this on the optimizer it wraps, checks what it
        returns for overflow, and only then applies it, through :meth:`apply_gradients`, or
        skips the step. So the gradients are reduced here (a collective), and a value that
        overflowed on one rank overflows in the sum on every rank: every rank skips the step,
        or none does. With ``backward_passes_per_step > 1`` the gradients are accumulated
        locally instead; the ranks then agree on overflow with one small allreduce, and every
        rank's gradients are made NaN when any rank's overflowed.

        Args:
            grads_and_vars: Pairs of (gradient, variable).

        Returns:
            The pairs, the gradients reduced (or, when accumulating, checked).
        """
        pairs = list(grads_and_vars)
        if not pairs:
            return pairs
        grads, variables = (list(t) for t in zip(*pairs, strict=True))
        self._build_once(variables)
        if self.backward_passes_per_step == 1:
            _check_not_xla()
            grads = self._reduce(grads, variables)
            self._reduced = list(grads)
        else:
            grads = _loss_scale.nan_unless_finite_everywhere(
                grads, name=f"{self._collective_name}.finite", process_set=self.process_set
            )
        return list(zip(grads, variables, strict=True))

    @property
    def _agg_helper(self):
        """Horovod's view of the accumulation: ``counter`` = passes since the last update."""
        if self.backward_passes_per_step == 1:
            return None
        return _PassCounter(self)

    def _build_once(self, variables) -> None:
        """Builds for ``variables`` on first use (whichever of Keras' entry points comes first)."""
        if not self.built:
            with self._creation_scope():
                self.build(variables)

    def _creation_scope(self):
        # Keras 3 names variables by its own scopes (its base class's apply() opens this one);
        # Keras 2 by TensorFlow's.
        name_scope = getattr(self._keras, "name_scope", None)
        if name_scope is not None:
            return name_scope(self.name, caller=self)
        return tf.name_scope(self.name)

    def _apply_inner(self, grads, variables) -> None:
        # apply_gradients is the one method every Keras optimizer has (Keras 3's calls apply).
        self.inner_optimizer.apply_gradients(list(zip(grads, variables, strict=True)))

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
            name=self._collective_name,
            variables=variables,
            step=self.iterations,
        )

    def _accumulate(self, grads, variables):
        k = self.backward_passes_per_step
        position = {id(v): i for i, v in enumerate(self._built_for)}
        positions = [position[id(v)] for v in variables]
        accumulators = [self._accumulators[p] for p in positions]
        for p, acc, grad in zip(positions, accumulators, grads, strict=True):
            if grad is not None:
                acc.assign_add(tf.cast(tf.convert_to_tensor(grad), acc.dtype))
                self._summed.add(p)
        self._passes.assign_add(1)

        def reduce_and_apply():
            # A variable without a gradient on the pass that ends the window still has what
            # the window's earlier passes gave it: its sum is reduced and applied, not dropped.
            # Which sums are reduced is fixed when the step is traced, so "earlier" means any
            # pass seen before (a variable none of them reached stays None, as in Keras); a
            # sum reduced in a window that gave it nothing is zero.
            summed = [
                tf.convert_to_tensor(acc) if g is not None or p in self._summed else None
                for p, acc, g in zip(positions, accumulators, grads, strict=True)
            ]
            if self.average_aggregated_gradients:
                summed = [None if s is None else s / tf.cast(k, s.dtype) for s in summed]
            self._apply_inner(self._reduce(summed, variables), variables)
            for acc in accumulators:
                acc.assign(tf.zeros_like(acc))

        def count_the_pass():
            # As Horovod's aggregation helpers do: iterations counts passes, so learning-rate
            # schedules (and Adam's bias correction) keyed to it move as they do under Horovod.
            self.iterations.assign_add(1)

        # Every rank counts the same passes, so every rank takes the same branch and the
        # collectives inside it stay in step.
        tf.cond(
            tf.equal(tf.math.floormod(tf.convert_to_tensor(self._passes), k), 0),
            reduce_and_apply,
            count_the_pass,
        )

    def get_config(self):
        # Only this wrapper's settings and the wrapped optimizer; the base class's arguments
        # (clipping, weight decay, ...) belong to the wrapped optimizer.
        return {
            # None unless chosen: loaded on rank 0 alone (Horovod's resume), the optimizer must
            # name its collectives as a new one on the other ranks does.
            "name": self._given_name,
            "optimizer": self._keras.optimizers.serialize(self.inner_optimizer),
            "compression": self._compression_name(),
            "sparse_as_dense": self.sparse_as_dense,
            "gradient_predivide_factor": self.gradient_predivide_factor,
            "op": self.op.kind,
            "backward_passes_per_step": self.backward_passes_per_step,
            "average_aggregated_gradients": self.average_aggregated_gradients,
        }

    def _compression_name(self) -> str | None:
        name = _compression.to_name(self.compression)
        if name is None:
            warnings.warn(
                f"syncdp: {self.name}'s config cannot name its compression {self.compression!r} "
                "(no import path reaches it), so it is saved without one and loads with "
                "Compression.none. Define the compressor as a class at module level to keep it.",
                stacklevel=3,
            )
        return name

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = copy.deepcopy(config)  # Keras' deserialize edits the optimizer's entry
        optimizer = cls._keras.optimizers.deserialize(
            config.pop("optimizer"), custom_objects=custom_objects
        )
        name = config.get("compression", "none")
        objects = dict(custom_objects or {})
        if name not in (None, "none", "fp16"):
            # Keras hands custom objects to a load through a scope as well as the argument.
            for key in (name, name.rpartition(".")[2]):
                found = cls._keras.saving.get_registered_object(key, custom_objects)
                if found is not None:
                    objects.setdefault(key, found)
        config["compression"] = _compression.from_name(name, objects)
        config["op"] = ops.ReduceOp[str(config.get("op", ops.Average.kind)).upper()]
        return cls(optimizer, **config)


class _VariableList(list):
    """A list of variables that can also be called (Keras 2 spells ``optimizer.variables()``)."""

    def __call__(self):
        return self


class _PassCounter:
    def __init__(self, optimizer):
        self._optimizer = optimizer

    @property
    def counter(self):
        passes = self._optimizer._passes
        k = self._optimizer.backward_passes_per_step
        return tf.math.floormod(tf.convert_to_tensor(0 if passes is None else passes), k)


# This wrapper's own attributes: never the wrapped optimizer's, though it has some of them.
_OWN = frozenset(
    {
        "inner_optimizer",
        "compression",
        "sparse_as_dense",
        "gradient_predivide_factor",
        "op",
        "backward_passes_per_step",
        "average_aggregated_gradients",
        "process_set",
        "scale_local_gradients",
        "built",
        "name",
    }
)

# Settings the Keras base class keeps on the wrapper too, unused by its methods the wrapper
# calls: the wrapped optimizer's are read and set instead.
_READ_FROM_INNER = ("clipnorm", "global_clipnorm", "clipvalue", "weight_decay")


def _settable_on(inner, name: str, wrapper_class: type) -> bool:
    """Whether setting ``name`` on the wrapper means setting it on the wrapped ``inner``: a
    public setting of ``inner``'s that is neither the wrapper's own nor defined by its class
    (``learning_rate`` and ``iterations`` are properties that reach ``inner`` themselves)."""
    if name.startswith("_") or name in _OWN or hasattr(wrapper_class, name):
        return False
    # Keras 2's legacy optimizers keep hyperparameters in _hyper (reading one may create it).
    return name in getattr(inner, "_hyper", ()) or hasattr(inner, name)


def _in_a_tf1_graph() -> bool:
    """Whether eager execution is off (``tf.compat.v1.disable_eager_execution()``: Keras 2
    runs its graph in a session of its own)."""
    return not tf.compat.v1.executing_eagerly_outside_functions()


def _same(reduced: list, grads: list) -> bool:
    """Whether ``grads`` are the very tensors reduced before (kept alive, so never mistaken for
    new tensors at a reused address)."""
    return len(reduced) == len(grads) and all(r is g for r, g in zip(reduced, grads))


def _default_name(optimizer) -> str:
    # Keras 2's legacy optimizers keep their name private.
    inner_name = getattr(optimizer, "name", None) or getattr(optimizer, "_name", None)
    return f"distributed_{inner_name}"


def _optimizer_bases(keras_: ModuleType) -> tuple[type, ...]:
    """``keras_``'s optimizer base classes: Keras 2 adds its legacy ``OptimizerV2``."""
    legacy = getattr(getattr(keras_.optimizers, "legacy", None), "Optimizer", None)
    return (keras_.optimizers.Optimizer,) + ((legacy,) if isinstance(legacy, type) else ())


def keras_of_optimizer(optimizer) -> ModuleType | None:
    """The Keras package of ``optimizer`` if it is a Keras optimizer; None otherwise."""
    keras_ = package_of(optimizer)
    if keras_ is None or not isinstance(optimizer, _optimizer_bases(keras_)):
        return None
    return keras_


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
