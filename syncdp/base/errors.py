"""Every error syncdp raises, in one hierarchy; each class is for one case.

    SyncdpError
    ├── NotInitializedError    syncdp used before syncdp.init() (or after shutdown())
    ├── ConfigError            a bad SYNCDP_* variable, init() keyword or launcher setting
    ├── CollectiveError        ranks passed mismatched arguments to one collective
    │   ├── StepMismatchError  ranks reduced gradients of different training steps
    │   └── MismatchError      ranks passed different dtypes, shapes, ops or roots to one call
    ├── UnsupportedError       a collective placed where it cannot run (an XLA-compiled step)
    ├── VerificationError      replicas that must be bit-identical are not
    ├── CheckpointError        a checkpoint cannot be written, read or matched to the model
    ├── DataError              missing, empty or corrupt input data
    ├── RankFailureError       elastic mode: a rank died or stalled; recover and go on
    │                          (Horovod's HorovodInternalError)
    ├── HostsUpdatedInterrupt  elastic mode: slots were added; grow at the next commit
    ├── ElasticAbortError      elastic mode: the job cannot go on (below --min-np, reset limit)
    └── HorovodVersionMismatchError  Horovod's name, for programs that catch it; never raised

Catch ``SyncdpError`` to handle any of them. A rank that stops answering or a job whose ranks
never all start is not an exception: the job ends (see ``syncdp.watch.watchdog`` and
``syncdp.job.runtime``) and the launcher names the ranks.
"""

__all__ = [
    "SyncdpError",
    "NotInitializedError",
    "ConfigError",
    "CollectiveError",
    "StepMismatchError",
    "MismatchError",
    "UnsupportedError",
    "VerificationError",
    "CheckpointError",
    "DataError",
    "RankFailureError",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "ElasticAbortError",
    "HorovodVersionMismatchError",
]


class SyncdpError(Exception):
    """Base class of every syncdp error."""


class NotInitializedError(SyncdpError, RuntimeError, ValueError):
    """syncdp was used before ``syncdp.init()`` or after ``syncdp.shutdown()``.

    Also a ``ValueError``, which is what Horovod raises there, so ``except ValueError`` written
    for Horovod catches it.
    """


class ConfigError(SyncdpError, ValueError):
    """A ``SYNCDP_*`` environment variable, ``init()`` keyword or launcher setting is bad."""


class CollectiveError(SyncdpError, RuntimeError):
    """Ranks called one collective with arguments that do not match (names, counts, steps)."""


class StepMismatchError(CollectiveError):
    """Ranks reduced gradients that belong to different training steps."""


class MismatchError(CollectiveError):
    """Ranks called one collective with different dtypes, shapes, ops, roots or names.

    Raised on every rank before any data moves, so the job can go on after catching it.
    """


class UnsupportedError(SyncdpError, RuntimeError):
    """A syncdp collective was placed where it cannot run, e.g. in an XLA-compiled step."""


class VerificationError(SyncdpError, AssertionError):
    """Replicas that must hold bit-identical values differ."""


class CheckpointError(SyncdpError, RuntimeError):
    """A checkpoint could not be written, read, or matched to the objects it restores."""


class DataError(SyncdpError, ValueError):
    """Input data is missing, empty or corrupt."""


class RankFailureError(SyncdpError, RuntimeError):
    """A rank of the job died (or stalled and was removed) during a collective.

    Elastic mode only (``syncdp-run --min-np``/``--elastic``): raised on every surviving rank
    by the collective that noticed, after syncdp has revoked the communicator so that no other
    rank waits in vain. ``syncdp.elastic.run`` catches it, restores the last commit, rebuilds
    the job without the lost rank (and with replacements) and calls the training function
    again. Horovod calls this ``HorovodInternalError``.
    """


HorovodInternalError = RankFailureError


class HostsUpdatedInterrupt(SyncdpError, RuntimeError):
    """Raised by ``state.commit()`` on every rank when the host discovery script offers more
    slots and the job is below ``--max-np``: ``syncdp.elastic.run`` then grows the job.

    Args:
        skip_sync: Whether the state need not be broadcast again (Horovod's field; syncdp
            always syncs, since new ranks need the state).
    """

    def __init__(self, skip_sync: bool = False):
        super().__init__("new slots were found; the job grows at this commit")
        self.skip_sync = skip_sync


class ElasticAbortError(SyncdpError, RuntimeError):
    """An elastic job cannot go on: fewer ranks than ``--min-np`` are left and no replacement
    could start, or the reset limit was reached."""


class HorovodVersionMismatchError(SyncdpError, ImportError):
    """Horovod raises it when a framework's version differs from the one its extension was
    compiled against. syncdp compiles nothing, so it never raises it; programs written for
    Horovod may still import and catch it.

    Args:
        name: The framework.
        version: The version found at run time.
        installed_version: The version at installation.
    """

    def __init__(self, name: str, version: str, installed_version: str):
        super().__init__(
            f"{name} {version} is installed, but the extension was built against "
            f"{installed_version}."
        )
        self.name = name
        self.version = version
        self.installed_version = installed_version
