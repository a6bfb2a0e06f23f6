"""Elastic training: state that survives a lost rank, and the loop that recovers it.

Horovod's elastic API on syncdp's engine (Open MPI ULFM underneath, no Gloo, no restart of the
survivors). A training function decorated with :func:`run` takes a :class:`State`; it calls
``state.commit()`` every few steps, which keeps a copy of the state in memory on every rank.
When a rank dies (or stalls and is removed), every survivor's current collective raises
:class:`~syncdp.base.errors.RankFailureError` (``HorovodInternalError``), and :func:`run`:

1. restores the last commit (``state.restore()``),
2. heals the job (``syncdp.job.runtime.reset``: revoke, shrink, spawn replacements, merge),
3. calls the reset callbacks (``state.register_reset_callbacks``; :func:`run_fn`'s ``reset``
   first); a rank lost while they run is one more failure, recovered from in the same way,
4. broadcasts rank 0's state to every rank, replacements included (``state.sync()``),
5. calls the training function again, which resumes from the state.

A replacement runs the program from the top: ``syncdp.init()`` merges it into the job, and its
:func:`run` starts with the same ``state.sync()``. So collectives a program calls between
``init()`` and :func:`run` must pair up with those of the survivors' reset callbacks (Horovod's
Keras example fits one step in both places). Until that sync the ranks' optimizers, and so their
step counts, differ: the step check is off from a membership change to the next sync
(:func:`syncdp.job.runtime.steps_agree`).

When the function returns on every rank, a fault-tolerant agreement makes sure no rank was lost
at the very end; if one was, the survivors recover and run the function again from the last
commit (usually returning at once).

A lost *host* is survived one level up: Open MPI's runtime ends with it, and ``syncdp-run``
starts the job again on the hosts left (:mod:`syncdp.launch.restart`). For that, in an elastic job
on several hosts, every ``commit()`` also puts the state on each host's local disk (its lowest
local rank writes it, :mod:`syncdp.membership.commits`), and every sync first finds the newest
commit
anywhere (in a rank's memory or on a host's disk) and gives it to every rank. A restarted job
therefore resumes from the last commit with the same code that heals a lost rank. A state's
copy is what :meth:`State.snapshot` returns: the attributes ``save()`` fills whose names start
with ``_saved`` (a subclass that keeps it elsewhere overrides :meth:`State.snapshot` and
:meth:`State.load_snapshot`).

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
import os
import socket
import sys
import time
from collections.abc import Callable
from typing import Any, NoReturn

from syncdp.base.errors import (
    ElasticAbortError,
    HorovodInternalError,
    HostsUpdatedInterrupt,
    RankFailureError,
)
from syncdp.job import runtime
from syncdp.membership import commits, membership
from syncdp.watch import report

__all__ = [
    "State",
    "ObjectState",
    "run",
    "run_fn",
    "RankFailureError",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
]


# What every rank's commit check carries (State.check_host_updates).
_COMMIT_SIGNATURE = (("collective", "elastic.commit_check"),)
# How long a survivor of a loss looks for the lost rank's farewell (it ended the job on purpose)
# before it recovers: the farewell leaves before that rank's MPI_Abort, but between hosts it may
# arrive after the news of the loss.
_FAREWELL_GRACE_SECONDS = 0.3


def _broadcast_object(obj, root_rank: int = 0):
    return runtime.communicator().broadcast_object(obj, root_rank, name="elastic.sync")


class State:
    """What a training function needs to resume: saved by ``commit()``, shared by ``sync()``.

    Subclasses define :meth:`save`, :meth:`restore` and :meth:`sync`.

    Args:
        bcast_object: ``fn(obj)`` returning rank 0's object on every rank, called with one
            argument as Horovod calls it (``syncdp.broadcast_object`` fits). Defaults to
            syncdp's.
        get_rank: ``fn()`` returning this rank. Defaults to ``syncdp.rank``.
    """

    def __init__(self, bcast_object=None, get_rank=None):
        self._bcast_object = bcast_object or _broadcast_object
        self._rank = get_rank or runtime.rank
        self._reset_callbacks: list = []
        self._looker = membership.Looker()  # rank 0's looks for room to grow
        # Commits so far, the same on every rank (they commit in lockstep; a sync sets it): the
        # counter of the copy on disk (syncdp.membership.commits).
        self._commits = 0

    def register_reset_callbacks(self, callbacks) -> None:
        """Calls each of ``callbacks`` (no arguments) after every membership change, on every
        rank, before the state is synced (e.g. to rescale the learning rate to the new size)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Calls :meth:`reset`, then the reset callbacks (called by :func:`run` after a
        membership change)."""
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def reset(self) -> None:
        """What a subclass does after a membership change, before the reset callbacks and the
        sync (Horovod's hook). Does nothing here."""

    def on_hosts_updated(self, timestamp, update_res) -> None:
        """Horovod's notification hook; syncdp checks for new hosts in :meth:`commit`."""

    def commit(self) -> None:
        """Saves the state in memory (every rank keeps its own copy), then checks for new
        hosts. A synchronization point when a discovery script or spares are set, or (a Keras
        state) partway through a ``backward_passes_per_step`` window, when the ranks first
        average the gradients accumulated so far: every rank must commit at the same points
        of training, and a commit inside a window costs one allreduce of the gradients.

        In an elastic job on several hosts under ``syncdp-run`` the lowest local rank of each
        host also writes the copy to that host's local disk, so that a restart after a lost
        host resumes from it (:mod:`syncdp.membership.commits`).

        Raises:
            HostsUpdatedInterrupt: The discovery script offers room to grow; :func:`run`
                grows the job and resumes from this commit.
        """
        self.save()
        self._commits += 1
        self._write_to_disk()
        self.check_host_updates()

    def _write_to_disk(self) -> None:
        store = commits.store()
        if store is None or runtime.elastic_plan() is None or runtime.local_rank() != 0:
            return
        try:
            store.write(self._commits, self.snapshot())
        except OSError as e:  # the job goes on; only a restart would miss this commit
            print(
                f"syncdp: rank {runtime.rank()}: commit {self._commits} could not be written to "
                f"{store.directory} ({e}); a restart after a lost host would resume from an "
                "older one.",
                file=sys.stderr,
                flush=True,
            )

    def snapshot(self) -> dict[str, Any]:
        """What the last ``save()`` kept, as one picklable value (for the copy on disk).

        Returns:
            The attributes whose names start with ``_saved``, by name.
        """
        return {name: value for name, value in vars(self).items() if name.startswith("_saved")}

    def load_snapshot(self, snapshot: dict[str, Any]) -> None:
        """Makes ``snapshot`` (from :meth:`snapshot`, maybe another process's) the saved
        copy; :meth:`restore` then puts it in place."""
        for name, value in snapshot.items():
            setattr(self, name, value)

    def check_host_updates(self) -> None:
        """Raises HostsUpdatedInterrupt on every rank when slots were added (elastic mode with
        ``--host-discovery-script`` and fewer ranks than ``--max-np``); otherwise returns.

        With warm spares (``--spares``) it also keeps their number (a collective):
        :func:`syncdp.job.runtime.tend_spares`. With spares or a discovery script every rank
        must commit at the same point of training: ranks that do not get ``MismatchError``.
        """
        plan = runtime.elastic_plan()
        if plan is None:
            return
        if plan.spare_target or plan.script:
            # The commit is a collective here. Checked like any other, so that one rank's
            # commit meeting another's training step is an error on every rank, instead of
            # pairing silently with that rank's next commit.
            runtime.communicator().agree(_COMMIT_SIGNATURE, name="elastic.commit_check")
        runtime.tend_spares()  # with --spares: used or dead spares are replaced meanwhile
        if not plan.script:
            return
        comm = runtime.communicator()
        if membership.slots_added(comm, plan, runtime.members(), self._looker):
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
            values = self._bcast_object(self._values())
            for name, value in values.items():
                setattr(self, name, value)
        self.save()


def _take_newest_commit(state: State) -> None:
    """Gives every rank the newest commit there is, when it is not rank 0's own (a collective
    of every rank, in an elastic job that keeps commits on disk; nothing otherwise).

    Each rank says which commit it holds in memory and which is the newest on its host's disk;
    the rank that holds the newest (in memory first, so no disk is read when one can be
    avoided) sends it to the others. Then ``state.sync()`` makes every rank rank 0's, as
    always. After a restart (a fresh process holds no commit) this is how the job resumes.
    """
    store = commits.store()
    if store is None or runtime.elastic_plan() is None:
        return
    comm = runtime.communicator()
    mine = (state._commits, store.newest(), socket.gethostname())
    found = commits.newest(comm.allgather_object(mine, name="elastic.commits"))
    loaded = False
    if found.rank != 0 or found.on_disk:  # rank 0 does not hold it in memory: it moves
        snapshot = None
        if comm.rank == found.rank:
            try:
                snapshot = store.read(found.counter) if found.on_disk else state.snapshot()
            except (OSError, ValueError, EOFError) as e:
                print(
                    f"syncdp: rank {comm.rank}: commit {found.counter} on {found.host} could "
                    f"not be read ({e}); going on from rank 0's state.",
                    file=sys.stderr,
                    flush=True,
                )
        if found.rank != 0:
            snapshot = comm.broadcast_object(snapshot, found.rank, name="elastic.commit")
        if snapshot is not None and (found.rank != 0 or comm.rank == 0):
            state.load_snapshot(snapshot)
            state.restore()
            state._commits, loaded = found.counter, True
    # Rank 0's counter is the one its state (which the sync hands out) goes with.
    state._commits = comm.broadcast_object(state._commits, 0, name="elastic.commit_counter")
    if comm.rank == 0 and loaded and found.on_disk:
        report.send(
            "resumed",
            0,
            f"resumed from commit {found.counter}, kept on {found.host}'s disk",
            counter=found.counter,
            source=found.host,
            size=comm.size,
        )


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


def _abort_if_a_rank_ended_the_job(event: Exception, error: Exception) -> None:
    """Raises ElasticAbortError when the rank behind a loss ended the job on purpose (it
    raised an exception, and said so before it went): that is not a loss, and the survivors
    must not re-form the job, train on, or make a new rank 0 while it ends."""
    if not isinstance(event, RankFailureError):
        return
    watchdog = runtime.communicator().watchdog
    if watchdog is None:
        return
    deadline = time.monotonic() + _FAREWELL_GRACE_SECONDS
    while (ender := watchdog.ended_on_purpose()) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    if ender is None:
        return
    message = (
        f"rank {ender} ended the job (it raised an exception: its own lines say which), which "
        "is no loss to recover from; this rank ends too"
    )
    print(f"syncdp: rank {runtime.rank()}: {message}.", file=sys.stderr, flush=True)
    raise ElasticAbortError(message) from error


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
        ElasticAbortError: Fewer than ``--min-np`` ranks are left, the reset limit was hit, or
            a rank raised an exception (which ends the job rather than being recovered from).
    """
    return run_fn(func, _no_reset)


def _no_reset() -> None:
    pass


def _leave_now(leaving: SystemExit) -> NoReturn:
    """Ends this rank at once, as a lost one, when its training function calls ``sys.exit()``
    with a failing status: the others recover without it from the last commit. Exiting the
    usual way would leave them waiting for it in their next collective while its
    ``MPI_Finalize`` waits for them, until the finalize bound (``--finalize-timeout``, 60 s)
    killed it."""
    code = leaving.code
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)  # what sys.exit("message") prints
    print(
        f"syncdp: rank {runtime.rank()} called sys.exit({code!r}) inside elastic.run before "
        "training finished; it leaves the job now, as a lost rank.",
        file=sys.stderr,
        flush=True,
    )
    sys.stdout.flush()
    os._exit(code if isinstance(code, int) else (0 if code is None else 1))


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
        runtime.training_finished(False)  # a second run trains again
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
                _take_newest_commit(state)
                state.sync()
                runtime.states_synced()  # every rank's optimizer, and so its step, is rank 0's
                result = func(state, *args, **kwargs)
                # Every rank must know that every rank finished: a rank lost at the very end
                # would otherwise leave some survivors recovering while the others exit.
                runtime.communicator().all_agree(1, name="elastic.done")
                runtime.training_finished()
                if runtime.rank() == 0:  # a host lost from now on needs no restart
                    report.send("trained", 0, "every rank finished training")
                return result
            except SystemExit as leaving:
                # sys.exit(0) (or None) takes the usual way out: every rank may be ending
                # together (an early stop), and they finalize together.
                if runtime.elastic_plan() is None or leaving.code in (None, 0):
                    raise
                _leave_now(leaving)
            except Exception as error:  # noqa: BLE001 - re-raised unless it is a failure
                event = _failure(error)
                if event is None or runtime.elastic_plan() is None:
                    raise
                _abort_if_a_rank_ended_the_job(event, error)
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
