"""Through the real launcher: the ranks read the settings the launcher resolved and acts on,
whatever the launcher's environment held."""

from __future__ import annotations

import re

from tests.launcher import check, launch, python_script

VIEW = r"""
from syncdp.base import settings
c = settings.from_env()
print(f"VIEW autotune={c.autotune} elastic={c.elastic} stall={c.stall_timeout:g}", flush=True)
"""


def _views(result) -> list[str]:
    return re.findall(r"<stdout>:VIEW (.*)", result.stdout)


def test_no_autotune_beats_the_environment_on_every_rank(tmp_path):
    result = check(
        launch(
            2,
            "python",
            python_script(tmp_path, VIEW),
            env={"SYNCDP_AUTOTUNE": "1", "SYNCDP_STALL_TIMEOUT": "99"},
            launcher_args=("--no-autotune",),
            timeout=60,
        )
    )
    assert _views(result) == ["autotune=False elastic=False stall=99"] * 2, result.stdout


def test_an_elastic_variable_runs_mpirun_with_ulfm(tmp_path):
    result = check(
        launch(
            2,
            "python",
            python_script(tmp_path, VIEW),
            env={"SYNCDP_MIN_NP": "1"},
            launcher_args=("--log-level", "DEBUG"),
            timeout=60,
        )
    )
    assert _views(result) == ["autotune=False elastic=True stall=60"] * 2, result.stdout
    command = next(
        line for line in result.stderr.splitlines() if " -m syncdp.launch.worker " in line
    )
    assert "--with-ft ulfm" in command, command
    assert "syncdp-run: elastic:" in result.stderr  # the launcher's elastic verdict
