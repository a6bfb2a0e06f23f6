"""Every error syncdp raises, in one hierarchy.

    SyncdpError
    ├── NotInitializedError    a collective or query before syncdp.init()
    ├── ConfigError            a bad SYNCDP_* variable or keyword argument
    ├── CollectiveError        ranks disagree about a collective
    │   ├── StallError         a collective waited past the stall timeout
    │   └── StepMismatchError  ranks reduced gradients of different steps
    ├── VerificationError      replicas that should be identical are not
    ├── CheckpointError        a checkpoint cannot be written, read or matched to the model
    └── DataError              missing, empty or corrupt input data

Catch ``SyncdpError`` to handle any of them.
"""

__all__ = [
    "SyncdpError",
    "NotInitializedError",
    "ConfigError",
    "CollectiveError",
    "StallError",
    "StepMismatchError",
    "VerificationError",
    "CheckpointError",
    "DataError",
]


class SyncdpError(Exception):
    """Base class of every syncdp error."""


class NotInitializedError(SyncdpError, RuntimeError):
    """syncdp was used before ``syncdp.init()``."""


class ConfigError(SyncdpError, ValueError):
    """A ``SYNCDP_*`` environment variable or an option has a bad value."""


class CollectiveError(SyncdpError, RuntimeError):
    """Ranks do not agree on a collective (its order, size or type)."""


class StallError(CollectiveError):
    """A collective waited longer than the stall timeout for some ranks."""


class StepMismatchError(CollectiveError):
    """Ranks reduced gradients that belong to different training steps."""


class VerificationError(SyncdpError, AssertionError):
    """Replicas that must hold bit-identical values differ."""


class CheckpointError(SyncdpError, RuntimeError):
    """A checkpoint could not be written, read, or matched to the objects it restores."""


class DataError(SyncdpError, ValueError):
    """Input data is missing, empty or corrupt."""
