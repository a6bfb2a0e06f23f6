"""The launcher without mpirun: parse -> config -> env -> command.

Every setting is checked before anything starts, as a flag and as a ``SYNCDP_*`` variable
alike: each nonsense value exits 2 with one line naming it, the value and what is allowed, and
no rank starts (the real launcher is run for those, and must answer within seconds). The report
channel, the verdict and the lifeline have their own test modules.
"""

import os
import subprocess
import sys
import time

import pytest

from syncdp.base import settings
from syncdp.launch import run
from syncdp.launch.lifeline import LIFELINE_VAR
from syncdp.watch import report
from tests.launcher import ROOT, alive, rank_env, wait_gone


def test_horovodrun_command_line():
    c = run.parse_args(
        ["-np", "4", "-H", "a:2,b:2", "python", "train.py", "--lr", "0.1"], environ={}
    )
    assert c.num_proc == 4 and c.hosts == "a:2,b:2"
    assert c.command == ("python", "train.py", "--lr", "0.1")
    assert c.settings == {}


def test_long_spelling_and_separator():
    c = run.parse_args(["--num-proc", "2", "--", "python", "-c", "pass"])
    assert c.num_proc == 2 and c.command == ("python", "-c", "pass")


def test_settings_flags_are_kept_by_name_in_the_flags_unit():
    c = run.parse_args(
        ["-np", "2", "--stall-timeout", "5", "--chunk-mb", "0.5", "--verbose", "python"]
    )
    assert c.settings == {"stall_timeout": 5.0, "chunk_bytes": 0.5, "verbose": True}


@pytest.mark.parametrize(
    "argv, words",
    [
        (["-np", "2"], "missing the command"),
        (["-np", "0", "python"], "-np must be at least 1; got 0"),
        (["python", "x.py"], "-np"),
        (["-np", "2", "--hostfile", "/nonexistent/hosts", "python"], "does not exist"),
        (["-np", "2", "--hostfile", "/", "python"], "'/' is a directory, not a hostfile"),
        (["-np", "2", "--min-np", "3", "python"], "--min-np (3) must not exceed -np (2)"),
        (["-np", "3", "--max-np", "2", "python"], "--max-np (2) must be at least -np (3)"),
        (["-np", "2", '--mpi-args=--mca btl "self', "python"], "--mpi-args '--mca btl \"self'"),
        (["-np", "2", "--binding-args=--bind-to 'core", "python"], "No closing quotation"),
    ],
)
def test_bad_command_lines_exit_with_usage(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        run.parse_args(argv, environ={})
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "syncdp-run" in err and words in err, err


def test_an_ssh_key_whose_path_holds_a_space_is_refused(tmp_path, capsys):
    # Open MPI splits plm_ssh_args at spaces: ssh would have taken "key'" for the host.
    key = tmp_path / "my key"
    key.write_text("")
    with pytest.raises(SystemExit):
        run.parse_args(["-np", "2", "-H", "a,b", "-i", str(key), "python"], environ={})
    assert "holds a space, which Open MPI cannot pass to ssh" in capsys.readouterr().err


# Nonsense for each kind of setting, as (flag, text) and as (variable, text).
SECONDS = "a finite number of seconds, at least 0"
BAD_FLAGS = [
    ("--stall-timeout", "nan", SECONDS),
    ("--stall-timeout", "inf", SECONDS),
    ("--stall-timeout", "-3", SECONDS),
    ("--stall-timeout", "soon", SECONDS),
    ("--start-timeout", "-inf", SECONDS),
    ("--stall-warning", "1e999", SECONDS),
    ("--fusion-threshold-mb", "inf", "a finite number of MiB, at least 0"),
    ("--fusion-threshold-mb", "nan", "a finite number of MiB, at least 0"),
    ("--fusion-threshold-mb", "-1", "a finite number of MiB, at least 0"),
    ("--first-bucket-mb", "abc", "a finite number of MiB, at least 0"),
    ("--chunk-mb", "0", "a finite number of MiB, at least 0.000976562 (1024 bytes)"),
    ("--chunk-mb", "0.0001", "a finite number of MiB, at least 0.000976562 (1024 bytes)"),
    ("--verify-every", "2.5", "a whole number, at least 0"),
    ("--verify-every", "nan", "a whole number, at least 0"),
    ("--min-np", "-1", "a whole number, at least 0"),
    ("--reset-limit", "lots", "a whole number, at least 0"),
    ("--hierarchical-allreduce", "maybe", "one of auto, on, off"),
]
BAD_VARIABLES = [
    ("SYNCDP_STALL_TIMEOUT", "nan", SECONDS),
    ("SYNCDP_STALL_TIMEOUT", "abc", SECONDS),
    ("SYNCDP_START_TIMEOUT", "inf", SECONDS),
    ("SYNCDP_STALL_WARNING", "-5", SECONDS),
    ("SYNCDP_FUSION_THRESHOLD", "nan", "a whole number of bytes, at least 0"),
    ("SYNCDP_FUSION_THRESHOLD", "1.5", "a whole number of bytes, at least 0"),
    ("SYNCDP_FUSION_THRESHOLD", "-5", "a whole number of bytes, at least 0"),
    ("SYNCDP_CHUNK_BYTES", "0", "a whole number of bytes, at least 1024"),
    ("SYNCDP_CHUNK_BYTES", "abc", "a whole number of bytes, at least 1024"),
    ("SYNCDP_VERIFY_EVERY", "-1", "a whole number, at least 0"),
    ("SYNCDP_VERBOSE", "maybe", "a boolean (1, true, yes, on, or 0, false, no, off)"),
    ("SYNCDP_HIERARCHICAL_ALLREDUCE", "sometimes", "one of auto, on, off"),
]


@pytest.mark.parametrize("flag, text, allowed", BAD_FLAGS)
def test_a_nonsense_flag_exits_2_naming_flag_value_and_what_is_allowed(flag, text, allowed, capsys):
    with pytest.raises(SystemExit) as e:
        run.parse_args(["-np", "2", f"{flag}={text}", "python"], environ={})
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err == f"syncdp-run: error: {flag} must be {allowed}; got {text!r}.\n", err


@pytest.mark.parametrize("name, text, allowed", BAD_VARIABLES)
def test_a_nonsense_variable_exits_2_naming_it_before_anything_starts(name, text, allowed, capsys):
    with pytest.raises(SystemExit) as e:
        run.parse_args(["-np", "2", "python"], environ={name: text})
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err == f"syncdp-run: error: {name} must be {allowed}; got {text!r}.\n", err


def test_an_unknown_variable_exits_2_naming_it(capsys):
    with pytest.raises(SystemExit) as e:
        run.parse_args(["-np", "2", "python"], environ={"SYNCDP_STAL_TIMEOUT": "5"})
    assert e.value.code == 2
    assert "Unknown environment variable SYNCDP_STAL_TIMEOUT" in capsys.readouterr().err


def test_a_flag_replaces_a_nonsense_variable_for_the_ranks():
    # The ranks get the flag's value, so the variable's is never used: not an error.
    c = run.parse_args(
        ["-np", "2", "--stall-timeout", "5", "python"], environ={"SYNCDP_STALL_TIMEOUT": "nan"}
    )
    env = run.build_env(c, environ={"SYNCDP_STALL_TIMEOUT": "nan"})
    assert settings.from_env(env).stall_timeout == 5.0


@pytest.mark.parametrize(
    "args, env",
    [
        (["--stall-timeout", "nan"], {}),
        (["--fusion-threshold-mb", "inf"], {}),
        ([], {"SYNCDP_CHUNK_BYTES": "0"}),
        ([], {"SYNCDP_STALL_TIMEOUT": "-5"}),
    ],
)
def test_the_real_launcher_exits_2_in_one_line_and_starts_no_rank(args, env, tmp_path):
    marker = tmp_path / "started"
    began = time.monotonic()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "syncdp.launch",
            "-np",
            "2",
            *args,
            "python",
            "-c",
            f"open({str(marker)!r}, 'w')",
        ],
        env=rank_env(env),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("syncdp-run: error: "), result.stderr
    assert "Traceback" not in result.stderr and not marker.exists()
    assert time.monotonic() - began < 20  # no rank, no TensorFlow: only the launcher's start


def test_timeline_path_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    c = run.parse_args(["-np", "1", "--timeline-filename", "t.json", "python"])
    assert run.build_env(c, environ={})["SYNCDP_TIMELINE"] == str(tmp_path / "t.json")


def test_env_lets_root_run_and_keeps_caller_values():
    env = run.build_env(
        run.parse_args(["-np", "2", "python"]), environ={"TF_CPP_MIN_LOG_LEVEL": "0", "KEEP": "me"}
    )
    assert env["OMPI_ALLOW_RUN_AS_ROOT"] == "1" and env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] == "1"
    assert env["PYTHONUNBUFFERED"] == "1" and env["SYNCDP_LAUNCHER"] == "1"
    assert env["TF_CPP_MIN_LOG_LEVEL"] == "0" and env["KEEP"] == "me"
    assert report.ADDRESS_VAR not in env


def test_open_mpi_yields_the_core_when_idle_unless_the_caller_says_otherwise():
    c = run.parse_args(["-np", "2", "python"])
    assert run.build_env(c, environ={})["OMPI_MCA_mpi_yield_when_idle"] == "1"
    env = run.build_env(c, environ={"OMPI_MCA_mpi_yield_when_idle": "0"})
    assert env["OMPI_MCA_mpi_yield_when_idle"] == "0"
    # Small messages between ranks of one host go in one piece, unless the caller says else.
    assert run.build_env(c, environ={})["OMPI_MCA_btl_sm_eager_limit"] == "32768"
    assert (
        run.build_env(c, environ={"OMPI_MCA_btl_sm_eager_limit": "4096"})[
            "OMPI_MCA_btl_sm_eager_limit"
        ]
        == "4096"
    )


def test_flag_wins_over_the_callers_variable():
    c = run.parse_args(["-np", "2", "--stall-timeout", "5", "python"])
    env = run.build_env(c, environ={"SYNCDP_STALL_TIMEOUT": "99"})
    assert env["SYNCDP_STALL_TIMEOUT"] == "5"


@pytest.mark.parametrize(
    "argv, environ, expected",
    [
        (["--start-timeout", "7"], {"SYNCDP_START_TIMEOUT": "99"}, 7.0),
        ([], {"SYNCDP_START_TIMEOUT": "99"}, 99.0),
        ([], {}, 120.0),
    ],
)
def test_ranks_read_the_start_timeout_the_launcher_was_given(argv, environ, expected):
    c = run.parse_args(["-np", "2", *argv, "python"], environ=environ)
    assert settings.from_env(run.build_env(c, environ=environ)).start_timeout == expected


def test_mpirun_gets_the_host_list_as_the_launcher_read_it():
    # Spaces after commas pass the launcher's reading; mpirun would take " h2" for a host.
    c = run.parse_args(["-np", "3", "-H", "h1:2, h2", "python", "train.py"], environ={})
    cmd = run.build_command(c, run.build_env(c, environ={}), mpirun="/opt/mpirun")
    assert cmd[cmd.index("--host") + 1] == "h1:2,h2:1"


def test_mpirun_command_exports_the_job_by_name_never_its_secret():
    c = run.parse_args(
        ["-np", "3", "-H", "h1:2,h2:1", "--mpi-args", "--mca btl self,tcp -v"]
        + ["--stall-timeout", "5", "python", "train.py"],
        environ={},
    )
    job = report.Job.new()
    env = run.build_env(
        c, environ={"PATH": "/bin"}, report_addr="node0:5000", lifeline_addr="node0:5001", job=job
    )
    assert env[report.ADDRESS_VAR] == "node0:5000" and env[LIFELINE_VAR] == "node0:5001"
    assert (env[report.JOB_VAR], env[report.SECRET_VAR]) == (job.id, job.secret)
    cmd = run.build_command(c, env, mpirun="/opt/mpirun")
    assert cmd[:6] == ["/opt/mpirun", "-np", "3", "--oversubscribe", "--bind-to", "none"]
    assert cmd[cmd.index("--host") + 1] == "h1:2,h2:1"
    exported = {cmd[i + 1] for i, a in enumerate(cmd) if a == "-x"}
    assert {
        "SYNCDP_STALL_TIMEOUT",
        report.ADDRESS_VAR,
        LIFELINE_VAR,
        report.JOB_VAR,
        report.SECRET_VAR,
        "OMPI_ALLOW_RUN_AS_ROOT",
        "PYTHONUNBUFFERED",
        "PATH",
    } <= exported
    assert job.secret not in " ".join(cmd)  # other users can read command lines
    assert "--mca btl self,tcp -v" in " ".join(cmd)
    assert cmd[-6:] == [sys.executable, "-P", "-m", "syncdp.launch.worker", "python", "train.py"]


def test_mpirun_exports_the_launchers_environment_as_horovodrun_does():
    # Ranks on other hosts start from the bare environment the remote shell gives: every
    # variable of the launcher's reaches them by name (horovodrun's -x for each), but those of
    # its own host and login, and Open MPI's, PMIx's and Slurm's per-process ones.
    c = run.parse_args(["-np", "2", "-H", "h1:1,h2:1", "python", "train.py"], environ={})
    given = {
        "DATA_DIR": "/data",
        "OMP_NUM_THREADS": "4",
        "NCCL_DEBUG": "INFO",
        "HF_TOKEN": "hf_x",
        "TMPDIR": "/scratch",
    }
    own = {
        "HOSTNAME": "node0",
        "PWD": "/home/u",
        "OLDPWD": "/",
        "HOME": "/home/u",
        "SHLVL": "2",
        "SSH_CONNECTION": "1 2 3 4",
        "CUDA_VISIBLE_DEVICES": "0",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "OMPI_COMM_WORLD_RANK": "0",
        "PMIX_RANK": "0",
        "OMPI_MCA_btl": "self,tcp",  # mpirun passes Open MPI's settings on itself
        "BASH_FUNC_f%%": "() { :; }",
    }
    cmd = run.build_command(c, run.build_env(c, environ={**given, **own}), mpirun="mpirun")
    exported = {cmd[i + 1] for i, a in enumerate(cmd) if a == "-x"}
    assert set(given) <= exported
    assert not set(own) & exported, set(own) & exported


def test_an_enclosing_jobs_channel_is_never_passed_on():
    outer = {report.ADDRESS_VAR: "a:1", LIFELINE_VAR: "a:2", **report.Job.new().env()}
    env = run.build_env(run.parse_args(["-np", "1", "python"], environ={}), environ=outer)
    assert not set(outer) & set(env)


def test_a_hostfiles_hosts_reach_mpirun_with_the_slots_counted_here(tmp_path):
    # mpirun gives a hostfile line without slots= every core of the host (both ranks went to
    # hostA), and max_slots= as slots; syncdp counts one, as the README says.
    hosts = tmp_path / "hosts"
    hosts.write_text("# cluster\nhostA\nhostB max_slots=4\nhostC slots=2\n")
    c = run.parse_args(["--hostfile", str(hosts), "python"], environ={})
    cmd = run.build_command(c, run.build_env(c, environ={}))
    assert c.num_proc == 4 and "--hostfile" not in cmd
    assert cmd[cmd.index("--host") + 1] == "hostA:1,hostB:1,hostC:2"


def test_a_one_host_job_leaves_out_ucx_windows_whatever_the_host_has(monkeypatch):
    # An RDMA device Open MPI cannot use made every rank print the UCX query's error; on one
    # host shared memory serves the windows. The caller's setting wins; multi-host jobs keep UCX.
    monkeypatch.setattr(os.path, "isdir", lambda p: True)  # as if /sys/class/infiniband existed
    one = run.parse_args(["-np", "2", "python"])
    assert run.build_env(one, environ={})["OMPI_MCA_osc"] == "^ucx"
    assert run.build_env(one, environ={"OMPI_MCA_osc": "ucx"})["OMPI_MCA_osc"] == "ucx"
    two = run.parse_args(["-np", "2", "-H", "a:1,b:1", "python"])
    assert "OMPI_MCA_osc" not in run.build_env(two, environ={})


def test_pmix_keeps_its_job_data_in_the_hash_store_unless_the_caller_chooses():
    # PMIx 5.0's shared-memory store crashed Open MPI's daemon on a host where a replacement
    # was spawned (a segfault in libpmix): every job asks for the hash store on mpirun's
    # command line, which reaches the daemons on other hosts too; the caller's choice wins.
    def gds(argv, environ):
        c = run.parse_args(["-np", "2", *argv, "python"])
        cmd = run.build_command(c, run.build_env(c, environ=environ))
        found = [cmd[i + 2] for i in range(len(cmd) - 2) if cmd[i : i + 2] == ["--pmixmca", "gds"]]
        return found

    assert gds([], {}) == ["hash"]
    assert gds(["--min-np", "1", "-H", "a:1,b:1"], {}) == ["hash"]
    assert gds(["--mpi-args", "--pmixmca gds shmem2,hash"], {}) == ["shmem2,hash"]
    assert gds([], {"PMIX_MCA_gds": "shmem2"}) == []


def test_a_hostfile_that_is_not_text_is_named_not_a_traceback(tmp_path, capsys):
    hosts = tmp_path / "hosts"
    hosts.write_bytes(b"\xff\xfe\n")
    with pytest.raises(SystemExit) as e:
        run.parse_args(["-np", "2", "--hostfile", str(hosts), "python"], environ={})
    assert e.value.code == 2
    assert "is not text (byte 0 is not UTF-8)" in capsys.readouterr().err


def test_more_ranks_than_the_listed_slots_are_refused(tmp_path, capsys):
    # horovodrun and mpirun refuse -np 3 on hosts with 2 slots; the launcher ran 3 ranks on them.
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a slots=1\nb slots=1\n")
    for argv, hosts in (
        (["-H", "localhost:2"], "localhost:2"),
        (["-H", "a:1,b:1"], "a:1,b:1"),
        (["--hostfile", str(hostfile)], "a:1,b:1"),
    ):
        with pytest.raises(SystemExit) as e:
            run.parse_args(["-np", "3", *argv, "python"], environ={})
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert f"-np 3 needs 3 slots, and the hosts listed have 2 ({hosts})" in err
        assert run.parse_args(["-np", "2", *argv, "python"], environ={}).num_proc == 2


def test_a_rank_command_not_found_exits_127_and_one_not_runnable_126(tmp_path, monkeypatch):
    # As a shell says it: the verdict carries the rank's code.
    from syncdp.launch import worker

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.sh").write_text("echo hi\n")  # not executable
    assert worker.main(["./train.sh"]) == 126
    assert worker.main(["./missing.sh"]) == 127


def test_what_mpirun_leaves_in_its_session_is_killed_once_it_has_ended():
    # Open MPI starts each remote shell (ssh) in a process group of its own: stopping mpirun's
    # group missed it, and an ssh whose host's link was cut outlived the launcher for hours.
    # Here a stand-in for mpirun starts a child in its own group and exits at once.
    from syncdp.launch import supervision

    mpirun = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys\n"
            "child = subprocess.Popen(['sleep', '120'], process_group=0)\n"
            "print(child.pid, flush=True)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    left = int(mpirun.stdout.readline())
    mpirun.wait(timeout=30)
    assert os.getpgid(left) == left and os.getsid(left) == mpirun.pid  # out of mpirun's group
    try:
        supervision.stop(mpirun)  # mpirun has ended: what it left is swept all the same
        assert not wait_gone([left], timeout=10)
    finally:
        if alive(left):
            os.kill(left, 9)
