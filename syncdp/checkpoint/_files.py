"""The on-disk format of syncdp's checkpoints, as rank 0 writes and reads it.

What is on disk and how it changes: writing a checkpoint atomically, checking one against its
manifest, listing, pruning, moving damaged ones aside, and putting back a step's old checkpoint
when a save that replaced it crashed. No collectives (the manager, :mod:`syncdp.checkpoint`,
holds them) and no TensorFlow: the TensorFlow files come from the ``tf.train.Checkpoint`` that
the manager hands to :func:`write`.

Layout of a checkpoint directory::

    DIRECTORY/ckpt-00000020/ckpt.index
    DIRECTORY/ckpt-00000020/ckpt.data-00000-of-00001
    DIRECTORY/ckpt-00000020/syncdp-checkpoint.json
    DIRECTORY/ckpt-00000030.damaged/      a damaged checkpoint moved aside: never read
    DIRECTORY/.ckpt-00000040.tmp-OWNER-NS       a save in progress (or one that crashed):
                                                never read
    DIRECTORY/.ckpt-00000020.replaced-OWNER-NS  step 20's old checkpoint while a new one
                                                replaces it

OWNER is ``HOST@PID.TICKS``, the process that saves (TICKS: when it started, from Linux's
/proc), so that a restore on that host cleans up only after saves that crashed, never under
one still under way in another process (another job in the same directory). Another host's are
taken as crashed: a restore there follows a lost rank 0, and its checkpoint must come back.

The manifest, ``syncdp-checkpoint.json``, records the format, the step, the caller's metadata,
the time, and the size and SHA-256 of every file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import socket
import time
from collections.abc import Callable
from typing import NamedTuple

from syncdp.base.errors import CheckpointError

__all__ = [
    "MANIFEST",
    "PREFIX",
    "DAMAGED",
    "sha256",
    "fsync",
    "check",
    "signature",
    "list_checkpoints",
    "write",
    "Pruned",
    "prune",
    "move_aside",
    "recover_interrupted_saves",
]

MANIFEST = "syncdp-checkpoint.json"
PREFIX = "ckpt"
_FORMAT = 1
_NAME = re.compile(r"^ckpt-(\d+)$")
DAMAGED = ".damaged"  # never matches _NAME, so a checkpoint moved aside is never listed
_REPLACED = ".replaced-"
# The saving process, at the end of a temporary or set-aside directory's name.
_OWNER = re.compile(r"(?:\.tmp-|\.replaced-)(?P<host>[^/]+)@(?P<pid>\d+)\.(?P<ticks>\d+)-\d+$")


def sha256(file) -> str:
    """The SHA-256 of a path's content, or of an open binary file's from where it stands."""
    if isinstance(file, str | os.PathLike):
        with open(file, "rb") as f:
            return sha256(f)
    h = hashlib.sha256()
    for block in iter(lambda: file.read(1 << 20), b""):
        h.update(block)
    return h.hexdigest()


def fsync(path: str) -> None:
    """Flushes a file's or a directory's content (a directory's: its entries) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check(path: str, *, sha256: Callable = sha256) -> dict:
    """Returns the manifest of the checkpoint at ``path``, once its files match it.

    Args:
        path: A ``ckpt-NNNNNNNN`` directory.
        sha256: Hashes one open binary file. Defaults to :func:`sha256`.

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
        or f"{PREFIX}.index" not in files
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
                digest = sha256(f) if size == meta["bytes"] else None
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


def signature(path: str) -> tuple | None:
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


def write(
    directory: str, step: int, metadata: dict, checkpoint, *, models: dict | None = None
) -> str:
    """Writes the checkpoint of ``step`` atomically; returns its path.

    The files go to a temporary directory, are flushed to disk with a manifest, and the
    directory is renamed into place only when complete. A step that has a checkpoint gets a new
    one: the old one is set aside under a name that :func:`recover_interrupted_saves` renames
    back if the process dies before the new one is in place.

    Args:
        directory: The checkpoint directory (made if missing).
        step: The training step.
        metadata: JSON-serializable, stored in the manifest.
        checkpoint: What writes the TensorFlow files: ``checkpoint.write(prefix)`` (a
            ``tf.train.Checkpoint``).
        models: JSON-serializable, stored in the manifest: the shapes and dtypes of each
            model's variables, by name, which a restore compares before reading. Defaults to
            None (none listed).

    Raises:
        OSError, TypeError, ValueError: The write failed; nothing of it is left.
    """
    os.makedirs(directory, exist_ok=True)
    name = f"{PREFIX}-{step:08d}"
    final = os.path.join(directory, name)
    unique = f"{_owner()}-{time.time_ns()}"
    temp = os.path.join(directory, f".{name}.tmp-{unique}")
    replaced = os.path.join(directory, f".{name}{_REPLACED}{unique}")
    os.makedirs(temp)
    try:
        checkpoint.write(os.path.join(temp, PREFIX))
        files = {}
        for file_name in sorted(os.listdir(temp)):
            file = os.path.join(temp, file_name)
            fsync(file)
            files[file_name] = {"bytes": os.path.getsize(file), "sha256": sha256(file)}
        manifest = {
            "format": _FORMAT,
            "step": step,
            "metadata": metadata,
            "models": models or {},
            "files": files,
            "time": time.time(),
        }
        with open(os.path.join(temp, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        fsync(temp)
        # A directory cannot be renamed over another, so the old one of this step moves to
        # a name that restore() renames back if the process dies before the next line.
        if os.path.lexists(final):
            os.rename(final, replaced)
        os.rename(temp, final)
        fsync(directory)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        if os.path.lexists(replaced) and not os.path.lexists(final):
            with contextlib.suppress(OSError):  # else restore() puts it back
                os.rename(replaced, final)
        raise
    shutil.rmtree(replaced, ignore_errors=True)
    return final


class Pruned(NamedTuple):
    """What :func:`prune` did: the checkpoints it deleted, and the damaged ones it met."""

    deleted: list[str]
    damaged: list[tuple[str, str]]  # (path, what is wrong), for move_aside


def prune(
    directory: str, written: str, max_to_keep: int, damage: Callable[[str], str | None]
) -> Pruned:
    """Deletes the checkpoints past ``max_to_keep``, after a save.

    Newest first, each checkpoint up to ``max_to_keep`` must prove intact to count. Damaged
    ones are returned to be moved aside, not counted; one that cannot be read is kept, not
    counted. The rest are deleted unread, except ``written``, which is always kept. The first
    counted is the newest intact one, so it is kept too.

    Args:
        directory: The checkpoint directory.
        written: The checkpoint just saved.
        max_to_keep: How many intact checkpoints to keep.
        damage: What is wrong with a checkpoint: None if it is intact, "" if it cannot be read,
            else the damage (the manager remembers which ones it has verified).
    """
    try:
        checkpoints = list_checkpoints(directory)
    except OSError:
        return Pruned([], [])  # the checkpoint is written; pruning waits for the next save
    kept, deleted, damaged = 0, [], []
    for _, path in reversed(checkpoints):
        if path == written:
            kept += 1
        elif kept >= max_to_keep:
            _delete(directory, path)
            deleted.append(path)
        elif (problem := damage(path)) is None:
            kept += 1
        elif problem:
            damaged.append((path, problem))
    return Pruned(deleted, damaged)


def _delete(directory: str, path: str) -> None:
    # Renamed out of view first, so a crash mid-delete leaves nothing restorable.
    doomed = os.path.join(directory, f".{os.path.basename(path)}.deleted")
    with contextlib.suppress(OSError):
        os.rename(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)


def move_aside(directory: str, damaged: list[tuple[str, str]]) -> tuple[str, ...]:
    """Renames damaged checkpoints out of the listing; returns a warning for each.

    Args:
        directory: The checkpoint directory.
        damaged: ``(path, what is wrong)`` of each damaged checkpoint.
    """
    warnings = []
    for path, problem in damaged:
        aside, n = path + DAMAGED, 1
        while os.path.lexists(aside):  # the same step damaged before
            n += 1
            aside = f"{path}{DAMAGED}-{n}"
        try:
            os.rename(path, aside)
        except OSError as e:
            done = (
                f"rank 0 could not move it aside ({e}), so it is reported again until it is "
                f"moved out of {directory}"
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
            fsync(directory)
    return tuple(warnings)


def _owner() -> str:
    """``HOST@PID.TICKS`` for this process (TICKS 0 where /proc cannot tell)."""
    return f"{socket.gethostname()}@{os.getpid()}.{_start_ticks(os.getpid()) or 0}"


def _start_ticks(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (Linux's /proc), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _in_use(path: str) -> bool:
    """Whether a temporary or set-aside directory belongs to a save still under way in another
    process of this host: the one named in it, alive, started when it did (not a later
    process given the same pid). Names without an owner are older syncdp's."""
    owner = _OWNER.search(os.path.basename(path))
    if owner is None or owner["host"] != socket.gethostname():
        return False
    pid = int(owner["pid"])
    if pid == os.getpid():  # this process saves nothing while it restores
        return False
    return _start_ticks(pid) == int(owner["ticks"]) != 0


def recover_interrupted_saves(directory: str) -> None:
    """Cleans up after saves and deletes that crashed (before a restore).

    A step's old checkpoint set aside by a save that replaced it goes back in place when the
    new one never arrived; temporary and half-deleted directories are removed. A save still
    under way in another process (:func:`_in_use`) is left alone.
    """
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return
    for name in names:
        if not name.startswith(f".{PREFIX}-"):
            continue
        path = os.path.join(directory, name)
        if _in_use(path):
            continue
        if _REPLACED in name:
            final = os.path.join(directory, name[1:].split(_REPLACED)[0])
            if not os.path.lexists(final):
                os.rename(path, final)
                continue
        if ".tmp-" in name or _REPLACED in name or name.endswith(".deleted"):
            shutil.rmtree(path, ignore_errors=True)
