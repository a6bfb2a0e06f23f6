"""``horovod.run``'s arguments, without starting a job (tests/integration/test_horovod_run.py
starts them): Horovod's keyword arguments become the launcher's flags, and the contradictions
Horovod refuses are refused."""

import pytest

from syncdp.launch import run_func
from syncdp.launch.cli import parse_args


def test_horovods_keyword_arguments_become_the_launchers_flags():
    argv = run_func._flag_arguments(
        {
            "num_proc": 4,
            "min_num_proc": 2,
            "max_num_proc": 8,
            "slots": 2,
            "reset_limit": 3,
            "cooldown_range": (10, 100),
            "hostfile": "hosts.txt",
            "start_timeout": 45,
            "ssh_port": 2222,
            "output_filename": "logs",
            "network_interface": "eth0",
            "host_discovery_script": "discover.sh",
            "mpi_args": "--mca btl ^openib",
            "disable_cache": True,
            "verbose": True,
            "use_gloo": True,
        }
    )
    assert argv == [
        "-np", "4", "--min-np", "2", "--max-np", "8", "--slots-per-host", "2",
        "--reset-limit", "3", "--hostfile", "hosts.txt", "--start-timeout", "45",
        "--ssh-port", "2222", "--output-filename", "logs", "--network-interface", "eth0",
        "--host-discovery-script", "discover.sh", "--blacklist-cooldown-range", "10", "100",
        "--mpi-args=--mca btl ^openib", "--disable-cache", "--verbose", "--gloo",
    ]  # fmt: skip
    assert run_func._flag_arguments({"num_proc": 2, "hosts": "a:1,b:1", "use_mpi": True}) == [
        "-np", "2", "-H", "a:1,b:1", "--mpi",
    ]  # fmt: skip


def test_the_flags_parse_as_a_command_line_does():
    argv = run_func._flag_arguments({"num_proc": 3, "min_num_proc": 2, "use_gloo": True})
    config = parse_args(argv + ["python", "-m", "syncdp.launch.run_func"], environ={})
    assert config.num_proc == 3 and config.elastic
    assert config.command == ("python", "-m", "syncdp.launch.run_func")


@pytest.mark.parametrize(
    "options, words",
    [
        ({"hosts": "a:1", "hostfile": "h.txt"}, "hosts or hostfile, not both"),
        ({"use_gloo": True, "use_mpi": True}, "use_gloo=True or use_mpi=True, not both"),
    ],
)
def test_what_horovod_refuses_is_refused_before_anything_starts(options, words):
    with pytest.raises(ValueError, match=words):
        run_func.run(print, **options)


def test_the_hook_gives_horovod_and_horovod_runner_a_run(monkeypatch):
    from syncdp import horovod_names

    for package in ("horovod", "horovod.runner"):
        module = horovod_names._answer(package)
        assert module.run is run_func.run
        with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
            module.nothing  # noqa: B018 - the attribute read is the test
