"""Where remote ranks reach the launcher when host names do not resolve on its host.

Inside ``salloc -N2`` the nodes' names may resolve nowhere on the launcher's host, and its own
name to loopback (Debian maps it to 127.0.1.1, containers to 127.0.0.1). The ranks must then be
told addresses they can route to: Slurm's ``NodeAddr`` for the nodes, else every non-loopback
address of the launcher's host, tried by each supervisor in turn. A loopback address is never
what a remote rank is told. The machine's view (name resolution, ``ip addr``, ``scontrol``) is
replaced here; tests/integration/test_slurm_addr.py runs the real thing on namespace hosts.
"""

from __future__ import annotations

import socket

import pytest

from syncdp.launch import hosts
from syncdp.launch.lifeline import Lifeline, LifelineServer
from syncdp.watch import report

SLURM = {"SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "node[1-2]"}


@pytest.fixture
def machine(monkeypatch):
    """This machine as the test describes it: names, addresses, routes and Slurm's nodes."""
    view = {
        "names": {"vm": "127.0.0.1"},  # the launcher's own name resolves to loopback
        "addresses": [("lo", "127.0.0.1"), ("eth0", "192.0.2.2"), ("br0", "10.213.23.1")],
        "routes": {"10.213.23.11": "10.213.23.1", "10.213.23.12": "10.213.23.1"},
        "nodes": ["node1", "node2"],
        "node_addr": {},
    }
    monkeypatch.setattr(hosts.socket, "gethostname", lambda: "vm")
    monkeypatch.setattr(hosts.socket, "getfqdn", lambda: "vm")
    monkeypatch.setattr(hosts, "_resolve", lambda name: view["names"].get(name))
    monkeypatch.setattr(hosts, "_ip_addresses", lambda: list(view["addresses"]))
    monkeypatch.setattr(hosts, "_route_source", lambda address: view["routes"].get(address))
    monkeypatch.setattr(hosts, "_slurm_nodes", lambda environ: list(view["nodes"]))
    monkeypatch.setattr(
        hosts,
        "_slurm_node_addresses",
        lambda nodes: {n: a for n, a in view["node_addr"].items() if n in nodes},
    )
    return view


def test_unresolvable_slurm_nodes_are_reached_at_slurms_node_addresses(machine):
    machine["node_addr"] = {"node1": "10.213.23.11", "node2": "10.213.23.12"}
    assert hosts.job_address(environ=SLURM) == ("10.213.23.1", ("10.213.23.1",))


def test_without_any_route_every_non_loopback_address_is_advertised(machine):
    # No name resolves and Slurm says nothing: the ranks try each of the host's addresses.
    listen, advertised = hosts.job_address(environ=SLURM)
    assert listen == "0.0.0.0"
    assert advertised == ("192.0.2.2", "10.213.23.1")
    listen, advertised = hosts.job_address([hosts.Host("ha", 2), hosts.Host("hb", 2)])
    assert (listen, advertised) == ("0.0.0.0", ("192.0.2.2", "10.213.23.1"))


def test_a_name_that_resolves_to_loopback_is_never_advertised(machine):
    # A node name mapped to loopback here (a copied /etc/hosts) gives no route to follow, and the
    # host's own name (loopback too) is never the fallback.
    machine["names"].update({"node1": "127.0.1.1", "node2": "127.0.1.1"})
    machine["routes"]["127.0.1.1"] = "127.0.0.1"
    listen, advertised = hosts.job_address(environ=SLURM)
    assert listen == "0.0.0.0" and advertised == ("192.0.2.2", "10.213.23.1")
    assert not any(a.startswith("127.") or a == "vm" for a in advertised)


def test_a_resolvable_host_is_reached_on_its_route(machine):
    machine["names"]["hb"] = "10.213.23.12"
    assert hosts.job_address([hosts.Host("hb", 2)]) == ("10.213.23.1", ("10.213.23.1",))


def test_a_host_with_only_loopback_cannot_serve_remote_ranks(machine):
    machine["addresses"] = [("lo", "127.0.0.1")]
    with pytest.raises(hosts.HostError, match="no address other than loopback"):
        hosts.job_address(environ=SLURM)


def test_a_one_node_allocation_and_a_local_job_stay_on_loopback(machine):
    assert hosts.job_address(environ={"SLURM_JOB_NUM_NODES": "1"}) == (
        "127.0.0.1",
        ("127.0.0.1",),
    )
    assert hosts.job_address([hosts.Host("localhost", 2)]) == ("127.0.0.1", ("127.0.0.1",))


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_supervisor_takes_the_first_advertised_address_that_answers():
    job = report.Job.new()
    # 192.0.2.0/24 (TEST-NET-1) has no route or drops packets; 127.0.0.2 refuses; loopback works.
    server = LifelineServer(job, host="127.0.0.1", advertise=("127.0.0.2", "127.0.0.1"))
    try:
        port = server.address.rpartition(":")[2]
        assert server.address == f"127.0.0.2:{port},127.0.0.1:{port}"
        server.start()
        listed = f"127.0.0.1:{_closed_port()},{server.address}"
        lifeline = Lifeline.connect(listed, job, timeout=5)
        lifeline._sock.close()
    finally:
        server.close()


def test_no_answering_address_names_each_and_why():
    closed = _closed_port()
    with pytest.raises(OSError) as e:
        report.connect(f"127.0.0.1:{closed},127.0.0.2:{closed}", 2)
    assert f"127.0.0.1:{closed} (Connection refused)" in str(e.value)
    assert f"127.0.0.2:{closed} (Connection refused)" in str(e.value)
    with pytest.raises(ValueError):
        report.connect("nohostport", 2)
