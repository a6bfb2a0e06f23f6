"""Every process of a job carries its settings and identity, spawned ones too (issue 35.1).

syncdp.membership.jobenv: what the launcher names in SYNCDP_CARRIED, what a spawn passes on
(the id and secret through the MPI info, never on a command line; the rest as the worker's
--job-env), and how a spawned process that lacks them refuses to train. The last test spawns a
real process through Open MPI without the job's settings: it must never train, and the spawning
process must learn at once that it is gone (never a hang, never a second rank 0).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from syncdp.launch import run
from syncdp.membership import jobenv, membership
from syncdp.watch import report
from tests.launcher import ROOT, python_script

_JOB = report.Job("0123456789abcdef", "ab" * 32)


def _rank_env(*argv: str) -> dict[str, str]:
    config = run.parse_args(["-np", "2", "--min-np", "1", *argv, "python", "train.py"])
    return run.build_env(
        config,
        environ={
            "PATH": "/usr/bin",
            "HOME": "/root",
            "MY_VAR": "x",
            "OMPI_MCA_btl": "self,tcp",
            "DATA_DIR": "/data",
            "HF_TOKEN": "hf_xyz",
            "SLURM_PROCID": "0",
        },
        report_addr="10.0.0.1:5000",
        lifeline_addr="10.0.0.1:5001",
        job=_JOB,
        commit_dir="/var/tmp/syncdp-0/job",
    )


def test_the_launcher_names_what_every_process_carries():
    env = _rank_env("--mpi-args", "-x MY_VAR -x OTHER=1")
    names = env[jobenv.CARRIED_VAR].split(",")
    for name in (
        "SYNCDP_MIN_NP",
        "SYNCDP_JOB_ID",
        "SYNCDP_REPORT_SECRET",
        "SYNCDP_LIFELINE_ADDR",
        "SYNCDP_REPORT_ADDR",
        "SYNCDP_COMMIT_DIR",
        "SYNCDP_LAUNCHER",
        "PATH",
        "PYTHONUNBUFFERED",
        "OMPI_MCA_btl",  # the user's Open MPI settings
        "MY_VAR",  # the user's -x NAME
        "OTHER",  # and -x NAME=VALUE
    ):
        assert name in names, name
    assert "HOME" not in names and jobenv.CARRIED_VAR not in names
    # The rest of the launcher's environment would ride on a spawned supervisor's command line
    # (readable by any user of the host, one argument bounded to 128 KiB): the first ranks
    # get it by name (-x), a spawned one does not.
    assert not {"DATA_DIR", "HF_TOKEN", "SLURM_PROCID"} & set(names)
    # Every name is one variable: ranks read them back with split(",").
    assert all(n and "=" not in n for n in names)


def test_a_spawn_passes_the_secret_by_info_and_the_rest_as_an_argument():
    env = {**_rank_env(), "SYNCDP_REPLACEMENT": "7", "OMPI_COMM_WORLD_RANK": "1"}
    args, envar = jobenv.spawn_parts(env)
    assert args[0] == jobenv.JOB_ENV_FLAG
    carried = json.loads(args[1])
    # Never on a command line (any user of the host could read it there).
    assert _JOB.secret not in args[1] and "SYNCDP_REPORT_SECRET" not in carried
    assert envar == f"SYNCDP_JOB_ID={_JOB.id}\nSYNCDP_REPORT_SECRET={_JOB.secret}"
    assert len(envar) < 256  # Open MPI's bound on an MPI info value
    # horovod.run's key too (every *_SECRET), and all of them still fit.
    run_func = {**env, "SYNCDP_RUN_FUNC_SECRET": "cd" * 32}
    run_func[jobenv.CARRIED_VAR] += ",SYNCDP_RUN_FUNC_SECRET"
    args, envar = jobenv.spawn_parts(run_func)
    assert "cd" * 32 not in args[1] and envar.endswith("SYNCDP_RUN_FUNC_SECRET=" + "cd" * 32)
    assert len(envar) < 256
    # The process's own label and Open MPI's per-process variables stay behind.
    assert "SYNCDP_REPLACEMENT" not in carried and "OMPI_COMM_WORLD_RANK" not in carried
    assert carried["SYNCDP_MIN_NP"] == "1" and carried["SYNCDP_COMMIT_DIR"].endswith("/job")
    assert carried[jobenv.CARRIED_VAR] == env[jobenv.CARRIED_VAR]  # the next spawn's list


def test_the_worker_takes_the_job_env_before_anything_else():
    host = {"PATH": "/bin", "SYNCDP_FUSION_THRESHOLD": "1"}
    rest = jobenv.apply(
        [jobenv.JOB_ENV_FLAG, json.dumps({"SYNCDP_FUSION_THRESHOLD": "2", "A": "b"}), "x"], host
    )
    assert rest == ["x"] and host == {"PATH": "/bin", "SYNCDP_FUSION_THRESHOLD": "2", "A": "b"}
    assert jobenv.apply(["--replacement", "3", "x"], host) == ["--replacement", "3", "x"]


def test_a_spawned_process_gets_the_launchers_environment_under_the_jobs_values():
    # The answer to its job_env request: what -x gave the first ranks (DATA_DIR, HF_TOKEN),
    # never what belongs to the launcher's host or process (HOME, SLURM_PROCID).
    env = _rank_env()
    answer = json.loads(jobenv.launcher_env(env))
    assert answer["DATA_DIR"] == "/data" and answer["HF_TOKEN"] == "hf_xyz"
    assert not {"HOME", "SLURM_PROCID"} & set(answer)
    # Nothing it carries already: the job's secret never travels this way.
    assert not {n for n in answer if n.startswith("SYNCDP_") or n.endswith("_SECRET")}
    assert _JOB.secret not in jobenv.launcher_env(env) and "PATH" not in answer
    # The spawned supervisor's environment: the host's, then the carried values (--job-env).
    carried = json.loads(jobenv.spawn_parts({**env, "OMPI_COMM_WORLD_RANK": "1"})[0][1])
    spawned = {"PATH": "/host/bin", "HOME": "/home/u", "DATA_DIR": "/host/data", **carried}
    spawned["SYNCDP_MIN_NP"] = "2"  # the spawning rank's value, newer than the launcher's
    # An answer from a launcher that sent more: the carried values still win.
    answer.update({"SYNCDP_MIN_NP": "1", "PATH": "/launcher/bin"})
    answer["SYNCDP_REPLACEMENT"] = "9"  # per process: never taken from another
    set_names = jobenv.widen(spawned, answer)
    assert spawned["DATA_DIR"] == "/data" and spawned["HF_TOKEN"] == "hf_xyz"  # -x's values
    assert spawned["SYNCDP_MIN_NP"] == "2" and spawned["PATH"] == carried["PATH"]
    assert spawned["HOME"] == "/home/u" and "SYNCDP_REPLACEMENT" not in spawned
    assert {"DATA_DIR", "HF_TOKEN"} <= set(set_names) and "PATH" not in set_names


def test_outside_a_launched_job_a_spawn_passes_nothing():
    assert jobenv.spawn_parts({"PATH": "/bin"}) == ([], "")


def test_what_a_spawned_process_lacks_is_named():
    full = {**_rank_env(), **dict([jobenv.spawn_parts(_rank_env())[1].split("\n")[0].split("=")])}
    assert jobenv.missing(full, elastic=True) == []
    assert jobenv.missing({"PATH": "/bin"}, elastic=False) == [
        "SYNCDP_ELASTIC (or --min-np, --max-np)",
        "SYNCDP_LAUNCHER",
        "SYNCDP_JOB_ID",
        "SYNCDP_REPORT_SECRET",
        "SYNCDP_LIFELINE_ADDR",
    ]


def test_worker_args_put_the_job_env_before_the_label(monkeypatch):
    for name, value in _rank_env().items():
        monkeypatch.setenv(name, value)
    args = membership.worker_args(5, ("python", "train.py"), spare=True)
    assert args[:4] == ["-P", "-m", "syncdp.launch.worker", jobenv.JOB_ENV_FLAG]
    assert args[5:] == ["--replacement", "5", "--spare", "python", "train.py"]


_PARENT = """
import os, sys
from mpi4py import MPI
info = MPI.Info.Create()
info.Set("wdir", os.getcwd())
child = [
    "-m", "syncdp.launch.worker", "--replacement", "3", sys.executable, "-c",
    "import syncdp; syncdp.init(); print('TRAINED', syncdp.rank(), syncdp.size(), flush=True)",
]
inter = MPI.COMM_SELF.Spawn(sys.executable, child, maxprocs=1, info=info)
merged = inter.Merge(high=False)
inter.Disconnect()
try:
    merged.Agree(1)
    print("JOINED", flush=True)
except MPI.Exception as e:
    print("GONE", e.Get_error_class() == MPI.ERR_PROC_FAILED, flush=True)
"""


def test_a_spawned_process_without_the_jobs_settings_refuses_to_train(tmp_path):
    # A parent with none of a job's settings spawns syncdp's supervisor as a recovery would:
    # the spawned process finds no SYNCDP_* settings or identity. It must not train (it would
    # be rank 0 of a job of its own) and must not leave its parent waiting.
    parent = python_script(tmp_path, _PARENT, "parent.py")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SYNCDP_", "OMPI_", "PMIX_"))}
    env.update(
        PYTHONPATH=str(ROOT),
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        OMPI_MCA_mpi_yield_when_idle="1",
    )
    cmd = ["mpirun", "-np", "1", "--with-ft", "ulfm", "--oversubscribe", sys.executable, parent]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=90)
    log = f"--- stdout ---\n{out.stdout}\n--- stderr ---\n{out.stderr}"
    assert "TRAINED" not in out.stdout and "JOINED" not in out.stdout, log
    assert "GONE True" in out.stdout, log
    assert "lacks the job's settings and identity (SYNCDP_ELASTIC" in out.stderr, log
    assert "It will not train" in out.stderr, log
