"""``horovod.run(func, ...)``, Horovod's programmatic launcher, on syncdp's launcher.

Horovod's contract (its ``horovod.runner.run`` docstring): ``func(*args, **kwargs)`` runs in
every process of a new job, and the call returns "a list which contains values return by all
Horovod processes", whose index is the process's rank. Each check runs a fresh ``python`` (the
import hook answers ``import horovod``) that calls ``horovod.run`` and prints what it got. A
function that raises on one rank makes the call raise, naming that rank.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.launcher import rank_env

CALLER = """
import json, os, sys, warnings

import horovod
import horovod.runner


def work(scale, offset=0.0):
    import tensorflow as tf
    import horovod.tensorflow as hvd

    hvd.init()
    total = hvd.allreduce(tf.constant([float(hvd.rank() + 1)]), op=hvd.Sum)
    return [hvd.rank(), hvd.size(), float(total.numpy()[0]) * scale + offset,
            os.environ.get("FROM_ENV")]


def fails_on(bad_rank):
    import horovod.tensorflow as hvd

    hvd.init()
    if hvd.rank() == bad_rank:
        raise ValueError(f"rank {hvd.rank()} has no data\\nshard {hvd.rank()} is empty")
    hvd.barrier()
    return hvd.rank()


def returns_a_lock():
    import threading

    return threading.Lock()


assert horovod.run is horovod.runner.run
mode, n = sys.argv[1], int(sys.argv[2])
if mode == "values":
    env = dict(os.environ, FROM_ENV="given")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # num_proc is the current spelling: no warning
        got = horovod.run(work, args=(2.0,), kwargs={"offset": 1.0}, num_proc=n, env=env,
                          use_mpi=True)
    print("RESULT " + json.dumps(got), flush=True)
elif mode == "thread":  # from a thread other than the main one, which alone sets handlers
    import threading

    got = {}
    call = lambda: got.update(r=horovod.run(work, args=(1.0,), num_proc=n))  # noqa: E731
    caller = threading.Thread(target=call)
    caller.start()
    caller.join()
    print("RESULT " + json.dumps(got.get("r")), flush=True)
else:
    try:
        if mode == "unpicklable":
            horovod.run(returns_a_lock, num_proc=n)
        else:
            horovod.runner.run(fails_on, args=(n - 1,), np=n)
    except Exception as e:
        cause = e.__cause__
        print("ERROR " + json.dumps([type(e).__name__, str(e), getattr(e, "rank", None),
                                     type(cause).__name__, str(cause)]), flush=True)
    else:
        print("NO ERROR", flush=True)
"""


def _call(tmp_path, mode: str, n: int) -> subprocess.CompletedProcess:
    script = tmp_path / "caller.py"
    script.write_text(textwrap.dedent(CALLER))
    env = rank_env({"TF_CPP_MIN_LOG_LEVEL": "3"})
    env.pop("PYTHONPATH", None)  # the installed syncdp, as a user has it
    return subprocess.run(
        [sys.executable, str(script), mode, str(n)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )


def _line(done: subprocess.CompletedProcess, prefix: str):
    found = [line for line in done.stdout.splitlines() if line.startswith(prefix)]
    assert len(found) == 1, (done.stdout[-3000:], done.stderr[-3000:])
    return json.loads(found[0][len(prefix) :])


@pytest.mark.parametrize("n", [1, 2, 3])
def test_run_returns_each_ranks_value_in_rank_order(tmp_path, n):
    done = _call(tmp_path, "values", n)
    assert done.returncode == 0, done.stderr[-3000:]
    total = n * (n + 1) / 2  # the sum of rank + 1 over the ranks
    assert _line(done, "RESULT ") == [[r, n, total * 2.0 + 1.0, "given"] for r in range(n)]


@pytest.mark.parametrize("n", [1, 3])
def test_run_called_from_another_thread_returns_each_ranks_value(tmp_path, n):
    # It set the launcher's signal handlers, which only the main thread may: the job started,
    # then ended with "signal only works in main thread", its ranks stopped.
    done = _call(tmp_path, "thread", n)
    assert done.returncode == 0, done.stderr[-3000:]
    total = n * (n + 1) / 2
    assert _line(done, "RESULT ") == [[r, n, total, None] for r in range(n)], done.stderr[-3000:]


@pytest.mark.parametrize("n", [2, 3])
def test_a_rank_that_raises_is_named(tmp_path, n):
    done = _call(tmp_path, "fails", n)
    assert done.returncode == 0, done.stderr[-3000:]
    kind, message, rank, cause, cause_text = _line(done, "ERROR ")
    bad = n - 1
    assert (kind, rank, cause) == ("RunError", bad, "ValueError")
    assert message == f"horovod.run: rank {bad} failed: ValueError: shard {bad} is empty"
    assert cause_text == f"rank {bad} has no data\nshard {bad} is empty"


def test_a_value_that_cannot_travel_is_named_with_its_rank(tmp_path):
    done = _call(tmp_path, "unpicklable", 2)
    assert done.returncode == 0, done.stderr[-3000:]
    kind, message, rank, cause, _ = _line(done, "ERROR ")
    assert kind == "RunError" and rank in (0, 1) and cause == "NoneType"
    assert message.startswith(f"horovod.run: rank {rank} failed: TypeError: func returned a lock")
    assert "cannot be pickled" in message


@pytest.mark.parametrize("n", [1, 2, 3])
def test_a_callers_own_launch_module_and_helpers_are_its_own(tmp_path, n):
    # The caller's folder holds a launch.py of its own (a common name in projects) and the
    # module its function comes from: horovod.run is syncdp's launcher all the same, and the
    # ranks import the function's module from the caller's folder (pickled by reference).
    (tmp_path / "launch.py").write_text("raise SystemExit('the project launch.py was run')\n")
    (tmp_path / "helpers.py").write_text(
        "import os\n\n\ndef scaled_rank(k):\n"
        "    return k * int(os.environ['OMPI_COMM_WORLD_RANK']) ** 2\n"
    )
    (tmp_path / "caller.py").write_text(
        "import json, horovod\nfrom helpers import scaled_rank\n"
        f"print('RESULT ' + json.dumps(horovod.run(scaled_rank, args=(3,), num_proc={n})))\n"
    )
    env = rank_env()
    env["PYTHONPATH"] = str(tmp_path)  # the project's folder first, as PYTHONPATH=. has it
    done = subprocess.run(
        [sys.executable, "caller.py"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert _line(done, "RESULT ") == [3 * r * r for r in range(n)]


def _run_caller(project, cwd) -> subprocess.CompletedProcess:
    env = rank_env({"TF_CPP_MIN_LOG_LEVEL": "3"})
    env.pop("PYTHONPATH", None)  # the installed syncdp; the caller's folder only as its script's
    return subprocess.run(
        [sys.executable, str(project / "caller.py")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=cwd,
    )


@pytest.mark.parametrize("n", [1, 2, 3])
def test_a_function_from_a_module_beside_the_script_run_from_elsewhere(tmp_path, n):
    # `python project/caller.py` from another folder: the ranks import the function's module
    # from the script's folder, which is not their working directory.
    project = tmp_path / "project"
    project.mkdir()
    (project / "helpers.py").write_text(
        "import os\n\n\ndef scaled_rank(k):\n"
        "    return k * int(os.environ['OMPI_COMM_WORLD_RANK']) ** 2\n"
    )
    (project / "caller.py").write_text(
        "import json, horovod\nfrom helpers import scaled_rank\n"
        f"print('RESULT ' + json.dumps(horovod.run(scaled_rank, args=(3,), num_proc={n})))\n"
    )
    done = _run_caller(project, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _line(done, "RESULT ") == [3 * r * r for r in range(n)]


@pytest.mark.parametrize("n", [2, 3])
def test_an_exception_that_cannot_be_rebuilt_keeps_its_type_and_message(tmp_path, n):
    # An exception whose __init__ takes two arguments does not unpickle from its args: the
    # caller still gets the rank's type and message.
    (tmp_path / "caller.py").write_text(
        textwrap.dedent(
            f"""
            import json, os, horovod

            class ConfigProblem(Exception):
                def __init__(self, key, detail):
                    super().__init__(f"bad key {{key}}: {{detail}}")

            def train():
                if int(os.environ["OMPI_COMM_WORLD_RANK"]) == {n - 1}:
                    raise ConfigProblem("lr", "must be positive")

            try:
                horovod.run(train, num_proc={n})
            except Exception as e:
                print("ERROR " + json.dumps([type(e).__name__, str(e), e.rank]), flush=True)
            """
        )
    )
    done = _run_caller(tmp_path, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    kind, message, rank = _line(done, "ERROR ")
    assert (kind, rank) == ("RunError", n - 1)
    assert message.startswith(
        f"horovod.run: rank {n - 1} failed: ConfigProblem: bad key lr: must be positive"
    ), message
