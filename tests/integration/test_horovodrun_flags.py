"""horovodrun's flags through the real launcher at np=2, with a tiny program (no TensorFlow).

Each rank's output reaches DIR/rank.N/stdout and DIR/rank.N/stderr with --output-filename, and
every line starts with the time under --prefix-output-with-timestamp; --tcp still runs MPI; a
horovodrun config file's settings, and the stall switches, are what the ranks find in their
environment; --gloo starts nothing.
"""

import re
import subprocess
import sys
import textwrap

import pytest

from tests.launcher import ROOT, check, launch, python_script, rank_env

# time.asctime(): "Tue May  6 10:12:01 2025"
STAMP = r"[A-Z][a-z]{2} [A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d \d{4}"

HELLO_MPI = """
import sys
from mpi4py import MPI
rank = MPI.COMM_WORLD.rank
total = MPI.COMM_WORLD.allreduce(rank + 1)
print(f"out {rank} sum {total}", flush=True)
print(f"err {rank}", file=sys.stderr, flush=True)
"""

SHOW_SETTINGS = """
import os
names = ("FUSION_THRESHOLD", "STALL_TIMEOUT", "STALL_WARNING", "HIERARCHICAL_ALLREDUCE")
seen = " ".join(f"{n}={os.environ.get('SYNCDP_' + n, '-')}" for n in names)
print(f"rank {os.environ['OMPI_COMM_WORLD_RANK']} {seen}", flush=True)
"""


def _ranks_lines(stdout: str, rank: int) -> list[str]:
    return [line for line in stdout.splitlines() if f"[{rank}]<stdout>:" in line]


def test_output_files_timestamps_and_tcp(tmp_path):
    logs = tmp_path / "logs"
    script = python_script(tmp_path, HELLO_MPI)
    result = check(
        launch(
            2,
            "python",
            script,
            launcher_args=(
                "--output-filename",
                str(logs),
                "--prefix-output-with-timestamp",
                "--tcp",
            ),
            timeout=120,
        )
    )
    for rank in (0, 1):
        (line,) = _ranks_lines(result.stdout, rank)
        assert re.fullmatch(rf"{STAMP}\[{rank}\]<stdout>:out {rank} sum 3", line), line
        stdout = (logs / f"rank.{rank}" / "stdout").read_text()
        stderr = (logs / f"rank.{rank}" / "stderr").read_text()
        assert re.fullmatch(rf"{STAMP}out {rank} sum 3\n", stdout), stdout
        assert re.fullmatch(rf"{STAMP}err {rank}\n", stderr), stderr
    assert sorted(p.name for p in logs.iterdir()) == ["rank.0", "rank.1"]


def test_a_config_file_reaches_the_ranks_and_the_command_line_wins(tmp_path):
    config = tmp_path / "horovod.yaml"
    config.write_text(
        textwrap.dedent(
            """
            params:
              fusion_threshold_mb: 4
              cycle_time_ms: 3
              hierarchical_allreduce: false
            stall_check:
              warning_time_seconds: 7
              shutdown_time_seconds: 70
            logging:
              level: DEBUG
            """
        )
    )
    script = python_script(tmp_path, SHOW_SETTINGS)
    result = check(
        launch(
            2,
            "python",
            script,
            launcher_args=(
                "--config-file",
                str(config),
                "--stall-check-shutdown-time-seconds",
                "90",
            ),
            timeout=120,
        )
    )
    for rank in (0, 1):
        assert _ranks_lines(result.stdout, rank) == [
            f"[{rank}]<stdout>:rank {rank} FUSION_THRESHOLD=4194304 STALL_TIMEOUT=90 "
            "STALL_WARNING=7 HIERARCHICAL_ALLREDUCE=off"
        ], result.stdout
    assert (
        f"syncdp-run: params.cycle_time_ms in {config} changes nothing: syncdp orders "
        "collectives when the graph is traced" in result.stderr
    )
    assert re.search(r"^syncdp-run: \S*mpirun -np 2 ", result.stderr, re.M)  # level DEBUG


def test_no_stall_check_reaches_the_ranks_and_log_level_error_is_quiet(tmp_path):
    script = python_script(tmp_path, SHOW_SETTINGS)
    result = check(
        launch(
            2,
            "python",
            script,
            launcher_args=("--no-stall-check", "--autotune", "--log-level", "ERROR"),
            timeout=120,
        )
    )
    for rank in (0, 1):
        (line,) = _ranks_lines(result.stdout, rank)
        assert "STALL_TIMEOUT=0 STALL_WARNING=0" in line, line
    assert "changes nothing" not in result.stderr and "mpirun -np" not in result.stderr


def test_gloo_runs_on_mpi_saying_so_in_one_line(tmp_path):
    marker = tmp_path / "started"
    result = subprocess.run(
        [sys.executable, "-m", "syncdp.launch", "-np", "2", "--gloo", "python", "-c"]
        + [f"open({str(marker)!r} + __import__('os').environ['OMPI_COMM_WORLD_RANK'], 'w')"],
        env=rank_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    said = [line for line in result.stderr.splitlines() if "--gloo" in line]
    assert len(said) == 1 and "runs on syncdp's engine over Open MPI" in said[0]
    assert all((tmp_path / f"started{r}").exists() for r in range(2))


@pytest.mark.parametrize("np_", [1, 2, 3])
def test_python_m_horovod_runner_launch_is_horovodrun(tmp_path, np_):
    # Horovod's launcher module run as a script (python -m horovod.runner.launch -np N ...)
    script = python_script(tmp_path, HELLO_MPI)
    result = subprocess.run(
        [sys.executable, "-m", "horovod.runner.launch", "-np", str(np_), "python", script],
        env=rank_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    total = np_ * (np_ + 1) // 2
    for rank in range(np_):
        assert _ranks_lines(result.stdout, rank) == [f"[{rank}]<stdout>:out {rank} sum {total}"]
