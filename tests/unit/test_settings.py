"""The settings table: one row per setting drives init(), the environment, the launcher, the README.

The first half checks :func:`syncdp.core.settings.from_env` (one frozen Config, keyword arguments
win, unknown or malformed variables raise). The second half checks that every place derived from
:data:`~syncdp.core.settings.SETTINGS` agrees with it: the launcher's flags and their help, the
variables the launcher sets, and the README's table.
"""

import argparse

import pytest

from launch import run
from syncdp.core import settings
from syncdp.core.errors import ConfigError
from tests.launcher import ROOT

MiB = 1024 * 1024

# A valid, non-default text for every variable, and the value it must parse to.
EVERY_VARIABLE = {
    "SYNCDP_FUSION_THRESHOLD": ("1048576", 1048576),
    "SYNCDP_FIRST_BUCKET_BYTES": ("65536", 65536),
    "SYNCDP_CHUNK_BYTES": ("4096", 4096),
    "SYNCDP_START_TIMEOUT": ("30", 30.0),
    "SYNCDP_STALL_TIMEOUT": ("12.5", 12.5),
    "SYNCDP_STALL_WARNING": ("3", 3.0),
    "SYNCDP_TIMELINE": ("/tmp/t.json", "/tmp/t.json"),
    "SYNCDP_VERIFY_EVERY": ("5", 5),
    "SYNCDP_HIERARCHICAL_ALLREDUCE": ("on", "on"),
    "SYNCDP_SHARED_MEMORY": ("off", "off"),
    "SYNCDP_ELASTIC": ("1", True),
    "SYNCDP_MIN_NP": ("2", 2),
    "SYNCDP_MAX_NP": ("4", 4),
    "SYNCDP_HOST_DISCOVERY_SCRIPT": ("/bin/hosts.sh", "/bin/hosts.sh"),
    "SYNCDP_RESET_LIMIT": ("3", 3),
    "SYNCDP_LOG_ALL_RANKS": ("true", True),
    "SYNCDP_VERBOSE": ("1", True),
}


def test_defaults_without_environment_are_the_tables():
    c = settings.from_env({})
    for s in settings.SETTINGS:
        assert getattr(c, s.name) == s.default, s.name
    assert c.fusion_threshold == 25 * MiB
    assert c.stall_timeout > c.stall_warning > 0
    assert c.timeline == ""


def test_every_variable_sets_its_field():
    assert set(EVERY_VARIABLE) == {s.env for s in settings.SETTINGS}
    c = settings.from_env({key: text for key, (text, _) in EVERY_VARIABLE.items()})
    for s in settings.SETTINGS:
        assert getattr(c, s.name) == EVERY_VARIABLE[s.env][1], s.env


@pytest.mark.parametrize("text, value", [("0", False), ("off", False), ("yes", True)])
def test_boolean_spellings(text, value):
    assert settings.from_env({"SYNCDP_VERBOSE": text}).verbose is value


def test_internal_launcher_variables_are_not_settings():
    c = settings.from_env({"SYNCDP_LAUNCHER": "1", "SYNCDP_REPORT_ADDR": "127.0.0.1:5000"})
    assert c == settings.Config()


def test_keyword_arguments_override_environment():
    c = settings.from_env({"SYNCDP_FUSION_THRESHOLD": "1024"}, fusion_threshold=2048)
    assert c.fusion_threshold == 2048
    # None means "not given": the environment's value stays.
    assert settings.from_env({"SYNCDP_FUSION_THRESHOLD": "1024"}, fusion_threshold=None) == (
        settings.from_env({"SYNCDP_FUSION_THRESHOLD": "1024"})
    )


def test_unknown_variable_raises_and_lists_known_ones():
    with pytest.raises(ConfigError, match="SYNCDP_FUSION_TRESHOLD") as e:
        settings.from_env({"SYNCDP_FUSION_TRESHOLD": "1"})
    for s in settings.SETTINGS:
        assert s.env in str(e.value)


def test_malformed_value_raises_naming_it():
    with pytest.raises(ConfigError, match="SYNCDP_STALL_TIMEOUT='soon'"):
        settings.from_env({"SYNCDP_STALL_TIMEOUT": "soon"})
    with pytest.raises(ConfigError, match="SYNCDP_VERBOSE='maybe'"):
        settings.from_env({"SYNCDP_VERBOSE": "maybe"})


def test_value_below_the_minimum_raises_naming_variable_and_flag():
    with pytest.raises(ConfigError, match="at least 0.*SYNCDP_STALL_TIMEOUT.*--stall-timeout"):
        settings.from_env({"SYNCDP_STALL_TIMEOUT": "-1"})
    with pytest.raises(ConfigError, match="chunk_bytes must be at least 1024; got 512"):
        settings.from_env({}, chunk_bytes=512)


def test_unknown_keyword_raises():
    with pytest.raises(ConfigError, match="fusion_treshold"):
        settings.from_env({}, fusion_treshold=1)


def test_config_is_frozen():
    with pytest.raises(AttributeError):
        settings.from_env({}).stall_timeout = 1


# --- Everything derived from the table agrees with it. ---


def _flag_actions() -> dict[str, list[argparse.Action]]:
    actions: dict[str, list[argparse.Action]] = {}
    for action in run.build_parser()._actions:
        for flag in action.option_strings:
            actions.setdefault(flag, []).append(action)
    return actions


def test_every_setting_has_exactly_one_launcher_flag_documented_by_its_row():
    actions = _flag_actions()
    for s in settings.SETTINGS:
        assert len(actions.get(s.flag, [])) == 1, s.flag
        (action,) = actions[s.flag]
        assert action.dest == s.name
        assert s.doc in action.help and s.env in action.help, action.help
        assert f"default {s.default_text()}" in action.help, action.help


def test_launcher_only_flags_are_not_settings():
    flags = {s.flag for s in settings.SETTINGS}
    own = {f for f in _flag_actions() if f not in flags}
    assert own == {
        "-h",
        "--help",
        "-np",
        "--num-proc",
        "-H",
        "--hosts",
        "--hostfile",
        "-p",
        "--ssh-port",
        "-i",
        "--ssh-identity-file",
        "--network-interface",
        "--mpi-args",
    }


def _flag_value(s: settings.Setting) -> tuple[list[str], str]:
    """Arguments that give the flag a non-default value, and the variable's expected text."""
    if s.type is bool:
        return [s.flag], "1"
    if s.type is str and s.choices:
        return [s.flag, s.choices[-1]], s.choices[-1]
    if s.type is str:
        return [s.flag, "/tmp/timeline.json"], "/tmp/timeline.json"
    if s.flag_unit == MiB:
        return [s.flag, "0.5"], str(MiB // 2)  # the flag is MiB, the variable bytes
    if s.name == "min_np":
        return [s.flag, "1"], "1"  # may not exceed -np (2)
    return [s.flag, "7"], "7"


@pytest.mark.parametrize("s", settings.SETTINGS, ids=lambda s: s.flag)
def test_each_flag_sets_exactly_its_rows_variable(s):
    base = run.build_env(run.parse_args(["-np", "2", "python"]), environ={})
    args, text = _flag_value(s)
    env = run.build_env(run.parse_args(["-np", "2", *args, "python"]), environ={})
    added = {k: v for k, v in env.items() if k not in base}
    assert added == {s.env: text}
    # And the ranks read back what the flag said.
    parsed = getattr(settings.from_env({s.env: text}), s.name)
    assert parsed == s.parse(text)


@pytest.mark.parametrize(
    "s",
    [s for s in settings.SETTINGS if s.minimum is not None and s.type in (int, float)],
    ids=lambda s: s.flag,
)
def test_flag_below_the_rows_minimum_is_a_usage_error_naming_it(s, capsys):
    too_small = s.minimum / s.flag_unit - 1
    with pytest.raises(SystemExit) as e:
        run.parse_args(["-np", "2", s.flag, f"{too_small:g}", "python"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"{s.flag} must be at least {s.minimum / s.flag_unit:g}" in err, err


def test_readme_holds_the_generated_settings_table():
    readme = (ROOT / "README.md").read_text()
    assert settings.markdown_table() in readme, (
        "README.md's settings table differs from syncdp/core/settings.py; paste the output of "
        '`python -c "from syncdp.core import settings; print(settings.markdown_table())"`.'
    )


def test_a_setting_with_choices_refuses_other_words(capsys):
    with pytest.raises(ConfigError, match="hierarchical_allreduce must be one of auto, on, off"):
        settings.from_env({"SYNCDP_HIERARCHICAL_ALLREDUCE": "maybe"})
    with pytest.raises(SystemExit):
        run.parse_args(["-np", "2", "--hierarchical-allreduce", "maybe", "python"])
    assert "invalid choice: 'maybe'" in capsys.readouterr().err
