"""Host lists, hostfiles and the pre-start host check, without starting a job."""

import os
import subprocess
import sys

import pytest

from syncdp.launch import hosts, restart, run
from syncdp.launch.hosts import Host, HostError


def test_host_list_with_and_without_slots():
    assert hosts.parse_hosts("a:2,b:3,c") == [Host("a", 2), Host("b", 3), Host("c", 1)]


def test_hostfile_in_horovods_format(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("# the cluster\nnode1 slots=4\n\nnode2 slots=2 max_slots=8  # big\nnode3\n")
    assert hosts.parse_hostfile(str(path)) == [Host("node1", 4), Host("node2", 2), Host("node3", 1)]


@pytest.mark.parametrize(
    "text, words",
    [
        ("node1 slots=0\n", "slots must be at least 1; got 0"),
        ("node1 slots=two\n", "slots must be a whole number; got 'two'"),
        ("node1 slots 4\n", "expected 'HOST slots=N'"),
        ("node1 cpus=4\n", "'cpus=4' is not a slots=N field"),
        ("node1 slots=2\nnode1 slots=2\n", "host 'node1' is listed twice"),
        ("# nothing\n\n", "lists no host"),
        ("node1 slots=2\r\nnode2 slots=2\r\n", "has Windows line endings (CRLF)"),
        ("node1:4\n", "a hostfile line reads 'HOST slots=N': 'node1 slots=4'"),
        ("node1:4 slots=2\n", "a hostfile line reads 'HOST slots=N': 'node1 slots=2'"),
        ("node1:4 max_slots=8\n", "reads 'HOST slots=N': 'node1 slots=4 max_slots=8'"),
    ],
)
def test_bad_hostfiles_name_the_line_and_the_fix(tmp_path, text, words):
    path = tmp_path / "hosts"
    path.write_bytes(text.encode())
    with pytest.raises(HostError) as e:
        hosts.parse_hostfile(str(path))
    assert words in str(e.value)
    if "slots" in text and "twice" not in words and "CRLF" not in words:
        assert f"{path}:1" in str(e.value)  # the line is named


@pytest.mark.parametrize(
    "spec, words",
    [("a:0", "at least 1"), ("a:x", "whole number"), ("a:2,,b", "empty host"), ("a,a", "twice")],
)
def test_bad_host_lists(spec, words):
    with pytest.raises(HostError, match=words):
        hosts.parse_hosts(spec)


def test_bad_hosts_are_usage_errors(tmp_path, capsys):
    path = tmp_path / "hosts"
    path.write_text("node1 slots=-1\n")
    with pytest.raises(SystemExit):
        run.parse_args(["-np", "2", "--hostfile", str(path), "python"])
    assert "slots must be at least 1" in capsys.readouterr().err


def test_np_defaults_to_the_listed_hosts_slots_then_to_the_slurm_allocation(monkeypatch, capsys):
    monkeypatch.setenv("SLURM_NTASKS", "6")
    assert run.parse_args(["python", "x.py"]).num_proc == 6
    # Hosts listed inside an allocation: their slots, not a task count they cannot hold.
    assert run.parse_args(["-H", "a:2,b:3", "python", "x.py"]).num_proc == 5
    monkeypatch.delenv("SLURM_NTASKS")
    assert run.parse_args(["-H", "a:2,b:3", "python", "x.py"]).num_proc == 5
    with pytest.raises(SystemExit):
        run.parse_args(["python", "x.py"])
    assert "-np is required outside a Slurm allocation" in capsys.readouterr().err


def test_slurm_tasks_per_node_reads_as_one_count_per_node():
    assert hosts.parse_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert hosts.parse_tasks_per_node("4") == [4]
    assert hosts.parse_tasks_per_node("1,3(x2)") == [1, 3, 3]
    for bad in ("", "2(x)", "x2", "2,,1", "2(3)"):
        assert hosts.parse_tasks_per_node(bad) is None, bad


def _allocation(monkeypatch, tmp_path, nodes: str, tasks: str, listing: str) -> None:
    """A Slurm allocation of ``nodes`` whose ``scontrol show hostnames`` prints ``listing``
    (a fake scontrol on PATH; an empty listing fails, as scontrol without a controller does)."""
    scontrol = tmp_path / "scontrol"
    body = f"echo '{listing}'" if listing else "exit 1"
    scontrol.write_text(f'#!/bin/sh\n[ "$1 $2" = "show hostnames" ] || exit 2\n{body}\n')
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", nodes)
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[1-3]")
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", tasks)
    monkeypatch.setenv("SLURM_NTASKS", "5")


def test_an_elastic_job_in_a_slurm_allocation_takes_its_nodes_as_hosts(monkeypatch, tmp_path):
    _allocation(monkeypatch, tmp_path, "3", "2(x2),1", "n1\nn2\nn3")
    c = run.parse_args(["--min-np", "2", "python", "x.py"])
    # The hosts a restart can leave one out of, with the slots mpirun reads from Slurm.
    assert c.hosts == "n1:2,n2:2,n3:1" and c.num_proc == 5
    assert c.slurm_nodes  # by Slurm's names: srun reaches them
    assert any("Slurm allocation's nodes (n1:2,n2:2,n3:1)" in note for note in c.notes)
    assert restart.Restarts.possible(c)
    # Not elastic: mpirun reads the allocation itself; -H given: it is the user's.
    assert run.parse_args(["python", "x.py"]).hosts is None
    given = run.parse_args(["--min-np", "2", "-H", "n1:2,n2:2", "python"])
    assert given.hosts == "n1:2,n2:2" and given.num_proc == 4  # -np: the hosts' slots
    assert not given.slurm_nodes


def test_more_ranks_than_a_slurm_allocation_of_several_nodes_has_tasks_are_refused(
    monkeypatch, tmp_path, capsys
):
    # mpirun reads the nodes from the allocation; with syncdp's --oversubscribe the extra
    # ranks went onto its nodes beyond their tasks, without a word.
    _allocation(monkeypatch, tmp_path, "3", "2(x2),1", "n1\nn2\nn3")
    assert run.parse_args(["-np", "5", "python", "x.py"]).num_proc == 5
    for argv in (["-np", "16"], ["-np", "16", "--min-np", "2"]):
        with pytest.raises(SystemExit):
            run.parse_args([*argv, "python", "x.py"])
        err = capsys.readouterr().err
        assert "-np 16 needs 16 slots, and the Slurm allocation's nodes have 5 tasks" in err
    # One node is one host: ranks may outnumber its tasks, as on any host given no hosts.
    _allocation(monkeypatch, tmp_path, "1", "1", "n1")
    assert run.parse_args(["-np", "2", "python", "x.py"]).num_proc == 2


def test_an_allocation_slurm_cannot_list_leaves_the_hosts_unset(monkeypatch, tmp_path):
    # scontrol fails, lists another number of nodes, or the allocation is one node: the job
    # runs on the allocation as mpirun reads it, and a lost node ends it, named.
    for nodes, tasks, listing in (
        ("3", "2(x2),1", ""),
        ("3", "2(x2),1", "n1\nn2"),
        ("1", "5", "n1"),
    ):
        _allocation(monkeypatch, tmp_path, nodes, tasks, listing)
        c = run.parse_args(["--min-np", "2", "python", "x.py"])
        assert c.hosts is None and not restart.Restarts.possible(c), (nodes, listing)


def test_ssh_flags_and_interface_reach_open_mpi(tmp_path):
    key = tmp_path / "id"
    key.write_text("key")
    c = run.parse_args(
        ["-H", "a:2,b:2", "-p", "2222", "-i", str(key), "--network-interface", "eth1", "python"]
    )
    cmd = run.build_command(c, run.build_env(c, environ={}))
    assert cmd[cmd.index("plm_ssh_args") + 1] == f"-p 2222 -i {key}"
    assert cmd[cmd.index("btl_tcp_if_include") + 1] == "eth1"
    assert cmd[cmd.index("oob_tcp_if_include") + 1] == "eth1"


def test_remote_shell_is_the_agent_from_mpi_args_else_ssh(tmp_path):
    assert hosts.remote_shell(["--mca", "plm_rsh_agent", "/x/agent.sh"], {}) == ["/x/agent.sh"]
    shell = hosts.remote_shell([], {}, ssh_port=2222, identity_file="/k")
    assert shell[0] == "ssh" and "BatchMode=yes" in shell
    assert shell[-4:] == ["-p", "2222", "-i", "/k"]


def test_inside_a_slurm_allocation_the_remote_shell_is_srun(tmp_path):
    # Open MPI starts its daemons there through Slurm, and nodes often refuse ssh: the host
    # checks and the cleanup of an elastic job went through ssh and failed (exit 255).
    srun = tmp_path / "srun"
    srun.write_text('#!/bin/sh\necho "srun $*"\nshift 6\nexec "$@"\n')
    srun.chmod(0o755)
    slurm = {"SLURM_JOB_ID": "42", "PATH": f"{tmp_path}:/usr/bin:/bin"}
    shell = hosts.remote_shell([], slurm, slurm_nodes=True)
    ran = subprocess.run(
        [*shell, "node7", "echo 'the command' $((1 + 1))"], capture_output=True, text=True
    )
    assert ran.stdout.splitlines() == [
        "srun --overlap -N1 -n1 -Q -w node7 sh -c echo 'the command' $((1 + 1))",
        "the command 2",
    ]
    # ssh where it is asked for, or outside an allocation; the user's agent always.
    # ssh where it is asked for, outside an allocation, or for hosts the user named (by
    # address, say: srun knows only Slurm's node names); the user's agent always.
    for asked in (
        hosts.remote_shell([], slurm, ssh_port=2222, slurm_nodes=True),
        hosts.remote_shell(["--prtemca", "plm", "ssh"], slurm, slurm_nodes=True),
        hosts.remote_shell([], {**slurm, "PRTE_MCA_plm": "rsh"}, slurm_nodes=True),
        hosts.remote_shell([], {"PATH": slurm["PATH"]}, slurm_nodes=True),
        hosts.remote_shell([], slurm),
    ):
        assert asked[0] == "ssh", asked
    assert hosts.remote_shell(["--mca", "plm_rsh_agent", "/x/a.sh"], slurm, slurm_nodes=True) == [
        "/x/a.sh"
    ]


def _shell(tmp_path, body: str) -> list[str]:
    """A fake remote shell: ``SHELL HOST COMMAND`` runs ``body`` with $1 = HOST."""
    path = tmp_path / "shell.sh"
    path.write_text(f'#!/bin/sh\nhost="$1"; shift\n{body}\n')
    path.chmod(0o755)
    return [str(path)]


def test_check_names_each_bad_host_and_why(tmp_path):
    import syncdp

    mine = f"{sys.version.split()[0]} {syncdp.__version__}"
    shell = _shell(
        tmp_path,
        'case "$host" in\n'
        f'  good) echo "{mine}" ;;\n'
        '  old) echo "3.8.1 0.0.1" ;;\n'
        "  slow) sleep 30 ;;\n"
        '  gone) echo "ssh: Could not resolve hostname gone" >&2; exit 255 ;;\n'
        "  quiet) exit 0 ;;\n"
        "esac",
    )
    listed = [Host(n, 1) for n in ("good", "old", "slow", "gone", "quiet", "localhost")]
    problems = hosts.check_hosts(listed, shell, timeout=2)
    assert len(problems) == 4
    old, slow, gone, quiet = problems
    # A shell that exits 0 printing nothing ran no check: the host was let through.
    assert quiet.startswith("host quiet: the check at ") and "printed nothing" in quiet
    assert old.startswith("host old: runs Python/syncdp 3.8.1 0.0.1")
    assert slow == "host slow: did not answer over the remote shell within 2 s"
    assert gone.startswith("host gone: the check command failed there (exit 255)")
    assert "Could not resolve hostname gone" in gone


def test_this_machines_own_addresses_are_local_and_others_are_not():
    # A hostfile that lists this machine by its address needs no remote shell (mpirun runs
    # such ranks here too); another machine's address, or a name, is not taken for it.
    import socket

    from syncdp.launch.hosts import is_local

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.200", 9))  # no packet is sent: picks the outgoing address
            own = probe.getsockname()[0]
        except OSError:  # no route at all: loopback only
            own = "127.0.0.1"
    assert is_local(own) and is_local("127.0.0.1") and is_local("127.0.0.2")
    assert is_local("::1") and is_local("[::1]")
    assert not is_local("203.0.113.77")  # TEST-NET-3: never this machine's
    assert not is_local("nosuch.invalid")
