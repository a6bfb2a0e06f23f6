"""DistributedGradientTape: a tf.GradientTape whose gradients are averaged over all ranks.

Step agreement: every call of :func:`reduce_gradients` belongs to a training step. Before any
gradient travels, the ranks exchange their step numbers in one tiny collective (an int64 per
rank); if they differ, every rank raises :class:`~syncdp.StepMismatchError` naming the ranks
and their steps, instead of averaging gradients of different steps. The step is the one the
caller passes (``step=``: ``optimizer.iterations``, which catches a rank that skipped an update,
or the loop's step, which catches a rank whose data skipped a batch); without one it is this
rank's count of gradient reductions, which only catches ranks whose counts were set apart.

The count also drives ``SYNCDP_VERIFY_EVERY=K``: every K-th reduction, the variables the
gradients are for are checked to be bit-identical on every rank
(:func:`syncdp.verify_synchronized`) before this step's update.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from syncdp import graph, ops, runtime, verify
from syncdp._exceptions import StepMismatchError
from syncdp.compression import Compression

__all__ = ["DistributedGradientTape", "reduce_gradients"]

_counter: tf.Variable | None = None


def _step_counter() -> tf.Variable:
    """This rank's count of gradient reductions, a variable so it counts inside tf.function."""
    global _counter
    if _counter is None:
        with tf.init_scope(), tf.device("/cpu:0"):
            _counter = tf.Variable(0, dtype=tf.int64, trainable=False, name="syncdp_step")
    return _counter


def _check_steps(steps: np.ndarray, rank: int) -> int:
    """Raises StepMismatchError unless every rank reported the same step; returns it."""
    mine = int(steps[rank])
    if (steps == mine).all():
        return mine
    by_step: dict[int, list[int]] = {}
    for r, s in enumerate(steps.tolist()):
        by_step.setdefault(s, []).append(r)
    majority = max(by_step, key=lambda s: (len(by_step[s]), 0 in by_step[s]))
    odd = ", ".join(
        f"rank {r} is at step {s}" for r, s in enumerate(steps.tolist()) if s != majority
    )
    raise StepMismatchError(
        "Ranks must reduce gradients of the same step, but they disagree: "
        f"{odd}; {verify._ranks(by_step[majority])} at step {majority}. A rank skipped or "
        "repeated a step (uneven data, a rank-dependent `continue` or early exit); give every "
        "rank the same number of steps (syncdp.data.tfrecord_dataset does)."
    )


def _agree_on_step(variables, step=None):
    """The step-agreement collective (and the periodic verification); returns a step tensor.

    Eagerly it raises at once; inside tf.function the returned tensor carries the check, and
    the gradients must depend on it so that no bucket starts when the ranks disagree.
    """
    comm = runtime.communicator()
    every = runtime.get_config().verify_every
    variables = list(variables or []) if every else []
    names = [verify.variable_name(v, i) for i, v in enumerate(variables)]
    count = _step_counter().assign_add(1)
    step = count if step is None else tf.cast(tf.convert_to_tensor(step), tf.int64)
    mine = tf.one_hot(comm.rank, comm.size, dtype=tf.int64) * tf.reshape(step, [])
    steps = ops.allreduce(mine, op=ops.Sum, name="step_agreement")

    def check(steps, count, *values):
        agreed = _check_steps(steps, comm.rank)
        if values and count % every == 0:
            verify.verify_arrays(names, values)
        return np.int64(agreed)

    values = [tf.convert_to_tensor(v) for v in variables]
    if tf.executing_eagerly():
        return check(steps.numpy(), int(count), *[v.numpy() for v in values])
    # The verification collective inside runs between the step agreement (its input) and the
    # first gradient bucket (which waits for it), so every rank runs it in the same place.
    agreed = graph.host_call(check, [steps, count, *values], tf.int64, name="step_agreement_check")
    agreed.set_shape([])
    return agreed


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


@tf.autograph.experimental.do_not_convert  # see syncdp.graph.host_call
def reduce_gradients(
    grads,
    *,
    op=ops.Average,
    compression=Compression.none,
    sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0,
    name: str = "gradients",
    variables=None,
    step=None,
):
    """Averages (or sums) a list of gradients over all ranks in fused collectives.

    A synchronization point, and one training step: every call is counted, and the ranks first
    check (one int64 per rank in one collective) that they are all at the same step. Gradients
    are bucketed from the last one to the first, because the backward pass produces the last
    layers' gradients first: the first bucket can then start reducing while earlier layers are
    still being differentiated.

    Args:
        grads: Tensors, ``tf.IndexedSlices`` or None (kept None).
        op: ``Average`` or ``Sum``. Defaults to ``Average``.
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
            this rank's count of gradient reductions.

    Returns:
        The reduced gradients, in the order given.

    Raises:
        StepMismatchError: Ranks are at different steps (eagerly; inside ``tf.function`` the
            step's run fails with a ``tf.errors.OpError`` carrying the same message). Raised
            on every rank, before any gradient is exchanged.
        VerificationError: ``SYNCDP_VERIFY_EVERY`` is set and ``variables`` differ.
    """
    grads = list(grads)
    if runtime.communicator().size > 1:
        grads = _after(_agree_on_step(variables, step), grads)
    if sparse_as_dense:
        grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
    prescale = postscale = 1.0
    if gradient_predivide_factor != 1.0:
        if op is not ops.Average:
            raise ValueError("gradient_predivide_factor needs op=Average.")
        prescale = 1.0 / gradient_predivide_factor
        postscale = gradient_predivide_factor
    reduced = ops.grouped_allreduce(
        grads[::-1],
        op=op,
        compression=compression,
        prescale_factor=prescale,
        postscale_factor=postscale,
        name=name,
    )
    return reduced[::-1]


class DistributedGradientTape:
    """Wraps a ``tf.GradientTape`` so that ``gradient()`` returns gradients averaged over ranks.

    Use it like Horovod's: record with a tape, wrap it, and ask for gradients; or open it as
    the context manager itself. ``gradient()`` is a synchronization point.

    Args:
        gradtape: The ``tf.GradientTape`` to wrap.
        device_dense: Accepted for Horovod compatibility.
        device_sparse: Accepted for Horovod compatibility.
        compression: ``Compression.none`` or ``Compression.fp16``. Defaults to none.
        sparse_as_dense: Reduce IndexedSlices gradients as dense tensors. Defaults to False.
        op: ``Average`` or ``Sum``. Defaults to ``Average``.
        gradient_predivide_factor: See :func:`reduce_gradients`. Defaults to 1.
        num_groups: Accepted for Horovod compatibility; fusion is set by the threshold.
        groups: Accepted for Horovod compatibility.
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
        op=ops.Average,
        gradient_predivide_factor: float = 1.0,
        num_groups: int = 0,
        groups=None,
        *,
        step=None,
    ):
        self._tape = gradtape
        self._step = step
        self._options = dict(
            op=op,
            compression=compression,
            sparse_as_dense=sparse_as_dense,
            gradient_predivide_factor=gradient_predivide_factor,
        )

    def __enter__(self):
        self._tape.__enter__()
        return self

    def __exit__(self, *exc):
        return self._tape.__exit__(*exc)

    def __getattr__(self, name):
        # watch(), stop_recording(), reset(), jacobian() ... belong to the wrapped tape.
        return getattr(self._tape, name)

    @tf.autograph.experimental.do_not_convert
    def gradient(
        self,
        target,
        sources,
        output_gradients=None,
        unconnected_gradients=tf.UnconnectedGradients.NONE,
    ):
        """Like ``tf.GradientTape.gradient``, then reduced over all ranks (a collective)."""
        grads = self._tape.gradient(target, sources, output_gradients, unconnected_gradients)
        flat = tf.nest.flatten(grads, expand_composites=False)
        reduced = reduce_gradients(
            flat, variables=tf.nest.flatten(sources), step=self._step, **self._options
        )
        return tf.nest.pack_sequence_as(grads, reduced)
