"""Which files each rank reads: resolving inputs, counting records together, balancing.

Every rank resolves the same file list; the ranks check that they see the same files (names
and sizes) and were given the same arguments; each counts a share of the files (by bytes), and
one ``allgather`` gives every rank every count and every error. All later decisions (which rank
reads which file, how many batches each rank yields) are computed from that shared view, so
every rank reaches the same answer with no further communication, and an error found by any
rank is raised on all of them.
"""

from __future__ import annotations

import glob
import heapq
import os
from collections.abc import Sequence
from stat import S_ISREG

import numpy as np

from syncdp.base.errors import DataError
from syncdp.data._tfrecord import _read_with_tensorflow, _scan_headers, count_records
from syncdp.job import runtime

__all__ = ["shard_files"]

# (realpath, size, mtime_ns, verify, compression) -> count, so that rebuilding a dataset every
# epoch does not count (or checksum) the files again.
_count_cache: dict[tuple, int] = {}


def _resolve_files(files, caller: str) -> list[str]:
    """Expands ``files`` (a path, a glob, or a sequence of them) into a list of paths.

    A path that exists is taken as it is, even where it holds glob characters (``run[1]/a``
    names that file, not ``run1/a``); only one that does not is expanded as a pattern.
    """
    if isinstance(files, (str, os.PathLike)):
        files = [files]
    elif not isinstance(files, Sequence):
        raise TypeError(
            f"{caller} takes a path, a glob pattern or a list of paths; got {type(files).__name__}."
        )
    paths: list[str] = []
    for entry in files:
        entry = os.fspath(entry)
        if glob.has_magic(entry) and not os.path.exists(entry):
            matched = sorted(glob.glob(entry))
            if not matched:
                raise DataError(
                    f"{caller}: the pattern {entry!r} matches no files. Check the "
                    "pattern and the directory it names."
                )
            paths.extend(matched)
        else:
            paths.append(entry)
    if not paths:
        raise DataError(f"{caller} needs at least one file; got an empty list.")
    seen: dict[str, str] = {}
    for path in paths:
        real = os.path.realpath(path)
        if real in seen:
            raise DataError(
                f"{caller}: {path!r} is listed twice (also as {seen[real]!r}); its "
                "records would be read twice. List every file once."
            )
        seen[real] = path
    return paths


def _resolved(files, caller: str, check=None) -> tuple[list[str], ValueError | None]:
    """:func:`_resolve_files`'s paths, or ``([], what was wrong)``: a problem with one rank's
    own list (a pattern that matches nothing on its host), or with its arguments (``check``,
    which raises ValueError), is raised on every rank together by :func:`_agree_on_files`,
    rather than on that rank alone while the others wait for it."""
    try:
        if check is not None:
            check()
        return _resolve_files(files, caller), None
    except ValueError as error:  # DataError is one
        return [], error


def _check_whole(caller: str, what: str, value, *, optional: bool = False) -> None:
    """Refuses a ``seed``, ``epoch`` or ``start_batch`` that cannot order the files or
    batches (not an integer >= 0; None where ``optional``), naming the argument."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(
            f"{caller} needs {what} to be an integer >= 0{' (or None)' if optional else ''}, "
            f"the same on every rank; got {value!r}."
        )


def _check_compression(caller: str, compression_type) -> None:
    """Refuses a ``compression_type`` TensorFlow's TFRecord reader does not know."""
    if compression_type not in (None, "", "GZIP", "ZLIB"):
        raise ValueError(
            f"{caller}: compression_type must be None, 'GZIP' or 'ZLIB'; got {compression_type!r}."
        )


def _count_one(
    path: str, verify: bool, compression_type: str | None, skip_corrupt: bool
) -> tuple[int, str | None, int | None]:
    """Returns (records a reader will yield, what was wrong or None, records skipped)."""
    verify = verify or skip_corrupt
    try:
        stat = os.stat(path)
        key = (os.path.realpath(path), stat.st_size, stat.st_mtime_ns, verify, compression_type)
    except OSError:
        key = None
    if key in _count_cache:
        return _count_cache[key], None, 0
    try:
        count = count_records(path, verify=verify, compression_type=compression_type)
    except DataError as error:
        if not skip_corrupt or key is None:
            raise
        # TensorFlow's reader yields the records before the damaged one and skips the rest of
        # the file; count exactly what it will yield so the step count stays exact.
        valid = _read_with_tensorflow(path, compression_type, skip_corrupt=True)
        try:
            total = None if compression_type else _scan_headers(path)
        except DataError:
            total = None
        return valid, str(error), None if total is None else total - valid
    if key is not None:
        _count_cache[key] = count
    return count, None, 0


def _assign(
    weights: Sequence[int], size: int, *, seed: int | None = None, epoch: int = 0
) -> list[list[int]]:
    """Splits item indices into ``size`` groups of near-equal total weight.

    Greedy largest-first onto the least-loaded group (ties: fewer items, then lower index),
    which is deterministic and within 4/3 of the best possible largest group. With a seed,
    items of equal weight are taken in an order drawn from ``(seed, epoch)`` (so they are
    grouped differently each epoch), the groups rotate among the ranks by one place per epoch
    (so with unequal weights a rank never keeps its group two epochs running), and each
    group's order is shuffled.

    Returns:
        ``groups[r]``: the indices for rank ``r``.
    """
    n = len(weights)
    if seed is None:
        tiebreak = np.arange(n)
    else:
        tiebreak = np.random.default_rng([seed, epoch]).permutation(n)
    order = sorted(range(n), key=lambda i: (-weights[i], tiebreak[i]))
    heap = [(0, 0, g) for g in range(size)]
    groups: list[list[int]] = [[] for _ in range(size)]
    for i in order:
        load, items, g = heapq.heappop(heap)
        groups[g].append(i)
        heapq.heappush(heap, (load + weights[i], items + 1, g))
    if seed is None:
        return [sorted(group) for group in groups]
    rng = np.random.default_rng([seed, epoch, 1])
    shift = int(np.random.default_rng([seed]).integers(size)) + epoch
    return [
        [group[j] for j in rng.permutation(len(group))]
        for group in (groups[(r + shift) % size] for r in range(size))
    ]


def _file_size(path: str) -> int:
    """The file's size in bytes, or -1 when it cannot be seen (missing, not a file)."""
    try:
        st = os.stat(path)
    except OSError:
        return -1
    return st.st_size if S_ISREG(st.st_mode) else -1


def _differing_files(paths: list[str], sizes_by_rank: list[list[int]]) -> list[str]:
    """What differs between the ranks' views of the same file names: one line per file that
    some rank cannot see or sees with another size."""
    lines = []
    for i, path in enumerate(paths):
        seen = [sizes[i] for sizes in sizes_by_rank]
        if len(set(seen)) > 1:
            views = ", ".join(
                f"rank {r}: {'missing' if b < 0 else f'{b} bytes'}" for r, b in enumerate(seen)
            )
            lines.append(
                f"{path}: not the same file on every rank ({views}). Every rank must read the "
                "same files: check that every host sees the same data."
            )
    return lines


def _listed(head: str, lines: list[str], kind: type[ValueError] = DataError) -> ValueError:
    """A ``kind`` of error of ``head`` and the first ten ``lines``, one per line."""
    shown = "\n  ".join(lines[:10])
    more = f"\n  ... and {len(lines) - 10} more" if len(lines) > 10 else ""
    return kind(f"{head}:\n  {shown}{more}")


def _gather_counts(
    paths: list[str],
    *,
    verify: bool,
    compression_type: str | None,
    skip_corrupt: bool,
    caller: str,
    agree: dict | None = None,
    problem: ValueError | None = None,
):
    """Counts every file's records, sharing the work and the results among all ranks.

    A synchronization point: all ranks must call it, in the same order, with the same files.
    First the ranks check that they were given the same arguments (``agree``, which decide who
    reads what) and see the same files (names and sizes); then each counts a share of the files
    and one ``allgather`` gives every rank every count and every error. ``problem`` is what
    this rank found wrong with its list or arguments (see :func:`_resolved`).

    Returns:
        ``(counts, damaged)``: the records each file yields, and ``(path, what was wrong,
        records skipped or None when unknown)`` for each damaged file (only with
        ``skip_corrupt``).

    Raises:
        MismatchError: On every rank, when ranks passed different ``agree`` values.
        DataError: On every rank, when any rank found a file missing or corrupt, when ranks
            were given different file lists, or see a file with different sizes.
    """
    comm = runtime.communicator()
    name = f"{caller}.count_records"
    sizes = _agree_on_files(paths, caller, name, agree, problem)
    # Every rank sees the same sizes now, so every rank makes the same split of the counting.
    mine = _assign([max(b, 0) for b in sizes], comm.size)[comm.rank]
    results: dict[int, tuple] = {}
    errors: list[str] = []
    for i in mine:
        try:
            results[i] = _count_one(paths[i], verify, compression_type, skip_corrupt)
        except DataError as error:
            errors.append(str(error))
    # Counting is I/O, and one rank may count every file: not a stall.
    gathered = comm.allgather_object((results, errors), name=name, timeout=runtime.io_timeout())
    errors = [e for _, rank_errors in gathered for e in rank_errors]
    if errors:
        raise _listed(f"{caller}: {len(errors)} bad input file(s)", errors)
    merged: dict[int, tuple] = {}
    for rank_results, _ in gathered:
        merged.update(rank_results)
    counts = [merged[i][0] for i in range(len(paths))]
    damaged = [
        (paths[i], merged[i][1], merged[i][2])
        for i in range(len(paths))
        if merged[i][1] is not None
    ]
    return counts, damaged


def _agree_on_files(
    paths: list[str],
    caller: str,
    name: str,
    agree: dict | None,
    problem: ValueError | None = None,
) -> list[int]:
    """Checks, on every rank together, that the ranks found no ``problem`` with their lists
    or arguments, passed the same ``agree`` values, were given the same files in the same
    order and see the same sizes; returns the sizes.

    Raises:
        ValueError: On every rank, when a rank found a bad argument (and none a problem with
            its list).
        MismatchError: On every rank, when ranks passed different ``agree`` values.
        DataError: On every rank, when a rank found a problem with its list, ranks were given
            different file lists or see a file with different sizes (or one rank does not see
            it).
    """
    comm = runtime.communicator()
    comm.enter(name)  # every rank is here: the gather below pairs with no other collective
    sizes = [_file_size(p) for p in paths]
    views = comm.allgather_object((paths, sizes, problem), name=f"{caller}.files")
    problems = [(r, error) for r, (_, _, error) in enumerate(views) if error is not None]
    if problems:
        # A bad argument alone is a ValueError; DataError (also a ValueError) otherwise.
        kind = DataError if any(isinstance(e, DataError) for _, e in problems) else ValueError
        if len(problems) == comm.size and len({str(e) for _, e in problems}) == 1:
            raise kind(str(problems[0][1]))  # the same on every rank: said once
        lines = [f"rank {r}: {error}" for r, error in problems]
        raise _listed(f"{caller} failed on {len(lines)} rank(s)", lines, kind)
    # Checked after the problems: a rank's bad argument is named as such, not as a mismatch.
    comm.enter(name, **(agree or {}))
    for rank, (rank_paths, _, _) in enumerate(views):
        if rank_paths != paths:
            raise DataError(
                f"{caller}: ranks were given different files: rank {comm.rank} has "
                f"{len(paths)} starting {paths[:2]}, rank {rank} has {len(rank_paths)} "
                f"starting {rank_paths[:2]}. Pass the same list (or glob) on every rank."
            )
    differing = _differing_files(paths, [rank_sizes for _, rank_sizes, _ in views])
    if differing:
        raise _listed(f"{caller}: {len(differing)} file(s) differ between ranks", differing)
    return sizes


def shard_files(
    files,
    *,
    balance: bool = True,
    seed: int | None = None,
    epoch: int = 0,
    compression_type: str | None = None,
) -> list[str]:
    """This rank's share of ``files``: disjoint between ranks, together covering every file.

    A synchronization point: all ranks must call it, in the same order, with the same files
    and arguments, which they check together (and, when ``balance`` is True, count the records
    together); every rank then makes the same assignment.

    Args:
        files: A list of TFRecord paths, or a glob pattern (matches are sorted).
        balance: Assign files by their record counts (greedy largest-first onto the rank with
            the fewest records) so ranks get near-equal numbers of records. If False, file
            ``i`` goes to rank ``i % size`` and nothing is read. Defaults to True.
        seed: If set, reshuffle the assignment every epoch, identically on all ranks: the
            balanced groups of files rotate among the ranks, files of equal record counts
            are regrouped, and each rank's file order is shuffled. Defaults to None.
        epoch: The epoch the assignment is for; only used with a seed. Defaults to 0.
        compression_type: ``None``, ``"GZIP"`` or ``"ZLIB"``; compressed files are read in
            full to be counted. Defaults to None.

    Returns:
        The paths this rank reads.

    Raises:
        DataError: A file is missing or corrupt, a pattern matches nothing, a file is listed
            twice, there are fewer files than ranks, or ranks were given different files (or
            see them differently). Raised on every rank.
        MismatchError: Ranks passed different ``seed``, ``epoch`` or ``balance``, on every
            rank.
        ValueError: ``seed`` or ``epoch`` is not an integer >= 0 (``seed`` may be None), or
            ``compression_type`` is unknown, on any rank: raised on every rank.

    Example:
        >>> my_files = syncdp.data.shard_files("data/*.tfrecord", seed=1, epoch=epoch)
    """

    def check():
        _check_whole("shard_files", "seed", seed, optional=True)
        _check_whole("shard_files", "epoch", epoch)
        _check_compression("shard_files", compression_type)

    paths, problem = _resolved(files, "shard_files", check)
    size, rank = runtime.size(), runtime.rank()
    if balance:
        weights, _ = _gather_counts(
            paths,
            verify=False,
            compression_type=compression_type,
            skip_corrupt=False,
            caller="shard_files",
            agree={"seed": seed, "epoch": epoch, "compression_type": compression_type or None},
            problem=problem,
        )
        _enough_files(paths, size)  # the same list on every rank now: raised on all or none
        return [paths[i] for i in _assign(weights, size, seed=seed, epoch=epoch)[rank]]
    # Unchecked, ranks that differ in seed, epoch or file order would read files twice or never.
    sizes = _agree_on_files(
        paths,
        "shard_files",
        "shard_files",
        {"seed": seed, "epoch": epoch, "balance": False},
        problem,
    )
    _enough_files(paths, size)
    missing = [p for p, b in zip(paths, sizes, strict=True) if b < 0]  # the same on every rank
    if missing:
        raise DataError(
            f"shard_files: {len(missing)} file(s) do not exist: {missing[:5]}. "
            "Check the paths, or that every host sees the same files."
        )
    order = np.arange(len(paths))
    if seed is not None:
        order = np.random.default_rng([seed, epoch]).permutation(len(paths))
    return [paths[i] for i in order[rank::size]]


def _enough_files(paths: list[str], size: int) -> None:
    """Refuses fewer files than ranks; called once the ranks agree on the list, so every rank
    raises or none does."""
    if len(paths) < size:
        raise DataError(
            f"shard_files needs at least as many files as ranks: got {len(paths)} "
            f"files for {size} ranks. Write more shards, or use "
            "tfrecord_dataset(..., shard_by='records')."
        )
