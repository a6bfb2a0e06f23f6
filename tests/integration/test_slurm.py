"""A real Slurm cluster on namespace hosts: sbatch with syncdp-run, and srun --mpi=pmix.

slurmctld runs in the root namespace, one slurmd per namespace host (tests/netns.py), with a
private munged. Checked, in one allocation of 2 nodes x 2 tasks: ``syncdp-run`` without ``-np``
takes the allocation's 4 tasks and places 2 ranks on each node, and Slurm's own direct launch
(``srun --mpi=pmix``, no mpirun) runs the same program. And, in an allocation of 3 nodes x 1
task, an elastic job given no ``-H`` takes the nodes as its hosts, so it restarts on the two
left when one node's link is cut.
Skips, saying why, where Slurm (Debian's slurm-wlm, munge, libpmix-dev; .ci/run installs them)
or namespaces are missing; stops every daemon and removes everything it made, also on failure.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.launcher import ROOT, rank_env
from tests.netns import NamespaceHosts, Unavailable

NODES = ["n1", "n2"]
ELASTIC_NODES = ["n1", "n2", "n3"]
SUBNET = "10.213.9"

_CONF = """ClusterName=syncdptest
SlurmctldHost={controller}({gateway})
AuthType=auth/munge
AuthInfo=socket={d}/munge.socket
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
StateSaveLocation={d}/state
SlurmctldPidFile={d}/slurmctld.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdPidFile={d}/slurmd-%n.pid
SlurmdLogFile={d}/slurmd-%n.log
SlurmdSpoolDir={d}/spool-%n
TmpFS={d}/tmp-%n
SlurmctldPort=6917
SlurmdPort=6918
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
{nodes}
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


def _kill_pidfile(path: Path) -> None:
    try:
        os.kill(int(path.read_text().strip()), signal.SIGKILL)
    except (OSError, ValueError):
        pass


@pytest.fixture
def slurm(tmp_path, request):
    names = getattr(request, "param", NODES)  # the nodes' names
    missing = [
        t for t in ("slurmctld", "slurmd", "munged", "sbatch", "nsenter") if not shutil.which(t)
    ]
    if missing:
        pytest.skip(f"Slurm is not installed here (no {', '.join(missing)}); .ci/run installs it")
    # Not under tmp_path: munged wants every directory above its socket searchable by all,
    # and pytest's are private.
    d = Path(tempfile.mkdtemp(prefix="syncdp-slurm-"))
    d.chmod(0o755)
    env = {**rank_env(), "SLURM_CONF": str(d / "slurm.conf")}
    try:
        hosts = NamespaceHosts(tmp_path, names, subnet=SUBNET, tag="sls")
        hosts.__enter__()
    except Unavailable as e:
        pytest.skip(str(e))
    try:
        key = d / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        subprocess.run(
            [
                "munged",
                f"--socket={d}/munge.socket",
                f"--key-file={key}",
                f"--pid-file={d}/munged.pid",
                f"--log-file={d}/munged.log",
                f"--seed-file={d}/seed",
            ],
            check=True,
            capture_output=True,
            timeout=30,
        )
        nodes = "\n".join(
            f"NodeName={n} NodeAddr={hosts.address[n]} CPUs=2 State=UNKNOWN" for n in names
        )
        controller = subprocess.run(["hostname", "-s"], capture_output=True, text=True).stdout
        (d / "slurm.conf").write_text(
            _CONF.format(controller=controller.strip(), gateway=hosts.gateway, d=d, nodes=nodes)
        )
        for n in names:
            (d / f"spool-{n}").mkdir()
            (d / f"tmp-{n}").mkdir()
        (d / "state").mkdir()
        subprocess.run(["slurmctld", "-f", str(d / "slurm.conf")], check=True, env=env, timeout=30)
        for n in names:
            # Not under `ip netns exec`: slurmd would not see /sys/fs/cgroup and not start.
            subprocess.run(
                [
                    "nsenter",
                    f"--net=/var/run/netns/{hosts.prefix}{n}",
                    "unshare",
                    "--uts",
                    "sh",
                    "-c",
                    f"hostname {n} && exec slurmd -N {n} -f {d}/slurm.conf",
                ],
                check=True,
                env=env,
                timeout=30,
            )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            out = subprocess.run(
                ["sinfo", "-h", "-o", "%T %D"], capture_output=True, text=True, env=env
            ).stdout.split()
            if out[:2] == ["idle", str(len(names))]:
                break
            time.sleep(0.5)
        else:
            log = (d / "slurmctld.log").read_text()[-2000:]
            pytest.fail(f"the Slurm nodes never became idle: {out}\n{log}")
        yield d, env, hosts
    finally:
        subprocess.run(["scancel", "--full", "-u", "root"], env=env, capture_output=True)
        for n in names:
            _kill_pidfile(d / f"slurmd-{n}.pid")
        _kill_pidfile(d / "slurmctld.pid")
        _kill_pidfile(d / "munged.pid")
        hosts.__exit__(None, None, None)
        shutil.rmtree(d, ignore_errors=True)


JOB = """
import socket
import tensorflow as tf
import syncdp
syncdp.init()
r, n = syncdp.rank(), syncdp.size()
total = int(syncdp.allreduce(tf.constant(r + 1), op=syncdp.Sum))
hosts = syncdp.allgather_object(socket.gethostname())
print(f"{{MODE}} rank {r}/{n} on {socket.gethostname()} local {syncdp.local_rank()}/"
      f"{syncdp.local_size()} cross {syncdp.cross_rank()}/{syncdp.cross_size()} sum {total} "
      f"hosts {','.join(hosts)}", flush=True)
"""


ALONE = "import syncdp; syncdp.init(); print('alone size', syncdp.size(), flush=True)"


def test_sbatch_with_syncdp_run_and_srun_direct_launch(slurm, tmp_path):
    d, env, hosts = slurm
    for mode in ("launcher", "direct"):
        (tmp_path / f"{mode}.py").write_text(JOB.replace("{{MODE}}", mode))
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/sh\n"
        f"cd {ROOT}\n"
        # No -np: the allocation's task count. The report address on the nodes' subnet.
        f"syncdp-run --network-interface {hosts.subnet} python {tmp_path}/launcher.py\n"
        'echo "syncdp-run exit $?"\n'
        f"srun --mpi=pmix python {tmp_path}/direct.py\n"
        'echo "srun exit $?"\n'
        # One process in the batch step is a job of one; srun without PMIx starts processes
        # whose MPI finds no other: refused, not a rank 0 each.
        f"python -c {ALONE!r}\n"
        'echo "batch step exit $?"\n'
        f"srun --mpi=none python -c {ALONE!r}\n"
        'echo "srun without pmix exit $?"\n'
    )
    out = tmp_path / "job.out"
    subprocess.run(
        ["sbatch", "--wait", "-N", "2", "-n", "4", "-o", str(out), str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    text = out.read_text()
    assert "syncdp-run exit 0" in text and "srun exit 0" in text, text[-4000:]
    for mode in ("launcher", "direct"):
        lines = re.findall(
            rf"{mode} rank (\d)/4 on (n\d) local (\d)/2 cross (\d)/2 sum 10 "
            rf"hosts n1,n1,n2,n2",
            text,
        )
        assert sorted(lines) == [
            ("0", "n1", "0", "0"),
            ("1", "n1", "1", "0"),
            ("2", "n2", "0", "1"),
            ("3", "n2", "1", "1"),
        ], text[-4000:]
    assert "alone size 1" in text and "batch step exit 0" in text, text[-4000:]
    assert "srun started this process as one of 4 (SLURM_STEP_NUM_TASKS=4)" in text, text[-4000:]
    assert re.search(r"srun without pmix exit [1-9]", text), text[-4000:]
    assert text.count("alone size") == 1, text[-4000:]
    # Through the launcher every line carries its rank.
    assert re.search(r"\[2\]<stdout>:launcher rank 2/4 on n2", text), text[-4000:]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:300]
    except OSError:
        return ""


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


@pytest.mark.parametrize("slurm", [ELASTIC_NODES], indirect=True)
def test_an_elastic_job_in_an_allocation_restarts_without_a_node_it_loses(slurm, tmp_path):
    # No -H: an elastic job takes the allocation's nodes as its hosts (n1:1,n2:1,n3:1), so when
    # n2's link is cut after epoch 0 the launcher starts the job again on n1 and n3 (--min-np 2),
    # in the same allocation, from the last commit: Open MPI reaches n3 through srun again, and
    # leaves the lost n2 alone. The program and its checks are the namespace
    # hosts' (test_elastic_hostloss.py): every epoch done, one weight digest at size 2, equal to
    # one process's result.
    from tests.integration import test_elastic_hostloss as hostloss

    d, env, hosts = slurm
    program = tmp_path / "elastic.py"
    program.write_text(hostloss.JOB)
    # No remote-shell agent (nor ssh, which the nodes do not run): Open MPI starts its
    # daemons through srun, and so does the launcher its host checks and its cleanup.
    mpi_args = "--mca mpi_yield_when_idle 1"
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/sh\n"
        f"cd {ROOT}\n"
        f"syncdp-run --min-np 2 --network-interface {hosts.subnet} --mpi-args '{mpi_args}' "
        f"python {program}\n"
        'echo "syncdp-run exit $?"\n'
    )
    out = tmp_path / "job.out"
    submitted = subprocess.run(
        ["sbatch", "--no-kill", "-N", "3", "-n", "3", "-o", str(out), str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert submitted.returncode == 0, submitted.stderr

    def wait_for(text: str, seconds: float) -> str:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            got = out.read_text() if out.exists() else ""
            if text in got:
                return got
            time.sleep(0.2)
        steps = subprocess.run(
            ["squeue", "--steps"], env=env, capture_output=True, text=True
        ).stdout
        log = (d / "slurmctld.log").read_text()[-1500:]
        procs = "\n".join(f"{n} {p} {_cmdline(p)}" for n in ELASTIC_NODES for p in hosts.pids(n))
        pytest.fail(f"no {text!r} within {seconds:g} s:\n{got[-5000:]}\n{steps}\n{log}\n{procs}")

    wait_for("EPOCH 0 SIZE 3", 150)
    hosts.cut("n2")
    cut = time.monotonic()
    text = wait_for("syncdp-run exit", hostloss.LIMIT)
    ended = time.monotonic()
    tail = text[-5000:]
    assert "syncdp-run exit 0" in text, tail
    assert "elastic: the hosts are the Slurm allocation's nodes (n1:1,n2:1,n3:1)" in text, tail
    sizes = hostloss._check_final_weights(text, 2, tail)
    assert all(s >= 2 for s in sizes.values()), tail
    assert re.search(r"elastic: host n2 was lost \(no word from it", text), tail
    assert "elastic: restart 1: starting 2 rank(s) on n1:1,n3:1 without n2;" in text, tail
    resumed = r"elastic: resumed from commit \d+, kept on n[13]'s disk at size 2"
    assert re.search(resumed, text), tail
    print("\n".join(line for line in text.splitlines() if line.startswith("syncdp-run: ")))
    print(f"cut to the launcher's end: {ended - cut:.1f} s")
    # Nothing of the job left on any node 15 s after it (Slurm's own daemons stay).
    deadline = ended + 15
    while True:
        left = {}
        for n in ELASTIC_NODES:
            named = [(p, _comm(p)) for p in hosts.pids(n)]
            job = [(p, c) for p, c in named if c not in ("slurmd", "slurmstepd")]
            if job:
                left[n] = job
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not left, f"processes left on nodes {left}\n{text[-3000:]}"
