"""A Chrome-trace timeline of every collective, viewable in Perfetto or chrome://tracing.

Turn it on with ``syncdp-run --timeline-filename trace.json`` (or ``SYNCDP_TIMELINE``). Each rank
keeps one complete ("X") event per collective in memory: its name (``gradients.bucket0``), the
bytes and dtype it moved, and for fused allreduces the bucket index, tensor count and op. At
``shutdown()`` rank 0 gathers every rank's events and writes one JSON file with one process row
per rank, so the ranks' collectives line up under each other on a common clock: every rank
starts its clock as it leaves one barrier in ``init()``, so no two hosts' wall clocks are ever
compared.

Until then rank 0 writes its own events to the file as they happen, and the file is valid JSON
after each one (as Horovod's is): a job that ends by an error, a stall or a signal leaves rank
0's collectives up to that moment. Rank 0 opens the file when the timeline starts, so a path it
cannot write is an error then, not at the end. ``start_timeline``/``stop_timeline`` record rank
0's collectives alone, as Horovod's do (a call on the other ranks does nothing): no rank waits
for another, so a program may call them on rank 0 only.

With the timeline on, the TensorFlow face also marks the moment each gradient is computed
(row "gradients"), so the trace shows a bucket's collective starting while later gradients are
still being computed.

Open the file at https://ui.perfetto.dev or chrome://tracing. A long bar on one rank under
short ones on the others is a rank that arrived late (it was still computing) rather than a
slow collective.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time

__all__ = ["Timeline", "gather_and_write", "load"]

# Rows (thread ids) of each rank's process in the trace.
_COLLECTIVES, _GRADIENTS = 0, 1

# Events each rank keeps for the job's trace (a Python dict each, about 0.5 KB: some 100 MB). The
# job's timeline is held in memory until shutdown; without a bound a long run would grow every
# rank's memory without end (ResNet-50 records about 170 events a step). Later ones are left
# out, and the trace says where.
MAX_EVENTS = 200_000


class Timeline:
    """Collects one complete ("X") event per collective on this rank.

    Args:
        path: Where rank 0 writes the trace.
        every_rank: Whether every rank records and rank 0 gathers their events at the end (the
            job's timeline, ``--timeline-filename``), or rank 0 records alone
            (``start_timeline``). Defaults to True.
        max_events: With ``every_rank``, the events this rank records at most (they are kept
            in memory until the gather); one more marks where the rest were left out.
            Defaults to :data:`MAX_EVENTS`.
    """

    def __init__(self, path: str, *, every_rank: bool = True, max_events: int = MAX_EVENTS):
        self.path = os.path.abspath(path)  # the whole trace is written there at the end
        self.every_rank = every_rank
        self.max_events = max_events
        self._counting = threading.Lock()
        self.rank = 0
        self.events: list[dict] = []
        self._origin = time.perf_counter()
        self.started = False
        self._stream: _TraceFile | None = None
        self._recorded = 0  # collectives recorded: each event's seq

    def start(self, rank: int, reading: float = 0.0) -> None:
        """Sets this rank's number and starts its clock at ``reading`` seconds (``init()``
        calls it after a barrier, with rank 0's reading for a rank joining a running job).
        Rank 0 opens the file here and writes each event into it from now on.

        Raises:
            OSError: Rank 0 cannot write the file (the message names it).
        """
        self._origin = time.perf_counter() - reading
        self.started = True
        self.set_rank(rank)

    def set_rank(self, rank: int) -> None:
        """This rank's number from now on (elastic mode renumbers); a rank that becomes rank
        0 starts writing the file.

        Raises:
            OSError: Rank 0 cannot write the file (the message names it).
        """
        self.rank = rank
        if rank == 0 and self._stream is None:
            self._stream = _TraceFile(self.path)

    def stop(self) -> str | None:
        """Stops recording on this rank alone; returns the path written, on rank 0 (the events
        it recorded, already in the file), None elsewhere."""
        self.events = []
        if self._stream is None:
            return None
        self._stream.close()
        self._stream = None
        return self.path

    def reading(self) -> float:
        """Seconds on this rank's clock."""
        return time.perf_counter() - self._origin

    def mark(self, name: str, when: float) -> None:
        """Records an instant on the gradients row, e.g. when a gradient was computed."""
        self._add(
            {
                "name": name,
                "cat": "gradient",
                "ph": "i",
                "s": "t",
                "pid": self.rank,
                "tid": _GRADIENTS,
                "ts": (when - self._origin) * 1e6,
            }
        )

    def record(self, name: str, nbytes: int, dtype: str, start: float, end: float, **info) -> None:
        """Adds one collective that ran from ``start`` to ``end`` (``time.perf_counter``).

        Args:
            name: The collective's name, e.g. ``gradients.bucket0``.
            nbytes: Bytes this rank contributed.
            dtype: The dtype on the wire.
            start: When it started, by ``time.perf_counter()``.
            end: When it ended.
            **info: More fields for the event's ``args`` (bucket index, tensor count, op).
        """
        self._add(
            {
                "name": name,
                "cat": "collective",
                "ph": "X",
                "pid": self.rank,
                "tid": _COLLECTIVES,
                "ts": (start - self._origin) * 1e6,
                "dur": (end - start) * 1e6,
                "args": {"seq": self._recorded, "bytes": nbytes, "dtype": dtype, **info},
            }
        )
        self._recorded += 1

    def _add(self, event: dict) -> None:
        added = [event]
        if self.every_rank:  # kept for the gather at the end
            with self._counting:  # TensorFlow's threads mark gradients while collectives end
                if len(self.events) >= self.max_events:
                    return  # full: the note that says so is the last event
                self.events.append(event)
                if len(self.events) == self.max_events:
                    added.append(self._full(event["ts"]))
        if self._stream is not None:
            for one in added:
                self._stream.add(one)

    def _full(self, ts: float) -> dict:
        """Adds the note that ends a full timeline; returns it."""
        note = {
            "name": f"timeline full: later events of this rank left out ({self.max_events:,} kept)",
            "cat": "timeline",
            "ph": "i",
            "s": "p",
            "pid": self.rank,
            "tid": _COLLECTIVES,
            "ts": ts,
        }
        self.events.append(note)
        if self.rank == 0:
            print(
                f"syncdp: the timeline holds {self.max_events:,} events per rank at most (in "
                "memory until the job ends); later collectives are left out of it. Record a "
                "shorter run for a whole trace.",
                file=sys.stderr,
                flush=True,
            )
        return note


def gather_and_write(mpi_comm, timeline: Timeline | None) -> str | None:
    """Gathers every rank's events of the job's timeline on rank 0, which writes the trace.

    A synchronization point: every rank must call it (``syncdp.shutdown()`` does when the
    job's timeline is on). The gather goes straight to MPI, outside the watchdog's numbering,
    so it neither appears in the trace nor counts as a collective the other ranks must match.

    Args:
        mpi_comm: The mpi4py communicator of the ranks that recorded events.
        timeline: This rank's timeline, or None. One that is not the job's (rank 0's
            ``start_timeline``) adds nothing and is stopped; where rank 0 holds none of the
            job's, its file already holds what it recorded and nothing more is written.

    Returns:
        The path written, on rank 0; None elsewhere.
    """
    job = timeline if timeline is not None and timeline.every_rank else None
    mine = job.events if job is not None else []
    if timeline is not None:
        timeline.stop()
    every = mpi_comm.gather(mine, root=0)
    if mpi_comm.Get_rank() != 0 or job is None:
        return None
    trace = []
    for r, events in enumerate(every):
        trace += _rows(r)
        trace += [_rounded({**event, "pid": r}) for event in events]
    directory = os.path.dirname(os.path.abspath(job.path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{job.path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"displayTimeUnit": "ms", "traceEvents": trace}, f)
    os.replace(tmp, job.path)
    return job.path


def _rows(rank: int) -> list[dict]:
    """The metadata events that name rank ``rank``'s process and its two rows."""
    return [
        {"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}},
        {"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}},
        *(
            {"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": row}}
            for tid, row in ((_COLLECTIVES, "collectives"), (_GRADIENTS, "gradients"))
        ),
    ]


def _rounded(event: dict) -> dict:
    """``event`` with its times in whole nanoseconds (the trace's microseconds to 3 places)."""
    event = dict(event)
    event["ts"] = round(event["ts"], 3)
    if "dur" in event:
        event["dur"] = round(event["dur"], 3)
    return event


class _TraceFile:
    """Rank 0's trace written as its events happen: after each, the file is a whole JSON
    document (the event goes in before the closing ``]}``, which is written again after it).

    Args:
        path: The file; its directory is made if missing.

    Raises:
        OSError: The file cannot be written; the message names it.
    """

    _END = b"]}"

    def __init__(self, path: str):
        self.path = path
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._file = open(path, "wb")  # noqa: SIM115 - open for the timeline's life
            head = json.dumps({"displayTimeUnit": "ms", "traceEvents": _rows(0)}).encode()
            self._file.write(head)
            self._file.flush()
        except OSError as e:
            raise type(e)(
                f"syncdp: the timeline cannot be written to {path!r}: {e.strerror or e}"
            ) from None
        self._end = len(head) - len(self._END)
        self._lock = threading.Lock()  # TensorFlow may run two collectives' host calls at once

    def add(self, event: dict) -> None:
        """Writes ``event`` into the file, which stays valid JSON."""
        text = b"," + json.dumps(_rounded(event)).encode()
        with self._lock:
            if self._file is None:
                return
            try:
                self._file.seek(self._end)
                self._file.write(text + self._END)
                self._file.flush()
            except OSError as e:  # a full disk must not end the training
                print(
                    f"syncdp: the timeline stops here: writing {self.path!r} failed ({e})",
                    file=sys.stderr,
                    flush=True,
                )
                with contextlib.suppress(OSError):  # the events so far, whole, if it can
                    self._file.seek(self._end)
                    self._file.truncate()
                    self._file.write(self._END)
                    self._file.flush()
                self._close()
                return
            self._end += len(text)

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None


def load(path: str) -> dict[int, list[dict]]:
    """Reads a trace written by :class:`Timeline`: rank -> its collective events, in order.

    Args:
        path: The JSON file.

    Returns:
        Every rank's events (collectives, and gradient marks with ``"ph": "i"``), sorted by
        start time.
    """
    with open(path) as f:
        trace = json.load(f)
    ranks: dict[int, list[dict]] = {}
    for event in trace["traceEvents"]:
        if event.get("ph") == "M" and event.get("name") == "process_name":
            ranks.setdefault(event["pid"], [])
        elif event.get("ph") in ("X", "i"):
            ranks.setdefault(event["pid"], []).append(event)
    for events in ranks.values():
        events.sort(key=lambda e: e["ts"])
    return ranks
