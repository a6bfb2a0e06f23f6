"""Host code in TensorFlow graphs: collectives as ordered ``tf.numpy_function`` nodes.

A collective is Python (NumPy buffers handed to MPI). Eagerly it runs at once; inside
``tf.function`` it becomes a stateful ``tf.numpy_function`` node, and :func:`ordered_call` gives
every such node a control dependency on the previous one built in the same graph, so the
collectives of a traced step run in the order they were written, identically on every rank,
with no run-time negotiation. A node waits only for its own inputs and the previous
collective, so a bucket of gradients can start reducing while the backward pass still
computes the next.
"""

from __future__ import annotations

import contextlib
import re
import sys
import threading
import weakref
from collections.abc import Sequence

import numpy as np
import tensorflow as tf
from tensorflow.python.eager import context as _tf_context
from tensorflow.python.eager import record as _tf_record

from syncdp.base import errors

__all__ = [
    "host_call",
    "ordered_call",
    "standalone",
    "in_v1_graph",
    "creating_variables",
    "MismatchError",
    "InvalidArgument",
]


def op_error_arguments(args: tuple) -> tuple:
    """TensorFlow's ``(node_def, op, message)`` for one of syncdp's TensorFlow errors, made
    from a message (as syncdp raises it) or from TensorFlow's own arguments (as Keras makes the
    error again, its context added, when it is raised in a layer's ``call()``)."""
    if len(args) == 1:
        return None, None, args[0]
    return args[:3]


class MismatchError(errors.MismatchError, tf.errors.FailedPreconditionError):
    """Ranks passed different arguments to one collective; also TensorFlow's
    ``FailedPreconditionError``, which is what Horovod raises on every rank in that case."""

    def __init__(self, *args):
        tf.errors.FailedPreconditionError.__init__(self, *op_error_arguments(args))

    def __str__(self) -> str:
        return self.message


class InvalidArgument(ValueError, tf.errors.InvalidArgumentError):
    """A bad argument found while a collective runs: TensorFlow's ``InvalidArgumentError``
    eagerly, and (being a ValueError) inside a graph too."""

    def __init__(self, *args):
        tf.errors.InvalidArgumentError.__init__(self, *op_error_arguments(args))

    def __str__(self) -> str:
        return self.message


# graph -> the name of the last collective op created in it; the next one depends on it. A
# name, not the op: an op holds its graph, and would keep the weak key alive forever.
_last_collective: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# graph -> the names of the function graphs built in it that hold collectives, whose calling
# ops (If, While, a function call) the next collective built in it must wait for, each with
# the number of ops the graph had when it was announced (its calling op comes after those).
_pending_calls: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_standalone = threading.local()
# graph -> {host call op's name: its gradient, fn(inputs, outputs, *dys) -> one gradient per
# input}. The functions hold no tensor of the graph (that would keep the weak key alive).
_gradients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_HOST_CALL_GRADIENT = "SyncdpHostCall"


@tf.RegisterGradient(_HOST_CALL_GRADIENT)
def _host_call_gradient(op, *dys):
    """The gradient of a host call that :func:`ordered_call` was given one for (taken when a
    graph is differentiated: ``tf.gradients``, a ``tf.function`` under a tape); None for each
    input of any other, as TensorFlow's own for ``PyFunc``, which this replaces, gives.
    Saving a SavedModel traces every registered gradient with no op (``op`` None): none."""
    if not isinstance(op, tf.Operation):
        return [None] * len(dys)
    gradient = _gradients.get(op.graph, {}).get(op.name)
    if gradient is None:
        return [None] * len(op.inputs)
    return gradient(list(op.inputs), list(op.outputs), *dys)


def _record(gradient, inputs, outputs) -> None:
    """Tells the tapes recording now (eagerly, or inside a ``tf.function`` being traced) that
    ``outputs`` came from ``inputs``, with ``gradient``: a tape sees no op of a host call."""
    if _tf_record.could_possibly_record():
        inputs, outputs = list(inputs), list(outputs)
        _tf_record.record_operation_backprop_only(  # no forward accumulator: it would run
            _HOST_CALL_GRADIENT, outputs, inputs, lambda *dys: gradient(inputs, outputs, *dys)
        )


@contextlib.contextmanager
def standalone():
    """Collectives built here form a chain of their own, apart from the graph's: they neither
    wait for the collectives built before nor make later ones wait. Only for ops a program runs
    on their own (a TF1 hook's broadcast), which would otherwise drag the training step's
    collectives, and its input batch, along.
    """
    _standalone.chain = [None]
    try:
        yield
    finally:
        _standalone.chain = None


def host_call(fn, inputs: Sequence[tf.Tensor], out_dtypes, *, stateful: bool = True, name: str):
    """``tf.numpy_function(fn, ...)``: ``fn`` runs on NumPy views of ``inputs`` when the graph
    runs.

    AutoGraph must not convert the Python that runs at every step: converted code goes through
    its ``converted_call`` machinery once per call at run time (on ResNet-50's gradients that
    made packing a fused buffer four times slower than the copy itself). ``tf.numpy_function``
    already runs ``fn`` as ``do_not_convert`` would, so ``fn`` is passed as it is (wrapping it
    again would cost each host call a second wrapper). That wrapper does not undo a conversion
    made while the step was traced, though: AutoGraph converts the functions that converted code
    calls, and the closures they define, so a ``fn`` built inside converted code would already
    be converted code. What keeps syncdp's closures unconverted is the public collectives (and
    ``reduce_gradients``) being marked ``do_not_convert``, which AutoGraph does not enter.
    """
    return tf.numpy_function(fn, list(inputs), out_dtypes, stateful=stateful, name=name)


def ordered_call(
    fn, inputs: Sequence[tf.Tensor], out_dtypes, out_shapes, name: str, *, gradient=None
):
    """Runs ``fn`` (NumPy arrays -> tuple of NumPy arrays) eagerly or as an ordered graph node.

    ``gradient``, ``fn(inputs, outputs, *dys)`` returning one gradient (or None) per input,
    makes the call differentiable, eagerly and in a graph: a tape around a step that reduces
    gradients then differentiates through the reduction, as through Horovod's ops (a penalty
    on the averaged gradient). It must hold no tensor of a graph.
    """
    if tf.executing_eagerly():
        try:
            results = fn(*[_numpy_view(t) for t in inputs])
        except errors.MismatchError as e:
            if isinstance(e, MismatchError):
                raise
            raise MismatchError(str(e)) from None
        outs = []
        for i, (r, dtype) in enumerate(zip(results, out_dtypes)):
            device = inputs[i].device if i < len(inputs) else ""
            with tf.device(device or "/cpu:0"):
                outs.append(tf.convert_to_tensor(r, dtype=dtype))
        if gradient is not None:
            _record(gradient, inputs, outs)
        return outs
    graph = tf.compat.v1.get_default_graph()
    own_chain = getattr(_standalone, "chain", None)
    if own_chain is None:
        previous = _chain_end(graph)
    else:
        previous = [] if own_chain[0] is None else [own_chain[0]]
    v1_graph = in_v1_graph()
    run = _with_status(fn, out_dtypes) if v1_graph else fn
    dtypes = list(out_dtypes) + ([tf.int32] if v1_graph else [])
    override = {"PyFunc": _HOST_CALL_GRADIENT} if gradient is not None else {}
    with (
        tf.control_dependencies([_after(p, graph) for p in previous]),
        graph.gradient_override_map(override),
    ):
        outs = host_call(run, inputs, dtypes, name=name.replace(".", "_"))
    if gradient is not None:
        _gradients.setdefault(graph, {})[outs[0].op.name] = gradient
        _record(gradient, inputs, outs)
    if own_chain is None:
        _last_collective[graph] = outs[0].op.name
        _announce(graph, outs[0].op)
    else:
        own_chain[0] = outs[0].op
    if v1_graph:
        outs = _fail_on_mismatch(outs[:-1], outs[-1])
    for out, shape in zip(outs, out_shapes):
        out.set_shape(shape)
    return outs


def _nested_in_v1_graph(graph) -> bool:
    """Whether ``graph`` is a function graph (a control flow v2 branch or loop body, a
    ``tf.function``) built inside a TF1 graph that a Session runs."""
    if not getattr(graph, "building_function", False):
        return False
    # executing_eagerly_outside_functions() alone says True in a program that touched the eager
    # context (tf.config.threading...) before disable_eager_execution(): TensorFlow's default
    # execution mode (private: no public view of it) settles that case.
    return (
        not tf.compat.v1.executing_eagerly_outside_functions()
        or _tf_context.default_execution_mode != _tf_context.EAGER_MODE
    )


def _chain_end(graph) -> list:
    """What the next collective built in ``graph`` waits for: its last collective and the ops
    built since that call function graphs holding collectives.

    A Session runs a TF1 graph's ops in no order but their edges, and TensorFlow adds no edges
    between stateful ops there (``tf.function`` does, inside itself). Control flow v2
    (``tf.compat.v1.cond`` and ``while_loop`` in TF2, and ``tf.function`` called in a TF1
    graph) builds each branch or body as a function graph of its own, called by one op of the
    graph around it: the first collective in a function graph waits for the chain of the graph
    around it (an edge from outside becomes an edge into the calling op), and the calling op
    joins that graph's chain, so collectives run in the order they were built on every rank.
    """
    last = _last_collective.get(graph)
    found = [] if last is None else [graph.get_operation_by_name(last)]
    pending = _pending_calls.get(graph)
    if pending:
        ops = graph.get_operations()
        for op in ops[min(pending.values()) :]:  # only ops made since the first was announced
            called = _called(op, pending)
            if called:
                found.append(op)
                _must_run(graph, op)
                for name in called:  # a graph still being built (its caller to come) stays
                    del pending[name]
    if not found and _nested_in_v1_graph(graph):
        return _chain_end(graph.outer_graph)
    return found


_INFERENCE_NAME = re.compile(r"__inference_(.*)_\d+")


def _called(op, names) -> set:
    """The function graphs named in ``names`` that ``op`` calls (cond and while_loop name the
    function after its graph; a tf.function's call names "__inference_<graph name>_<n>")."""
    called = set()
    for value in op.node_def.attr.values():
        if value.HasField("func"):
            functions = [value.func.name]
        else:
            functions = [f.name for f in value.list.func]
        for function in functions:
            inferred = _INFERENCE_NAME.fullmatch(function)
            called |= {n for n in names if n in (function, inferred and inferred.group(1))}
    return called


def _must_run(graph, op) -> None:
    """Makes the call of function graph ``graph`` end only once ``op`` has run: a Session
    inlines a cond's branches, and the call then ends with the ops its function lists as
    control outputs (a v1 graph's functions list none), not with every op in it."""
    # A tf.function's graph (automatic control dependencies: TensorFlow's private flag) lists
    # its stateful ops itself, and refuses one listed twice.
    automatic = getattr(graph, "_add_control_dependencies", False)
    if _nested_in_v1_graph(graph) and not automatic and op not in graph.control_outputs:
        graph.control_outputs.append(op)


def _announce(graph, op) -> None:
    """After collective ``op`` is built in ``graph``: every graph around it, up to the TF1
    graph, must wait for the op that calls the function graph it is in."""
    _must_run(graph, op)
    while _nested_in_v1_graph(graph):
        outer = graph.outer_graph
        # name -> how many ops the graph around had then: its calling op comes later
        _pending_calls.setdefault(outer, {}).setdefault(graph.name, len(outer.get_operations()))
        graph = outer


def _after(previous, graph):
    """What the next collective built in ``graph`` waits for: the ``previous`` one, or, where
    TF1 control flow (``tf.compat.v1.cond`` and ``while_loop`` as Switch, Merge, Enter and Exit
    nodes in one graph) puts it where a plain control edge would not do, an op that runs once it
    has run or never will.

    Two cases break a plain edge. A ``previous`` in a cond branch not taken is dead, and its
    deadness would spread to every collective after it: they, and the training step that needs
    them, would be skipped without an error. A ``previous`` inside a while loop the next one is
    not in lives in another frame, and TensorFlow refuses the edge when the graph runs. So the
    edge goes from the exits of the outermost such loop (they run when the loop has ended), and
    through a ``ControlTrigger``, which runs whether its inputs ran or were dead. Graphs of
    ``tf.function`` (control flow v2: each branch and body a function of its own) have no such
    contexts and always take the plain edge.
    """
    # TF1 control flow offers no public view of an op's context.
    here = graph._get_control_flow_context()
    there = previous._get_control_flow_context()
    if _encloses(there, here):
        return previous
    anchors = [previous]
    while there is not None and not _encloses(there, here):
        if there.IsWhileContext():
            anchors = [exit_.op for exit_ in there.loop_exits]
        there = there.outer_context
    with tf.control_dependencies(anchors):
        return tf.raw_ops.ControlTrigger(name="syncdp_after_control_flow")


def _encloses(outer, inner) -> bool:
    """Whether TF1 control-flow context ``outer`` (None: the graph itself) is ``inner`` or one
    of the contexts around it."""
    while inner is not None and inner is not outer:
        inner = inner.outer_context
    return inner is outer


def follow_collective(op) -> None:
    """Makes ``op`` the last collective of the graph being built, so that the next ordered call
    waits for it: for collectives built as one op (a ``tf.switch_case`` whose branches each
    hold a chain of their own)."""
    own_chain = getattr(_standalone, "chain", None)
    if own_chain is None:
        graph = tf.compat.v1.get_default_graph()
        _last_collective[graph] = op.name
        _announce(graph, op)
    else:
        own_chain[0] = op


@contextlib.contextmanager
def creating_variables():
    """Variables created here are made eagerly, even inside a ``tf.function``'s later trace.

    syncdp makes its state (gradient accumulators, pass counters) on first use, and the first
    use may be traced anywhere: Horovod's elastic example traces its step once without syncdp,
    then again with it. ``tf.init_scope()`` lifts the creation out of the trace, but
    ``tf.function`` still refuses a variable made after its first trace, through a variable
    creator it keeps on the graph being traced: a guard against a function that makes new
    variables each time it is traced. syncdp makes each of these variables once and keeps it,
    so the traced graph's creators are set aside while they are made (TensorFlow's private
    ``Graph._variable_creator_stack``, saved and restored as TensorFlow's own code does;
    without it TensorFlow's error stands).
    """
    tracing = not tf.executing_eagerly() and not in_v1_graph()
    with tf.init_scope():
        graph = tf.compat.v1.get_default_graph()
        saved = getattr(graph, "_variable_creator_stack", None)
        if not tracing or saved is None:  # outside a trace, every creator (a strategy's) applies
            yield
            return
        graph._variable_creator_stack = []
        try:
            yield
        finally:
            graph._variable_creator_stack = saved


_OK, _MISMATCH, _INVALID = 0, 1, 2


def in_v1_graph() -> bool:
    """Whether ops are being built into a TF1 graph run by a Session (not eager, not a
    ``tf.function``)."""
    if tf.executing_eagerly():
        return False
    return not getattr(tf.compat.v1.get_default_graph(), "building_function", False)


def _with_status(fn, out_dtypes):
    """``fn`` returning a status too, and empty outputs instead of raising a bad-input error.

    The node itself then always succeeds, so the collectives chained after it in the graph
    still run; only the consumers of its outputs fail (see :func:`_fail_on_mismatch`).
    """

    def run(*arrays):
        try:
            return (*fn(*arrays), np.int32(_OK))
        except errors.MismatchError as e:
            status = _MISMATCH
            print(f"syncdp: {e}", file=sys.stderr, flush=True)
        except InvalidArgument as e:
            status = _INVALID
            print(f"syncdp: {e}", file=sys.stderr, flush=True)
        empty = [np.zeros(0, tf.as_dtype(d).as_numpy_dtype) for d in out_dtypes]
        return (*empty, np.int32(status))

    return run


def _fail_on_mismatch(outs, status):
    """The outputs, or the error Horovod raises when the node ran with a bad-input status.

    In a TF1 graph an error raised inside a ``numpy_function`` surfaces as ``UnknownError``
    (or ``InvalidArgumentError`` for a ValueError); Horovod programs expect
    ``FailedPreconditionError`` for arguments that differ between ranks. No op raises that on
    request, but reading a variable that was never created does: that read sits on the
    failing branch of a cond. The message itself (what each rank passed) is printed to stderr
    on every rank.
    """

    def mismatch():
        missing = tf.raw_ops.VarHandleOp(
            dtype=tf.int32, shape=[], shared_name="syncdp_ranks_passed_different_arguments"
        )
        return tf.raw_ops.ReadVariableOp(resource=missing, dtype=tf.int32)

    def invalid():
        check = tf.debugging.Assert(False, ["syncdp: invalid collective argument, see stderr"])
        with tf.control_dependencies([check]):
            return tf.constant(0)

    def fail():  # ops are made inside the branches: a cond runs every stateful op of its branch
        failure = tf.cond(tf.equal(status, _MISMATCH), mismatch, invalid)
        with tf.control_dependencies([failure]):
            return [tf.identity(o) for o in outs]

    return tf.cond(tf.equal(status, _OK), lambda: [tf.identity(o) for o in outs], fail)


def _numpy_view(tensor: tf.Tensor) -> np.ndarray:
    """The tensor's values as NumPy, sharing its memory where TensorFlow allows (read only)."""
    view = getattr(tensor, "_numpy", None)  # .numpy() would copy
    return view() if view is not None else tensor.numpy()
