"""Checkpoints written by rank 0 and restored on every rank, for exact resume.

Rank 0, the chief, is the only rank that touches the checkpoint directory. ``save(step)``
writes ``DIRECTORY/ckpt-00000020/`` atomically: a TensorFlow checkpoint (``tf.train.Checkpoint``
of the trackables, so Keras models, optimizers with their slots, ``tf.Module`` objects and
variables all work) plus a manifest, ``syncdp-checkpoint.json``, that records the step and the
size and SHA-256 of every file. The files go to a temporary directory first, are flushed to
disk (fsync), and the directory is renamed into place only when complete, so every
``ckpt-NNNNNNNN`` directory was complete once. A crash at any moment of a save therefore leaves
either the new checkpoint or none, never a half-written one that would be restored; saving a
step again replaces its checkpoint, and a crash in the middle of that keeps the old one.

``restore()`` reads the newest intact checkpoint on rank 0 and broadcasts the state, so every
rank resumes identical without access to the directory; with no checkpoint it broadcasts rank
0's current state, which makes it the one call a training script needs at its start.

What ``restore()`` does with a checkpoint it cannot use depends on why:

- Its content is wrong (a file missing, of the wrong size or not matching its SHA-256; the
  manifest missing, not JSON or incomplete): the checkpoint is damaged for good. ``restore()``
  resumes from the newest intact one, and rank 0 moves each damaged one newer than that aside,
  to ``ckpt-00000030.damaged``: kept for inspection, never restored, never deleted and never
  counted against ``max_to_keep``. Every rank prints a warning naming it and its damage.
- Every checkpoint is damaged: ``restore()`` raises
  :class:`~syncdp.core.errors.CheckpointError` on every rank, naming each and its damage, and
  moves nothing. Starting again from step 0 would lose their progress without anyone noticing,
  so it happens only when asked for: ``restore(allow_fresh=True)``.
- The operating system refuses to read it (``EIO``, ``EACCES``, a directory where a file should
  be, ...): that says nothing about the checkpoint, and may pass, so ``restore()`` raises
  :class:`~syncdp.core.errors.CheckpointError` on every rank, naming the file and the cause.
  Falling back would resume from older state without anyone noticing, and the saves that
  follow would overwrite the newer checkpoint.

After each save rank 0 keeps the ``max_to_keep`` newest intact checkpoints and deletes the
older ones unread. It never deletes the one just written (kept too when ``max_to_keep`` newer ones
exist) nor the newest intact one; a damaged checkpoint it meets while counting is moved aside
like in ``restore()``, so it never takes the place of an intact one.

The manager holds any trackables that ``tf.train.Checkpoint`` takes and imports no Keras:
models, layers and optimizers are recognized by what they expose (``built``, ``build``,
``apply_gradients``, ``trainable_variables``), so this layer stays below :mod:`syncdp.keras`.

Layout of a checkpoint directory::

    DIRECTORY/ckpt-00000020/ckpt.index
    DIRECTORY/ckpt-00000020/ckpt.data-00000-of-00001
    DIRECTORY/ckpt-00000020/syncdp-checkpoint.json
    DIRECTORY/ckpt-00000030.damaged/      a damaged checkpoint moved aside: never read
    DIRECTORY/.ckpt-00000040.tmp-...      a save in progress (or one that crashed): never read
    DIRECTORY/.ckpt-00000020.replaced-... step 20's old checkpoint while a new one replaces it

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
from typing import NamedTuple

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
_DAMAGED = ".damaged"  # never matches _NAME, so a checkpoint moved aside is never listed
_REPLACED = ".replaced-"
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
        CheckpointError: The checkpoint is damaged (a missing file, a wrong size, a SHA-256
            mismatch, a missing or unparsable manifest); the message names the file.
        OSError: The operating system refused to read a file (``filename`` names it): the
            checkpoint may be fine, so the caller must not treat it as damaged.
    """
    manifest_path = os.path.join(path, MANIFEST)
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path} has no {MANIFEST}.") from None
    except ValueError as e:
        raise CheckpointError(f"{manifest_path} is not readable JSON ({e}).") from None
    except OSError as e:
        raise _with_filename(e, manifest_path) from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if (
        not isinstance(files, dict)
        or f"{_PREFIX}.index" not in files
        or not all(isinstance(m, dict) and {"bytes", "sha256"} <= m.keys() for m in files.values())
        or not isinstance(manifest.get("metadata", {}), dict)
    ):
        raise CheckpointError(f"{manifest_path} does not list the checkpoint's files.")
    for name, meta in files.items():
        file = os.path.join(path, name)
        # open() before any size check, so a directory in a file's place is a refused read
        # (EISDIR), not a "wrong size" that would be taken for damage.
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


def _signature(path: str) -> tuple | None:
    """What a checkpoint's files look like on disk (names, sizes, inodes, mtimes), or None.

    Equal signatures mean no file was replaced, resized or written since: a checkpoint once
    verified need not be hashed again.
    """
    try:
        entries = sorted(os.scandir(path), key=lambda e: e.name)
        return tuple((e.name, *_stat_key(e.stat(follow_symlinks=False))) for e in entries)
    except OSError:
        return None


def _stat_key(st: os.stat_result) -> tuple:
    return st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns


def list_checkpoints(directory: str | os.PathLike) -> list[tuple[int, str]]:
    """The checkpoints in ``directory`` as ``(step, path)``, oldest first.

    Every ``ckpt-NNNNNNNN`` directory counts: saves rename them into place only when
    complete, so one whose manifest is missing now is a damaged checkpoint, not an unfinished
    one. Temporary directories of a save in progress or a crashed one are ignored, and so are
    damaged checkpoints moved aside (``ckpt-NNNNNNNN.damaged``). Files are not checked here
    (``restore`` does).

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
        if match and os.path.isdir(path):
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


class _Outcome(NamedTuple):
    """What rank 0 found in ``restore()``, sent to every rank."""

    step: int
    metadata: dict
    error: str | None = None
    warnings: tuple[str, ...] = ()  # printed by every rank


class CheckpointManager:
    """Saves on rank 0 and restores on every rank, for exact resume after a failure.

    Args:
        directory: Where rank 0 keeps the checkpoints. Other ranks never touch it.
        max_to_keep: How many intact checkpoints to keep; the oldest are deleted after each
            save, but never the one just written nor the newest intact one, and damaged ones
            are moved aside instead of counted (see the module docstring). None keeps all.
            Defaults to 3.
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
        # Rank 0: the checkpoints known intact (written or verified here), by path, with their
        # _signature then; pruning hashes only the others.
        self._intact: dict[str, tuple] = {}

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

    def restore(self, *, allow_fresh: bool = False) -> int:
        """Makes every rank hold the newest intact checkpoint's state, or rank 0's current state.

        A synchronization point: all ranks must call it. Rank 0 reads the newest intact
        checkpoint and broadcasts every variable, optimizer slots included; with no checkpoint
        it broadcasts its current state, so this also replaces the initial
        ``broadcast_variables``. Damaged checkpoints newer than the one restored are moved
        aside by rank 0 and reported by a warning on every rank. Call it eagerly, after the
        model is built and before training.

        Args:
            allow_fresh: When checkpoints exist but every one is damaged, move them aside and
                start from step 0 with rank 0's current state, instead of raising. Defaults to
                False.

        Returns:
            The step the checkpoint was saved at, or 0 when there is none. The checkpoint's
            metadata (``save(step, metadata=...)``) is in ``self.metadata`` afterwards.

        Raises:
            CheckpointError: Every checkpoint is damaged (and ``allow_fresh`` is False), rank 0
                could not read a file of one (the message names it and the cause), the
                checkpoint does not match the trackables, or the ranks' variables differ in
                number, shape or dtype. Raised on every rank.

        Example:
            >>> start = manager.restore()  # rank 0's state at step 0 in an empty directory
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
            outcome = self._read_newest(allow_fresh=allow_fresh)
        everyone = comm.allgather_object(
            (signature, outcome), name="checkpoint.restore", timeout=_io_timeout()
        )
        step, metadata, error, warnings = everyone[0][1]
        _warn(warnings)
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

    def _read_newest(self, *, allow_fresh: bool = False) -> _Outcome:
        """On rank 0: loads the newest intact checkpoint.

        Every failure comes back as ``error`` rather than raised, so rank 0 still reaches the
        collective that tells the other ranks; raising here would leave them waiting.
        """
        try:
            return self._load_newest(allow_fresh)
        except OSError as e:
            file = e.filename or self.directory
            return _Outcome(0, {}, self._unreadable(file, e.strerror or str(e)))

    def _load_newest(self, allow_fresh: bool) -> _Outcome:
        self._recover_interrupted_saves()
        damaged = []  # (path, what is wrong), newest first
        for step, path in reversed(list_checkpoints(self.directory)):
            try:
                manifest = _check(path)
            except CheckpointError as e:
                damaged.append((path, str(e)))
                continue
            error = self._read(path)
            if error:
                return _Outcome(0, {}, error)
            self._intact[path] = _signature(path)
            # Moved aside only now that an older one is restored: when none is, they stay.
            warnings = self._move_aside(damaged)
            step = int(manifest.get("step", step))
            return _Outcome(step, dict(manifest.get("metadata", {})), None, warnings)
        if damaged and not allow_fresh:
            return _Outcome(0, {}, self._none_intact(damaged))
        if damaged:
            fresh = (
                f"syncdp: warning: no intact checkpoint in {self.directory}; starting from step "
                "0 with rank 0's current state, as restore(allow_fresh=True) asks."
            )
            return _Outcome(0, {}, None, (*self._move_aside(damaged), fresh))
        return _Outcome(0, {})

    def _read(self, path: str) -> str | None:
        """Loads the (verified) checkpoint at ``path`` into the trackables; returns an error."""
        try:
            status = self._checkpoint.read(os.path.join(path, _PREFIX))
            status.assert_existing_objects_matched()
            del status
        except (AssertionError, ValueError, tf.errors.InvalidArgumentError) as e:
            return (
                f"The checkpoint {path} does not match the objects given to "
                f"CheckpointManager ({', '.join(self.trackables)}): {e}. Restore with the "
                "same model and optimizer it was saved from, or use another directory."
            )
        except tf.errors.OpError as e:
            # TensorFlow's own read failed after the checksums passed: an I/O failure
            # (TF reports the file in its message), not a mismatch.
            return self._unreadable(os.path.join(path, _PREFIX), e.message)
        return None

    def _unreadable(self, file: str, cause: str) -> str:
        return (
            f"Rank 0 could not read {file} to restore from {self.directory}: {cause}. "
            "restore() does not fall back to an older checkpoint when a file cannot be read "
            "(only when one is damaged), since it may be readable again. Make it readable (check "
            "the disk, the mount and the permissions), or move its checkpoint directory out of "
            f"{self.directory} to resume from the one before."
        )

    def _none_intact(self, damaged: list[tuple[str, str]]) -> str:
        names = ", ".join(os.path.basename(path) for path, _ in reversed(damaged))
        which = (
            f"the only checkpoint ({names})"
            if len(damaged) == 1
            else f"each of the {len(damaged)} checkpoints ({names})"
        )
        return (
            f"restore() resumes only from an intact checkpoint, and {which} in "
            f"{self.directory} is damaged: "
            + " ".join(problem for _, problem in damaged)
            + " Nothing was moved or deleted. To resume, replace one with an intact copy (from "
            "a backup); to start from step 0 with rank 0's current state instead, pass "
            "allow_fresh=True to restore() (or to CheckpointCallback), which moves them aside "
            f"as ckpt-NNNNNNNN{_DAMAGED}."
        )

    def _move_aside(self, damaged: list[tuple[str, str]]) -> tuple[str, ...]:
        """On rank 0: renames damaged checkpoints out of the listing; returns the warnings."""
        warnings = []
        for path, problem in damaged:
            self._intact.pop(path, None)
            aside, n = path + _DAMAGED, 1
            while os.path.lexists(aside):  # the same step damaged before
                n += 1
                aside = f"{path}{_DAMAGED}-{n}"
            try:
                os.rename(path, aside)
            except OSError as e:
                done = (
                    f"rank 0 could not move it aside ({e}), so it is reported again until it is "
                    f"moved out of {self.directory}"
                )
            else:
                done = (
                    f"rank 0 moved it to {aside}, kept for inspection: it is never restored nor "
                    "counted against max_to_keep"
                )
            warnings.append(
                f"syncdp: warning: checkpoint {path} is damaged ({problem.rstrip('.')}); {done}."
            )
        if damaged:
            with contextlib.suppress(OSError):
                _fsync(self.directory)
        return tuple(warnings)

    def save(self, step: int, *, metadata: dict | None = None) -> str | None:
        """Writes a checkpoint of the current state on rank 0, atomically.

        A synchronization point: all ranks must call it, at the same step. Rank 0 writes only
        once every rank has arrived, and the others wait until it has finished, so a failed
        write raises everywhere. Then rank 0 prunes to ``max_to_keep`` (never deleting this
        checkpoint nor the newest intact one) and every rank warns about damaged checkpoints
        it moved aside. Call it eagerly.

        Args:
            step: The training step the state belongs to (usually the number of updates done),
                returned by ``restore()`` later. Saving a step that has a checkpoint replaces
                it on purpose (the state of a step is the newest one saved for it): the old
                checkpoint stays restorable until the new one is in place, so a crash in
                between keeps one of the two.
            metadata: A small JSON-serializable dict stored with the checkpoint and available
                as ``self.metadata`` after ``restore()``. Defaults to None.

        Returns:
            The checkpoint's path on rank 0, None on the other ranks.

        Raises:
            CheckpointError: Rank 0 could not write the checkpoint (raised on every rank).

        Example:
            >>> manager.save(100, metadata={"epoch": 4})
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
        outcome = (None, None, ())
        if comm.rank == 0:
            try:
                path = self._write(step, metadata or {})
                outcome = (path, None, self._prune(path))
            except (OSError, TypeError, ValueError, tf.errors.OpError) as e:
                outcome = (
                    None,
                    f"Rank 0 could not write the checkpoint of step {step} to "
                    f"{self.directory}: {e}. Check the disk space and permissions.",
                    (),
                )
        path, error, warnings = comm.allgather_object(
            outcome if comm.rank == 0 else None, name="checkpoint.save.end", timeout=_io_timeout()
        )[0]
        _warn(warnings)
        if error:
            raise CheckpointError(error)
        return path if comm.rank == 0 else None

    def _write(self, step: int, metadata: dict) -> str:
        os.makedirs(self.directory, exist_ok=True)
        name = f"{_PREFIX}-{step:08d}"
        final = os.path.join(self.directory, name)
        unique = f"{os.getpid()}-{time.time_ns()}"
        temp = os.path.join(self.directory, f".{name}.tmp-{unique}")
        replaced = os.path.join(self.directory, f".{name}{_REPLACED}{unique}")
        os.makedirs(temp)
        try:
            self._checkpoint.write(os.path.join(temp, _PREFIX))
            files = {}
            for file_name in sorted(os.listdir(temp)):
                file = os.path.join(temp, file_name)
                _fsync(file)
                files[file_name] = {"bytes": os.path.getsize(file), "sha256": _sha256(file)}
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
            # A directory cannot be renamed over another, so the old one of this step moves to
            # a name that restore() renames back if the process dies before the next line.
            if os.path.lexists(final):
                os.rename(final, replaced)
            os.rename(temp, final)
            _fsync(self.directory)
        except BaseException:
            shutil.rmtree(temp, ignore_errors=True)
            if os.path.lexists(replaced) and not os.path.lexists(final):
                with contextlib.suppress(OSError):  # else restore() puts it back
                    os.rename(replaced, final)
            raise
        shutil.rmtree(replaced, ignore_errors=True)
        self._intact[final] = _signature(final)
        return final

    def _prune(self, written: str) -> tuple[str, ...]:
        """On rank 0, after a save: deletes the checkpoints past ``max_to_keep``.

        Newest first, each checkpoint up to ``max_to_keep`` must prove intact to count: one
        written or verified by this manager whose files are unchanged, or else one whose files
        match its manifest (hashed once). Damaged ones are moved aside, not counted; one that
        cannot be read is kept, not counted. The rest are deleted unread, except ``written``,
        which is always kept. The first counted is the newest intact one, so it is kept too.

        Returns:
            The warnings about the checkpoints moved aside.
        """
        if self.max_to_keep is None:
            return ()
        try:
            checkpoints = list_checkpoints(self.directory)
        except OSError:
            return ()  # the checkpoint is written; pruning waits for the next save
        kept, damaged = 0, []
        for _, path in reversed(checkpoints):
            if path == written:
                kept += 1
            elif kept >= self.max_to_keep:
                self._delete(path)
            elif (problem := self._damage(path)) is None:
                kept += 1
            elif problem:
                damaged.append((path, problem))
        return self._move_aside(damaged)

    def _damage(self, path: str) -> str | None:
        """What is wrong with the checkpoint at ``path``: None if intact, "" if unreadable."""
        signature = _signature(path)
        if signature is not None and self._intact.get(path) == signature:
            return None
        try:
            _check(path)
        except CheckpointError as e:
            return str(e)
        except OSError:
            return ""
        self._intact[path] = signature
        return None

    def _delete(self, path: str) -> None:
        self._intact.pop(path, None)
        # Renamed out of view first, so a crash mid-delete leaves nothing restorable.
        doomed = os.path.join(self.directory, f".{os.path.basename(path)}.deleted")
        with contextlib.suppress(OSError):
            os.rename(path, doomed)
            shutil.rmtree(doomed, ignore_errors=True)

    def _recover_interrupted_saves(self) -> None:
        """On rank 0, before a restore: cleans up after saves and deletes that crashed.

        A step's old checkpoint set aside by a save that replaced it goes back in place when
        the new one never arrived; temporary and half-deleted directories are removed.
        """
        try:
            names = sorted(os.listdir(self.directory))
        except FileNotFoundError:
            return
        for name in names:
            if not name.startswith(f".{_PREFIX}-"):
                continue
            path = os.path.join(self.directory, name)
            if _REPLACED in name:
                final = os.path.join(self.directory, name[1:].split(_REPLACED)[0])
                if not os.path.lexists(final):
                    os.rename(path, final)
                    continue
            if ".tmp-" in name or _REPLACED in name or name.endswith(".deleted"):
                shutil.rmtree(path, ignore_errors=True)


def _warn(warnings) -> None:
    for line in warnings:
        print(line, file=sys.stderr, flush=True)
