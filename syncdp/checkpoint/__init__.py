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
  :class:`~syncdp.base.errors.CheckpointError` on every rank, naming each and its damage, and
  moves nothing. Starting again from step 0 would lose their progress without anyone noticing,
  so it happens only when asked for: ``restore(allow_fresh=True)``.
- The operating system refuses to read it (``EIO``, ``EACCES``, a directory where a file should
  be, ...): that says nothing about the checkpoint, and may pass, so ``restore()`` raises
  :class:`~syncdp.base.errors.CheckpointError` on every rank, naming the file and the cause.
  Falling back would resume from older state without anyone noticing, and the saves that
  follow would overwrite the newer checkpoint.

After each save rank 0 keeps the ``max_to_keep`` newest intact checkpoints and deletes the
older ones unread. It never deletes the one just written (kept too when ``max_to_keep`` newer ones
exist) nor the newest intact one; a damaged checkpoint it meets while counting is moved aside
like in ``restore()``, so it never takes the place of an intact one.

The manager holds any trackables that ``tf.train.Checkpoint`` takes and imports no Keras:
models, layers and optimizers are recognized by what they expose (``built``, ``build``,
``apply_gradients``, ``trainable_variables``), so this layer stays below :mod:`syncdp.keras`.

This module is the manager: what the ranks do together. What is on disk (the layout, writing,
checking, listing, pruning, moving aside, recovering a crashed save) is
:mod:`syncdp.checkpoint._files`.

Example:
    >>> manager = CheckpointManager("/ckpt", model=model, optimizer=optimizer)
    >>> start = manager.restore()
    >>> for step in range(start, steps):
    ...     train_step(step)
    ...     if (step + 1) % 10 == 0:
    ...         manager.save(step + 1)
"""

from __future__ import annotations

import json
import os
import sys
from typing import NamedTuple

import tensorflow as tf

from syncdp.base.errors import CheckpointError
from syncdp.checkpoint import _files
from syncdp.checkpoint._files import MANIFEST, list_checkpoints  # noqa: F401 - for callers
from syncdp.job import runtime
from syncdp.tensorflow import collectives as ops
from syncdp.tensorflow import keras2_names, verify

__all__ = ["CheckpointManager", "list_checkpoints"]


# The manager checks and hashes through these two names, looked up at each call, so that a
# test can count the checks or stand in for a disk that fails.
_sha256 = _files.sha256


def _check(path: str) -> dict:
    """The verified manifest of the checkpoint at ``path`` (see :func:`_files.check`)."""
    return _files.check(path, sha256=_sha256)


def _is_optimizer(obj) -> bool:
    # A Keras optimizer (DistributedOptimizer included) applies gradients and creates its slot
    # variables in build(var_list), or in _create_all_weights (tf-keras's legacy optimizers);
    # duck-typed so this layer does not import Keras.
    creates = getattr(obj, "build", None) or getattr(obj, "_create_all_weights", None)
    return callable(getattr(obj, "apply_gradients", None)) and callable(creates)


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
    if _is_optimizer(obj):
        return keras2_names.optimizer_state(obj)
    variables = getattr(obj, "variables", None)
    if variables is None:
        raise CheckpointError(
            f"CheckpointManager needs trackables that hold variables (a Keras model or "
            f"optimizer, a tf.Module, a tf.Variable); got {name}={type(obj).__name__}. Pass "
            "the objects whose state must be saved and kept identical on every rank."
        )
    return list(variables)


def _distributed_optimizers(objects) -> list:
    """The DistributedOptimizers among ``objects`` and what they hold (a model's optimizer, a
    LossScaleOptimizer's inner one), each once, in the same order on every rank."""
    found, seen, pending = [], set(), list(objects)
    while pending:
        obj = pending.pop(0)
        if obj is None or id(obj) in seen or _is_variable(obj):
            continue
        seen.add(id(obj))
        if callable(getattr(obj, "share_pending_gradients", None)):
            found.append(obj)
        pending += [getattr(obj, name, None) for name in ("optimizer", "inner_optimizer")]
    return found


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
        # signature then; pruning hashes only the others.
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
            if _is_optimizer(obj) and models:  # its slots, once (kept if they exist)
                keras2_names.create_optimizer_variables(
                    obj, [v for m in models for v in m.trainable_variables]
                )
            elif _is_optimizer(obj) and not getattr(obj, "built", True):
                raise CheckpointError(
                    f"The optimizer {name} has no slot variables yet, and there is no Keras "
                    "model among the trackables to create them from. Call "
                    f"{name}.build(model.trainable_variables) before the CheckpointManager."
                )
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
        _check_eager("restore", "; call it before the training loop")
        comm = runtime.communicator()
        variables = self._variables()
        signature = [
            (verify.variable_name(v, i), tuple(v.shape), str(v.dtype))
            for i, v in enumerate(variables)
        ]
        comm.enter("CheckpointManager.restore")
        outcome = None
        if comm.rank == 0:
            outcome = self._read_newest(allow_fresh=allow_fresh)
        everyone = comm.allgather_object(
            (signature, outcome), name="checkpoint.restore", timeout=runtime.io_timeout()
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
        _files.recover_interrupted_saves(self.directory)
        damaged = []  # (path, what is wrong), newest first
        for step, path in reversed(list_checkpoints(self.directory)):
            try:
                manifest = _check(path)
            except CheckpointError as e:
                damaged.append((path, str(e)))
                continue
            error = self._models_differ(path, manifest) or self._read(path)
            if error:
                return _Outcome(0, {}, error)
            self._intact[path] = _files.signature(path)
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

    def _models(self) -> dict:
        """The shape and dtype of every variable of each Keras model among the trackables."""
        return {
            name: [
                [tf.TensorShape(v.shape).as_list(), tf.as_dtype(v.dtype).name]
                for v in _variables_of(name, obj)
            ]
            for name, obj in self.trackables.items()
            if _is_model(obj)
        }

    def _models_differ(self, path: str, manifest: dict) -> str | None:
        """How the models saved in the checkpoint at ``path`` differ from the trackables'.

        TensorFlow restores the layers a checkpoint shares with the model and drops the others
        without a word, so a bigger model's checkpoint would fill a smaller model: the model's
        own variables are compared first (a checkpoint may still hold more objects than given,
        as ``_read`` allows). A checkpoint whose manifest does not list the models (written by
        an older syncdp) is not compared. A model must be whole when restored: one that
        builds a part later has fewer variables now, and is refused.
        """
        saved = manifest.get("models", {})
        for name, here in self._models().items():
            if name not in saved or saved[name] == here:
                continue
            there = saved[name]
            if len(there) != len(here):
                what = f"{name} has {len(here)} variables here, {len(there)} in the checkpoint"
            else:
                i = next(i for i, (a, b) in enumerate(zip(here, there)) if a != b)
                what = (
                    f"{name}'s variable {i} has shape {tuple(here[i][0])} and dtype "
                    f"{here[i][1]} here, shape {tuple(there[i][0])} and dtype {there[i][1]} in "
                    "the checkpoint"
                )
            return (
                f"The checkpoint {path} does not match the objects given to "
                f"CheckpointManager ({', '.join(self.trackables)}): {what}. Restore with the "
                "same model it was saved from, or use another directory."
            )
        return None

    def _read(self, path: str) -> str | None:
        """Loads the (verified) checkpoint at ``path`` into the trackables; returns an error."""
        try:
            status = self._checkpoint.read(os.path.join(path, _files.PREFIX))
            # Matched, not consumed: a checkpoint may hold more than the objects given (a
            # training checkpoint read for evaluation, accumulators of another
            # backward_passes_per_step, an optimizer tracked by the model).
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
            return self._unreadable(os.path.join(path, _files.PREFIX), e.message)
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
            f"as ckpt-NNNNNNNN{_files.DAMAGED}."
        )

    def _move_aside(self, damaged: list[tuple[str, str]]) -> tuple[str, ...]:
        """On rank 0: renames damaged checkpoints out of the listing; returns the warnings."""
        for path, _ in damaged:
            self._intact.pop(path, None)
        return _files.move_aside(self.directory, damaged)

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
            metadata: A small JSON-serializable dict with string keys, stored with the
                checkpoint and available as ``self.metadata`` after ``restore()`` (as JSON
                reads it back: tuples as lists). Defaults to None.

        Returns:
            The checkpoint's path on rank 0, None on the other ranks.

        Raises:
            CheckpointError: Rank 0 could not write the checkpoint, or its ``metadata`` is not
                a JSON-serializable dict (raised on every rank).

        Example:
            >>> manager.save(100, metadata={"epoch": 4})
        """
        _check_eager("save")
        step = int(step)
        if step < 0:
            raise CheckpointError(f"save(step) needs a step >= 0; got {step}.")
        comm = runtime.communicator()
        self._variables()  # creates the optimizer's slots, so they are in every checkpoint
        # A checkpoint of step N exists only once every rank has reached step N.
        # Steps are compared only where they agree (not while an elastic job re-forms).
        comm.enter("CheckpointManager.save", **({"step": step} if runtime.steps_agree() else {}))
        for optimizer in _distributed_optimizers(self.trackables.values()):
            # Partway through backward_passes_per_step: rank 0 must write what every rank
            # needs to resume the window.
            optimizer.share_pending_gradients()
        outcome = (None, None, ())
        problem = _metadata_problem(metadata) if comm.rank == 0 else None
        if problem:  # refused before anything is written or pruned
            outcome = (None, f"save(step={step}) refused its metadata: {problem}", ())
        elif comm.rank == 0:
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
            outcome if comm.rank == 0 else None,
            name="checkpoint.save.end",
            timeout=runtime.io_timeout(),
        )[0]
        _warn(warnings)
        if error:
            raise CheckpointError(error)
        return path if comm.rank == 0 else None

    def _write(self, step: int, metadata: dict) -> str:
        """On rank 0: writes the checkpoint of ``step`` (:func:`_files.write`), known intact."""
        path = _files.write(self.directory, step, metadata, self._checkpoint, models=self._models())
        self._intact[path] = _files.signature(path)
        return path

    def _prune(self, written: str) -> tuple[str, ...]:
        """On rank 0, after a save: keeps the ``max_to_keep`` newest intact checkpoints.

        Each one counted must prove intact: written or verified by this manager with its files
        unchanged since, or else matching its manifest (hashed once). See
        :func:`_files.prune`.

        Returns:
            The warnings about the checkpoints moved aside.
        """
        if self.max_to_keep is None:
            return ()
        pruned = _files.prune(self.directory, written, self.max_to_keep, self._damage)
        for path in pruned.deleted:
            self._intact.pop(path, None)
        return self._move_aside(pruned.damaged)

    def _damage(self, path: str) -> str | None:
        """What is wrong with the checkpoint at ``path``: None if intact, "" if unreadable."""
        signature = _files.signature(path)
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


def _metadata_problem(metadata) -> str | None:
    """Why ``metadata`` cannot be stored with a checkpoint (a restore would call the checkpoint
    damaged), or None."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        return f"it must be a dict (or None), not {type(metadata).__name__}"
    try:
        json.dumps(metadata)
    except (TypeError, ValueError) as e:
        return f"it must be JSON-serializable: {e}"
    key = _key_not_a_string(metadata)
    if key is not None:  # JSON would turn it into a string: restore() would give another key
        stored = next(iter(json.loads(json.dumps({key: 0}))))
        return f"its keys must be strings (JSON stores {key!r} as {stored!r})"
    return None


def _key_not_a_string(value):
    """The first dict key in ``value`` (at any depth) that is not a string, or None."""
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return key
            found = _key_not_a_string(item)
            if found is not None:
                return found
    elif isinstance(value, list | tuple):
        for item in value:
            found = _key_not_a_string(item)
            if found is not None:
                return found
    return None


def _warn(warnings) -> None:
    for line in warnings:
        print(line, file=sys.stderr, flush=True)


def _check_eager(method: str, hint: str = "") -> None:
    """Raises CheckpointError unless ``CheckpointManager.<method>()`` runs eagerly."""
    if tf.executing_eagerly():
        return
    if not tf.compat.v1.executing_eagerly_outside_functions():
        raise CheckpointError(
            f"CheckpointManager.{method}() needs eager execution, which this program turned "
            "off (tf.compat.v1.disable_eager_execution()); in a TF1 graph save from rank 0 "
            "with tf.compat.v1.train.Saver, or Keras' ModelCheckpoint, instead."
        )
    raise CheckpointError(
        f"CheckpointManager.{method}() must run eagerly, not inside tf.function{hint}."
    )
