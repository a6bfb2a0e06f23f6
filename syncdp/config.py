"""The one place syncdp reads its configuration.

A frozen :class:`Config` is read once from ``SYNCDP_*`` environment variables (the launcher sets
them from its flags, one variable per flag) and keyword arguments override it. A ``SYNCDP_*``
name that syncdp does not know raises, so a typo is never silently ignored.

| variable                | launcher flag           | meaning                                      |
|-------------------------|-------------------------|----------------------------------------------|
| SYNCDP_FUSION_THRESHOLD | --fusion-threshold-mb   | bytes per fused buffer (default 64 MiB)      |
| SYNCDP_CHUNK_BYTES      | --chunk-mb              | largest single MPI message (default 8 MiB)   |
| SYNCDP_STALL_TIMEOUT    | --stall-timeout         | seconds before a stalled collective ends the |
|                         |                         | job (default 60; 0 disables)                 |
| SYNCDP_STALL_WARNING    | --stall-warning         | seconds before a stall is reported (def. 10) |
| SYNCDP_START_TIMEOUT    | --start-timeout         | seconds for all ranks to reach init()        |
| SYNCDP_TIMELINE         | --timeline-filename     | Chrome-trace JSON of every collective        |
| SYNCDP_VERIFY_EVERY     | --verify-every          | check replicas are identical every K steps   |
| SYNCDP_VERBOSE          | --verbose               | log what syncdp does on every rank           |
| SYNCDP_LOG_ALL_RANKS    | --log-all-ranks         | Keras progress bars on every rank            |
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from syncdp._exceptions import ConfigError

__all__ = ["Config", "ENV_VARS", "from_env"]

MiB = 1024 * 1024


@dataclasses.dataclass(frozen=True)
class Config:
    """syncdp's settings for one process.

    Attributes:
        fusion_threshold: Bytes of gradients packed into one fused buffer. 0 turns fusion off
            (one collective per tensor).
        chunk_bytes: Largest message handed to one MPI call; bigger buffers are reduced in
            chunks of this size, each filled and reduced in place. On an idle machine 1 MiB
            chunks are fastest (they stay in cache); on a loaded one every chunk is a point
            where both ranks must be running, and 8 MiB measured far better, so it is the
            default. Lower it when ranks have cores to themselves.
        stall_timeout: Seconds a collective may wait for other ranks before the job ends with a
            StallError naming them. 0 waits forever.
        stall_warning: Seconds before a waiting collective prints a warning.
        start_timeout: Seconds ``init()`` waits for every rank to arrive.
        timeline: Path of the Chrome-trace timeline, or "" for none.
        verify_every: Run ``verify_synchronized`` every this many steps (0: never).
        verbose: Log syncdp's decisions on every rank.
        log_all_ranks: Show Keras progress output on every rank, not only rank 0.
    """

    fusion_threshold: int = 64 * MiB
    chunk_bytes: int = 8 * MiB
    stall_timeout: float = 60.0
    stall_warning: float = 10.0
    start_timeout: float = 120.0
    timeline: str = ""
    verify_every: int = 0
    verbose: bool = False
    log_all_ranks: bool = False

    def __post_init__(self):
        for name in (
            "fusion_threshold",
            "verify_every",
            "stall_timeout",
            "stall_warning",
            "start_timeout",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0; got {getattr(self, name)}.")
        if self.chunk_bytes < 1024:
            raise ConfigError(f"chunk_bytes must be at least 1024; got {self.chunk_bytes}.")


# Environment variable -> (Config field, parser).
def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


ENV_VARS: dict[str, tuple[str, type]] = {
    "SYNCDP_FUSION_THRESHOLD": ("fusion_threshold", int),
    "SYNCDP_CHUNK_BYTES": ("chunk_bytes", int),
    "SYNCDP_STALL_TIMEOUT": ("stall_timeout", float),
    "SYNCDP_STALL_WARNING": ("stall_warning", float),
    "SYNCDP_START_TIMEOUT": ("start_timeout", float),
    "SYNCDP_TIMELINE": ("timeline", str),
    "SYNCDP_VERIFY_EVERY": ("verify_every", int),
    "SYNCDP_VERBOSE": ("verbose", _bool),
    "SYNCDP_LOG_ALL_RANKS": ("log_all_ranks", _bool),
}

# Variables the launcher sets for its own per-rank wrapper; not settings of the library.
_LAUNCHER_VARS = {"SYNCDP_LAUNCHER"}


def from_env(environ: Mapping[str, str] | None = None, **overrides) -> Config:
    """Reads a Config from ``SYNCDP_*`` variables; keyword arguments win.

    Args:
        environ: The environment to read. Defaults to ``os.environ``.
        **overrides: Config fields to set regardless of the environment.

    Returns:
        The frozen Config.

    Raises:
        ConfigError: A ``SYNCDP_*`` variable is unknown or cannot be parsed, or an override
            names no Config field.
    """
    environ = os.environ if environ is None else environ
    values = {}
    for key, text in environ.items():
        if not key.startswith("SYNCDP_") or key in _LAUNCHER_VARS:
            continue
        if key not in ENV_VARS:
            known = ", ".join(sorted(ENV_VARS))
            raise ConfigError(f"Unknown environment variable {key}; syncdp knows {known}.")
        field, parse = ENV_VARS[key]
        try:
            values[field] = parse(text)
        except ValueError as e:
            raise ConfigError(f"{key}={text!r} is not a valid {parse.__name__}: {e}") from None
    fields = {f.name for f in dataclasses.fields(Config)}
    for key, value in overrides.items():
        if key not in fields:
            raise ConfigError(f"Unknown syncdp option {key!r}; options are {sorted(fields)}.")
        if value is not None:
            values[key] = value
    return Config(**values)
