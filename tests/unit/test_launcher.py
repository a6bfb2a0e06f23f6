"""The launcher's pipeline without starting processes: parse -> config -> env -> command."""

import sys

import pytest

from launch import run


def test_horovodrun_command_line():
    c = run.parse_args(["-np", "4", "-H", "a:2,b:2", "python", "train.py", "--lr", "0.1"])
    assert c.num_proc == 4 and c.hosts == "a:2,b:2"
    assert c.command == ("python", "train.py", "--lr", "0.1")


def test_long_spelling_and_separator():
    c = run.parse_args(["--num-proc", "2", "--", "python", "-c", "pass"])
    assert c.num_proc == 2 and c.command == ("python", "-c", "pass")


@pytest.mark.parametrize("argv", [["-np", "2"], ["-np", "0", "python"], ["python", "x.py"],
                                  ["-np", "2", "--stall-timeout", "-3", "python"],
                                  ["-np", "2", "--hostfile", "/nonexistent/hosts", "python"]])
def test_bad_command_lines_exit_with_usage(argv, capsys):
    with pytest.raises(SystemExit) as e:
        run.parse_args(argv)
    assert e.value.code == 2
    assert "syncdp-run" in capsys.readouterr().err


def test_each_flag_sets_exactly_one_variable():
    base = run.build_env(run.parse_args(["-np", "2", "python"]), environ={})
    cases = {
        ("--start-timeout", "30"): ("SYNCDP_START_TIMEOUT", "30"),
        ("--stall-timeout", "12.5"): ("SYNCDP_STALL_TIMEOUT", "12.5"),
        ("--stall-warning", "4"): ("SYNCDP_STALL_WARNING", "4"),
        ("--fusion-threshold-mb", "32"): ("SYNCDP_FUSION_THRESHOLD", str(32 * 1024 * 1024)),
        ("--chunk-mb", "0.5"): ("SYNCDP_CHUNK_BYTES", str(512 * 1024)),
        ("--verify-every", "10"): ("SYNCDP_VERIFY_EVERY", "10"),
        ("--log-all-ranks",): ("SYNCDP_LOG_ALL_RANKS", "1"),
        ("--verbose",): ("SYNCDP_VERBOSE", "1"),
    }
    for flag, (key, value) in cases.items():
        env = run.build_env(run.parse_args(["-np", "2", *flag, "python"]), environ={})
        added = {k: v for k, v in env.items() if k not in base}
        assert added == {key: value}, flag


def test_timeline_path_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    env = run.build_env(run.parse_args(["-np", "1", "--timeline-filename", "t.json", "python"]),
                        environ={})
    assert env["SYNCDP_TIMELINE"] == str(tmp_path / "t.json")


def test_env_lets_root_run_and_keeps_caller_values():
    env = run.build_env(run.parse_args(["-np", "2", "python"]),
                        environ={"TF_CPP_MIN_LOG_LEVEL": "0", "KEEP": "me"})
    assert env["OMPI_ALLOW_RUN_AS_ROOT"] == "1" and env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] == "1"
    assert env["PYTHONUNBUFFERED"] == "1"
    assert env["TF_CPP_MIN_LOG_LEVEL"] == "0" and env["KEEP"] == "me"


def test_mpirun_command():
    c = run.parse_args(["-np", "3", "-H", "h1:2,h2:1", "--mpi-args", "--mca btl self,tcp -v",
                        "--stall-timeout", "5", "python", "train.py"])
    env = run.build_env(c, environ={"PATH": "/bin"})
    cmd = run.build_command(c, env, mpirun="/opt/mpirun")
    assert cmd[:6] == ["/opt/mpirun", "-np", "3", "--oversubscribe", "--bind-to", "none"]
    assert cmd[cmd.index("--host") + 1] == "h1:2,h2:1"
    exported = {cmd[i + 1] for i, a in enumerate(cmd) if a == "-x"}
    assert {"SYNCDP_STALL_TIMEOUT", "OMPI_ALLOW_RUN_AS_ROOT", "PYTHONUNBUFFERED",
            "PATH"} <= exported
    assert "--mca btl self,tcp -v" in " ".join(cmd)
    assert cmd[-5:] == [sys.executable, "-m", "launch.worker", "python", "train.py"]


def test_hostfile_is_passed_to_mpirun(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost slots=2\n")
    c = run.parse_args(["-np", "2", "--hostfile", str(hosts), "python"])
    cmd = run.build_command(c, run.build_env(c, environ={}))
    assert cmd[cmd.index("--hostfile") + 1] == str(hosts)


def test_failure_lines_are_recognized():
    match = run._FAILURE_LINE.search("[1]<stderr>:syncdp: rank 1 failed with ValueError: x")
    assert match.group(1) == "rank 1 failed with ValueError: x"
    match = run._FAILURE_LINE.search("syncdp-run: rank 0 (pid 5 on h) was killed by signal 9")
    assert match.group(1).startswith("rank 0 (pid 5")
