"""Elastic training: state that survives a lost rank, and the loop that recovers it.

Horovod's elastic API on syncdp's engine (Open MPI ULFM underneath, no Gloo, no restart of the
survivors). A training function decorated with :func:`run` takes a :class:`State`; it calls
``state.commit()`` every few steps, which keeps a copy of the state in memory on every rank.
When a rank dies (or stalls and is removed), every survivor's current collective raises
:class:`~syncdp.core.errors.RankFailureError` (``HorovodInternalError``), and :func:`run`:

1. restores the last commit (``state.restore()``),
2. heals the job (``syncdp.core.runtime.reset``: revoke, shrink, spawn replacements, merge),
3. calls the reset callbacks (``state.register_reset_callbacks``; :func:`run_fn`'s ``reset``
   first); a rank lost while they run is one more failure, recovered from in the same way,
4. broadcasts rank 0's state to every rank, replacements included (``state.sync()``),
5. calls the training function again, which resumes from the state.

A replacement runs the program from the top: ``syncdp.init()`` merges it into the job, and its
:func:`run` starts with the same ``state.sync()``. So collectives a program calls between
``init()`` and :func:`run` must pair up with those of the survivors' reset callbacks (Horovod's
Keras example fits one step in both places). Until that sync the ranks' optimizers, and so their
step counts, differ: the step check is off from a membership change to the next sync
(:func:`syncdp.core.runtime.steps_agree`).

When the function returns on every rank, a fault-tolerant agreement makes sure no rank was lost
at the very end; if one was, the survivors recover and run the function again from the last
commit (usually returning at once).

Example:
    >>> state = syncdp.tensorflow.elastic.TensorFlowKerasState(model, optimizer, epoch=0, batch=0)
    >>> @syncdp.tensorflow.elastic.run
    ... def train(state):
    ...     for state.epoch in range(state.epoch, epochs):
    ...         ...  # steps; state.commit() every few
    >>> train(state)
"""

from __future__ import annotations

import copy
import functools
import sys
from collections.abc import Callable

from syncdp.core import membership, runtime
from syncdp.core.errors import (
    HorovodInternalError,
    HostsUpdatedInterrupt,
    RankFailureError,
)

__all__ = [
    "State",
    "ObjectState",
    "run",
    "run_fn",
    "RankFailureError",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
]


def _broadcast_object(obj, root_rank: int = 0):
    return runtime.communicator().broadcast_object(obj, root_rank, name="elastic.sync")


class State:
    """What a training function needs to resume: saved by ``commit()``, shared by ``sync()``.

    Subclasses define :meth:`save`, :meth:`restore` and :meth:`sync`.

    Args:
        bcast_object: ``fn(obj, root_rank)`` returning rank ``root_rank``'s object on every
            rank. Defaults to syncdp's.
        get_rank: ``fn()`` returning this rank. Defaults to ``syncdp.rank``.
    """

    def __init__(self, bcast_object=None, get_rank=None):
        self._bcast_object = bcast_object or _broadcast_object
        self._rank = get_rank or runtime.rank
        self._reset_callbacks: list = []
        self._last_check = [0.0]  # when rank 0 last ran the host discovery script

    def register_reset_callbacks(self, callbacks) -> None:
        """Calls each of ``callbacks`` (no arguments) after every membership change, on every
        rank, before the state is synced (e.g. to rescale the learning rate to the new size)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Runs the reset callbacks (called by :func:`run` after a membership change)."""
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp, update_res) -> None:
        """Horovod's notification hook; syncdp checks for new hosts in :meth:`commit`."""

    def commit(self) -> None:
        """Saves the state in memory (every rank keeps its own copy; nothing goes to disk),
        then checks for new hosts. A synchronization point when a discovery script is set.

        Raises:
            HostsUpdatedInterrupt: The discovery script offers room to grow; :func:`run`
                grows the job and resumes from this commit.
        """
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raises HostsUpdatedInterrupt on every rank when slots were added (elastic mode with
        ``--host-discovery-script`` and fewer ranks than ``--max-np``); otherwise returns.

        With warm spares (``--spares``) it also keeps their number (a collective):
        :func:`syncdp.core.runtime.tend_spares`."""
        plan = runtime.elastic_plan()
        if plan is None:
            return
        runtime.tend_spares()  # with --spares: used or dead spares are replaced meanwhile
        if not plan.script:
            return
        comm = runtime.communicator()
        if membership.slots_added(comm, plan, runtime.members(), self._last_check):
            raise HostsUpdatedInterrupt(False)

    def save(self) -> None:
        """Keeps a copy of the state in memory."""
        raise NotImplementedError

    def restore(self) -> None:
        """Puts back the copy :meth:`save` kept."""
        raise NotImplementedError

    def sync(self) -> None:
        """Makes every rank's state rank 0's (a collective), then saves it."""
        raise NotImplementedError


class ObjectState(State):
    """State made of picklable Python values, given as keyword arguments and read back as
    attributes (``state.epoch``, ``state.batch``).

    Args:
        bcast_object: See :class:`State`. Defaults to syncdp's.
        get_rank: See :class:`State`. Defaults to ``syncdp.rank``.
        **kwargs: The values, by name.
    """

    def __init__(self, bcast_object=None, get_rank=None, **kwargs):
        super().__init__(bcast_object, get_rank)
        self._names = list(kwargs)
        self._saved = copy.deepcopy(kwargs)
        for name, value in kwargs.items():
            setattr(self, name, value)

    def _values(self) -> dict:
        return {name: getattr(self, name) for name in self._names}

    def save(self) -> None:
        self._saved = copy.deepcopy(self._values())

    def restore(self) -> None:
        for name, value in copy.deepcopy(self._saved).items():
            setattr(self, name, value)

    def sync(self) -> None:
        if self._names:
            values = self._bcast_object(self._values(), 0)
            for name, value in values.items():
                setattr(self, name, value)
        self.save()


def _failure(error: BaseException) -> Exception | None:
    """The membership event behind ``error``, or None when it is an ordinary error.

    A failure inside ``tf.function`` or Keras arrives wrapped (TensorFlow turns host-call
    errors into ``UnknownError``), so a revoked communicator is the sign: any error raised
    while the job's communicator is broken is the failure surfacing.
    """
    if isinstance(error, RankFailureError | HostsUpdatedInterrupt):
        return error
    comm = runtime.communicator()
    if comm.broken:
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        ours = [line for line in lines if "a rank of" in line]
        text = (ours or lines or [type(error).__name__])[0]
        return RankFailureError(text.removeprefix(f"{RankFailureError.__name__}: "))
    return None


def run(func: Callable) -> Callable:
    """Makes ``func(state, *args, **kwargs)`` survive lost ranks: Horovod's ``elastic.run``.

    The wrapped function syncs the state from rank 0 first, then calls ``func``; on a rank
    failure it restores the last commit, heals the job, runs the reset callbacks, syncs and
    calls ``func`` again. Outside elastic mode it syncs once and calls ``func``.

    Args:
        func: The training function; its first argument is the :class:`State`.

    Returns:
        The wrapped function, returning what ``func`` returns.

    Raises:
        ElasticAbortError: Fewer than ``--min-np`` ranks are left, or the reset limit was hit.
    """
    return run_fn(func, _no_reset)


def _no_reset() -> None:
    pass


def run_fn(func: Callable, reset: Callable[[], None]) -> Callable:
    """:func:`run`, calling ``reset()`` after every membership change: Horovod's ``run_fn``.

    Horovod's frameworks build their ``run`` from it, passing the function that re-forms their
    communication (``shutdown()`` then ``init()``). syncdp re-forms the job itself, in place
    (lost ranks replaced, or new slots joined, in one MPI job that cannot be started twice), so
    here ``reset`` is only for what the program must redo for the new membership; it must not
    call ``syncdp.shutdown()`` or ``syncdp.init()``.

    Args:
        func: The training function; its first argument is the :class:`State`.
        reset: Called with no arguments on every surviving rank after the job is re-formed,
            before the state's reset callbacks and its sync.

    Returns:
        The wrapped function, returning what ``func`` returns.

    Raises:
        ElasticAbortError: Fewer than ``--min-np`` ranks are left, or the reset limit was hit.

    Example:
        >>> train = syncdp.tensorflow.elastic.run_fn(train_loop, reset=rebuild_dataset)
        >>> train(state)
    """

    @functools.wraps(func)
    def wrapper(state: State, *args, **kwargs):
        reformed = False  # the job was just re-formed: the reset functions run first
        while True:
            try:
                if reformed:
                    # Inside the try: a reset callback may run collectives (Horovod's Keras
                    # example fits a step there), and a rank lost meanwhile is one more
                    # failure to recover from, not the end of the job.
                    reformed = False
                    reset()
                    state.on_reset()
                state.sync()
                runtime.states_synced()  # every rank's optimizer, and so its step, is rank 0's
                result = func(state, *args, **kwargs)
                # Every rank must know that every rank finished: a rank lost at the very end
                # would otherwise leave some survivors recovering while the others exit.
                runtime.communicator().all_agree(1, name="elastic.done")
                return result
            except Exception as error:  # noqa: BLE001 - re-raised unless it is a failure
                event = _failure(error)
                if event is None or runtime.elastic_plan() is None:
                    raise
            grow = isinstance(event, HostsUpdatedInterrupt)
            if not grow:
                print(
                    f"syncdp: rank {runtime.rank()}: {event} Recovering from the last commit.",
                    file=sys.stderr,
                    flush=True,
                )
                state.restore()
            runtime.reset(grow=grow)
            reformed = True

    return wrapper
