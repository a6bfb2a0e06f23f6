"""A Chrome-trace timeline of every collective, viewable in Perfetto or chrome://tracing.

Turn it on with ``syncdp-run --timeline-filename trace.json`` (or ``SYNCDP_TIMELINE``). Each rank
keeps one complete ("X") event per collective in memory: its name (``gradients.bucket0``), the
bytes and dtype it moved, and for fused allreduces the bucket index, tensor count and op. At
``shutdown()`` rank 0 gathers every rank's events and writes one JSON file with one process row
per rank, so the ranks' collectives line up under each other on a common clock: every rank
starts its clock as it leaves one barrier in ``init()``, so no two hosts' wall clocks are ever
compared.

With the timeline on, the TensorFlow face also marks the moment each gradient is computed
(row "gradients"), so the trace shows a bucket's collective starting while later gradients are
still being computed.

Open the file at https://ui.perfetto.dev or chrome://tracing. A long bar on one rank under
short ones on the others is a rank that arrived late (it was still computing) rather than a
slow collective.
"""

from __future__ import annotations

import json
import os
import time

__all__ = ["Timeline", "load"]


class Timeline:
    """Collects one complete ("X") event per collective on this rank.

    Args:
        path: Where rank 0 writes the trace.
    """

    # Rows (thread ids) of each rank's process in the trace.
    COLLECTIVES, GRADIENTS = 0, 1

    def __init__(self, path: str):
        self.path = path
        self.rank = 0
        self.events: list[dict] = []
        self._origin = time.perf_counter()
        self.started = False

    def start(self, rank: int, reading: float = 0.0) -> None:
        """Sets this rank's number and starts its clock at ``reading`` seconds (``init()``
        calls it after a barrier, with rank 0's reading for a rank joining a running job)."""
        self.rank = rank
        self._origin = time.perf_counter() - reading
        self.started = True

    def reading(self) -> float:
        """Seconds on this rank's clock."""
        return time.perf_counter() - self._origin

    def mark(self, name: str, when: float) -> None:
        """Records an instant on the gradients row, e.g. when a gradient was computed."""
        self.events.append(
            {
                "name": name,
                "cat": "gradient",
                "ph": "i",
                "s": "t",
                "pid": self.rank,
                "tid": self.GRADIENTS,
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
        self.events.append(
            {
                "name": name,
                "cat": "collective",
                "ph": "X",
                "pid": self.rank,
                "tid": self.COLLECTIVES,
                "ts": (start - self._origin) * 1e6,
                "dur": (end - start) * 1e6,
                "args": {"seq": len(self.events), "bytes": nbytes, "dtype": dtype, **info},
            }
        )

    def gather_and_write(self, mpi_comm) -> str | None:
        """Gathers every rank's events on rank 0 and writes the trace.

        A synchronization point: every rank must call it (``syncdp.shutdown()`` does). The
        gather goes straight to MPI, outside the watchdog's numbering, so it neither appears
        in the trace nor counts as a collective the other ranks must match.

        Args:
            mpi_comm: The mpi4py communicator of the ranks that recorded events.

        Returns:
            The path written, on rank 0; None elsewhere.
        """
        mine, self.events = self.events, []
        every = mpi_comm.gather(mine, root=0)
        if mpi_comm.Get_rank() != 0:
            return None
        trace = []
        for r, events in enumerate(every):
            trace.append(
                {"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}}
            )
            trace.append(
                {"name": "process_sort_index", "ph": "M", "pid": r, "args": {"sort_index": r}}
            )
            for tid, row in ((self.COLLECTIVES, "collectives"), (self.GRADIENTS, "gradients")):
                trace.append(
                    {"name": "thread_name", "ph": "M", "pid": r, "tid": tid, "args": {"name": row}}
                )
            for event in events:
                event["pid"] = r
                event["ts"] = round(event["ts"], 3)
                if "dur" in event:
                    event["dur"] = round(event["dur"], 3)
                trace.append(event)
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump({"traceEvents": trace, "displayTimeUnit": "ms"}, f)
        os.replace(tmp, self.path)
        return self.path


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
