"""Hostile peers for tests: connections to a launcher's port that never prove anything.

Anyone on the host can connect to the launcher's report and lifeline ports. :class:`Crowd`
keeps a number of such connections open for as long as it runs, opening a new one whenever the
launcher closes one, and can trickle a byte a second down each (so that they never look idle).
"""

from __future__ import annotations

import socket
import threading
import time


class Crowd:
    """``count`` connections to ``address`` (``host:port``) kept open until :meth:`stop`.

    Args:
        address: The port to crowd, ``host:port``.
        count: How many connections to hold.
        trickle: Send one byte (never a newline) down each connection every second.
            Defaults to False (idle connections).

    Attributes:
        opened: Connections opened in all (the launcher closing some makes this grow).
    """

    def __init__(self, address: str, count: int, *, trickle: bool = False):
        host, _, port = address.split(",")[0].rpartition(":")
        self._target = (host, int(port))
        self._count = count
        self._trickle = trickle
        self._socks: list[socket.socket] = []
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.opened = 0

    def __enter__(self) -> Crowd:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> Crowd:
        """Opens the connections (all of them before returning) and keeps them open."""
        self._fill()
        self._thread.start()
        return self

    def stop(self) -> None:
        """Closes every connection."""
        self._stopping.set()
        self._thread.join(timeout=10)
        for s in self._socks:
            s.close()

    def _fill(self) -> None:
        while len(self._socks) < self._count and not self._stopping.is_set():
            try:
                self._socks.append(socket.create_connection(self._target, timeout=2))
                self.opened += 1
            except OSError:
                time.sleep(0.05)

    def _run(self) -> None:
        while not self._stopping.wait(1.0):
            alive = []
            for s in self._socks:
                try:
                    if self._trickle:
                        s.send(b"x")
                    s.setblocking(False)
                    try:
                        closed = s.recv(4096) == b""
                    except BlockingIOError:
                        closed = False
                    s.setblocking(True)
                except OSError:
                    closed = True
                if closed:
                    s.close()
                else:
                    alive.append(s)
            self._socks = alive
            self._fill()
