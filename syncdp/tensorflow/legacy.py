"""TF1 graph-mode training, as parameter-server programs are written: the optimizer and hook.

A between-graph-replication program (``tf.compat.v1.train.MonitoredTrainingSession``,
``replica_device_setter``, ``SyncReplicasOptimizer``, a chief and parameter servers) moves to
syncdp with two changes, as it did to Horovod: wrap the ``tf.compat.v1.train.Optimizer`` in
:func:`DistributedOptimizer` (gradients averaged over the ranks in fused collectives, every
update synchronous) and add :class:`BroadcastGlobalVariablesHook` (rank 0's initial values on
every rank as soon as the session exists: no worker waits for a chief to initialize).
"""

from __future__ import annotations

import tensorflow as tf

from syncdp.tensorflow import collectives
from syncdp.tensorflow.compression import Compression
from syncdp.tensorflow.tape import local_positions, reduce_gradients

__all__ = ["LegacyDistributedOptimizer", "BroadcastGlobalVariablesHook"]


class LegacyDistributedOptimizer(tf.compat.v1.train.Optimizer):
    """A ``tf.compat.v1.train.Optimizer`` whose gradients are averaged over the ranks.

    ``compute_gradients`` asks the wrapped optimizer for the gradients and reduces them (local
    variables excepted); ``apply_gradients``, slots and variables belong to the wrapped
    optimizer, so ``minimize`` works as before. Made by :func:`syncdp.DistributedOptimizer`
    (Horovod's name) when given a TF1 optimizer.

    Args:
        optimizer: The ``tf.compat.v1.train.Optimizer`` to wrap.
        name: Defaults to ``"Distributed" + type(optimizer).__name__``.
        use_locking: Passed to the base class.
        compression: ``Compression.none`` or ``Compression.fp16``. Defaults to none.
        sparse_as_dense: Reduce IndexedSlices as dense tensors. Defaults to False.
        op: ``Average``, ``Sum`` or ``Adasum``. Defaults to ``Average``.
        gradient_predivide_factor: See :func:`syncdp.tape.reduce_gradients`. Defaults to 1.
        process_set: The ranks that average together. Defaults to the whole job.
        scale_local_gradients: Divide local variables' gradients by the set's size.

    Raises:
        ValueError: ``backward_passes_per_step`` > 1 (use a Keras optimizer for local
            aggregation).
    """

    def __init__(
        self,
        optimizer,
        name=None,
        use_locking=False,
        compression=Compression.none,
        sparse_as_dense=False,
        op=collectives.Average,
        gradient_predivide_factor=1.0,
        backward_passes_per_step=1,
        process_set=collectives.global_process_set,
        scale_local_gradients=True,
    ):
        op = collectives.reduce_op(op)
        if backward_passes_per_step != 1:
            raise ValueError(
                "backward_passes_per_step > 1 is not supported with a tf.compat.v1 optimizer "
                "in syncdp; accumulate with a Keras optimizer "
                "(syncdp.keras.DistributedOptimizer) instead."
            )
        super().__init__(
            name=name or "Distributed" + type(optimizer).__name__, use_locking=use_locking
        )
        self._optimizer = optimizer
        self.process_set = process_set
        self._local_vars: list = []
        self._options = dict(
            op=op,
            compression=compression,
            sparse_as_dense=sparse_as_dense,
            gradient_predivide_factor=gradient_predivide_factor,
            process_set=process_set,
            scale_local_gradients=scale_local_gradients,
        )

    def compute_gradients(self, *args, **kwargs):
        """The wrapped optimizer's ``(gradient, variable)`` pairs, gradients reduced."""
        pairs = self._optimizer.compute_gradients(*args, **kwargs)
        if not pairs:
            return pairs
        grads, variables = zip(*pairs)
        reduced = reduce_gradients(
            list(grads),
            variables=list(variables),
            local=local_positions(variables, self._local_vars),
            **self._options,
        )
        return list(zip(reduced, variables))

    def apply_gradients(self, *args, **kwargs):
        """The wrapped optimizer's ``apply_gradients``."""
        return self._optimizer.apply_gradients(*args, **kwargs)

    def register_local_var(self, var) -> None:
        """Keeps ``var``'s gradient on this rank: it is never reduced."""
        self._local_vars.append(var)

    def get_slot(self, *args, **kwargs):
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args, **kwargs):
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args, **kwargs):
        return self._optimizer.variables(*args, **kwargs)


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
    """Broadcasts rank ``root_rank``'s global variables to every rank once the session exists.

    For ``MonitoredTrainingSession``: the broadcast op is built when the graph is finalized
    (``begin``) and run right after the variables are initialized or restored
    (``after_create_session``), so every rank starts from the same values.

    Args:
        root_rank: The rank whose values everyone receives. Defaults to 0.
        device: Accepted for Horovod compatibility.
    """

    def __init__(self, root_rank: int = 0, device: str = ""):
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.bcast_op = None

    def begin(self):
        if self.bcast_op is None or self.bcast_op.graph != tf.compat.v1.get_default_graph():
            self.bcast_op = collectives.broadcast_global_variables(self.root_rank)

    def after_create_session(self, session, coord):
        session.run(self.bcast_op)
