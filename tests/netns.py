"""Separate hosts on one machine for tests: network namespaces joined by a bridge.

:class:`NamespaceHosts` makes ``k`` namespaces, each with its own address on a private test
subnet (a veth pair into a bridge in the root namespace, which gets ``.1``), and an agent
script Open MPI uses as its remote shell (``--mca plm_rsh_agent AGENT``): ``AGENT HOST CMD``
runs CMD in HOST's namespace under its own UTS hostname, so every host reports its own name,
in a bare environment as ssh gives one (PATH, HOME, USER, LOGNAME, SHELL and the machine's
OPENBLAS_* settings, as a host's profile would set them; nothing of the launcher's), so a
process reaches a remote host with only what the job passes on; a host may be given by its
address too. Everything it made is removed on exit, also when the test fails; traffic stays on
the test subnet and loopback. With ``private_disks`` each host also gets a /var/tmp of its own, so a
test can show that nothing relies on a file system the hosts share. The agent cannot reach a
host whose link was cut (:meth:`NamespaceHosts.cut`): it waits, as ssh would. Where namespaces
cannot be made (not root, no ``ip``) it raises :class:`Unavailable` with the reason (tests skip
with it; ``benchmarks/multihost.py`` says it).
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path


class Unavailable(RuntimeError):
    """Namespace hosts cannot be made on this machine; the message says why."""


_AGENT = """#!/bin/sh
# Open MPI's remote shell for namespace hosts: AGENT HOST COMMAND...
host="$1"; shift
# A host may be given by its address, as users write -H 10.0.0.12:4: reach it by either.
case "$host" in
{aliases}esac
# A host whose link is cut cannot be reached: wait, as ssh does until its connect timeout,
# and fail as it does (exit 255).
if [ -e "{marks}/cut-$host" ]; then
    sleep {unreachable}
    echo "ssh: connect to host $host port 22: Connection timed out" >&2
    exit 255
fi
# A host whose daemon cannot start (NamespaceHosts.break_daemon): the remote shell works, Open
# MPI's daemon fails there at once.
case "$*" in *prted*) if [ -e "{marks}/nodaemon-$host" ]; then
    echo "prted: error while loading shared libraries: cannot open shared object file" >&2
    exit 127
fi ;; esac
# What ssh gives a remote command: a bare environment (PATH, HOME and this machine's own
# settings, as the host's shell profile would set them), nothing of the launcher's.
exec env -i PATH="$PATH" HOME="$HOME" USER="$(id -un)" LOGNAME="$(id -un)" SHELL=/bin/sh \\
    {profile} \\
    ip netns exec "{prefix}$host" unshare --uts {unshare} \\
    sh -c 'hostname "$0" && {bind}exec sh -c "$1"' "$host" "$*"
"""
# With private disks: the host's own directory over /var/tmp, in a mount namespace of its own.
_BIND = 'mount --bind "{disks}/$0" /var/tmp && '


# How long the agent waits before failing for a host whose link is cut (ssh's connect timeout).
_UNREACHABLE = 30


def _profile() -> dict[str, str]:
    """What this machine's shell profile sets that every host shares: OpenBLAS's CPU type (the
    same arithmetic on every host, so that results compare bit for bit with the test's own)."""
    return {k: v for k, v in os.environ.items() if k.startswith("OPENBLAS_")}


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


class NamespaceHosts:
    """``with NamespaceHosts(tmp_path, ["h1", "h2"]) as hosts:`` -> hosts.agent, hosts.subnet.

    Args:
        workdir: Where the agent script is written.
        names: The hosts' names (short, letters and digits).
        subnet: The first three octets of the test subnet. Defaults to ``"10.213.7"``.
        tag: Prefix of every name it makes (namespaces, bridge, links), so that two sets of
            hosts can exist at once. Defaults to ``"sdp"``.
        private_disks: Whether each host gets a /var/tmp of its own (a directory under
            ``workdir`` mounted over it for everything the agent starts there), so that what a
            host writes to its local disk is seen by no other host. Defaults to False (the
            machine's file system is shared by all).
    """

    def __init__(
        self,
        workdir: Path,
        names: list[str],
        subnet: str = "10.213.7",
        tag: str = "sdp",
        *,
        private_disks: bool = False,
    ):
        self.names = list(names)
        self.tag = tag
        self.prefix = f"{tag}-"
        self.bridge = f"{tag}br0"
        self.subnet = f"{subnet}.0/24"
        self.gateway = f"{subnet}.1"
        self.address = {n: f"{subnet}.{11 + i}" for i, n in enumerate(self.names)}
        self.workdir = Path(workdir)
        self.agent = str(self.workdir / "netns-agent.sh")
        self.private_disks = private_disks

    def __enter__(self) -> NamespaceHosts:
        if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("unshare") is None:
            raise Unavailable("namespace hosts need root, iproute2's ip and unshare")
        try:
            self._build()
        except Unavailable:
            self.__exit__(None, None, None)
            raise
        except subprocess.CalledProcessError as e:
            self.__exit__(None, None, None)
            raise Unavailable(
                f"cannot make namespace hosts here: {' '.join(e.cmd)}: {e.stderr.strip()}"
            ) from None
        bind = ""
        if self.private_disks:
            for name in self.names:
                self.disk(name).mkdir(parents=True, exist_ok=True)
            bind = _BIND.format(disks=self.workdir / "disks")
        Path(self.agent).write_text(
            _AGENT.format(
                prefix=self.prefix,
                marks=self.workdir,
                unreachable=_UNREACHABLE,
                unshare="--mount" if self.private_disks else "",
                bind=bind,
                profile=" ".join(shlex.quote(f"{k}={v}") for k, v in _profile().items()),
                aliases="".join(f"    {a}) host={n} ;;\n" for n, a in self.address.items()),
            )
        )
        os.chmod(self.agent, 0o755)
        return self

    def _build(self) -> None:
        self._cleanup()  # leftovers of an earlier run that was killed
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i, name in enumerate(self.names):
            ns, outside, inside = self.prefix + name, f"{self.tag}v{i}", f"{self.tag}e{i}"
            _ip("netns", "add", ns)
            _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
            _ip("link", "set", inside, "netns", ns)
            _ip("link", "set", outside, "master", self.bridge)
            _ip("link", "set", outside, "up")
            _ip("netns", "exec", ns, "ip", "addr", "add", f"{self.address[name]}/24", "dev", inside)
            _ip("netns", "exec", ns, "ip", "link", "set", inside, "up")
            _ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
        self._wait_until_up()

    def _wait_until_up(self, seconds: float = 10.0) -> None:
        """Waits until every link is up and forwards: an Open MPI daemon started on a link
        still coming up fails to report back, and mpirun ends before any rank starts."""
        deadline = time.monotonic() + seconds
        while True:
            waiting = []
            for i, name in enumerate(self.names):
                port = Path(f"/sys/class/net/{self.tag}v{i}/brport/state")
                if not port.exists() or port.read_text().strip() != "3":  # 3: forwarding
                    waiting.append(f"{self.tag}v{i}")
                inside = f"/sys/class/net/{self.tag}e{i}/operstate"
                state = _ip("netns", "exec", self.prefix + name, "cat", inside, check=False)
                if state.stdout.strip() != "up":
                    waiting.append(f"{self.tag}e{i}")
            if not waiting:
                return
            if time.monotonic() > deadline:
                raise Unavailable(f"links not up after {seconds:g} s: {', '.join(waiting)}")
            time.sleep(0.05)

    def disk(self, name: str) -> Path:
        """The directory that is ``name``'s /var/tmp (with ``private_disks``)."""
        return self.workdir / "disks" / name

    def outside_link(self, name: str) -> str:
        return f"{self.tag}v{self.names.index(name)}"

    def cut(self, name: str) -> None:
        """Cuts ``name``'s link: it can no longer reach or be reached by any other host, and
        the agent cannot reach it either (it waits :data:`_UNREACHABLE` seconds and fails, as
        ssh to an unreachable host does)."""
        _ip("link", "set", self.outside_link(name), "down")
        (self.workdir / f"cut-{name}").touch()

    def break_daemon(self, name: str) -> None:
        """From now on Open MPI's daemon cannot start on ``name`` (it fails at once, as one
        missing a library would), while the remote shell still reaches the host."""
        (self.workdir / f"nodaemon-{name}").touch()

    def limit(self, rate: str) -> None:
        """Limits every host's link to ``rate`` (e.g. ``"1gbit"``) each way, with tbf."""
        for i, name in enumerate(self.names):
            shape = ["root", "tbf", "rate", rate, "burst", "256kb", "latency", "50ms"]
            inside = ["ip", "netns", "exec", self.prefix + name]
            for cmd in (
                ["tc", "qdisc", "replace", "dev", f"{self.tag}v{i}", *shape],
                [*inside, "tc", "qdisc", "replace", "dev", f"{self.tag}e{i}", *shape],
            ):
                subprocess.run(cmd, capture_output=True, text=True, check=True)

    def pids(self, name: str) -> list[int]:
        """The processes running in ``name``'s namespace."""
        out = _ip("netns", "pids", self.prefix + name, check=False).stdout
        return [int(p) for p in out.split()]

    def _cleanup(self) -> None:
        for name in self.names:
            for pid in self.pids(name):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            _ip("netns", "del", self.prefix + name, check=False)
        for i in range(len(self.names)):
            _ip("link", "del", f"{self.tag}v{i}", check=False)
        _ip("link", "del", self.bridge, check=False)
        if self.private_disks:
            shutil.rmtree(self.workdir / "disks", ignore_errors=True)

    def __exit__(self, *exc) -> None:
        self._cleanup()
