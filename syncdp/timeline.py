"""A Chrome-trace timeline of every collective, viewable in Perfetto or chrome://tracing.

Each rank keeps its events in memory; at ``shutdown()`` (a collective while a timeline is on)
rank 0 gathers them and writes one JSON file with one process row per rank.
"""

from __future__ import annotations

import json
import os
import time

__all__ = ["Timeline"]


class Timeline:
    """Collects one complete ("X") event per collective.

    Args:
        path: Where rank 0 writes the trace.
    """

    def __init__(self, path: str):
        self.path = path
        self.rank = 0
        self.events: list[dict] = []
        self._origin = time.perf_counter()

    def record(self, name: str, nbytes: int, dtype: str, start: float, end: float) -> None:
        """Adds one collective that ran from ``start`` to ``end`` (``time.perf_counter``)."""
        self.events.append({
            "name": name.split("#")[0],
            "ph": "X",
            "pid": self.rank,
            "tid": 0,
            "ts": (start - self._origin) * 1e6,
            "dur": (end - start) * 1e6,
            "args": {"collective": name, "bytes": nbytes, "dtype": dtype},
        })

    def gather_and_write(self, comm) -> str | None:
        """Gathers every rank's events on rank 0 and writes the trace (a collective).

        Returns:
            The path written, on rank 0; None elsewhere.
        """
        mine, self.events = self.events, []
        # Align the ranks' clocks on the same host: perf_counter is CLOCK_MONOTONIC on Linux.
        every = comm.allgather_object((self._origin, mine), name="timeline")
        if comm.rank != 0:
            return None
        base = min(origin for origin, _ in every)
        trace = []
        for r, (origin, events) in enumerate(every):
            trace.append({"name": "process_name", "ph": "M", "pid": r,
                          "args": {"name": f"rank {r}"}})
            for event in events:
                event["ts"] += (origin - base) * 1e6
                trace.append(event)
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump({"traceEvents": trace, "displayTimeUnit": "ms"}, f)
        os.replace(tmp, self.path)
        return self.path
