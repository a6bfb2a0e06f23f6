"""DistributedGradientTape: a tf.GradientTape whose gradients are averaged over all ranks.

:func:`reduce_gradients` is the path of every gradient (the tape and the Keras optimizer both
call it). It hands the gradients to the engine in reverse order, so the first bucket (small,
``first_bucket_bytes``) holds the last layers' gradients, which backprop produces first, and
its collective starts while the earlier layers are still being differentiated; each bucket's
collective waits only for its own gradients and for the bucket before it.

Step agreement: every call belongs to a training step, and the first bucket carries every
rank's step (:mod:`syncdp.engine.steps`): no collective of its own. If the steps differ, every
rank raises :class:`~syncdp.StepMismatchError` naming the ranks and their steps, and no update
is applied. The step is the one the caller passes (``step=``: ``optimizer.iterations``, which
catches a rank that skipped an update, or the loop's step); without one it is this rank's count
of gradient reductions.

``SYNCDP_VERIFY_EVERY=K``: on every K-th agreed step, the variables the gradients are for are
checked to be bit-identical on every rank (:func:`syncdp.verify_synchronized`), in the same
ordered chain as the buckets, before the step's update.

With a timeline on, each gradient passes a marker that records when it was computed, so the
trace shows the buckets' collectives against the backward pass.
"""

from __future__ import annotations

import time
import weakref

import numpy as np
import tensorflow as tf

from syncdp.job import process_sets, runtime
from syncdp.tensorflow import collectives, graph, verify
from syncdp.tensorflow.compression import Compression
from syncdp.transport import communicator

__all__ = [
    "DistributedGradientTape",
    "PartialDistributedGradientTape",
    "LocalGradientAggregationHelper",
    "reduce_gradients",
    "local_positions",
]


class _StepCount:
    """This rank's count of gradient reductions in one process set, kept on the host.

    Not a ``tf.Variable``: a variable made at the first reduction would be made inside the
    user's trace, which ``tf.function`` refuses after its first trace (Horovod's elastic
    example traces its step once without syncdp, then again with the tape), and a variable
    lifted into one graph cannot be used from another. Inside ``tf.function`` the count
    advances in a stateful host call, which the function runs in program order, once per run.
    Its methods are named as a variable's.
    """

    def __init__(self):
        self.value = 0

    def _advance(self, by: int) -> np.int64:
        self.value += by
        return np.int64(self.value)

    def advance(self) -> int:
        """Counts one more reduction; returns the count. Called inside the first bucket's host
        call when a traced step runs, so that counting costs no host call of its own."""
        self.value += 1
        return self.value

    def assign_add(self, by: int) -> tf.Tensor:
        """The count after adding ``by``, as an int64 scalar (a graph node inside a trace)."""
        if tf.executing_eagerly():
            return tf.constant(self._advance(by))
        count = graph.host_call(lambda: self._advance(by), [], tf.int64, name="syncdp_step")
        return tf.reshape(count, [])

    def assign(self, value: int) -> None:
        self.value = int(value)

    def numpy(self) -> np.int64:
        return np.int64(self.value)


# One step count per process set id (0: the job's), the same object for the process's whole
# life, so a step traced before an elastic reset counts on the counter the reset zeroes. An id
# that names another set (a removed set's id given to a new one) counts from 0 again.
_counters: dict[int, _StepCount] = {}


def _zero_counters() -> None:
    # After an elastic membership change every rank, replacements included, counts from 0.
    for counter in _counters.values():
        counter.assign(0)


def _zero_counter(process_set_id: int) -> None:
    if process_set_id in _counters:
        _counters[process_set_id].assign(0)


runtime.on_reset(_zero_counters)
process_sets.on_renewed(_zero_counter)


def _step_counter(process_set=None) -> _StepCount:
    key = 0 if process_set is None else process_set.process_set_id
    return _counters.setdefault(key, _StepCount())


def _dense_count(grads) -> int:
    """How many of ``grads`` are dense tensors (not None, not IndexedSlices)."""
    return sum(1 for g in grads if g is not None and not isinstance(g, tf.IndexedSlices))


def _mark_computed(grads, variables):
    """With a timeline, routes each dense gradient through a marker recording when it exists."""
    timeline = runtime.communicator().timeline
    if timeline is None or tf.executing_eagerly():
        return grads
    names = [verify.variable_name(v, i) for i, v in enumerate(variables or [])]
    out = []
    for i, g in enumerate(grads):
        if g is None or isinstance(g, tf.IndexedSlices):
            out.append(g)
            continue
        label = f"gradient {names[i] if i < len(names) else i}"

        def mark(array, label=label):
            timeline.mark(label, time.perf_counter())
            return array

        marked = graph.host_call(mark, [g], g.dtype, stateful=False, name="syncdp_mark")
        marked.set_shape(g.shape)
        out.append(marked)
    return out


def _verify_every(agreed_step, variables, every: int, process_set=None):
    """The periodic replica check, as an ordered collective after the buckets, among the
    ranks that reduced them (``process_set``)."""
    variables = list(variables)
    names = [verify.variable_name(v, i) for i, v in enumerate(variables)]
    values = [tf.convert_to_tensor(v) for v in variables]

    def check(step, *arrays):
        if int(step) % every == 0:
            comm = collectives._comm(process_set)
            verify.verify_arrays(names, arrays, comm=comm, periodic=True)
        return (np.int64(step),)

    return graph.ordered_call(
        check, [agreed_step, *values], [tf.int64], [tf.TensorShape([])], "verify_every"
    )[0]


def _after(check, grads):
    """The gradients, made to wait for ``check`` (a tensor) inside tf.function."""
    if tf.executing_eagerly():
        return grads
    out = []
    with tf.control_dependencies([check]):
        for g in grads:
            if g is None:
                out.append(None)
            elif isinstance(g, tf.IndexedSlices):
                out.append(tf.IndexedSlices(tf.identity(g.values), g.indices, g.dense_shape))
            else:
                out.append(tf.identity(g))
    return out


# What DistributedGradientTape.gradient returned, by id, while it lives: a DistributedOptimizer
# given these very gradients applies them as they are (Horovod's applies what it is given), so
# a program that wraps both the tape and the optimizer reduces once.
_REDUCED_BY_A_TAPE: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def reduced_by_a_tape(grads) -> bool:
    """Whether every gradient of ``grads`` but None is one a DistributedGradientTape returned
    (the very object: a gradient clipped or scaled since is a new one)."""
    given = [g for g in grads if g is not None]
    return bool(given) and all(_REDUCED_BY_A_TAPE.get(id(g)) is g for g in given)


def check_groups(num_groups, groups) -> None:
    """Refuses what Horovod refuses for its fusion groups (syncdp fuses by the threshold, so
    it takes the arguments and uses neither): ``groups`` (or a non-zero ``num_groups``) must
    be a positive integer or a list (Horovod's are lists of variables).

    Raises:
        ValueError: Neither.
    """
    if groups is None and num_groups:
        groups = num_groups
    if groups is None or isinstance(groups, list):
        return
    if isinstance(groups, bool) or not isinstance(groups, (int, np.integer)) or groups <= 0:
        raise ValueError(
            "groups should be a positive integer (the number of fusion groups) or a list of "
            f"lists of tf.Variable; got {groups!r}."
        )


@tf.autograph.experimental.do_not_convert  # see syncdp.tensorflow.graph.host_call
def reduce_gradients(
    grads,
    *,
    op=collectives.Average,
    compression=Compression.none,
    sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0,
    name: str = "gradients",
    variables=None,
    step=None,
    process_set=None,
    local=(),
    scale_local_gradients: bool = True,
):
    """Averages (or sums) a list of gradients over all ranks in fused collectives.

    A synchronization point, and one training step: the first bucket carries every rank's
    step, and the ranks must agree on it. Gradients are bucketed from the last one to the
    first, so the first bucket can start reducing while earlier layers are still being
    differentiated.

    Args:
        grads: Tensors, ``tf.IndexedSlices`` or None (kept None).
        op: ``Average`` or ``Sum``; also ``Adasum``, and ``Min``, ``Max`` or ``Product`` as
            Horovod takes them (of each gradient element; dense gradients only, and no step
            check). Defaults to ``Average``.
        compression: ``Compression.none`` or ``Compression.fp16``. Defaults to none.
        sparse_as_dense: Reduce IndexedSlices as dense tensors. Defaults to False.
        gradient_predivide_factor: Divide by this before the sum and by size/factor after it
            (Average only). Defaults to 1.
        name: Name prefix in the timeline. Defaults to "gradients".
        variables: The variables the gradients are for; with ``SYNCDP_VERIFY_EVERY=K`` they
            are checked to be identical on every rank every K-th step. Defaults to None (no
            periodic check).
        step: This rank's training step (an int, or an integer tensor or variable such as
            ``optimizer.iterations``); every rank must be at the same one. Defaults to None:
            this rank's count of gradient reductions. In a TF1 graph no step is carried.
        process_set: The ranks that average together. A rank outside the set keeps its own
            gradients. Defaults to the whole job.
        local: Positions of gradients that stay on this rank, unreduced (Horovod's local
            variables). Defaults to none.
        scale_local_gradients: Divide the local gradients by the set's size, so they have the
            scale of averaged ones (Horovod's default). Defaults to True.

    Returns:
        The reduced gradients, in the order given.

    Raises:
        StepMismatchError: Ranks are at different steps (eagerly; inside ``tf.function`` the
            step's run fails with a ``tf.errors.OpError`` carrying the same message). Raised
            on every rank, and no update is applied.
        VerificationError: ``SYNCDP_VERIFY_EVERY`` is set and ``variables`` differ.
    """
    op = collectives.reduce_op(op)
    grads = list(grads)
    if process_set is not None and process_set.included() is False:
        # As in Horovod: a rank outside the set keeps its own gradients. A removed set (None)
        # is refused below, as not registered.
        return grads
    comm = collectives._comm(process_set)
    if local:
        return _reduce_except_local(
            grads,
            set(local),
            comm.size if scale_local_gradients else 1,
            op=op,
            compression=compression,
            sparse_as_dense=sparse_as_dense,
            gradient_predivide_factor=gradient_predivide_factor,
            name=name,
            variables=variables,
            step=step,
            process_set=process_set,
        )
    if sparse_as_dense:
        grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
    prescale = postscale = 1.0
    if gradient_predivide_factor != 1.0:
        if op is not collectives.Average:
            raise ValueError("gradient_predivide_factor needs op=Average.")
        prescale = 1.0 / gradient_predivide_factor
        postscale = gradient_predivide_factor
    step_tensor = None
    # In elastic mode a traced step must stay right when the job later grows from one rank.
    several = comm.size > 1 or runtime.get_config().elastic
    # Only a sum carries the ranks' steps (an Average is one); Adasum, Min, Max and Product
    # reduce without the step check.
    carries = op in (collectives.Average, collectives.Sum)
    if several and not graph.in_v1_graph() and carries:
        if step is None and not tf.executing_eagerly() and _dense_count(grads):
            step_tensor = _step_counter(process_set).advance  # counted by the first bucket
        elif step is None:
            step_tensor = tf.reshape(_step_counter(process_set).assign_add(1), [])
        else:
            step_tensor = tf.reshape(tf.cast(tf.convert_to_tensor(step), tf.int64), [])
    grads = _mark_computed(grads, variables)
    results = list(grads)
    dense_at = [
        i for i, g in enumerate(grads) if g is not None and not isinstance(g, tf.IndexedSlices)
    ]
    agreed = None
    every = runtime.get_config().verify_every
    check_replicas = bool(every) and variables is not None
    missing = _missing(grads, variables)
    if dense_at:
        reduced, agreed = collectives.fused_allreduce(
            [grads[i] for i in dense_at],
            op,
            compression=compression,
            prescale=prescale,
            postscale=postscale,
            name=name,
            reverse=True,
            step=step_tensor,
            process_set=process_set,
            return_step=check_replicas,
            fields=missing,
        )
        for i, r in zip(dense_at, reduced):
            results[i] = r
    elif step_tensor is not None or (several and not carries):
        # No dense gradient to carry the step: a bucket of its own. (Adasum and the others
        # carry no step; their bucket meets the other ranks' gradients, and the checks differ.)
        _, agreed = collectives.fused_allreduce(
            [tf.zeros([1], tf.float32)],
            op,
            name=f"{name}.step",
            step=step_tensor,
            process_set=process_set,
            return_step=check_replicas,
            fields=missing,
        )
    for i, g in enumerate(grads):
        if isinstance(g, tf.IndexedSlices):
            # Gathering rows is linear: the predivide and its undoing cancel out.
            results[i] = collectives.allreduce(
                g, op=op, name=f"{name}.sparse{i}", process_set=process_set
            )
    if check_replicas and agreed is not None:
        checked = _verify_every(agreed, variables, every, process_set)
        results = _after(checked, results)
    return results


# What the argument check's error adds when ranks differ in the gradients they have.
communicator.FIELD_HINTS["no_gradient"] = (
    "A variable that a rank's loss did not use has no gradient (None) on that rank, and the "
    "ranks must reduce the same gradients: compute the gradients with "
    "`tape.gradient(loss, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO)` so "
    "that every rank has one for every variable, or use every variable on every rank."
)


class _Absent(tuple):
    """The positions of the gradients a rank lacks. Ranks compare them by position (their
    ``repr``, which the argument check's checksum and comparison use): variable names are
    numbered per process and may differ between ranks. The error shows them by name (``str``).
    """

    def __new__(cls, positions, names: str):
        absent = super().__new__(cls, positions)
        absent.names = names
        return absent

    def __repr__(self) -> str:
        return repr(tuple(self))

    def __str__(self) -> str:
        return self.names

    def __reduce__(self):
        return (_Absent, (tuple(self), self.names))


def _missing(grads, variables) -> tuple:
    """The bucket check's field naming the gradients this rank lacks (None), if any: ranks
    that differ in them are told so rather than only that their shapes differ."""
    absent = [i for i, g in enumerate(grads) if g is None]
    if not absent:
        return ()
    names = ", ".join(
        verify.variable_name(variables[i], i) if variables is not None else f"gradient #{i}"
        for i in absent
    )
    return (("no_gradient", _Absent(absent, names)),)


def _reduce_except_local(grads, local: set, divide: int, *, variables, **options):
    """:func:`reduce_gradients` of the non-local gradients; local ones divided by ``divide``."""
    shared = [i for i in range(len(grads)) if i not in local]
    reduced = reduce_gradients(
        [grads[i] for i in shared],
        variables=None if variables is None else [variables[i] for i in shared],
        **options,
    )
    out = list(grads)
    for i, r in zip(shared, reduced):
        out[i] = r
    for i in local:
        g = grads[i]
        if g is None or divide == 1:
            continue
        if isinstance(g, tf.IndexedSlices):
            out[i] = tf.IndexedSlices(g.values / divide, g.indices, g.dense_shape)
        else:
            out[i] = g / tf.cast(divide, g.dtype)
    return out


def local_positions(variables, local_variables) -> list[int]:
    """Positions in ``variables`` of those registered as local (compared by identity)."""
    keys = {id(v) for v in local_variables}
    return [i for i, v in enumerate(variables) if id(v) in keys]


class DistributedGradientTape(tf.GradientTape):
    """Wraps a ``tf.GradientTape`` so that ``gradient()`` returns gradients averaged over ranks.

    Use it like Horovod's: record with a tape, wrap it, and ask for gradients; or open it as
    the context manager itself. ``gradient()`` is a synchronization point of the process set.
    It is a ``tf.GradientTape`` (as Horovod's is), whose recording is the wrapped tape's: every
    other method and attribute is the wrapped tape's own.

    Args:
        gradtape: The ``tf.GradientTape`` to wrap.
        device_dense: Accepted for Horovod compatibility.
        device_sparse: Accepted for Horovod compatibility.
        compression: ``Compression.none`` or ``Compression.fp16``. Defaults to none.
        sparse_as_dense: Reduce IndexedSlices gradients as dense tensors. Defaults to False.
        op: ``Average``, ``Sum`` or ``Adasum``; ``Min``, ``Max`` or ``Product`` as Horovod
            takes them (see :func:`reduce_gradients`). Defaults to ``Average``.
        gradient_predivide_factor: See :func:`reduce_gradients`. Defaults to 1.
        num_groups: Accepted for Horovod compatibility; fusion is set by the threshold.
        groups: Accepted for Horovod compatibility (checked as Horovod does: a positive
            integer or a list); fusion is set by the threshold.
        process_set: The ranks that average together. Defaults to the whole job.
        scale_local_gradients: Divide the gradients of local sources by the set's size.
            Defaults to True.
        step: The training step every rank must agree on, e.g. ``optimizer.iterations`` (see
            :func:`reduce_gradients`). Defaults to None (the count of reductions).

    Example:
        >>> with tf.GradientTape() as tape:
        ...     loss = loss_fn(model(x), y)
        >>> tape = syncdp.DistributedGradientTape(tape)
        >>> grads = tape.gradient(loss, model.trainable_variables)
    """

    def __init__(
        self,
        gradtape: tf.GradientTape,
        device_dense: str = "",
        device_sparse: str = "",
        compression=Compression.none,
        sparse_as_dense: bool = False,
        op=collectives.Average,
        gradient_predivide_factor: float = 1.0,
        num_groups: int = 0,
        groups=None,
        process_set=collectives.global_process_set,
        scale_local_gradients: bool = True,
        *,
        step=None,
    ):
        op = collectives.reduce_op(op)
        if gradient_predivide_factor != 1.0 and op is not collectives.Average:
            raise ValueError("gradient_predivide_factor not supported with op != Average.")
        check_groups(num_groups, groups)
        # Not GradientTape.__init__: this object records nothing itself.
        self._wrapped = gradtape
        self._step = step
        self._local_sources: list = []
        self._options = dict(
            op=op,
            compression=compression,
            sparse_as_dense=sparse_as_dense,
            gradient_predivide_factor=gradient_predivide_factor,
            process_set=process_set,
            scale_local_gradients=scale_local_gradients,
        )

    def __enter__(self):
        self._wrapped.__enter__()
        return self

    def __exit__(self, *exc):
        return self._wrapped.__exit__(*exc)

    def __getattr__(self, name):
        # Attributes GradientTape.__init__ would have set (_persistent, ...) are the wrapped
        # tape's. (_wrapped itself is missing only before __init__, e.g. in copy.copy.)
        if name == "_wrapped":
            raise AttributeError(name)
        return getattr(self._wrapped, name)

    # tf.GradientTape's other methods, on the wrapped tape: inherited, those that record
    # (reset, _push_tape, ...) would set _tape and _recording on this object, where they would
    # hide the wrapped tape's.
    def watch(self, tensor):
        return self._wrapped.watch(tensor)

    def stop_recording(self):
        return self._wrapped.stop_recording()

    def reset(self):
        return self._wrapped.reset()

    def watched_variables(self):
        return self._wrapped.watched_variables()

    def jacobian(self, *args, **kwargs):
        return self._wrapped.jacobian(*args, **kwargs)

    def batch_jacobian(self, *args, **kwargs):
        return self._wrapped.batch_jacobian(*args, **kwargs)

    def _push_tape(self):
        return self._wrapped._push_tape()

    def _pop_tape(self):
        return self._wrapped._pop_tape()

    def _ensure_recording(self):
        return self._wrapped._ensure_recording()

    def register_local_source(self, source) -> None:
        """Keeps the gradient of ``source`` on this rank: it is never reduced."""
        self._local_sources.append(source)

    @tf.autograph.experimental.do_not_convert
    def gradient(
        self,
        target,
        sources,
        output_gradients=None,
        use_generic_names: bool = False,
        unconnected_gradients=tf.UnconnectedGradients.NONE,
    ):
        """Like ``tf.GradientTape.gradient``, then reduced over the ranks (a collective).

        The arguments come in Horovod's order. ``use_generic_names`` is accepted for Horovod
        compatibility; a ``tf.UnconnectedGradients`` in its place is taken as
        ``unconnected_gradients``, the 4th argument of ``tf.GradientTape.gradient``.
        """
        if isinstance(use_generic_names, tf.UnconnectedGradients):
            unconnected_gradients = use_generic_names
        grads = self._wrapped.gradient(target, sources, output_gradients, unconnected_gradients)
        flat = tf.nest.flatten(grads, expand_composites=False)
        variables = tf.nest.flatten(sources)
        reduced = reduce_gradients(
            flat,
            variables=variables,
            step=self._step,
            local=local_positions(variables, self._local_sources),
            **self._options,
        )
        for g in reduced:
            if g is not None:
                _REDUCED_BY_A_TAPE[id(g)] = g
        return tf.nest.pack_sequence_as(grads, reduced)

    def get_local_and_global_gradients(self, target, sources, output_gradients=None):
        """The gradients split as Horovod 0.28 does: ``(local, global)`` lists of
        ``(variable, gradient)`` pairs, local sources first list, reduced ones second."""
        variables = tf.nest.flatten(sources)
        grads = self.gradient(target, variables, output_gradients)
        local = set(local_positions(variables, self._local_sources))
        pairs = list(zip(variables, grads))
        return (
            [p for i, p in enumerate(pairs) if i in local],
            [p for i, p in enumerate(pairs) if i not in local],
        )


def PartialDistributedGradientTape(  # noqa: N802 - Horovod's name for a factory
    gradtape: tf.GradientTape,
    device_dense: str = "",
    device_sparse: str = "",
    compression=Compression.none,
    sparse_as_dense: bool = False,
    op=collectives.Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups=None,
    process_set=collectives.global_process_set,
    local_layers=None,
    scale_local_gradients: bool = True,
) -> DistributedGradientTape:
    """A :class:`DistributedGradientTape` whose ``local_layers`` keep their gradients local.

    Args:
        local_layers: A Keras layer or a list of them; their trainable weights are registered
            as local sources. Other arguments as for :class:`DistributedGradientTape`.

    Raises:
        ValueError: ``local_layers`` holds something that is not a Keras layer.
    """
    from syncdp.tensorflow.keras2_names import package_of

    def is_layer(obj) -> bool:  # a layer of its own Keras: Keras 3's, or tf-keras's
        package = package_of(obj)
        return package is not None and isinstance(obj, package.layers.Layer)

    if local_layers is None:
        local_layers = []
    elif is_layer(local_layers):
        local_layers = [local_layers]
    if not all(is_layer(layer) for layer in local_layers):
        raise ValueError("All local layers must be of keras.layers.Layer type.")
    tape = DistributedGradientTape(
        gradtape,
        device_dense,
        device_sparse,
        compression,
        sparse_as_dense,
        op,
        gradient_predivide_factor,
        num_groups,
        groups,
        process_set,
        scale_local_gradients,
    )
    for layer in local_layers:
        for weight in layer.trainable_weights:
            tape.register_local_source(weight)
    return tape


class LocalGradientAggregationHelper:
    """Sums ``backward_passes_per_step`` local gradients before one reduction (Horovod's helper).

    Call :meth:`compute_gradients` once per backward pass: it adds the gradients to this
    rank's accumulators and, on every ``backward_passes_per_step``-th call, reduces the sums
    (divided by the count with ``average_aggregated_gradients``) and clears the accumulators;
    on the other calls it returns the running sums. :meth:`apply_gradients` applies only after
    a reduction and otherwise just advances ``optimizer.iterations``. Every rank counts the same
    passes, so every rank reduces on the same calls.

    Args:
        backward_passes_per_step: Passes per reduction, > 0.
        allreduce_func: ``fn(grads, variables) -> grads`` that reduces. Defaults to
            :func:`reduce_gradients` over ``process_set``.
        sparse_as_dense: Accept IndexedSlices by densifying them. Defaults to False.
        average_aggregated_gradients: Divide the sums by the number of passes.
        rank, optimizer_type, name: Accepted for Horovod compatibility.
        process_set: The ranks that reduce together. Defaults to the whole job.
        scale_local_gradients: See :func:`reduce_gradients`. Defaults to True.

    Raises:
        ValueError: ``backward_passes_per_step`` <= 0, or IndexedSlices without
            ``sparse_as_dense``.
    """

    def __init__(
        self,
        backward_passes_per_step: int,
        allreduce_func=None,
        sparse_as_dense: bool = False,
        average_aggregated_gradients: bool = False,
        rank=None,
        optimizer_type=None,
        process_set=collectives.global_process_set,
        scale_local_gradients: bool = True,
        name=None,
    ):
        if backward_passes_per_step <= 0:
            raise ValueError("backward_passes_per_step must be > 0")
        self.backward_passes_per_step = int(backward_passes_per_step)
        self.sparse_as_dense = sparse_as_dense
        self.average_aggregated_gradients = average_aggregated_gradients
        self.process_set = process_set
        self.scale_local_gradients = scale_local_gradients
        self._allreduce = allreduce_func or self._reduce
        self._local_vars: list = []
        # One sum per variable, all made at the first call, so every trace's clear covers
        # every sum (one made in a later trace would miss the clears an earlier trace runs).
        self._sums: dict[int, tf.Variable] = {}
        self._reached: set[int] = set()  # sums that some pass has added to (when traced)
        with graph.creating_variables():
            self.counter = tf.Variable(0, dtype=tf.int32, trainable=False, name="aggregation")

    def register_local_var(self, var) -> None:
        """Keeps ``var``'s gradient on this rank: it is never reduced."""
        self._local_vars.append(var)

    def _reduce(self, grads, variables):
        return reduce_gradients(
            grads,
            variables=list(variables),
            process_set=self.process_set,
            local=local_positions(list(variables), self._local_vars),
            scale_local_gradients=self.scale_local_gradients,
        )

    def compute_gradients(self, grads, variables):
        """Adds ``grads`` to the sums; returns the reduced sums on every k-th call."""
        for i, v in enumerate(variables):
            if i not in self._sums:  # made once, even if the first pass is traced
                with graph.creating_variables():
                    self._sums[i] = tf.Variable(tf.zeros_like(v), trainable=False)
        sums = []
        for i, g in enumerate(grads):
            if g is None:
                # An earlier pass's gradients are not dropped because this pass gave none.
                sums.append(tf.convert_to_tensor(self._sums[i]) if i in self._reached else None)
                continue
            if isinstance(g, tf.IndexedSlices):
                if not self.sparse_as_dense:
                    raise ValueError(
                        "IndexedSlices are not supported when `backward_passes_per_step` > 1 "
                        "and `sparse_as_dense` is False."
                    )
                g = tf.convert_to_tensor(g)
            self._reached.add(i)
            # A value, not assign_add's lazy read, which would see the clear below.
            added = self._sums[i].assign_add(tf.cast(g, self._sums[i].dtype))
            sums.append(tf.convert_to_tensor(added))
        count = self.counter.assign_add(1)
        k = self.backward_passes_per_step

        def reduce_and_clear():
            reduced = self._allreduce(list(sums), variables)
            if self.average_aggregated_gradients:
                reduced = [None if r is None else r / k for r in reduced]
            with tf.control_dependencies([r for r in reduced if r is not None]):
                clears = [v.assign(tf.zeros_like(v)) for v in self._sums.values()]
                clears.append(self.counter.assign(0))
            with tf.control_dependencies(clears):
                return [None if r is None else tf.identity(r) for r in reduced]

        if tf.executing_eagerly():
            return reduce_and_clear() if int(count) == k else sums
        present = [i for i, s in enumerate(sums) if s is not None]

        def reduced_present():  # one reduction for all of them
            reduced = reduce_and_clear()
            return [reduced[i] for i in present]

        chosen = tf.cond(tf.equal(count, k), reduced_present, lambda: [sums[i] for i in present])
        out = [None] * len(sums)
        for i, c in zip(present, chosen):
            out[i] = c
        return out

    def apply_gradients(self, apply_closure, optimizer, *args, **kwargs):
        """Runs ``apply_closure()`` right after a reduction; otherwise only counts the step."""
        if tf.executing_eagerly():
            if int(self.counter) == 0:
                return apply_closure()
            return optimizer.iterations.assign_add(1)
        return tf.cond(
            tf.equal(self.counter, 0),
            lambda: _done(apply_closure()),
            lambda: _done(optimizer.iterations.assign_add(1)),
        )


def _done(op):
    with tf.control_dependencies([op] if op is not None else []):
        return tf.constant(True)
