"""The settings table: one row per setting drives init(), the environment, the launcher, the docs.

The first half checks :func:`syncdp.base.settings.from_env` (one frozen Config, keyword arguments
win, unknown or malformed variables raise). The second half checks that every place derived from
:data:`~syncdp.base.settings.SETTINGS` agrees with it: the launcher's flags and their help, the
variables the launcher sets, and the table in docs/settings.md.
"""

import argparse

import pytest

from syncdp.base import settings
from syncdp.base.errors import ConfigError
from syncdp.launch import horovodrun_flags, run
from tests.launcher import ROOT

MiB = 1024 * 1024


def _valid_text(s: settings.Setting) -> tuple[str, object]:
    """A valid, non-default text for a row's variable, and the value it must parse to (from
    the table, so that a new row is covered without editing this file)."""
    if s.type is bool:
        return "true", True
    if s.choices:
        word = next(c for c in reversed(s.choices) if c != s.default)
        return word, word
    if s.type is str:
        return "/tmp/some/path", "/tmp/some/path"
    least = int(s.minimum or 0)
    value = max(least, s.default if isinstance(s.default, int) else 0) + 3
    if s.type is float:
        return f"{value}.5", value + 0.5
    return str(value), value


EVERY_VARIABLE = {s.env: _valid_text(s) for s in settings.SETTINGS}


def test_defaults_without_environment_are_the_tables():
    c = settings.from_env({})
    for s in settings.SETTINGS:
        assert getattr(c, s.name) == s.default, s.name
    assert c.fusion_threshold == 25 * MiB
    assert c.stall_timeout > c.stall_warning > 0
    assert c.timeline == ""


def test_every_variable_sets_its_field():
    c = settings.from_env({key: text for key, (text, _) in EVERY_VARIABLE.items()})
    for s in settings.SETTINGS:
        assert getattr(c, s.name) == EVERY_VARIABLE[s.env][1], s.env
        assert getattr(c, s.name) != s.default, s.env


def test_a_few_variables_parse_as_a_user_writes_them():
    c = settings.from_env(
        {
            "SYNCDP_FUSION_THRESHOLD": "1048576",
            "SYNCDP_STALL_TIMEOUT": "12.5",
            "SYNCDP_VERBOSE": "1",
        }
    )
    assert (c.fusion_threshold, c.stall_timeout, c.verbose) == (1048576, 12.5, True)


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
    with pytest.raises(ConfigError, match="SYNCDP_STALL_TIMEOUT must be .*; got 'soon'"):
        settings.from_env({"SYNCDP_STALL_TIMEOUT": "soon"})
    with pytest.raises(ConfigError, match="SYNCDP_VERBOSE must be a boolean .*; got 'maybe'"):
        settings.from_env({"SYNCDP_VERBOSE": "maybe"})


def test_value_below_the_minimum_raises_naming_the_variable():
    with pytest.raises(ConfigError, match="SYNCDP_STALL_TIMEOUT must be .*at least 0; got '-1'"):
        settings.from_env({"SYNCDP_STALL_TIMEOUT": "-1"})


NONSENSE_KEYWORDS = [
    ("stall_timeout", float("nan")),
    ("stall_timeout", float("inf")),
    ("start_timeout", -1.0),
    ("fusion_threshold", float("inf")),
    ("fusion_threshold", 1.5),
    ("fusion_threshold", "25MB"),
    ("chunk_bytes", 0),
    ("chunk_bytes", 512),
    ("verify_every", True),
    ("verbose", 1),
    ("hierarchical_allreduce", "maybe"),
]


@pytest.mark.parametrize("name, value", NONSENSE_KEYWORDS)
def test_init_keywords_get_the_same_check_naming_variable_and_flag(name, value):
    s = next(s for s in settings.SETTINGS if s.name == name)
    with pytest.raises(ConfigError) as e:
        settings.from_env({}, **{name: value})
    text = str(e.value)
    assert (
        text.startswith(f"{name} must be ")
        and f"got {value!r} ({s.env}, syncdp-run {s.flag})" in text
    )
    assert "\n" not in text


def test_nan_in_the_environment_no_longer_turns_stall_detection_off():
    # NaN compares false with everything: it passed "at least 0" and no wait ever exceeded it.
    with pytest.raises(ConfigError, match="SYNCDP_STALL_TIMEOUT must be a finite number"):
        settings.from_env({"SYNCDP_STALL_TIMEOUT": "nan"})


def test_validate_returns_the_value_in_the_sources_unit():
    assert settings.validate("chunk_bytes", "0.5", source="flag") == 0.5  # MiB
    assert settings.validate("chunk_bytes", "4096", source="env") == 4096
    assert settings.validate("verbose", True, source="flag") is True
    assert settings.validate("stall_timeout", 0) == 0  # 0: never, allowed


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


def test_launcher_only_flags_are_not_settings_and_all_are_horovodruns():
    flags = {s.flag for s in settings.SETTINGS}
    aliases = {a for spellings in horovodrun_flags.ALIASES.values() for a in spellings}
    own = {f for f in _flag_actions() if f not in flags | aliases}
    # Every flag that is not a setting is one of horovodrun's: syncdp adds only settings, and
    # --spares (processes the launcher starts, not something a rank is configured with).
    assert own <= {n for row in horovodrun_flags.FLAGS for n in row.names} | {"--spares"}
    assert {"-np", "-H", "--hostfile", "--network-interface", "--mpi-args"} <= own
    assert {"--stall-check-shutdown-time-seconds", "--min-num-proc"} <= aliases


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
    # --reset-limit is refused outside elastic mode: both jobs are elastic for it.
    mode = ["--elastic"] if s.name == "reset_limit" else []
    base = run.build_env(run.parse_args(["-np", "2", *mode, "python"], environ={}), environ={})
    args, text = _flag_value(s)
    env = run.build_env(
        run.parse_args(["-np", "2", *mode, *args, "python"], environ={}), environ={}
    )
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
        run.parse_args(["-np", "2", f"{s.flag}={too_small:g}", "python"], environ={})
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"{s.flag} must be " in err and f"at least {s.minimum / s.flag_unit:g}" in err, err


def test_docs_hold_the_generated_settings_table():
    page = (ROOT / "docs" / "settings.md").read_text()
    assert settings.markdown_table() in page, (
        "docs/settings.md's settings table differs from syncdp/base/settings.py; paste the "
        "output of "
        '`python -c "from syncdp.base import settings; print(settings.markdown_table())"`.'
    )


def test_a_setting_with_choices_refuses_other_words(capsys):
    with pytest.raises(ConfigError, match="SYNCDP_HIERARCHICAL_ALLREDUCE must be one of auto, on"):
        settings.from_env({"SYNCDP_HIERARCHICAL_ALLREDUCE": "maybe"})
    with pytest.raises(SystemExit):
        run.parse_args(["-np", "2", "--hierarchical-allreduce=maybe", "python"], environ={})
    assert "--hierarchical-allreduce must be one of auto, on, off; got 'maybe'" in (
        capsys.readouterr().err
    )


def test_hierarchical_allreduce_alone_is_horovodruns_switch():
    # horovodrun's --hierarchical-allreduce takes no value: the next word starts the program.
    c = run.parse_args(["-np", "2", "--hierarchical-allreduce", "python", "x.py"], environ={})
    assert c.settings == {"hierarchical_allreduce": "on"} and c.command == ("python", "x.py")
    c = run.parse_args(["-np", "2", "--hierarchical-allreduce", "auto", "python"], environ={})
    assert c.settings == {"hierarchical_allreduce": "auto"} and c.command == ("python",)
