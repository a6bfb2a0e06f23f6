"""horovodrun 0.28's command line on syncdp-run, without starting a job.

Every horovodrun flag is accepted with Horovod's spelling and argument type; each maps to the
setting, mpirun argument or launcher behaviour it stands for, says on stderr why it changes
nothing, or exits 2 saying what to use instead. ``--config-file`` reads horovodrun's YAML
layout, and flags on the command line win.
"""

import importlib.metadata
import importlib.util
import io
import os
import subprocess
import sys
import textwrap

import pytest

from syncdp.base import settings
from syncdp.launch import config_file, horovodrun_flags, output, run
from tests.launcher import ROOT, rank_env

# Every option of horovodrun 0.28 (horovod/runner/launch.py parse_args), its spellings together:
# written out here, apart from syncdp.launch.horovodrun_flags, so a row dropped there is noticed.
HOROVODRUN = [
    ("--help", "-h"),
    ("--version", "-v"),
    ("--num-proc", "-np"),
    ("--check-build", "-cb"),
    ("--disable-cache",),
    ("--start-timeout",),
    ("--network-interfaces",),
    ("--network-interface",),
    ("--output-filename",),
    ("--verbose",),
    ("--config-file",),
    ("--ssh-port", "-p"),
    ("--ssh-identity-file", "-i"),
    ("--fusion-threshold-mb",),
    ("--cycle-time-ms",),
    ("--cache-capacity",),
    ("--hierarchical-allreduce",),
    ("--no-hierarchical-allreduce",),
    ("--torus-allreduce",),  # horovodrun's newest launcher
    ("--no-torus-allreduce",),
    ("--hierarchical-allgather",),
    ("--no-hierarchical-allgather",),
    ("--autotune",),
    ("--no-autotune",),
    ("--autotune-log-file",),
    ("--autotune-warmup-samples",),
    ("--autotune-steps-per-sample",),
    ("--autotune-bayes-opt-max-samples",),
    ("--autotune-gaussian-process-noise",),
    ("--min-np", "--min-num-proc"),
    ("--max-np", "--max-num-proc"),
    ("--slots-per-host",),
    ("--elastic-timeout",),
    ("--reset-limit",),
    ("--blacklist-cooldown-range",),
    ("--timeline-filename",),
    ("--timeline-mark-cycles",),
    ("--no-timeline-mark-cycles",),
    ("--no-stall-check",),
    ("--stall-check",),
    ("--stall-check-warning-time-seconds",),
    ("--stall-check-shutdown-time-seconds",),
    ("--mpi-threads-disable",),
    ("--no-mpi-threads-disable",),
    ("--mpi-args",),
    ("--tcp",),
    ("--binding-args",),
    ("--num-nccl-streams",),
    ("--thread-affinity",),
    ("--gloo-timeout-seconds",),
    ("--log-level",),
    ("--log-with-timestamp",),
    ("--log-without-timestamp",),
    ("--prefix-output-with-timestamp", "-prefix-timestamp"),
    ("--log-hide-timestamp",),
    ("--no-log-hide-timestamp",),
    ("--hosts", "-H"),
    ("--hostfile", "-hostfile"),
    ("--host-discovery-script",),
    ("--gloo",),
    ("--mpi",),
    ("--jsrun",),
]
EVERY_SPELLING = [name for names in HOROVODRUN for name in names]

# A valid use of each flag that starts a job (not --help, --version, -cb).
USES = {
    "--num-proc": ["--num-proc", "2"],
    "--disable-cache": ["--disable-cache"],
    "--start-timeout": ["--start-timeout", "30"],
    "--network-interfaces": ["--network-interfaces", "lo,eth0"],
    "--network-interface": ["--network-interface", "lo"],
    "--output-filename": ["--output-filename", "logs"],
    "--verbose": ["--verbose"],
    "--config-file": None,  # tests of their own below
    "--ssh-port": ["--ssh-port", "2222"],
    "--ssh-identity-file": None,
    "--fusion-threshold-mb": ["--fusion-threshold-mb", "32"],
    "--cycle-time-ms": ["--cycle-time-ms", "2.5"],
    "--cache-capacity": ["--cache-capacity", "2048"],
    "--hierarchical-allreduce": ["--hierarchical-allreduce"],
    "--no-hierarchical-allreduce": ["--no-hierarchical-allreduce"],
    "--torus-allreduce": ["--torus-allreduce"],
    "--no-torus-allreduce": ["--no-torus-allreduce"],
    "--hierarchical-allgather": ["--hierarchical-allgather"],
    "--no-hierarchical-allgather": ["--no-hierarchical-allgather"],
    "--autotune": ["--autotune"],
    "--no-autotune": ["--no-autotune"],
    "--autotune-log-file": ["--autotune-log-file", "tune.csv"],
    "--autotune-warmup-samples": ["--autotune-warmup-samples", "3"],
    "--autotune-steps-per-sample": ["--autotune-steps-per-sample", "10"],
    "--autotune-bayes-opt-max-samples": ["--autotune-bayes-opt-max-samples", "20"],
    "--autotune-gaussian-process-noise": ["--autotune-gaussian-process-noise", "0.8"],
    "--min-np": ["--min-np", "1"],
    "--min-num-proc": ["--min-num-proc", "1"],
    "--max-np": ["--max-np", "4"],
    "--max-num-proc": ["--max-num-proc", "4"],
    "--slots-per-host": ["--slots-per-host", "2", "-H", "localhost"],
    "--elastic-timeout": ["--elastic-timeout", "600"],
    "--reset-limit": ["--reset-limit", "3", "--min-np", "1"],  # elastic mode only
    "--blacklist-cooldown-range": ["--blacklist-cooldown-range", "60", "300"],
    "--timeline-filename": ["--timeline-filename", "t.json"],
    "--timeline-mark-cycles": ["--timeline-mark-cycles"],
    "--no-timeline-mark-cycles": ["--no-timeline-mark-cycles"],
    "--no-stall-check": ["--no-stall-check"],
    "--stall-check": ["--stall-check"],
    "--stall-check-warning-time-seconds": ["--stall-check-warning-time-seconds", "20"],
    "--stall-check-shutdown-time-seconds": ["--stall-check-shutdown-time-seconds", "90"],
    "--mpi-threads-disable": ["--mpi-threads-disable"],
    "--no-mpi-threads-disable": ["--no-mpi-threads-disable"],
    "--mpi-args": ["--mpi-args=--map-by slot"],
    "--tcp": ["--tcp"],
    "--binding-args": ["--binding-args=--bind-to core"],
    "--num-nccl-streams": ["--num-nccl-streams", "2"],
    "--thread-affinity": ["--thread-affinity", "1"],
    "--gloo-timeout-seconds": ["--gloo-timeout-seconds", "60"],
    "--log-level": ["--log-level", "INFO"],
    "--log-with-timestamp": ["--log-with-timestamp"],
    "--log-without-timestamp": ["--log-without-timestamp"],
    "--prefix-output-with-timestamp": ["--prefix-output-with-timestamp"],
    "-prefix-timestamp": ["-prefix-timestamp"],
    "--log-hide-timestamp": ["--log-hide-timestamp"],
    "--no-log-hide-timestamp": ["--no-log-hide-timestamp"],
    "--hosts": ["--hosts", "localhost:2"],
    "-H": ["-H", "localhost:2"],
    "--hostfile": None,
    "-hostfile": None,
    "--host-discovery-script": ["--host-discovery-script", "discover.sh"],
    "--mpi": ["--mpi"],
    "--gloo": ["--gloo"],
    "--jsrun": ["--jsrun"],
}
INERT = {
    name
    for row in horovodrun_flags.FLAGS
    if row.kind == horovodrun_flags.INERT
    for name in row.names
}


def parse(*args, environ=None):
    return run.parse_args(["-np", "2", *args, "python", "x.py"], environ=environ or {})


def env_of(config):
    return run.build_env(config, environ={})


def test_the_table_holds_exactly_horovodruns_flags():
    assert [row.names for row in horovodrun_flags.FLAGS] == HOROVODRUN
    table = horovodrun_flags.markdown_table()
    for names in HOROVODRUN:
        assert "| " + ", ".join(f"`{n}`" for n in names) + " |" in table, names


@pytest.mark.parametrize("name", EVERY_SPELLING)
def test_the_parser_knows_every_spelling(name):
    assert name in run.build_parser()._option_string_actions


@pytest.mark.parametrize("flag", sorted(k for k, v in USES.items() if v), ids=str)
def test_each_flag_is_accepted_and_leaves_the_command_alone(flag):
    c = parse(*USES[flag])
    assert c.command == ("python", "x.py")
    assert settings.from_env(env_of(c))  # what the ranks will read is valid
    said = "\n".join(c.notes)
    assert (f"{flag} changes nothing: " in said) == (flag in INERT), said


@pytest.mark.parametrize("flag", sorted(INERT))
def test_an_inert_flag_says_why_in_one_line_and_sets_nothing(flag):
    args = USES[flag]
    c = parse(*args)
    (line,) = [n for n in c.notes if n.startswith(flag)]
    row = next(r for r in horovodrun_flags.FLAGS if flag in r.names)
    assert line == f"{flag} changes nothing: {row.effect}" and "\n" not in line
    assert c.settings == {} and env_of(c) == env_of(parse())


@pytest.mark.parametrize(
    "args, words",
    [
        (["--cache-capacity", "-1"], "argument --cache-capacity: must be a whole number"),
        (["--cycle-time-ms", "nan"], "argument --cycle-time-ms: must be a finite number"),
        (["--autotune-gaussian-process-noise", "1.5"], "must be a number from 0 to 1"),
        (["--blacklist-cooldown-range", "60"], "range: must be a whole number, at least 0; got"),
        (["--thread-affinity", "core"], "argument --thread-affinity: must be a whole number"),
        (["--log-level", "LOUD"], "argument --log-level: invalid choice: 'LOUD'"),
        (["--slots-per-host", "0", "-H", "a"], "--slots-per-host must be at least 1"),
    ],
)
def test_horovodruns_argument_checks_hold(args, words, capsys):
    with pytest.raises(SystemExit) as e:
        parse(*args)
    assert e.value.code == 2
    assert words in capsys.readouterr().err


@pytest.mark.parametrize("flag, instead", [("--gloo", "over Open MPI"), ("--jsrun", "mpirun")])
def test_horovods_other_controllers_run_on_syncdps_engine_saying_so_in_one_line(flag, instead):
    # horovodrun --gloo (its elastic mode's default) and --jsrun start a job; syncdp's is the
    # same job --mpi starts, with one line that says so.
    c = parse(flag)
    (line,) = [n for n in c.notes if n.startswith(flag)]
    assert line.startswith(f"{flag} is accepted, and the job runs on syncdp's engine")
    assert instead in line and "\n" not in line
    assert c.command == ("python", "x.py") and env_of(c) == env_of(parse("--mpi"))
    assert not [n for n in parse("--mpi").notes if "--mpi" in n]


@pytest.mark.parametrize(
    "first, second",
    [
        ("--mpi", "--gloo"),
        ("--stall-check", "--no-stall-check"),
        ("--hierarchical-allreduce", "--no-hierarchical-allreduce"),
        ("--no-hierarchical-allreduce", "--hierarchical-allreduce"),
        ("--autotune", "--no-autotune"),
        ("--log-with-timestamp", "--log-hide-timestamp"),
    ],
)
def test_contradicting_switches_are_refused_as_horovodrun_does(first, second, capsys):
    with pytest.raises(SystemExit) as e:
        parse(first, second)
    assert e.value.code == 2
    assert f"argument {second}: not allowed with argument {first}" in capsys.readouterr().err


def test_version_prints_syncdps_and_exits_0():
    import syncdp

    done = subprocess.run(
        [sys.executable, "-m", "syncdp.launch", "--version"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert (done.returncode, done.stdout.strip()) == (0, syncdp.__version__)


def test_check_build_needs_no_np_and_lists_what_this_install_supports():
    done = subprocess.run(
        [sys.executable, "-m", "syncdp.launch", "-cb"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=rank_env(),
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    for heading in (
        "Available Frameworks:",
        "Available Controllers:",
        "Available Tensor Operations:",
    ):
        assert heading in lines
    assert any(line.startswith("    [X] TensorFlow 2.") for line in lines), lines
    assert "    [ ] PyTorch" in lines and "    [ ] Gloo" in lines and "    [X] MPI" in lines
    assert any(line.startswith("    [X] MPI (Open MPI 5.") for line in lines), lines
    assert any("ULFM" in line for line in lines)
    # Keras 2 (tf-keras), which Horovod's Keras 2 programs run on, with its version.
    tf_keras = importlib.util.find_spec("tf_keras")
    (keras2,) = [line for line in lines if "Keras 2" in line]
    if tf_keras is None:
        assert keras2 == "    [ ] Keras 2 (tf-keras is not installed: pip install tf-keras)"
    else:
        version = importlib.metadata.version("tf-keras")
        assert keras2 == f"    [X] Keras 2 (tf-keras {version}, with TF_USE_LEGACY_KERAS=1)"
    assert lines.index(keras2) == lines.index("Available Frameworks:") + 3  # after Keras 3


# --- Flags that map onto syncdp's settings and mpirun arguments. ---


def test_stall_spellings_set_syncdps_stall_settings():
    env = env_of(
        parse(
            "--stall-check-shutdown-time-seconds", "90", "--stall-check-warning-time-seconds", "20"
        )
    )
    assert (env["SYNCDP_STALL_TIMEOUT"], env["SYNCDP_STALL_WARNING"]) == ("90", "20")


def test_no_stall_check_means_no_stall_timeout_and_no_warning():
    env = env_of(parse("--no-stall-check"))
    assert (env["SYNCDP_STALL_TIMEOUT"], env["SYNCDP_STALL_WARNING"]) == ("0", "0")
    config = settings.from_env(env)
    assert config.stall_timeout == 0 and config.stall_warning == 0  # 0: never, for both
    assert "SYNCDP_STALL_TIMEOUT" not in env_of(parse("--stall-check"))


def test_no_stall_check_beside_a_stall_time_is_a_contradiction(capsys):
    with pytest.raises(SystemExit) as e:
        parse("--no-stall-check", "--stall-check-shutdown-time-seconds", "30")
    assert e.value.code == 2
    assert (
        "--no-stall-check turns the stall check off, but --stall-check-shutdown-time-seconds "
        "sets a time for it; give one of them." in capsys.readouterr().err
    )


def test_an_error_names_the_spelling_that_was_typed(capsys):
    with pytest.raises(SystemExit):
        parse("--stall-check-warning-time-seconds", "soon")
    assert capsys.readouterr().err == (
        "syncdp-run: error: --stall-check-warning-time-seconds must be a finite number of "
        "seconds, at least 0; got 'soon'.\n"
    )
    with pytest.raises(SystemExit):
        run.parse_args(["-np", "2", "--min-num-proc", "3", "python"], environ={})
    assert "--min-num-proc (3) must not exceed -np (2)" in capsys.readouterr().err


def test_min_and_max_num_proc_are_min_np_and_max_np():
    c = parse("--min-num-proc", "1", "--max-num-proc", "4")
    assert c.settings == {"min_np": 1, "max_np": 4} and c.elastic
    assert "--with-ft" in run.build_command(c, env_of(c))


def test_no_hierarchical_allreduce_turns_it_off():
    assert env_of(parse("--no-hierarchical-allreduce"))["SYNCDP_HIERARCHICAL_ALLREDUCE"] == "off"
    assert env_of(parse("--hierarchical-allreduce"))["SYNCDP_HIERARCHICAL_ALLREDUCE"] == "on"


def test_torus_allreduce_is_the_hierarchical_allreduce():
    assert env_of(parse("--torus-allreduce"))["SYNCDP_HIERARCHICAL_ALLREDUCE"] == "on"
    assert env_of(parse("--no-torus-allreduce"))["SYNCDP_HIERARCHICAL_ALLREDUCE"] == "off"


def test_network_interfaces_are_gathered_for_open_mpi():
    c = parse("--network-interfaces", "eth0,eth1", "--network-interface", "ib0,eth0")
    assert c.network_interfaces == ("eth0", "eth1", "ib0")
    cmd = run.build_command(c, env_of(c))
    assert cmd[cmd.index("btl_tcp_if_include") + 1] == "eth0,eth1,ib0"
    assert cmd[cmd.index("oob_tcp_if_include") + 1] == "eth0,eth1,ib0"


def test_slots_per_host_fills_in_hosts_without_a_count(tmp_path):
    c = run.parse_args(["--slots-per-host", "4", "-H", "a,b:2", "python"], environ={})
    assert (c.hosts, c.num_proc) == ("a:4,b:2", 6)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a\nb slots=1\n")
    c = run.parse_args(["--slots-per-host", "3", "--hostfile", str(hostfile), "python"], environ={})
    assert (c.hosts, c.hostfile, c.num_proc) == ("a:3,b:1", None, 4)
    assert run.build_command(c, env_of(c)).count("--hostfile") == 0
    assert "--slots-per-host changes nothing without -H" in " ".join(
        parse("--slots-per-host", "2").notes
    )


def test_tcp_keeps_mpi_off_rdma_and_binding_args_replace_bind_to_none():
    c = parse("--tcp", "--binding-args=--bind-to core --map-by socket")
    cmd = run.build_command(c, env_of(c), mpirun="mpirun")
    assert cmd[:8] == ["mpirun", "-np", "2", "--oversubscribe"] + [
        "--bind-to",
        "core",
        "--map-by",
        "socket",
    ]
    joined = " ".join(cmd)
    assert "--mca pml ob1 --mca btl self,sm,tcp --mca osc ^ucx" in joined
    assert "--bind-to none" not in joined
    plain = run.build_command(parse(), env_of(parse()))
    assert "pml" not in plain and plain[4:6] == ["--bind-to", "none"]


def test_output_flags_and_log_level_reach_the_config():
    c = parse("--output-filename", "logs", "-prefix-timestamp", "--log-level", "debug")
    assert (c.output_filename, c.timestamps, c.log_level) == ("logs", True, "DEBUG")
    assert parse().log_level == "WARNING" and not parse().timestamps


@pytest.mark.parametrize("level, shown", [("WARNING", True), ("ERROR", False)])
def test_notes_are_said_before_anything_starts_unless_the_log_level_is_error(
    level, shown, monkeypatch, capsys
):
    def no_mpirun():
        raise FileNotFoundError("no mpirun here")

    monkeypatch.setattr(run, "_find_mpirun", no_mpirun)
    assert run.run(parse("--cycle-time-ms", "5", "--log-level", level)) == 127
    err = capsys.readouterr().err
    assert ("syncdp-run: --cycle-time-ms changes nothing: " in err) is shown, err
    assert "no mpirun here" in err  # errors are said at every level


# --- --config-file: horovodrun's YAML layout; the command line wins. ---

HOROVOD_YAML = """
controller: mpi
params:
  fusion_threshold_mb: 32
  cycle_time_ms: 10
  cache_capacity: 2048
  hierarchical_allreduce: false
  hierarchical_allgather: true
autotune:
  enabled: true
  log_file: autotune.csv
  warmup_samples: 5
  steps_per_sample: 20
  bayes_opt_max_samples: 50
  gaussian_process_noise: 0.9
timeline:
  filename: timeline.json
  mark_cycles: true
stall_check:
  enabled: true
  warning_time_seconds: 120
  shutdown_time_seconds: 240
library_options:
  mpi_threads_disable: true
  num_nccl_streams: 2
  thread_affinity: 1
  gloo_timeout_seconds: 60
logging:
  level: INFO
  with_timestamp: true
"""


def write(tmp_path, text, name="horovod.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_a_horovod_config_file_sets_what_its_keys_stand_for(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = write(tmp_path, HOROVOD_YAML)
    c = parse("--config-file", path)
    assert dict(c.settings) == {
        "fusion_threshold": 32.0,
        "stall_timeout": 240.0,
        "stall_warning": 120.0,
        "timeline": "timeline.json",
        "hierarchical_allreduce": "off",
        "autotune": True,
        "autotune_log_file": "autotune.csv",
        "autotune_warmup_samples": 5,
        "autotune_steps_per_sample": 20,
        "autotune_max_samples": 50,
    }
    env = env_of(c)
    assert env["SYNCDP_FUSION_THRESHOLD"] == str(32 * 1024 * 1024)
    assert env["SYNCDP_TIMELINE"] == str(tmp_path / "timeline.json")
    assert env["SYNCDP_AUTOTUNE"] == "1"
    assert env["SYNCDP_AUTOTUNE_LOG_FILE"] == str(tmp_path / "autotune.csv")
    assert env["SYNCDP_AUTOTUNE_MAX_SAMPLES"] == "50"
    assert c.log_level == "INFO"
    said = "\n".join(c.notes)
    for key in (
        "params.cycle_time_ms",
        "autotune.gaussian_process_noise",
        "library_options.thread_affinity",
    ):
        assert f"{key} in {path} changes nothing: " in said, said
    assert "autotune.enabled" not in said


def test_flags_on_the_command_line_win_over_the_file(tmp_path):
    path = write(tmp_path, HOROVOD_YAML)
    c = parse(
        "--stall-timeout",
        "7",
        "--config-file",
        path,
        "--hierarchical-allreduce",
        "--log-level",
        "ERROR",
    )
    assert c.settings["stall_timeout"] == 7.0  # the command line's, whatever its position
    assert c.settings["stall_warning"] == 120.0  # the file's, where the command line said nothing
    assert c.settings["hierarchical_allreduce"] == "on"
    assert c.log_level == "ERROR"


def test_the_files_stall_check_off_wins_over_its_times_not_over_the_command_line(tmp_path):
    path = write(tmp_path, "stall_check:\n  enabled: false\n  shutdown_time_seconds: 30\n")
    env = env_of(parse("--config-file", path))
    assert (env["SYNCDP_STALL_TIMEOUT"], env["SYNCDP_STALL_WARNING"]) == ("0", "0")
    env = env_of(parse("--config-file", path, "--stall-check-warning-time-seconds", "9"))
    assert (env["SYNCDP_STALL_TIMEOUT"], env["SYNCDP_STALL_WARNING"]) == ("30", "9")
    env = env_of(parse("--config-file", path, "--stall-check"))
    assert env["SYNCDP_STALL_TIMEOUT"] == "30" and "SYNCDP_STALL_WARNING" not in env


def test_horovods_own_default_file_asks_for_gloo_and_runs_on_mpi(tmp_path):
    path = write(tmp_path, "controller: gloo\nparams:\n  fusion_threshold_mb: 64\n")
    c = parse("--config-file", path)
    assert c.settings == {"fusion_threshold": 64.0}
    assert any("is accepted, and the job runs on syncdp's engine" in n for n in c.notes), c.notes
    assert parse("--mpi", "--config-file", path).settings == {"fusion_threshold": 64.0}


@pytest.mark.parametrize(
    "text, words",
    [
        ("params:\n  fusion_threshold_mb: -1\n", "params.fusion_threshold_mb in {path} must be a"),
        ("params:\n  cycle_time_ms: soon\n", "{path}: params.cycle_time_ms: argument --cycle"),
        ("stall_check:\n  enabled: maybe\n", "stall_check.enabled must be true or false"),
        ("params:\n  fusion_threshold_mb: [1, 2]\n", "must be a single value"),
        ("logging:\n  level: LOUD\n", "logging.level: argument --log-level: invalid choice"),
        ("controller: nccl\n", "controller must be mpi or gloo; got 'nccl'"),
        ("params: 5\n", "params must be a mapping of keys; got 5"),
        ("- a list\n", "must hold sections such as params:"),
        ("params: [\n", "is not YAML: "),
    ],
)
def test_a_bad_config_file_exits_2_naming_the_key(tmp_path, text, words, capsys):
    path = write(tmp_path, text)
    with pytest.raises(SystemExit) as e:
        parse("--config-file", path)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert words.format(path=path) in err and err.count("\n") == 1, err


def test_a_missing_config_file_exits_2(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse("--config-file", str(tmp_path / "nothing.yaml"))
    assert "cannot be read: No such file or directory" in capsys.readouterr().err


def test_keys_horovodrun_does_not_read_are_named_and_ignored(tmp_path):
    path = write(tmp_path, "autotune:\n  cycles_per_sample: 10\nverbose: true\n")
    c = parse("--config-file", path)
    assert c.settings == {}
    assert f"{path}: autotune.cycles_per_sample is not a key horovodrun reads; ignored" in c.notes
    assert f"{path}: verbose is not a key horovodrun reads; ignored" in c.notes


def test_every_key_stands_for_a_flag_the_parser_knows():
    known = run.build_parser()._option_string_actions
    for flag in config_file.KEYS.values():
        for spelling in (flag,) if isinstance(flag, str) else flag:
            assert spelling.split("=")[0] in known, spelling


# --- The launcher's output: timestamps and each rank's files. ---


def test_rank_files_are_horovods_layout_padded_to_the_last_rank(tmp_path):
    files = output.RankFiles(str(tmp_path / "out"), 12)
    assert files.path(3, "stdout") == str(tmp_path / "out" / "rank.03" / "stdout")
    files.close()
    assert sorted(os.listdir(tmp_path / "out"))[:2] == ["rank.00", "rank.01"]
    assert os.listdir(tmp_path / "out" / "rank.11") and len(os.listdir(tmp_path / "out")) == 12


def test_each_ranks_lines_go_to_its_file_without_the_tag(tmp_path, monkeypatch):
    files = output.RankFiles(str(tmp_path), 2)
    source = io.BytesIO(b"[1]<stderr>:oops\nmpirun says\n[0]<stderr>:x\n[10]<stderr>:late\n")
    sink = io.BytesIO()
    monkeypatch.setattr(output, "_stamp", lambda: b"Tue May  6 10:12:01 2025")
    output._pump(source, sink, timestamps=True, files=files)
    files.close()
    assert sink.getvalue().splitlines()[0] == b"Tue May  6 10:12:01 2025[1]<stderr>:oops"
    assert (tmp_path / "rank.1" / "stderr").read_bytes() == b"Tue May  6 10:12:01 2025oops\n"
    assert (tmp_path / "rank.0" / "stderr").read_bytes().endswith(b"x\n")
    assert (tmp_path / "rank.10" / "stderr").exists()  # a replacement rank in elastic mode
    assert (tmp_path / "rank.0" / "stdout").read_bytes() == b""


def test_the_docs_hold_the_flag_table():
    from pathlib import Path

    from syncdp.launch import horovodrun_flags

    doc = (Path(__file__).resolve().parents[2] / "docs" / "horovodrun-flags.md").read_text()
    assert horovodrun_flags.markdown_table() in doc, (
        "docs/horovodrun-flags.md is stale: paste the output of "
        '`python -c "from syncdp.launch import horovodrun_flags as h; print(h.markdown_table())"`.'
    )


def test_horovods_own_variables_set_the_settings_they_stand_for():
    # A Horovod user's environment (HOROVOD_TIMELINE=... horovodrun ...) works unchanged; a
    # SYNCDP_* variable or a flag wins over it; knobs syncdp lacks are named, not dropped.
    horovods = {
        "HOROVOD_TIMELINE": "tl.json",
        "HOROVOD_FUSION_THRESHOLD": str(3 << 20),
        "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "30",
        "HOROVOD_STALL_CHECK_TIME_SECONDS": "7",
        "HOROVOD_HIERARCHICAL_ALLREDUCE": "1",
        "HOROVOD_CYCLE_TIME": "5",
        "HOROVOD_START_TIMEOUT": "3",
    }
    c = parse(environ=horovods)
    env = env_of(c)
    assert env["SYNCDP_START_TIMEOUT"] == "3"
    assert env["SYNCDP_TIMELINE"] == os.path.abspath("tl.json")
    assert env["SYNCDP_FUSION_THRESHOLD"] == str(3 << 20)
    assert env["SYNCDP_STALL_TIMEOUT"] == "30" and env["SYNCDP_STALL_WARNING"] == "7"
    assert env["SYNCDP_HIERARCHICAL_ALLREDUCE"] == "on"
    assert any("HOROVOD_CYCLE_TIME is Horovod's and changes nothing here" in n for n in c.notes)
    c = parse("--fusion-threshold-mb", "1", environ={**horovods, "SYNCDP_STALL_TIMEOUT": "9"})
    env = env_of(c)
    assert env["SYNCDP_FUSION_THRESHOLD"] == str(1 << 20) and env["SYNCDP_STALL_TIMEOUT"] == "9"
    # The ranks read them too when started without the launcher (plain mpirun).
    config = settings.from_env({"HOROVOD_AUTOTUNE": "1", "HOROVOD_TIMELINE": "t.json"})
    assert config.autotune and config.timeline == os.path.abspath("t.json")
    # Horovod's DYNAMIC: no timeline until the program starts one.
    assert settings.from_env({"HOROVOD_TIMELINE": "DYNAMIC"}).timeline == ""
    assert env_of(parse(environ={"HOROVOD_TIMELINE": "DYNAMIC"})).get("SYNCDP_TIMELINE") == ""
    flat = settings.from_env({"HOROVOD_HIERARCHICAL_ALLREDUCE": "0"})
    assert flat.hierarchical_allreduce == "off"
    with pytest.raises(SystemExit):
        parse(environ={"HOROVOD_FUSION_THRESHOLD": "lots"})
    with pytest.raises(settings.ConfigError, match=r"HOROVOD_FUSION_THRESHOLD='lots' \(Horovod's"):
        settings.from_env({"HOROVOD_FUSION_THRESHOLD": "lots"})


def test_horovods_stall_check_disable_turns_off_the_warning_and_the_shutdown():
    # Horovod with HOROVOD_STALL_CHECK_DISABLE=1 checks for stalls not at all, whatever its two
    # stall times say; a SYNCDP_* variable or a flag still wins over it.
    off = {"HOROVOD_STALL_CHECK_DISABLE": "1", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "30"}
    config = settings.from_env(off)
    assert (config.stall_timeout, config.stall_warning) == (0, 0)
    c = parse(environ=off)
    env = env_of(c)
    assert env["SYNCDP_STALL_TIMEOUT"] == "0" and env["SYNCDP_STALL_WARNING"] == "0"
    assert not any("HOROVOD_STALL_CHECK_DISABLE" in n for n in c.notes)
    env = env_of(parse("--stall-timeout", "9", environ={**off, "SYNCDP_STALL_WARNING": "4"}))
    assert env["SYNCDP_STALL_TIMEOUT"] == "9" and env["SYNCDP_STALL_WARNING"] == "4"
    # 0 leaves the check on, with Horovod's times.
    config = settings.from_env({**off, "HOROVOD_STALL_CHECK_DISABLE": "0"})
    assert config.stall_timeout == 30 and config.stall_warning == settings.Config().stall_warning


def test_standard_input_reaches_rank_0_only_from_a_terminal_or_when_asked():
    def stdin_args(*flags, terminal):
        c = parse(*flags)
        cmd = run.build_command(c, env_of(c), stdin_is_terminal=terminal)
        return [cmd[i + 1] for i, a in enumerate(cmd) if a == "--stdin"]

    assert stdin_args(terminal=False) == ["none"]
    assert stdin_args(terminal=True) == []
    assert stdin_args("--mpi-args=--stdin 0", terminal=False) == ["0"]


def test_a_variable_mpi_args_exports_with_a_value_is_not_exported_by_the_launcher_too():
    # Open MPI keeps the first -x of a name: the launcher's own -x FOO, first, gave the ranks
    # the launcher's FOO instead of the user's -x FOO=bar.
    c = parse("--mpi-args=-x FOO=bar -x BAZ")
    cmd = run.build_command(c, run.build_env(c, environ={"FOO": "orig", "BAZ": "b", "QUX": "q"}))
    exported = [value for flag, value in zip(cmd, cmd[1:]) if flag == "-x"]
    assert exported.count("FOO=bar") == 1 and "FOO" not in exported
    assert exported.count("BAZ") == 1 and "QUX" in exported
