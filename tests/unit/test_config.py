"""Configuration: one frozen Config from SYNCDP_* variables, keyword arguments win."""

import pytest

from syncdp import config
from syncdp._exceptions import ConfigError


def test_defaults_without_environment():
    c = config.from_env({})
    assert c.fusion_threshold == 64 * 1024 * 1024
    assert c.stall_timeout > c.stall_warning > 0
    assert c.timeline == ""


def test_every_variable_maps_to_a_field():
    env = {
        "SYNCDP_FUSION_THRESHOLD": "1048576",
        "SYNCDP_CHUNK_BYTES": "4096",
        "SYNCDP_STALL_TIMEOUT": "12.5",
        "SYNCDP_STALL_WARNING": "3",
        "SYNCDP_START_TIMEOUT": "30",
        "SYNCDP_TIMELINE": "/tmp/t.json",
        "SYNCDP_VERIFY_EVERY": "5",
        "SYNCDP_VERBOSE": "1",
        "SYNCDP_LOG_ALL_RANKS": "true",
    }
    assert set(env) == set(config.ENV_VARS)
    c = config.from_env(env)
    assert (c.fusion_threshold, c.chunk_bytes, c.stall_timeout, c.stall_warning) == (
        1048576, 4096, 12.5, 3.0)
    assert (c.start_timeout, c.timeline, c.verify_every) == (30.0, "/tmp/t.json", 5)
    assert c.verbose is True and c.log_all_ranks is True


def test_keyword_arguments_override_environment():
    c = config.from_env({"SYNCDP_FUSION_THRESHOLD": "1024"}, fusion_threshold=2048)
    assert c.fusion_threshold == 2048


def test_unknown_variable_raises_and_lists_known_ones():
    with pytest.raises(ConfigError, match="SYNCDP_FUSION_TRESHOLD.*SYNCDP_FUSION_THRESHOLD"):
        config.from_env({"SYNCDP_FUSION_TRESHOLD": "1"})


def test_malformed_value_raises():
    with pytest.raises(ConfigError, match="SYNCDP_STALL_TIMEOUT='soon'"):
        config.from_env({"SYNCDP_STALL_TIMEOUT": "soon"})
    with pytest.raises(ConfigError, match="must be >= 0"):
        config.from_env({"SYNCDP_STALL_TIMEOUT": "-1"})


def test_unknown_option_raises():
    with pytest.raises(ConfigError, match="fusion_treshold"):
        config.from_env({}, fusion_treshold=1)


def test_config_is_frozen():
    with pytest.raises(AttributeError):
        config.from_env({}).stall_timeout = 1
