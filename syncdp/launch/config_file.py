"""horovodrun's ``--config-file``: Horovod's YAML layout, read as the flags its keys stand for.

The layout is horovodrun 0.28's; every section and key is optional::

    controller: mpi                    # --mpi (gloo: --gloo, which runs on MPI too)
    params:
      fusion_threshold_mb: 32          # --fusion-threshold-mb
      cycle_time_ms: 5                 # --cycle-time-ms (changes nothing)
      cache_capacity: 1024             # --cache-capacity (changes nothing)
      hierarchical_allreduce: true     # --hierarchical-allreduce / --no-hierarchical-allreduce
      hierarchical_allgather: false    # (changes nothing)
    autotune:
      enabled: false                   # --autotune / --no-autotune
      log_file: autotune.csv           # --autotune-log-file
      warmup_samples: 3                # --autotune-warmup-samples
      steps_per_sample: 10             # --autotune-steps-per-sample
      bayes_opt_max_samples: 20        # --autotune-bayes-opt-max-samples
      gaussian_process_noise: 0.8      # (changes nothing)
    timeline:
      filename: timeline.json          # --timeline-filename
      mark_cycles: false               # (changes nothing)
    stall_check:
      enabled: true                    # false: --no-stall-check
      warning_time_seconds: 60         # --stall-check-warning-time-seconds
      shutdown_time_seconds: 120       # --stall-check-shutdown-time-seconds
    library_options:                   # (change nothing)
      mpi_threads_disable: false
      num_nccl_streams: 1
      thread_affinity: 0
      gloo_timeout_seconds: 30
    logging:
      level: WARNING                   # --log-level
      with_timestamp: true             # (changes nothing)

``syncdp-run`` also takes ``hierarchical_allreduce: auto`` (or ``on``, ``off``). :func:`read`
turns the file into those flags, key by key; the launcher parses them with its own parser, so
each value is checked as its flag's is, and applies each where the command line did not set the
same thing: flags on the command line win. A key horovodrun does not read (older Horovod
versions wrote some: ``cycles_per_sample``, ``mlsl_bgt_affinity``) is reported and ignored, as
horovodrun ignores it.
"""

from __future__ import annotations

import argparse
import dataclasses

import yaml

__all__ = ["ConfigFileError", "Contents", "KEYS", "read", "apply"]

# Key -> the flag its value is given to, or (flag when true, flag when false) for a switch.
KEYS: dict[str, str | tuple[str, str]] = {
    "params.fusion_threshold_mb": "--fusion-threshold-mb",
    "params.cycle_time_ms": "--cycle-time-ms",
    "params.cache_capacity": "--cache-capacity",
    "params.hierarchical_allreduce": ("--hierarchical-allreduce=on", "--no-hierarchical-allreduce"),
    "params.hierarchical_allgather": ("--hierarchical-allgather", "--no-hierarchical-allgather"),
    "autotune.enabled": ("--autotune", "--no-autotune"),
    "autotune.log_file": "--autotune-log-file",
    "autotune.warmup_samples": "--autotune-warmup-samples",
    "autotune.steps_per_sample": "--autotune-steps-per-sample",
    "autotune.bayes_opt_max_samples": "--autotune-bayes-opt-max-samples",
    "autotune.gaussian_process_noise": "--autotune-gaussian-process-noise",
    "timeline.filename": "--timeline-filename",
    "timeline.mark_cycles": ("--timeline-mark-cycles", "--no-timeline-mark-cycles"),
    "stall_check.enabled": ("--stall-check", "--no-stall-check"),
    "stall_check.warning_time_seconds": "--stall-check-warning-time-seconds",
    "stall_check.shutdown_time_seconds": "--stall-check-shutdown-time-seconds",
    "library_options.mpi_threads_disable": ("--mpi-threads-disable", "--no-mpi-threads-disable"),
    "library_options.num_nccl_streams": "--num-nccl-streams",
    "library_options.thread_affinity": "--thread-affinity",
    "library_options.gloo_timeout_seconds": "--gloo-timeout-seconds",
    "logging.level": "--log-level",
    "logging.with_timestamp": ("--log-with-timestamp", "--log-without-timestamp"),
}
_CONTROLLERS = {"mpi": "--mpi", "gloo": "--gloo"}
_SECTIONS = {key.split(".")[0] for key in KEYS}


class ConfigFileError(ValueError):
    """The config file cannot be read, or a key's value is not one its flag takes (named)."""


@dataclasses.dataclass(frozen=True)
class Contents:
    """What a config file says.

    Attributes:
        flags: (key, the flag arguments it stands for), in the file's order.
        ignored: The keys horovodrun does not read, dotted (``autotune.cycles_per_sample``).
    """

    flags: tuple[tuple[str, tuple[str, ...]], ...]
    ignored: tuple[str, ...]


def _tokens(key: str, value) -> tuple[str, ...]:
    """The flag arguments one key's value stands for."""
    if key == "controller":
        flag = _CONTROLLERS.get(str(value).lower())
        if flag is None:
            raise ConfigFileError(f"controller must be mpi or gloo; got {value!r}")
        return (flag,)
    flag = KEYS[key]
    if isinstance(value, dict | list):
        raise ConfigFileError(f"{key} must be a single value; got {value!r}")
    if isinstance(flag, str):
        return (flag, str(value))
    if isinstance(value, bool):
        return (flag[0] if value else flag[1],)
    if "=" in flag[0]:  # a switch that also takes a word: hierarchical_allreduce: auto
        return (f"{flag[0].split('=')[0]}={value}",)
    raise ConfigFileError(f"{key} must be true or false; got {value!r}")


def read(path: str) -> Contents:
    """Reads a horovodrun config file.

    Args:
        path: The YAML file.

    Returns:
        Its :class:`Contents`. A key with no value (``level:``) is left out, as horovodrun
        leaves it out.

    Raises:
        ConfigFileError: The file cannot be read or parsed, is not a mapping of sections, or a
            value cannot stand for its flag (named by its key).
    """
    try:
        with open(path, "rb") as f:
            raw = f.read()
        data = yaml.safe_load(raw.decode("utf-8-sig"))
    except OSError as e:
        raise ConfigFileError(f"cannot be read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        column = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise ConfigFileError(
            f"is not UTF-8 text: byte 0x{raw[e.start]:02x} at line {line}, column {column}; "
            "save it as UTF-8"
        ) from None
    except yaml.YAMLError as e:
        raise ConfigFileError(f"is not YAML: {' '.join(str(e).split())}") from None
    if data is None:
        return Contents((), ())
    if not isinstance(data, dict):
        raise ConfigFileError(f"must hold sections such as params: and stall_check:; got {data!r}")
    flags, ignored = [], []
    for section, body in data.items():
        if section == "controller":
            if body is not None:
                flags.append(("controller", _tokens("controller", body)))
            continue
        if section not in _SECTIONS:
            ignored.append(str(section))
            continue
        if body is None:
            continue
        if not isinstance(body, dict):
            raise ConfigFileError(f"{section} must be a mapping of keys; got {body!r}")
        for name, value in body.items():
            key = f"{section}.{name}"
            if key not in KEYS:
                ignored.append(key)
            elif value is not None:
                flags.append((key, _tokens(key, value)))
    return Contents(tuple(flags), tuple(ignored))


def apply(
    path: str,
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    spelled: dict[str, str],
) -> list[str]:
    """Sets on ``args`` what the file at ``path`` says, wherever the command line did not.

    Args:
        path: The config file.
        parser: The launcher's parser (:func:`syncdp.launch.run.build_parser`): each key's flag
            arguments are parsed by it, so a value is checked as its flag's is.
        args: The command line, parsed.
        spelled: dest -> how the command line spelled it
            (:func:`syncdp.launch.horovodrun_flags.scan`); the places the file sets are added,
            as ``"KEY in PATH"``.

    Returns:
        A line for each key of the file that horovodrun does not read.

    Raises:
        ConfigFileError: The file cannot be read, or a key's value is not one its flag takes
            (the message names the file and the key).
    """
    try:
        contents = read(path)
    except ConfigFileError as e:
        raise ConfigFileError(f"--config-file {path} {e}") from None
    on_command_line = set(spelled)
    defaults = vars(parser.parse_args([]))
    parser.exit_on_error = False  # so that a bad value can be named by its key
    try:
        for key, tokens in contents.flags:
            try:
                values = vars(parser.parse_args(list(tokens)))
            except argparse.ArgumentError as e:
                raise ConfigFileError(f"--config-file {path}: {key}: {e}") from None
            for dest, value in values.items():
                if value != defaults[dest] and dest not in on_command_line:
                    setattr(args, dest, value)
                    spelled[dest] = f"{key} in {path}"
    finally:
        parser.exit_on_error = True
    return [f"{path}: {key} is not a key horovodrun reads; ignored" for key in contents.ignored]
