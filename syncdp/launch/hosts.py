"""Hosts for a multi-host job: parse ``-H``/``--hostfile``, reach hosts, check them before starting.

``syncdp-run -H a:2,b:2`` and ``--hostfile FILE`` (horovodrun's ``host slots=N`` lines) name
the hosts; Open MPI starts a daemon on each through a remote shell (ssh, or the agent given as
``--mpi-args "--mca plm_rsh_agent AGENT"``). Before the job starts, :func:`check_hosts` runs
one small command on every remote host through that same shell, in parallel and within a
bound: the host must answer, and run the same Python and syncdp versions as the launcher.
A host that does not is named with the reason, and nothing starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import ipaddress
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence

__all__ = [
    "Host",
    "HostError",
    "parse_hosts",
    "parse_hostfile",
    "listed",
    "format_hosts",
    "slurm_allocation",
    "parse_tasks_per_node",
    "remote_shell",
    "check_hosts",
    "host_problems",
    "stop_probes",
    "loopback_interface",
    "is_local",
    "resolve",
    "local_address",
    "job_address",
]

# The command each remote host runs for the check: its Python and syncdp versions.
_PROBE = "import sys, syncdp; print(sys.version.split()[0], syncdp.__version__)"


class HostError(ValueError):
    """A host list, hostfile or host is not usable; the message names the host or line."""


@dataclasses.dataclass(frozen=True)
class Host:
    """One host of the job and the ranks (slots) it takes."""

    name: str
    slots: int


def _slots(text: str, where: str) -> int:
    try:
        slots = int(text)
    except ValueError:
        raise HostError(f"{where}: slots must be a whole number; got {text!r}.") from None
    if slots < 1:
        raise HostError(f"{where}: slots must be at least 1; got {slots}.")
    return slots


def _unique(hosts: list[Host], where: str) -> list[Host]:
    seen = set()
    for h in hosts:
        if h.name in seen:
            raise HostError(
                f"{where}: host {h.name!r} is listed twice; give it once with its slots."
            )
        seen.add(h.name)
    return hosts


def parse_hosts(spec: str, *, default_slots: int = 1) -> list[Host]:
    """Parses ``-H host1:2,host2:2``.

    Args:
        spec: The ``-H`` value.
        default_slots: The slots of a host given without ``:N`` (horovodrun's
            ``--slots-per-host``). Defaults to 1.

    Raises:
        HostError: An empty entry, a bad slot count, or a host listed twice.
    """
    hosts = []
    for entry in spec.split(","):
        entry = entry.strip()
        name, _, count = entry.partition(":")
        if not name:
            raise HostError(f"-H {spec!r}: empty host name in entry {entry!r}.")
        hosts.append(Host(name, _slots(count, f"-H entry {entry!r}") if count else default_slots))
    return _unique(hosts, f"-H {spec!r}")


def parse_hostfile(path: str, *, default_slots: int = 1) -> list[Host]:
    """Parses a hostfile: ``host slots=N`` per line (``#`` starts a comment; Open MPI's
    ``max_slots=`` is accepted and ignored).

    Args:
        path: The hostfile.
        default_slots: The slots of a line without ``slots=N`` (horovodrun's
            ``--slots-per-host``). Defaults to 1.

    Raises:
        HostError: The file cannot be read, a line is malformed (named with its number), a
            slot count is not a positive integer, a host is listed twice, or no host is left.
    """
    try:
        with open(path, encoding="utf-8", newline="") as f:
            text = f.read()
    except OSError as e:
        raise HostError(f"hostfile {path!r} cannot be read: {e.strerror}.") from None
    except UnicodeDecodeError as e:
        raise HostError(
            f"hostfile {path!r} is not text (byte {e.start} is not UTF-8): a hostfile lists "
            "'HOST slots=N' lines."
        ) from None
    if "\r" in text:  # mpirun, which reads the file too, stops at the first one
        raise HostError(
            f"hostfile {path!r} has Windows line endings (CRLF), which Open MPI's mpirun cannot "
            f"read; convert it, e.g. with: sed -i 's/\\r$//' {shlex.quote(path)}"
        )
    hosts = []
    for number, line in enumerate(text.splitlines(), start=1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        where = f"{path}:{number} ({line.strip()!r})"
        slots = default_slots
        for word in words[1:]:
            key, eq, value = word.partition("=")
            if not eq or key not in ("slots", "max_slots", "max-slots"):
                raise HostError(
                    f"{where}: expected 'HOST slots=N'; {word!r} is not a slots=N field."
                )
            if key == "slots":
                slots = _slots(value, where)
        name, colon, count = words[0].rpartition(":")
        if colon and ":" not in name and count.isdigit():  # -H's spelling, not an IPv6 address
            given = any(word.startswith("slots=") for word in words[1:])
            fields = " ".join(words[1:] if given else [f"slots={count}", *words[1:]])
            raise HostError(f"{where}: a hostfile line reads 'HOST slots=N': '{name} {fields}'.")
        hosts.append(Host(words[0], slots))
    if not hosts:
        raise HostError(f"hostfile {path!r} lists no host.")
    return _unique(hosts, f"hostfile {path!r}")


def listed(
    hosts: str | None, hostfile: str | None, *, slots_per_host: int | None = None
) -> list[Host] | None:
    """The hosts of ``-H`` or ``--hostfile``, or None when neither is given.

    Args:
        hosts: ``-H``'s value, or None.
        hostfile: ``--hostfile``'s path, or None.
        slots_per_host: The slots of a host listed without a count (horovodrun's
            ``--slots-per-host``). Defaults to 1.

    Raises:
        HostError: See :func:`parse_hosts` and :func:`parse_hostfile`.
    """
    slots = slots_per_host or 1
    if hostfile:
        return parse_hostfile(hostfile, default_slots=slots)
    return parse_hosts(hosts, default_slots=slots) if hosts else None


def format_hosts(hosts: Sequence[Host]) -> str:
    """The ``-H``/``mpirun --host`` text for ``hosts``, every host with its slots."""
    return ",".join(f"{h.name}:{h.slots}" for h in hosts)


def is_local(name: str) -> bool:
    """Whether ``name`` is this machine (no remote shell needed to reach it): its names, a
    loopback address, or an address of one of its interfaces (in this network namespace)."""
    if name in ("localhost", "127.0.0.1", socket.gethostname(), socket.getfqdn()):
        return True
    return _own_address(name)


@functools.lru_cache(maxsize=256)
def _own_address(name: str) -> bool:
    """Whether ``name`` is an IP address this machine holds: one a socket can be bound to
    here. Names are not looked up (no DNS wait)."""
    try:
        address = ipaddress.ip_address(name.strip("[]"))
    except ValueError:
        return False
    if address.is_loopback:
        return True
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((str(address), 0))
    except OSError:
        return False
    return True


def remote_shell(
    mpi_args: Sequence[str],
    environ: Mapping[str, str] | None = None,
    *,
    ssh_port: int | None = None,
    identity_file: str | None = None,
    connect_timeout: float = 10.0,
    slurm_nodes: bool = False,
) -> list[str]:
    """The command that runs a command on a host: ``[*shell, HOST, COMMAND]``.

    The agent Open MPI will use (``--mca plm_rsh_agent X`` or ``--prtemca plm_ssh_agent X``
    in ``mpi_args``, else ``PRTE_MCA_plm_ssh_agent``); for ``slurm_nodes`` (the hosts are the
    Slurm allocation's nodes, by Slurm's names), where Open MPI starts its daemons through
    Slurm and nodes often refuse ssh, ``srun`` (a step on that node alone, sharing the
    allocation's resources: ``--overlap``), unless ssh is asked for (a port, an identity file,
    Open MPI told to use it); otherwise ssh with the port and identity file, in batch mode (no
    password prompt can hang the check).
    """
    environ = os.environ if environ is None else environ
    agent = None
    launcher = environ.get("PRTE_MCA_plm") or environ.get("OMPI_MCA_plm")
    args = list(mpi_args)
    for i, arg in enumerate(args[:-2]):
        if arg in ("--mca", "--prtemca", "-mca") and args[i + 1] in (
            "plm_rsh_agent",
            "plm_ssh_agent",
        ):
            agent = args[i + 2]
        if arg in ("--mca", "--prtemca", "-mca") and args[i + 1] == "plm":
            launcher = args[i + 2]
    agent = agent or environ.get("PRTE_MCA_plm_ssh_agent")
    if agent:
        return shlex.split(agent)
    ssh_asked = ssh_port or identity_file or launcher in ("rsh", "ssh")
    if slurm_nodes and environ.get("SLURM_JOB_ID") and not ssh_asked:
        srun = shutil.which("srun", path=environ.get("PATH"))
        if srun:  # [*shell, HOST, COMMAND]: the host is $0, the command $1
            step = f"exec {shlex.quote(srun)} --overlap -N1 -n1 -Q -w " + '"$0" sh -c "$1"'
            return ["sh", "-c", step]
    cmd = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={int(connect_timeout)}"]
    if ssh_port:
        cmd += ["-p", str(ssh_port)]
    if identity_file:
        cmd += ["-i", identity_file]
    return cmd


# The host checks' remote shells running now, for stop_probes(), which also stops new ones.
_PROBES: set[subprocess.Popen] = set()
_PROBES_LOCK = threading.Lock()
_PROBES_STOPPED = threading.Event()


def _probe(shell: list[str], host: str, timeout: float) -> tuple[str | None, str]:
    """Runs the version probe on ``host``; returns (its output or None, why it failed)."""
    command = f"{shlex.quote(sys.executable)} -c {shlex.quote(_PROBE)}"
    with _PROBES_LOCK:  # started and registered at once: stop_probes misses none
        if _PROBES_STOPPED.is_set():
            return None, "not checked: the launcher is stopping"
        try:
            proc = subprocess.Popen(
                [*shell, host, command], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        except OSError as e:
            return None, f"the remote shell {shell[0]!r} could not run: {e.strerror}"
        _PROBES.add(proc)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()  # not its pipes: a process the shell started may hold them open
        proc.stdout.close()
        proc.stderr.close()
        return None, f"did not answer over the remote shell within {timeout:g} s"
    finally:
        with _PROBES_LOCK:
            _PROBES.discard(proc)
    if proc.returncode != 0:
        detail = (err.strip().splitlines() or ["no message"])[-1]
        return None, f"the check command failed there (exit {proc.returncode}): {detail}"
    return out.strip(), ""


def stop_probes() -> None:
    """Kills the host checks' remote shells still running, and starts no more (the launcher
    is stopping)."""
    with _PROBES_LOCK:
        _PROBES_STOPPED.set()
        running = list(_PROBES)
    for proc in running:
        with contextlib.suppress(OSError):
            proc.kill()


def check_hosts(hosts: Sequence[Host], shell: list[str], timeout: float = 30.0) -> list[str]:
    """Checks every remote host in parallel; returns one problem per bad host (empty: all good).

    A host must be resolvable, answer over the remote shell within ``timeout`` seconds, and
    run the same Python and syncdp versions as this launcher (at the same interpreter path).
    """
    problems = host_problems(hosts, shell, timeout)
    return [f"host {h}: {why}" for h, why in problems.items()]


def host_problems(hosts: Sequence[Host], shell: list[str], timeout: float = 30.0) -> dict[str, str]:
    """:func:`check_hosts`, by host: what is wrong with each bad remote host, in list order."""
    from syncdp import __version__

    mine = f"{sys.version.split()[0]} {__version__}"
    problems: dict[str, str] = {}
    remote = [h.name for h in hosts if not is_local(h.name)]

    good: set[str] = set()  # a host is good only when its check said so

    def check(host: str) -> None:
        output, why = _probe(shell, host, timeout)
        lines = (output or "").splitlines()
        if output is None:
            problems[host] = why
        elif not lines:
            problems[host] = (
                f"the check at {sys.executable} printed nothing (it prints the Python and "
                "syncdp versions): the remote shell ran something else"
            )
        elif lines[-1] != mine:
            problems[host] = (
                f"runs Python/syncdp {lines[-1]} at {sys.executable}, but the launcher runs "
                f"{mine}; install the same versions on every host"
            )
        else:
            good.add(host)

    threads = [threading.Thread(target=check, args=(h,), daemon=True) for h in remote]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5)
    return {
        h: problems.get(h, f"the check did not end within {timeout + 5:g} s")
        for h in remote
        if h not in good
    }


def _ip_addresses() -> list[tuple[str, str]]:
    """This machine's IPv4 addresses as ``(interface, address)``, from ``ip -o -4 addr``."""
    try:
        out = subprocess.run(
            ["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    found = []
    for line in out.stdout.splitlines():
        words = line.split()
        if len(words) >= 4 and words[2] == "inet":
            found.append((words[1], words[3].split("/")[0]))
    return found


def local_address(interface: str) -> str | None:
    """This machine's IPv4 address on ``interface`` (a NIC name, or a CIDR subnet such as
    ``10.0.0.0/24``); None when it has none."""
    for name, address in _ip_addresses():
        if name == interface:
            return address
        try:
            if ipaddress.ip_address(address) in ipaddress.ip_network(interface, strict=False):
                return address
        except ValueError:
            continue
    return None


def loopback_interface(interface: str) -> bool:
    """Whether ``interface`` (a NIC name, or a CIDR subnet) is this machine's loopback."""
    try:
        return ipaddress.ip_network(interface, strict=False).is_loopback
    except ValueError:  # a name
        if interface == "lo":  # Linux's, also where ip(8) cannot list addresses
            return True
        address = local_address(interface)
        return address is not None and _loopback(address)


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def resolve(name: str) -> str | None:
    """The IPv4 address ``name`` resolves to here (itself for an address); None when it does
    not resolve."""
    try:
        return socket.getaddrinfo(name, 9, socket.AF_INET, socket.SOCK_DGRAM)[0][4][0]
    except (OSError, IndexError):
        return None


_resolve = resolve


def _route_source(address: str) -> str | None:
    """This machine's address on the way to ``address`` (no packet is sent); None when there
    is no route."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((address, 9))
            return probe.getsockname()[0]
    except OSError:
        return None


def _slurm_nodes(environ: Mapping[str, str]) -> list[str]:
    """The allocation's node names (``scontrol show hostnames``); empty when unknown."""
    nodes = environ.get("SLURM_JOB_NODELIST")
    if not nodes:
        return []
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodes], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return out.stdout.split() if out.returncode == 0 else []


def parse_tasks_per_node(text: str) -> list[int] | None:
    """Slurm's ``SLURM_TASKS_PER_NODE`` (``2(x3),1``: three nodes of 2 tasks, then one of 1)
    as one count per node, in the allocation's node order; None when it is not in that form."""
    counts: list[int] = []
    for part in text.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            return None
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def slurm_allocation(environ: Mapping[str, str] | None = None) -> list[Host] | None:
    """The nodes of the Slurm allocation this runs in, each with its tasks as its slots (what
    Open MPI reads from the allocation itself); None outside an allocation of two or more nodes,
    or where Slurm cannot list them.

    Args:
        environ: The environment (for Slurm's). Defaults to ``os.environ``.
    """
    environ = os.environ if environ is None else environ
    count = environ.get("SLURM_JOB_NUM_NODES", "")
    if not count.isdigit() or int(count) < 2:
        return None
    tasks = parse_tasks_per_node(environ.get("SLURM_TASKS_PER_NODE", ""))
    if tasks is None:
        return None
    nodes = _slurm_nodes(environ)
    if len(nodes) != len(tasks):
        return None
    return [Host(node, n) for node, n in zip(nodes, tasks) if n > 0]


def _slurm_node_addresses(nodes: Sequence[str]) -> dict[str, str]:
    """Each node's ``NodeAddr`` as Slurm knows it (``scontrol show node``): how slurmctld
    reaches a node whose name does not resolve here. Empty when Slurm cannot say."""
    if not nodes:
        return {}
    try:
        out = subprocess.run(
            ["scontrol", "-o", "show", "node", ",".join(nodes)],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return {}
    found = {}
    for line in out.stdout.splitlines():
        fields = dict(w.split("=", 1) for w in line.split() if "=" in w)
        if fields.get("NodeName") and fields.get("NodeAddr"):
            found[fields["NodeName"]] = fields["NodeAddr"]
    return found


def job_address(
    hosts: Sequence[Host] = (),
    *,
    network_interfaces: Sequence[str] = (),
    environ: Mapping[str, str] | None = None,
) -> tuple[str, tuple[str, ...]]:
    """Where the launcher listens for its ranks, and the addresses they are told.

    Loopback for a job on this host alone. With ``network_interfaces``: this machine's address
    on the first of them it has. Otherwise the address this machine reaches the first remote
    host from: a listed host, or a node of a Slurm allocation of several, by the address its
    name resolves to here or, for a Slurm node whose name does not resolve, the ``NodeAddr``
    Slurm has for it. When none of that can be told (names that resolve nowhere here), the
    launcher listens on every interface and tells the ranks every non-loopback address of this
    machine: each supervisor tries them all and keeps the first that answers
    (:func:`syncdp.watch.report.connect`). A name that resolves to loopback is never what
    remote ranks are told (Debian maps the host name to 127.0.1.1; a container, to 127.0.0.1).

    Args:
        hosts: The job's hosts (``-H``/``--hostfile``). Defaults to none.
        network_interfaces: ``--network-interface(s)``' NIC names or CIDR subnets. Defaults
            to none.
        environ: The environment (for Slurm's). Defaults to ``os.environ``.

    Returns:
        ``(address to listen on, addresses the ranks are told, in the order to try them)``.

    Raises:
        HostError: The job has remote hosts but this machine has no address other than
            loopback to give them.
    """
    environ = os.environ if environ is None else environ
    remote = [h.name for h in hosts if not is_local(h.name)]
    nodes = environ.get("SLURM_JOB_NUM_NODES", "1")
    slurm = not hosts and nodes.isdigit() and int(nodes) > 1
    if slurm:
        remote = [n for n in _slurm_nodes(environ) if not is_local(n)]
    if not remote and not slurm:
        return "127.0.0.1", ("127.0.0.1",)
    for interface in network_interfaces:
        address = local_address(interface)
        if address and not _loopback(address):  # remote ranks cannot reach loopback
            return address, (address,)
    addresses = {name: _resolve(name) for name in remote}
    if slurm:
        unresolved = [n for n, a in addresses.items() if a is None or _loopback(a)]
        addresses.update(_slurm_node_addresses(unresolved))
    for address in addresses.values():
        if address is None or _loopback(address):
            continue
        source = _route_source(address)
        if source and not _loopback(source):
            return source, (source,)
    every = [a for name, a in _ip_addresses() if name != "lo" and not _loopback(a)]
    mine = _resolve(socket.gethostname())
    if mine and not _loopback(mine) and mine not in every:
        every.append(mine)
    if not every:
        raise HostError(
            "the ranks on other hosts must reach the launcher, but this machine has no "
            "address other than loopback (ip -4 addr lists none, and its name resolves to "
            f"{mine or 'nothing'}); connect it to the hosts' network, or run the launcher on "
            "one of the hosts"
        )
    return "0.0.0.0", tuple(every)
