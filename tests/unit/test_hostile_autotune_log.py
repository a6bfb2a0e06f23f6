"""An autotune log that cannot be written is found before training starts: by the launcher
(exit 2, one line naming the file) and by rank 0's ``init()`` (a ConfigError naming it); one
that stops being writable while training is said once and training goes on."""

from __future__ import annotations

import os

import pytest

from syncdp.base import settings
from syncdp.base.errors import ConfigError
from syncdp.launch import cli


def test_what_cannot_be_written_is_named(tmp_path):
    assert settings.unwritable(str(tmp_path / "tune.csv")) is None
    assert settings.unwritable(str(tmp_path / "new" / "tune.csv")) == (
        f"No such directory: {str(tmp_path / 'new')!r}"
    )
    assert settings.unwritable(str(tmp_path)) == f"{str(tmp_path)!r} is a directory"
    (tmp_path / "file").write_text("")
    assert settings.unwritable(str(tmp_path / "file" / "t.csv")) == (
        f"Not a directory: {str(tmp_path / 'file')!r}"
    )


def _env(path, **more):
    return {"SYNCDP_AUTOTUNE": "1", "SYNCDP_AUTOTUNE_LOG_FILE": str(path), **more}


def test_rank_0_init_refuses_a_log_it_cannot_write(tmp_path):
    bad = tmp_path / "missing" / "tune.csv"
    for rank_var in ({}, {"OMPI_COMM_WORLD_RANK": "0"}, {"PMIX_RANK": "0"}):
        with pytest.raises(ConfigError) as e:
            settings.from_env(_env(bad, **rank_var))
        assert str(bad) in str(e.value) and "\n" not in str(e.value)
    # init(autotune_log_file=...) is checked the same way.
    with pytest.raises(ConfigError, match="missing"):
        settings.from_env({}, autotune=True, autotune_log_file=str(bad))


def test_only_the_rank_that_writes_checks(tmp_path):
    bad = str(tmp_path / "missing" / "tune.csv")
    assert settings.from_env(_env(bad, OMPI_COMM_WORLD_RANK="1")).autotune_log_file == bad
    assert settings.from_env({"SYNCDP_AUTOTUNE_LOG_FILE": bad}).autotune is False  # not tuning
    elastic = settings.from_env(_env(bad, SYNCDP_MIN_NP="1"))  # elastic jobs do not tune
    assert elastic.elastic and elastic.autotune_log_file == bad
    good = str(tmp_path / "tune.csv")
    assert settings.from_env(_env(good)).autotune_log_file == good


@pytest.mark.parametrize(
    "argv,environ",
    [
        (["--autotune", "--autotune-log-file", "{bad}"], {}),
        (["--autotune-log-file", "{bad}"], {"SYNCDP_AUTOTUNE": "1"}),
        (["--autotune"], {"SYNCDP_AUTOTUNE_LOG_FILE": "{bad}"}),
        (["--config-file", "{config}"], {}),
    ],
)
def test_the_launcher_exits_2_naming_the_file(tmp_path, capsys, argv, environ):
    bad = str(tmp_path / "missing" / "tune.csv")
    config = tmp_path / "run.yaml"
    config.write_text(f"autotune:\n  enabled: true\n  log_file: {bad}\n")
    fill = {"bad": bad, "config": str(config)}
    argv = [a.format(**fill) for a in argv]
    environ = {k: v.format(**fill) for k, v in environ.items()}
    with pytest.raises(SystemExit) as e:
        cli.parse_args(["-np", "2", *argv, "python", "train.py"], environ=environ)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and bad in err[0] and "No such directory" in err[0], err


def test_a_log_that_stops_being_writable_is_said_once(tmp_path, monkeypatch, capsys):
    autotuning = pytest.importorskip("syncdp.tensorflow.autotuning")
    from syncdp.engine.autotune import Choice, Tuner
    from syncdp.job import runtime

    gone = tmp_path / "gone"
    gone.mkdir()
    path = gone / "tune.csv"
    config = settings.Config(autotune=True, autotune_log_file=str(path))
    monkeypatch.setattr(runtime, "get_config", lambda: config)
    monkeypatch.setattr(autotuning, "_LOG_FAILED", False)
    t = Tuner(
        Choice(1 << 20, 0, 1 << 20, False), warmup_samples=1, steps_per_sample=1, max_samples=4
    )
    autotuning._log(t, finished=False)
    assert path.exists()
    os.unlink(path)
    os.rmdir(gone)
    autotuning._log(t, finished=False)
    autotuning._log(t, finished=False)
    said = [line for line in capsys.readouterr().err.splitlines() if "autotune log" in line]
    assert len(said) == 1 and str(path) in said[0], said
