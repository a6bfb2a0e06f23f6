"""Ranks on hosts whose names do not resolve on the launcher's host still reach the launcher.

The case of ``salloc -N2`` + ``syncdp-run python train.py`` where the allocation's node names
resolve nowhere on the launcher's host, and that host's own name resolves to loopback (this
machine's /etc/hosts maps its name to 127.0.0.1, as Debian maps it to 127.0.1.1). Namespace
hosts (tests/netns.py) named ``ha`` and ``hb`` resolve nowhere here, and no
``--network-interface`` is given, so the launcher cannot tell which of its addresses the hosts
route to: it must advertise every non-loopback address, and each supervisor must find the one
that answers. Before, every rank ended at once with "the launcher's lifeline at vm:PORT cannot
be reached". Without Slurm installed this is the same launcher path (``job_address`` with
nothing resolvable); tests/unit/test_slurm_addr.py covers Slurm's ``NodeAddr`` choice.
"""

from __future__ import annotations

import socket
import time

import pytest

from tests.launcher import check, launch
from tests.netns import NamespaceHosts, Unavailable

HOSTS = ["ha", "hb"]

JOB = (
    "import os, socket, syncdp; syncdp.init(); "
    "print('RAN', syncdp.rank(), socket.gethostname(), os.environ['SYNCDP_LIFELINE_ADDR'], "
    "os.environ['SYNCDP_REPORT_ADDR'], float(syncdp.allreduce(1.0 + syncdp.rank(), op=syncdp.Sum)))"
)


@pytest.fixture
def cluster(tmp_path):
    try:
        with NamespaceHosts(tmp_path, HOSTS, subnet="10.213.23", tag="ssa") as hosts:
            yield hosts
    except Unavailable as e:
        pytest.skip(str(e))


def test_ranks_reach_the_launcher_when_host_names_do_not_resolve(cluster):
    for name in HOSTS:
        with pytest.raises(OSError):
            socket.getaddrinfo(name, 9)  # the premise: these names resolve nowhere here
    result = check(
        launch(
            2,
            "python",
            "-c",
            JOB,
            launcher_args=(
                "-H",
                "ha:1,hb:1",
                "--mpi-args",
                f"--mca plm_rsh_agent {cluster.agent} --mca mpi_yield_when_idle 1",
            ),
            timeout=120,
        )
    )
    lines = [
        line.split(":", 1)[1].split() for line in result.stdout.splitlines() if ":RAN " in line
    ]
    assert sorted((int(w[1]), w[2]) for w in lines) == [(0, "ha"), (1, "hb")], result.stdout
    for words in lines:
        for address in (words[3], words[4]):
            hosts = [entry.rpartition(":")[0] for entry in address.split(",")]
            assert cluster.gateway in hosts, address  # the one that routes from the hosts
            assert not any(h.startswith("127.") or h == socket.gethostname() for h in hosts)
        assert float(words[5]) == 3.0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(cluster.pids(h) for h in HOSTS):
        time.sleep(0.5)
    assert not any(cluster.pids(h) for h in HOSTS)
