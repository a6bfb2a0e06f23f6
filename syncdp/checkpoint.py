"""Checkpoints written by rank 0 and restored on every rank, for exact resume.

Rank 0, the chief, is the only rank that touches the checkpoint directory. ``save(step)``
writes ``DIRECTORY/ckpt-00000020/`` atomically: a TensorFlow checkpoint (``tf.train.Checkpoint``
of the trackables, so Keras models, optimizers with their slots, ``tf.Module`` objects and
variables all work) plus a manifest, ``syncdp-checkpoint.json``, that records the step and the
size and SHA-256 of every file. The files go to a temporary directory first, are flushed to
disk (fsync), and the directory is renamed into place only when complete; ``restore`` considers
only directories whose manifest and files check out. A crash at any moment of a save
therefore leaves either the new checkpoint or none, never a half-written one that would be
restored.

``restore()`` reads the newest good checkpoint on rank 0 and broadcasts the state, so every
rank resumes identical without access to the directory; with no checkpoint it broadcasts rank
0's current state, which makes it the one call a training script needs at its start.

What ``restore()`` does with a newest checkpoint it cannot use depends on why:

- Its content is wrong (a file missing, of the wrong size or not matching its SHA-256, a
  manifest that is not JSON): the checkpoint is damaged for good, so it is skipped, with a
  warning, for the one before.
- The operating system refuses to read it (``EIO``, ``EACCES``, a directory where a file should
  be, ...): that says nothing about the checkpoint, and may pass, so ``restore()`` raises
  :class:`~syncdp.core.errors.CheckpointError` on every rank, naming the file and the cause.
  Falling back would resume from older state without anyone noticing, and the saves that
  follow would overwrite the newer checkpoint.

The manager holds any trackables that ``tf.train.Checkpoint`` takes and imports no Keras:
models, layers and optimizers are recognized by what they expose (``built``, ``build``,
``apply_gradients``, ``trainable_variables``), so this layer stays below :mod:`syncdp.keras`.

Layout of a checkpoint directory::

    DIRECTORY/ckpt-00000020/ckpt.index
    DIRECTORY/ckpt-00000020/ckpt.data-00000-of-00001
    DIRECTORY/ckpt-00000020/syncdp-checkpoint.json
    DIRECTORY/.ckpt-00000030.tmp-...   a save in progress (or one that crashed): never read

Example:
    >>> manager = CheckpointManager("/ckpt", model=model, optimizer=optimizer)
    >>> start = manager.restore()
    >>> for step in range(start, steps):
    ...     train_step(step)
    ...     if (step + 1) % 10 == 0:
    ...         manager.save(step + 1)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import sys
import time

import tensorflow as tf

from syncdp.core import runtime
from syncdp.core.errors import CheckpointError
from syncdp.tensorflow import collectives as ops
from syncdp.tensorflow import verify

__all__ = ["CheckpointManager", "list_checkpoints"]

MANIFEST = "syncdp-checkpoint.json"
_PREFIX = "ckpt"
_FORMAT = 1
_NAME = re.compile(r"^ckpt-(\d+)$")
# Rank 0 may spend a while on the disk while the other ranks wait in the save/restore
# collective: they wait at least this long (or forever with the stall timeout off).
_IO_TIMEOUT_SECONDS = 600.0


def _sha256(file) -> str:
    """The SHA-256 of a path's content, or of an open binary file's from where it stands."""
    if isinstance(file, str | os.PathLike):
        with open(file, "rb") as f:
            return _sha256(f)
    h = hashlib.sha256()
    for block in iter(lambda: file.read(1 << 20), b""):
        h.update(block)
    return h.hexdigest()


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _check(path: str) -> dict:
    """Returns the manifest of the checkpoint at ``path``.

    Raises:
        CheckpointError: The checkpoint's content is wrong (missing file, wrong size, SHA-256
            mismatch, unparsable manifest): skip it.
        OSError: The operating system refused to read a file (``filename`` names it): the
            checkpoint may be fine, so the caller must not skip it.
    """
    manifest_path = os.path.join(path, MANIFEST)
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
    except FileNotFoundError as e:
        raise CheckpointError(f"{path} has no {MANIFEST} ({e}).") from None
    except ValueError as e:
        raise CheckpointError(f"{path} has no readable {MANIFEST} ({e}).") from None
    except OSError as e:
        raise _with_filename(e, manifest_path) from None
    for name, meta in manifest.get("files", {}).items():
        file = os.path.join(path, name)
        # open() before any size check, so a directory in a file's place is a refused read
        # (EISDIR), not a "wrong size" that would be skipped as damage.
        try:
            with open(file, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                digest = _sha256(f) if size == meta["bytes"] else None
        except FileNotFoundError:
            raise CheckpointError(f"{file} is missing.") from None
        except OSError as e:
            raise _with_filename(e, file) from None
        if size != meta["bytes"]:
            raise CheckpointError(f"{file} has {size} bytes, not the {meta['bytes']} expected.")
        if digest != meta["sha256"]:
            raise CheckpointError(f"{file} does not match its SHA-256 in {MANIFEST}.")
    return manifest


def _with_filename(error: OSError, file: str) -> OSError:
    # read() errors carry no file name; the message to the user must name the file.
    if error.filename is None:
        error.filename = file
    return error


def list_checkpoints(directory: str | os.PathLike) -> list[tuple[int, str]]:
    """The complete checkpoints in ``directory`` as ``(step, path)``, oldest first.

    Only renamed-into-place directories count; temporary ones from a save in progress or a
    crashed save are ignored. Files are not checksummed here (``restore`` does).

    Args:
        directory: The CheckpointManager's directory. A missing one has no checkpoints.
    """
    directory = os.fspath(directory)
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        match = _NAME.match(name)
        path = os.path.join(directory, name)
        if match and os.path.isfile(os.path.join(path, MANIFEST)):
            found.append((int(match.group(1)), path))
    return sorted(found)


def _is_optimizer(obj) -> bool:
    # A Keras optimizer (DistributedOptimizer included) applies gradients and creates its slot
    # variables in build(var_list); duck-typed so this layer does not import Keras.
    return callable(getattr(obj, "apply_gradients", None)) and callable(getattr(obj, "build", None))


def _is_model(obj) -> bool:
    # A Keras model or layer: it has weights once ``built``. A tf.Module has no ``built``.
    return not _is_optimizer(obj) and hasattr(obj, "built") and hasattr(obj, "trainable_variables")


def _is_variable(obj) -> bool:
    # tf.Variable, or a Keras 3 variable (a tf Tensor with assign(), not a tf.Variable).
    return isinstance(obj, tf.Variable) or (
        not hasattr(obj, "variables")
        and callable(getattr(obj, "assign", None))
        and hasattr(obj, "shape")
        and hasattr(obj, "dtype")
    )


def _variables_of(name: str, obj) -> list:
    if _is_variable(obj):
        return [obj]
    variables = getattr(obj, "variables", None)
    if variables is None:
        raise CheckpointError(
            f"CheckpointManager needs trackables that hold variables (a Keras model or "
            f"optimizer, a tf.Module, a tf.Variable); got {name}={type(obj).__name__}. Pass "
            "the objects whose state must be saved and kept identical on every rank."
        )
    return list(variables)


def _io_timeout() -> float:
    stall = runtime.get_config().stall_timeout
    return 0.0 if not stall else max(stall, _IO_TIMEOUT_SECONDS)


class CheckpointManager:
    """Saves on rank 0 and restores on every rank, for exact resume after a failure.

    Args:
        directory: Where rank 0 keeps the checkpoints. Other ranks never touch it.
        max_to_keep: How many of the newest checkpoints to keep; older ones are deleted after
            each save. None keeps all. Defaults to 3.
        **trackables: The objects to save, by name, e.g. ``model=model, optimizer=optimizer``.
            Keras models must be built. An optimizer's slots are created (``build``) from the
            models' trainable variables if it has none yet, so they are saved and restored too.

    Raises:
        CheckpointError: No trackables, or one that holds no variables.

    Example:
        >>> manager = syncdp.checkpoint.CheckpointManager(
        ...     "/ckpt", model=model, optimizer=optimizer)
        >>> step = manager.restore()  # 0 on the first run
        >>> manager.save(step + 10)
    """

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = 3, **trackables):
        if not trackables:
            raise CheckpointError(
                "CheckpointManager needs the objects to save; got none. Pass them by name, "
                "e.g. CheckpointManager(directory, model=model, optimizer=optimizer)."
            )
        if max_to_keep is not None and max_to_keep < 1:
            raise CheckpointError(f"max_to_keep must be at least 1 or None; got {max_to_keep}.")
        self.directory = os.path.abspath(os.fspath(directory))
        self.max_to_keep = max_to_keep
        self.trackables = dict(trackables)
        self.metadata: dict = {}
        self._checkpoint = tf.train.Checkpoint(**self.trackables)

    def _variables(self) -> list:
        """Every variable to keep identical, in the same order on every rank."""
        models = [t for t in self.trackables.values() if _is_model(t)]
        for name, obj in self.trackables.items():
            if _is_model(obj) and not obj.built:
                raise CheckpointError(
                    f"CheckpointManager needs built models; {name} has no variables yet. Build "
                    "it first (call it on a batch, or model.build(input_shape))."
                )
            if _is_optimizer(obj) and not getattr(obj, "built", True):
                if not models:
                    raise CheckpointError(
                        f"The optimizer {name} has no slot variables yet, and there is no Keras "
                        "model among the trackables to create them from. Call "
                        f"{name}.build(model.trainable_variables) before the CheckpointManager."
                    )
                obj.build([v for m in models for v in m.trainable_variables])
        seen, variables = set(), []
        for name, obj in self.trackables.items():
            for v in _variables_of(name, obj):
                if id(v) not in seen:
                    seen.add(id(v))
                    variables.append(v)
        return variables

    def restore(self) -> int:
        """Makes every rank hold the newest checkpoint's state, or rank 0's current state.

        A synchronization point: all ranks must call it. Rank 0 reads the newest complete
        checkpoint (skipping, with a warning, any whose files do not match their manifest; one
        whose files the system refuses to read is an error, see the module docstring) and
        broadcasts every variable, optimizer slots included; with no checkpoint it broadcasts
        its current state, so this also replaces the initial ``broadcast_variables``. Call it
        eagerly, after the model is built and before training.

        Returns:
            The step the checkpoint was saved at, or 0 when there is none. The checkpoint's
            metadata (``save(step, metadata=...)``) is in ``self.metadata`` afterwards.

        Raises:
            CheckpointError: Rank 0 could not read a file of the newest checkpoint (the
                message names it and the cause), the checkpoint does not match the trackables,
                or the ranks' variables differ in number, shape or dtype. Raised on every rank.
        """
        if not tf.executing_eagerly():
            raise CheckpointError(
                "CheckpointManager.restore() must run eagerly, not inside "
                "tf.function; call it before the training loop."
            )
        comm = runtime.communicator()
        variables = self._variables()
        signature = [
            (verify.variable_name(v, i), tuple(v.shape), str(v.dtype))
            for i, v in enumerate(variables)
        ]
        outcome = None
        if comm.rank == 0:
            outcome = self._read_newest()
        everyone = comm.allgather_object(
            (signature, outcome), name="checkpoint.restore", timeout=_io_timeout()
        )
        step, metadata, error = everyone[0][1]
        if error:
            raise CheckpointError(error)
        different = [r for r, (sig, _) in enumerate(everyone) if sig != everyone[0][0]]
        if different:
            raise CheckpointError(
                "Every rank must restore the same variables (names, shapes, dtypes) as rank 0; "
                f"ranks {different} have different ones. Build the same model and optimizer on "
                "every rank before restore()."
            )
        ops.broadcast_variables(variables, root_rank=0)
        self.metadata = metadata
        return step

    def _read_newest(self) -> tuple[int, dict, str | None]:
        """On rank 0: loads the newest good checkpoint; returns (step, metadata, error).

        Every failure comes back as ``error`` rather than raised, so rank 0 still reaches the
        collective that tells the other ranks; raising here would leave them waiting.
        """
        try:
            return self._load_newest()
        except OSError as e:
            file = e.filename or self.directory
            return 0, {}, self._unreadable(file, e.strerror or str(e))

    def _load_newest(self) -> tuple[int, dict, str | None]:
        self._remove_stale_temporaries()
        for step, path in reversed(list_checkpoints(self.directory)):
            try:
                manifest = _check(path)
            except CheckpointError as e:
                print(
                    f"syncdp: warning: skipping checkpoint {path}: {e}", file=sys.stderr, flush=True
                )
                continue
            try:
                status = self._checkpoint.read(os.path.join(path, _PREFIX))
                status.assert_existing_objects_matched()
                del status
            except (AssertionError, ValueError, tf.errors.InvalidArgumentError) as e:
                return (
                    0,
                    {},
                    (
                        f"The checkpoint {path} does not match the objects given to "
                        f"CheckpointManager ({', '.join(self.trackables)}): {e}. Restore with the "
                        "same model and optimizer it was saved from, or use another directory."
                    ),
                )
            except tf.errors.OpError as e:
                # TensorFlow's own read failed after the checksums passed: an I/O failure
                # (TF reports the file in its message), not a mismatch.
                return 0, {}, self._unreadable(os.path.join(path, _PREFIX), e.message)
            return int(manifest.get("step", step)), dict(manifest.get("metadata", {})), None
        return 0, {}, None

    def _unreadable(self, file: str, cause: str) -> str:
        return (
            f"Rank 0 could not read {file} to restore from {self.directory}: {cause}. "
            "restore() does not fall back to an older checkpoint when a file cannot be read "
            "(only when one is damaged), since it may be readable again. Make it readable (check "
            "the disk, the mount and the permissions), or move its checkpoint directory out of "
            f"{self.directory} to resume from the one before."
        )

    def save(self, step: int, *, metadata: dict | None = None) -> str | None:
        """Writes a checkpoint of the current state on rank 0, atomically.

        A synchronization point: all ranks must call it, at the same step. Rank 0 writes only
        once every rank has arrived, and the others wait until it has finished, so a failed
        write raises everywhere. Call it eagerly.

        Args:
            step: The training step the state belongs to (usually the number of updates done),
                returned by ``restore()`` later. Saving a step again replaces it.
            metadata: A small JSON-serializable dict stored with the checkpoint and available
                as ``self.metadata`` after ``restore()``. Defaults to None.

        Returns:
            The checkpoint's path on rank 0, None on the other ranks.

        Raises:
            CheckpointError: Rank 0 could not write the checkpoint (raised on every rank).
        """
        if not tf.executing_eagerly():
            raise CheckpointError(
                "CheckpointManager.save() must run eagerly, not inside tf.function."
            )
        step = int(step)
        if step < 0:
            raise CheckpointError(f"save(step) needs a step >= 0; got {step}.")
        comm = runtime.communicator()
        self._variables()  # creates the optimizer's slots, so they are in every checkpoint
        # A checkpoint of step N exists only once every rank has reached step N.
        comm.barrier(name="checkpoint.save.begin")
        outcome = (None, None)
        if comm.rank == 0:
            try:
                outcome = (self._write(step, metadata or {}), None)
            except (OSError, TypeError, ValueError, tf.errors.OpError) as e:
                outcome = (
                    None,
                    f"Rank 0 could not write the checkpoint of step {step} to "
                    f"{self.directory}: {e}. Check the disk space and permissions.",
                )
        path, error = comm.allgather_object(
            outcome if comm.rank == 0 else None, name="checkpoint.save.end", timeout=_io_timeout()
        )[0]
        if error:
            raise CheckpointError(error)
        return path if comm.rank == 0 else None

    def _write(self, step: int, metadata: dict) -> str:
        os.makedirs(self.directory, exist_ok=True)
        final = os.path.join(self.directory, f"{_PREFIX}-{step:08d}")
        temp = os.path.join(
            self.directory, f".{_PREFIX}-{step:08d}.tmp-{os.getpid()}-{time.time_ns()}"
        )
        os.makedirs(temp)
        try:
            self._checkpoint.write(os.path.join(temp, _PREFIX))
            files = {}
            for name in sorted(os.listdir(temp)):
                file = os.path.join(temp, name)
                _fsync(file)
                files[name] = {"bytes": os.path.getsize(file), "sha256": _sha256(file)}
            manifest = {
                "format": _FORMAT,
                "step": step,
                "metadata": metadata,
                "files": files,
                "time": time.time(),
            }
            with open(os.path.join(temp, MANIFEST), "w") as f:
                json.dump(manifest, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            _fsync(temp)
            if os.path.exists(final):  # saving a step again: move the old one out of view
                os.rename(final, temp + ".old")
            os.rename(temp, final)
            _fsync(self.directory)
        except BaseException:
            shutil.rmtree(temp, ignore_errors=True)
            raise
        shutil.rmtree(temp + ".old", ignore_errors=True)
        self._prune()
        return final

    def _prune(self) -> None:
        if self.max_to_keep is None:
            return
        for _, path in list_checkpoints(self.directory)[: -self.max_to_keep]:
            # Renamed out of view first, so a crash mid-delete leaves nothing restorable.
            doomed = os.path.join(self.directory, f".{os.path.basename(path)}.deleted")
            with contextlib.suppress(OSError):
                os.rename(path, doomed)
                shutil.rmtree(doomed, ignore_errors=True)

    def _remove_stale_temporaries(self) -> None:
        """Deletes what crashed saves left behind (rank 0 only, before a restore)."""
        with contextlib.suppress(FileNotFoundError):
            for name in os.listdir(self.directory):
                if name.startswith(f".{_PREFIX}-") and (
                    ".tmp-" in name or name.endswith(".deleted")
                ):
                    shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
