"""The failure channel: ranks tell the launcher what happened, as data.

Under ``syncdp-run`` every rank finds ``SYNCDP_REPORT_ADDR=host:port`` in its environment: the
launcher listens there. A report is one JSON object on one line::

    {"kind": "stall", "rank": 0, "host": "node3", "pid": 4242, "time": 1795433058.9,
     "message": "collective #23 gradients.bucket0 waited 60.0 s ...", "ranks": [1]}

Its ``kind`` says what happened; the launcher reads the fields and never parses the message:

    started        the rank reached ``init()`` (the launcher counts arrivals against
                   ``--start-timeout``)
    exception      an exception escaped on the rank (``message``: its type and text)
    stall          a collective waited past the stall timeout; ``ranks`` did not arrive
    start_timeout  not every rank reached ``init()`` in time; ``ranks`` lists the ones that
                   did not, when this rank can tell (empty otherwise)
    exit_early     the rank finished its program while ``ranks`` wait for it in a collective
    exit           written by the rank's supervisor (``launch.worker``): the program ended;
                   ``code`` (exit status) or ``signal`` (number); ``requested`` is true when
                   it was stopped because the job was ending

Without the launcher (plain ``mpirun``) there is no address and :func:`send` only returns; the
same words are printed to stderr by the caller either way.
"""

from __future__ import annotations

import json
import os
import socket
import time

__all__ = ["ADDRESS_VAR", "send", "make"]

ADDRESS_VAR = "SYNCDP_REPORT_ADDR"
# A report must never hold up a rank that is about to end the job.
_CONNECT_SECONDS = 2.0


def make(kind: str, rank: int | None, message: str = "", **fields) -> dict:
    """One report as a dict: kind, rank, host, pid, time, message and any extra fields."""
    return {
        "kind": kind,
        "rank": rank,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "time": time.time(),
        "message": message,
        **fields,
    }


def send(kind: str, rank: int | None, message: str = "", **fields) -> bool:
    """Sends one report to the launcher, if there is one; never raises.

    Args:
        kind: What happened (see the module docstring).
        rank: The rank it is about.
        message: The human-readable text, as printed on stderr.
        **fields: Extra data for that kind (``ranks``, ``code``, ``signal``...).

    Returns:
        Whether the report was delivered.
    """
    address = os.environ.get(ADDRESS_VAR)
    if not address:
        return False
    host, _, port = address.rpartition(":")
    line = json.dumps(make(kind, rank, message, **fields)) + "\n"
    try:
        with socket.create_connection((host, int(port)), timeout=_CONNECT_SECONDS) as s:
            s.sendall(line.encode())
        return True
    except (OSError, ValueError):
        return False
