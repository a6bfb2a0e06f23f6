"""The rank environment: ``init()``, who this process is, and what happens when it fails.

``init()`` starts MPI (through mpi4py), reads the configuration, works out the local and cross
topology (ranks on this host; hosts), pins this rank's GPU by local rank, and installs a hook
that ends the whole job when an exception escapes on any rank, so no other rank is left
waiting in a collective.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
import traceback

import mpi4py

mpi4py.rc.thread_level = "multiple"  # the stall watchdog talks MPI from a second thread
from mpi4py import MPI  # noqa: E402

from syncdp import config as _config  # noqa: E402
from syncdp._exceptions import NotInitializedError  # noqa: E402
from syncdp.comm import Communicator  # noqa: E402

__all__ = [
    "init",
    "shutdown",
    "is_initialized",
    "rank",
    "size",
    "local_rank",
    "local_size",
    "cross_rank",
    "cross_size",
    "is_chief",
    "communicator",
    "get_config",
]


class _State:
    comm: Communicator | None = None
    config: _config.Config | None = None
    local_rank = 0
    local_size = 1
    cross_rank = 0
    cross_size = 1
    hook_installed = False
    exit_comm: MPI.Comm | None = None
    shutdown_hooks: list = []


_state = _State()


def init(comm: MPI.Comm | None = None, **options) -> None:
    """Initializes syncdp on this rank.

    A synchronization point: every rank must call it. Calling it again after a successful
    ``init()`` does nothing.

    Args:
        comm: The MPI communicator whose processes train together. Defaults to
            ``MPI.COMM_WORLD``.
        **options: Settings that override the ``SYNCDP_*`` environment variables, by their
            :class:`~syncdp.config.Config` names (e.g. ``fusion_threshold=16 << 20``).

    Raises:
        ConfigError: A ``SYNCDP_*`` variable or an option is unknown or malformed.

    Example:
        >>> import syncdp
        >>> syncdp.init()
        >>> print(syncdp.rank(), syncdp.size())
    """
    if _state.comm is not None:
        return
    config = _config.from_env(**options)
    from syncdp.timeline import Timeline

    timeline = Timeline(config.timeline) if config.timeline else None
    world = Communicator(comm if comm is not None else MPI.COMM_WORLD, config, timeline)
    if timeline is not None:
        timeline.rank = world.rank
    # The first collective is the rendezvous: every rank must reach it within the start timeout.
    hosts = world.allgather_object(
        MPI.Get_processor_name(), name="init", timeout=config.start_timeout
    )
    host_order = list(dict.fromkeys(hosts))
    same_host = [r for r, h in enumerate(hosts) if h == hosts[world.rank]]
    _state.local_rank = same_host.index(world.rank)
    _state.local_size = len(same_host)
    _state.cross_rank = host_order.index(hosts[world.rank])
    _state.cross_size = len(host_order)
    _state.comm = world
    _state.config = config
    _pin_gpu(_state.local_rank)
    _install_failure_hook()
    _state.exit_comm = world.mpi.Dup()
    atexit.register(_at_exit)
    if config.verbose:
        print(
            f"syncdp: rank {world.rank}/{world.size} on {hosts[world.rank]} "
            f"(local {_state.local_rank}/{_state.local_size}), {config}",
            file=sys.stderr,
        )


def _pin_gpu(local: int) -> None:
    """Makes only the GPU numbered ``local`` (modulo the count) visible to this rank."""
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return
    gpu = gpus[local % len(gpus)]
    try:
        tf.config.set_visible_devices(gpu, "GPU")
        tf.config.experimental.set_memory_growth(gpu, True)
    except RuntimeError as e:  # TensorFlow already created its GPU devices
        print(
            f"syncdp: warning: could not pin GPU {local} ({e}); call syncdp.init() before "
            "building any model or tensor.",
            file=sys.stderr,
        )


def _install_failure_hook() -> None:
    """Ends every rank when an exception escapes on one, naming the rank and the exception."""
    if _state.hook_installed:
        return
    previous = sys.excepthook

    def hook(kind, value, tb):
        previous(kind, value, tb)
        if _state.comm is None or _state.comm.size == 1 or issubclass(kind, KeyboardInterrupt):
            return
        text = "".join(traceback.format_exception_only(kind, value)).strip()
        print(
            f"syncdp: rank {_state.comm.rank} failed with {text}; ending the job.",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        MPI.COMM_WORLD.Abort(1)

    sys.excepthook = hook
    _state.hook_installed = True


def _at_exit() -> None:
    """Leaves together, or ends the job if another rank is waiting for this one.

    MPI_Finalize waits for every rank. A rank whose program ends early (``sys.exit(3)`` in
    the middle of training) would sit there while the others wait for it in a collective, and
    neither would ever finish. So each rank waits at a barrier of its own here, asking the
    others where they are, and aborts the job with a message naming both sides when one of
    them is inside a collective this rank never reached.
    """
    comm, exit_comm = _state.comm, _state.exit_comm
    watchdog = comm.watchdog if comm is not None else None
    if watchdog is not None and watchdog.can_ask and exit_comm is not None:
        watchdog.exiting = True
        everyone_here = exit_comm.Ibarrier()
        while not everyone_here.Test():
            for other, (seq, name, _) in watchdog.ask_others(grace=0.5).items():
                if seq is not None and seq > comm.seq:
                    print(
                        f"syncdp: rank {comm.rank} finished its program after collective "
                        f"#{comm.seq}, but rank {other} is waiting for it in collective "
                        f"#{seq} {name}; ending the job.",
                        file=sys.stderr,
                        flush=True,
                    )
                    MPI.COMM_WORLD.Abort(1)
            time.sleep(0.2)
    if exit_comm is not None:
        exit_comm.Free()
        _state.exit_comm = None
    shutdown()


def shutdown() -> None:
    """Releases syncdp's communicators; ``init()`` may be called again.

    Called at exit automatically. Not a collective, except with a timeline on: then rank 0
    gathers every rank's events here, so every rank must call it.
    """
    comm = _state.comm
    if comm is None:
        return
    for hook in list(_state.shutdown_hooks):
        hook()
    if comm.timeline is not None:
        timeline, comm.timeline = comm.timeline, None  # the gather itself is not recorded
        timeline.gather_and_write(comm)
    _state.comm = None
    comm.close()


def is_initialized() -> bool:
    """Whether ``init()`` has been called (and ``shutdown()`` has not)."""
    return _state.comm is not None


def communicator() -> Communicator:
    """The Communicator of this job.

    Raises:
        NotInitializedError: ``init()`` has not been called.
    """
    if _state.comm is None:
        raise NotInitializedError("syncdp is not initialized; call syncdp.init() first.")
    return _state.comm


def get_config() -> _config.Config:
    """The configuration ``init()`` read."""
    communicator()
    return _state.config


def rank() -> int:
    """This process's rank, 0 to ``size() - 1``."""
    return communicator().rank


def size() -> int:
    """The number of ranks training together."""
    return communicator().size


def local_rank() -> int:
    """This process's rank among the ranks on its host (used to pick its GPU)."""
    communicator()
    return _state.local_rank


def local_size() -> int:
    """The number of ranks on this host."""
    communicator()
    return _state.local_size


def cross_rank() -> int:
    """The index of this host among the job's hosts."""
    communicator()
    return _state.cross_rank


def cross_size() -> int:
    """The number of hosts in the job."""
    communicator()
    return _state.cross_size


def is_chief() -> bool:
    """Whether this is rank 0, the rank that writes checkpoints and logs."""
    return rank() == 0


def rank_from_env() -> int:
    """This process's rank as the launcher or mpirun announced it, without initializing MPI."""
    for key in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"):
        if key in os.environ:
            return int(os.environ[key])
    return 0
