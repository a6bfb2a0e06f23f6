"""One precedence for every setting, resolved once in the launcher (the command line, then
``--config-file``, then the launcher's ``SYNCDP_*`` variables) and exported, so the ranks read
exactly what the launcher acts on."""

from __future__ import annotations

import pytest

from syncdp.base import settings
from syncdp.launch import run


def _launch(argv, environ):
    c = run.parse_args(["-np", "2", *argv, "python", "x.py"], environ=environ)
    return c, settings.from_env(run.build_env(c, environ=environ))


def _config(tmp_path, text: str) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


def test_no_autotune_beats_an_inherited_variable(tmp_path):
    c, ranks = _launch(["--no-autotune"], {"SYNCDP_AUTOTUNE": "1"})
    assert c.settings["autotune"] is False and ranks.autotune is False
    off = _config(tmp_path, "autotune:\n  enabled: false\n")
    c, ranks = _launch(["--config-file", off], {"SYNCDP_AUTOTUNE": "1"})
    assert c.settings["autotune"] is False and ranks.autotune is False
    c, ranks = _launch([], {"SYNCDP_AUTOTUNE": "1"})  # nothing says otherwise: the variable
    assert c.settings["autotune"] is True and ranks.autotune is True


@pytest.mark.parametrize("variable", [{"SYNCDP_MIN_NP": "1"}, {"SYNCDP_ELASTIC": "1"}])
def test_an_elastic_variable_makes_the_launcher_elastic_too(variable):
    c, ranks = _launch([], variable)
    assert c.elastic and ranks.elastic
    assert "--with-ft" in run.build_command(c, run.build_env(c, environ=variable))
    c, ranks = _launch(["--spares", "1"], variable)  # no longer refused
    assert c.spares == 1 and c.elastic and ranks.elastic


def test_flags_then_config_file_then_environment(tmp_path):
    environ = {"SYNCDP_STALL_TIMEOUT": "99"}
    config = _config(tmp_path, "stall_check:\n  shutdown_time_seconds: 50\n")
    assert _launch(["--stall-timeout", "7", "--config-file", config], environ)[1].stall_timeout == 7
    assert _launch(["--config-file", config], environ)[1].stall_timeout == 50
    c, ranks = _launch([], environ)
    assert c.settings["stall_timeout"] == 99 and ranks.stall_timeout == 99


def test_variables_reach_the_ranks_unchanged():
    environ = {"SYNCDP_FUSION_THRESHOLD": "1048577", "SYNCDP_TIMELINE": "", "SYNCDP_VERBOSE": "no"}
    c, ranks = _launch([], environ)
    assert c.settings["fusion_threshold"] * settings.MiB == 1048577  # in the flag's unit
    assert ranks.fusion_threshold == 1048577  # not rounded through MiB
    assert ranks.timeline == ""  # an empty file name stays empty (not the working directory)
    assert ranks.verbose is False


def test_a_bad_variable_still_exits_2_naming_it(capsys):
    with pytest.raises(SystemExit) as e:
        _launch([], {"SYNCDP_MIN_NP": "many"})
    assert e.value.code == 2
    assert "SYNCDP_MIN_NP" in capsys.readouterr().err


def test_min_np_from_the_environment_is_checked_against_np_naming_the_variable(capsys):
    with pytest.raises(SystemExit) as e:
        _launch([], {"SYNCDP_MIN_NP": "5"})
    assert e.value.code == 2
    assert "SYNCDP_MIN_NP (5) must not exceed -np (2)" in capsys.readouterr().err
