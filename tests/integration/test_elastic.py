"""Elastic mode through the real launcher: lost and stalled ranks are replaced, training goes on.

The job is examples/elastic_custom_loop.py (linear regression, state committed every step,
data from elastic_tfrecord_dataset with a fixed global batch, gradients summed). Its update
does not depend on the number of ranks, so whatever the failures, the final weights must equal
one process's result (examples/elastic_custom_loop.py:reference), which applies every global
batch of every epoch exactly once: a batch lost or applied twice would show.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import re
import signal
import subprocess
import time

import numpy as np
import pytest

from tests.launcher import ROOT, launch, python_script, start

EXAMPLE = "examples/elastic_custom_loop.py"
EPOCHS, RECORDS, GLOBAL_BATCH, LR = 2, 600, 60, 0.05


def _example():
    spec = importlib.util.spec_from_file_location("elastic_custom_loop", ROOT / EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # numpy only at import: TensorFlow loads in main()
    return module


def _expected():
    ex = _example()
    x, y = ex.make_data(RECORDS)
    order = ex.file_order(RECORDS, ex.SHARDS)
    return ex.reference(x[order], y[order], GLOBAL_BATCH, EPOCHS, LR)


def _results(stdout: str) -> list[dict]:
    return [json.loads(m) for m in re.findall(r"<stdout>:RESULT (\{.*\})", stdout)]


def _run(tmp_path, np_, *kills, launcher=(), extra=(), timeout=300):
    args = ["--data", str(tmp_path / "data"), "--epochs", str(EPOCHS), *extra]
    for kill in kills:
        args += ["--kill", kill]
    return launch(
        np_,
        "python",
        EXAMPLE,
        *args,
        launcher_args=("--min-np", "2", *launcher),
        timeout=timeout,
    )


def _assert_finished(result, size: int, changes: int) -> list[dict]:
    """Exit 0, every rank done and bit-identical, equal to one process, the log right.

    Returns the results of the run in which the ranks were lost and replaced (the only run,
    unless Open MPI lost a daemon as the job ended; see below)."""
    out = f"--- stdout ---\n{result.stdout[-4000:]}\n--- stderr ---\n{result.stderr[-6000:]}"
    assert result.returncode == 0, out
    results = _results(result.stdout)
    summary = f"{changes} membership change(s); the job finished with {size} rank(s)"
    if len(results) == 2 * size and "1 restart(s) after a lost Open MPI daemon" in result.stderr:
        # Open MPI lost a daemon as the job ended, before the ranks there reported how they
        # ended (seen in full runs under load, about once in 30): the launcher cannot tell their
        # program's end was done, so it restarts from the last commit and the end runs again
        # (docs/elastic-host-loss.md). Both runs' results must be whole and agree, and the
        # last line counts the restart; the restart itself loses no rank.
        replaced, results = results[:size], results[size:]
        assert sorted(r["rank"] for r in replaced) == list(range(size)), out
        assert all(r["w"] == results[0]["w"] and r["b"] == results[0]["b"] for r in replaced), out
        summary = "1 restart(s) after a lost Open MPI daemon"
        last_line = result.stderr.strip().splitlines()[-1]
        assert summary in last_line and "since then, no rank was lost" in last_line, out
    else:
        replaced = results
    assert len(results) == size, out
    assert sorted(r["rank"] for r in results) == list(range(size)), out
    assert all(r["size"] == size and r["epoch"] == EPOCHS for r in results), out
    first = results[0]
    assert all(r["w"] == first["w"] and r["b"] == first["b"] for r in results), out
    w, b = _expected()
    np.testing.assert_allclose(first["w"], w, rtol=1e-9, atol=1e-12)
    assert abs(first["b"] - b) < 1e-9
    logged = re.findall(r"syncdp-run: elastic: .*recovered in ([0-9.]+) s", result.stderr)
    assert len(logged) == changes, out
    assert summary in result.stderr, out
    return replaced


@pytest.mark.parametrize("label", [1, 0])
def test_killed_rank_is_replaced_and_training_matches_one_process(tmp_path, label):
    result = _run(tmp_path, 3, f"{label}:0:4")
    results = _assert_finished(result, size=3, changes=1)
    assert re.search(
        rf"elastic: lost rank {label} \(pid \d+ on .*\): it was killed by signal 9", result.stderr
    )
    assert "size 3 -> 3" in result.stderr
    # The replacement's output is labelled 3, and it finished as the last rank.
    assert any(r["label"] == 3 and r["rank"] == 2 for r in results)


def test_two_failures_and_a_failure_during_recovery(tmp_path):
    # Rank 1 dies; while the job recovers (after the rebuild, before the state is synced)
    # rank 2 dies too; later the first replacement (label 3) dies in epoch 1.
    result = _run(tmp_path, 3, "1:0:3", "2:reset", "3:1:2")
    _assert_finished(result, size=3, changes=3)
    assert len(re.findall(r"elastic: lost rank", result.stderr)) >= 3


def _discovery(tmp_path, slots: int) -> str:
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\necho localhost:{slots}\n")
    script.chmod(0o755)
    return str(script)


def test_no_free_slot_goes_on_at_a_smaller_size(tmp_path):
    # The discovery script offers 2 slots: after rank 1 dies there is none for a replacement,
    # and the job finishes on the 2 survivors, still equal to one process (fixed global batch).
    result = _run(
        tmp_path, 3, "1:0:4", launcher=("--host-discovery-script", _discovery(tmp_path, 2))
    )
    _assert_finished(result, size=2, changes=1)
    assert "0 replacement(s) started; size 3 -> 2" in result.stderr


def test_a_listed_host_where_no_replacement_can_start_is_left_out(tmp_path):
    # The script lists a host the job was not started with (Open MPI cannot place a process
    # there): the failed spawn leaves it out, and the job goes on with the 2 survivors
    # (--min-np 2) instead of failing the same way until the job ends.
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho localhost:2\necho nohost.invalid:2\n")
    script.chmod(0o755)
    result = _run(
        tmp_path, 3, "1:0:4", launcher=("--min-np", "2", "--host-discovery-script", str(script))
    )
    _assert_finished(result, size=2, changes=1)
    assert "a replacement could not start on nohost.invalid; leaving it out" in result.stderr
    assert "0 replacement(s) started; size 3 -> 2" in result.stderr


def test_the_job_grows_when_the_discovery_script_offers_slots(tmp_path):
    # 2 slots until rank 0 creates the marker in epoch 0, 3 after: at its next commit the job
    # spawns a third rank (--max-np 3), which receives the state, and finishes at size 3.
    # The script is given as Horovod allows too: a shell command line, whose host printed
    # without a count has --slots-per-host slots.
    marker = tmp_path / "more-slots"
    script = f"if [ -e {marker} ]; then echo localhost; else echo localhost:2; fi"
    result = _run(
        tmp_path,
        2,
        launcher=("--max-np", "3", "--host-discovery-script", script, "--slots-per-host", "3"),
        # Slow steps: rank 0 runs the script at most every 2 s, at a commit.
        extra=("--touch", f"0:2:{marker}", "--step-seconds", "0.3"),
    )
    _assert_finished(result, size=3, changes=1)
    assert "new slots found" in result.stderr and "size 2 -> 3" in result.stderr


def test_below_min_np_ends_cleanly_with_a_message(tmp_path):
    result = _run(
        tmp_path,
        2,
        "1:0:4",
        launcher=("--host-discovery-script", _discovery(tmp_path, 1)),
        timeout=180,
    )
    assert result.returncode != 0
    assert "only 1 rank(s) left" in result.stderr and "--min-np is 2" in result.stderr, (
        result.stderr[-4000:]
    )
    assert re.search(r"syncdp-run: the job failed .*elastic mode could not go on", result.stderr)


def test_the_reset_limit_ends_the_job_before_anything_is_spawned_for_the_change_past_it(
    tmp_path,
):
    # --reset-limit 1: rank 1 dies and is replaced by [2]; [2] dies in epoch 1, and that change
    # would be the second. The job ends at once, as Horovod's: no replacement is started for
    # it, and no rank says it leaves for the job to recover without it.
    result = _run(tmp_path, 2, "1:0:3", "2:1:3", launcher=("--reset-limit", "1"), timeout=180)
    assert result.returncode == 1, result.stderr[-4000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last == (
        "syncdp-run: the job failed (elastic); first failure: elastic mode could not go on: "
        "the reset limit (1) was reached; ending the job."
    ), result.stderr[-4000:]
    assert re.findall(r"output \[(\d+)\]\)", result.stderr) == ["2"], result.stderr[-4000:]
    assert "recovers without it" not in result.stderr
    assert re.search(
        r"lost rank 0 \(pid \d+ on .*\): it exited with code 1; elastic mode could not go on",
        result.stderr,
    ), result.stderr[-4000:]


def test_below_min_np_ends_the_job_before_anything_is_spawned(tmp_path):
    # 4 ranks, --min-np 4, 3 slots: ranks 1 and 2 die; whatever the recovery finds, it cannot
    # reach 4, so nothing is spawned (a replacement would only be thrown away).
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho localhost:3\n")
    script.chmod(0o755)
    result = _run(
        tmp_path,
        4,
        "1:0:3",
        "2:0:3",
        launcher=("--min-np", "4", "--host-discovery-script", str(script)),
        timeout=180,
    )
    assert result.returncode == 1, result.stderr[-4000:]
    last = result.stderr.strip().splitlines()[-1]
    assert "elastic mode could not go on: only" in last and "--min-np is 4" in last, last
    assert "output [" not in result.stderr, result.stderr[-4000:]
    assert not re.search(r"^\[[4-9]\]<", result.stdout + result.stderr, re.M)


def test_a_discovery_script_that_fails_at_the_start_is_refused_before_any_rank_starts(tmp_path):
    # As horovodrun: a script that cannot run would leave every lost rank unreplaced.
    marker = tmp_path / "started"
    for script, why in [
        (str(tmp_path / "missing.sh"), "exited with 127"),  # the shell found no such file
        ("echo localhost:2; exit 3", "exited with 3"),
    ]:
        result = launch(
            2,
            "python",
            "-c",
            f"open({str(marker)!r}, 'w')",
            launcher_args=("--min-np", "1", "--host-discovery-script", script),
            timeout=60,
        )
        assert result.returncode == 2, result.stderr
        assert why in result.stderr, result.stderr
        assert f"the host discovery script {script!r} failed" in result.stderr, result.stderr
        assert not marker.exists()


UNEVEN_COMMITS = """
import syncdp
import syncdp.elastic

syncdp.init()
state = syncdp.elastic.ObjectState(step=0)


@syncdp.elastic.run
def train(state):
    while state.step < 6:
        syncdp.barrier()
        state.step += 1
        if syncdp.rank() == 0 or state.step % 2 == 0:  # rank 0 commits twice as often
            state.commit()


train(state)
print("FINISHED", flush=True)
"""


def test_ranks_that_commit_at_different_points_fail_instead_of_pairing_silently(tmp_path):
    # With a discovery script (or spares) a commit is a collective: rank 0's commit at step 1
    # meets rank 1's barrier. Every rank gets MismatchError; nothing finishes as a success.
    program = tmp_path / "uneven_commits.py"
    program.write_text(UNEVEN_COMMITS)
    flags = ("--min-np", "2", "--host-discovery-script", "echo localhost:2")
    result = launch(2, "python", str(program), launcher_args=flags, timeout=120)
    out = f"--- stdout ---\n{result.stdout[-3000:]}\n--- stderr ---\n{result.stderr[-5000:]}"
    assert result.returncode != 0, out
    assert "FINISHED" not in result.stdout, out
    assert "MismatchError" in result.stderr, out
    expected = "rank 0 in elastic.commit_check; rank 1 in barrier"
    assert expected in result.stderr, out
    assert "recovering" not in result.stderr, out  # an exception ends the job: no recovery
    assert "it raised an exception, so the job ends" in result.stderr, out


RAISES = """
import sys
import time
import syncdp
import syncdp.elastic

syncdp.init()
state = syncdp.elastic.ObjectState(step=0)


@syncdp.elastic.run
def train(state):
    while state.step < 40:
        syncdp.barrier()
        state.step += 1
        state.commit()
        if syncdp.rank() == int(sys.argv[1]) and state.step == 3:
            raise ValueError("user error")
        time.sleep(0.05)


train(state)
print("FINISHED", flush=True)
"""


@pytest.mark.parametrize("raiser", [0, 2])
def test_an_exception_on_one_rank_ends_the_job_without_a_recovery(tmp_path, raiser):
    # An exception is not a loss: the survivors, which meet it as a lost rank, must not
    # re-form the job (nor make a new rank 0 of themselves) and train on while it ends.
    program = tmp_path / "raises.py"
    program.write_text(RAISES)
    flags = ("--min-np", "1", "--spares", "1")
    result = launch(3, "python", str(program), str(raiser), launcher_args=flags, timeout=120)
    out = f"--- stdout ---\n{result.stdout[-3000:]}\n--- stderr ---\n{result.stderr[-5000:]}"
    assert result.returncode == 1, out
    assert "FINISHED" not in result.stdout, out
    assert f"rank {raiser} ended the job (it raised an exception" in result.stderr, out
    assert "Recovering from the last commit" not in result.stderr, out
    assert "took over" not in result.stderr and "recovered" not in result.stderr, out
    assert result.stderr.splitlines()[-1].endswith("failed with ValueError: user error"), out


def test_stalled_rank_is_removed_and_replaced(tmp_path):
    result = _run(tmp_path, 3, "2:0:4:STOP", launcher=("--stall-timeout", "4"))
    _assert_finished(result, size=3, changes=1)
    assert re.search(
        r"elastic: rank \[2\] \(pid \d+ on .*\) stalled past the stall timeout", (result.stderr)
    )


def test_keras_example_survives_a_random_kill(tmp_path):
    """The issue's acceptance run: any one rank SIGKILLed at a random moment of training."""
    data = str(tmp_path / "digits")
    proc = start(
        3,
        "python",
        "examples/elastic_train.py",
        "--data-dir",
        data,
        "--epochs",
        "4",
        "--step-seconds",
        "0.05",
        "--verbose",
        "2",
        launcher_args=("--min-np", "2"),
    )
    rng = random.Random()
    victim = None
    try:
        lines = []
        deadline = time.monotonic() + 240
        for line in proc.stdout:  # wait until training is under way
            lines.append(line)
            if "Epoch 2/2" in line or time.monotonic() > deadline:
                break
        time.sleep(rng.uniform(0.0, 1.5))
        pids = subprocess.run(
            ["pgrep", "-f", f"^python examples/elastic_train.py --data-dir {data}"],
            capture_output=True,
            text=True,
        ).stdout.split()
        assert len(pids) == 3, pids
        victim = int(rng.choice(pids))
        os.kill(victim, signal.SIGKILL)
        out, err = proc.communicate(timeout=300)
        out = "".join(lines) + out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("the elastic Keras job did not end within its timeout")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    log = f"--- stdout ---\n{out[-3000:]}\n--- stderr ---\n{err[-5000:]}"
    assert proc.returncode == 0, log
    results = _results(out)
    assert len(results) == 3 and {r["epoch"] for r in results} == {4}, log
    assert len({r["weights_sha1"] for r in results}) == 1, log
    assert re.search(rf"elastic: lost rank \d \(pid {victim} on", err), log
    assert "1 membership change(s); the job finished with 3 rank(s)" in err, log
    accuracy = float(re.findall(r"held-out accuracy: ([0-9.]+)", out)[-1])
    assert accuracy > 0.85, log


NEVER_JOINS = """
import os, signal, sys, time
if os.environ.get("SYNCDP_REPLACEMENT"):
    sys.exit(3)  # a replacement that cannot start: it ends before init()
import syncdp
import syncdp.elastic

syncdp.init()
state = syncdp.elastic.ObjectState(
    bcast_object=syncdp.broadcast_object, get_rank=syncdp.rank, step=0
)


@syncdp.elastic.run
def train(state):
    while state.step < 1000:
        syncdp.barrier()
        state.step += 1
        state.commit()
        if state.step == 10 and syncdp.rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.01)


train(state)
"""


def test_a_replacement_that_never_joins_ends_the_job_instead_of_a_hang(tmp_path):
    # Open MPI's spawn would wait for it forever; the launcher sees it end unjoined.
    result = launch(
        2,
        "python",
        python_script(tmp_path, NEVER_JOINS),
        launcher_args=("--min-np", "2"),
        timeout=120,
    )
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert "the job failed (elastic)" in last, result.stderr[-3000:]
    assert "replacement [2] (pid " in last and "exited with code 3 before it joined" in last
    assert result.elapsed < 60, result.elapsed


# Rank 1 leaves the training function early; rank 0 goes on to its next allgather, which is
# the same collective number as rank 1's final agreement (elastic.done).
LEAVES_EARLY = """
import syncdp, syncdp.elastic
from syncdp.job import runtime
syncdp.init()
state = syncdp.elastic.ObjectState(step=0)

@syncdp.elastic.run
def train(state):
    while state.step < 6:
        if syncdp.rank() == 1 and state.step == 3:
            return
        runtime.communicator().allgather_object(state.step)
        state.step += 1
        state.commit()

train(state)
"""


def test_ranks_in_different_collectives_of_one_number_are_told_apart_at_the_stall(tmp_path):
    result = launch(
        2,
        "python",
        python_script(tmp_path, LEAVES_EARLY),
        launcher_args=("--min-np", "1", "--stall-timeout", "5"),
        timeout=120,
    )
    assert result.returncode != 0
    assert re.search(
        r"rank 0 stalled: collective #\d+ allgather_object waited [\d.]+ s \(stall timeout 5 s\), "
        r"and the others are in another collective of that number \(rank 1 in elastic\.done\): "
        r"the ranks took different code paths",
        result.stderr,
    ), result.stderr[-3000:]
    assert "an MPI transfer is stuck" not in result.stderr


# The start of a job in which rank 0 dies 0.3 s into the first spawn it makes. No TensorFlow:
# the change of membership is what is tested.
RANK0_DIES_IN_ITS_FIRST_SPAWN = """
import json, os, signal, sys, threading, time
import syncdp, syncdp.elastic
from syncdp.job import runtime
from syncdp.membership import membership

syncdp.init()
me = membership.me().label
if me == 0:
    real_spawn = membership._spawn

    def spawn(*args, **kwargs):
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGKILL)).start()
        return real_spawn(*args, **kwargs)

    membership._spawn = spawn
state = syncdp.elastic.ObjectState(step=0, total=0)
"""

# Rank 1 dies at step 5; rank 0 dies in the spawn of its replacement, which is left without
# its parent.
RANK0_LOST_IN_SPAWN = (
    RANK0_DIES_IN_ITS_FIRST_SPAWN
    + """
@syncdp.elastic.run
def train(state):
    comm = runtime.communicator()
    while state.step < 40:
        if me == 1 and state.step == 5:
            os.kill(os.getpid(), signal.SIGKILL)
        assert len(set(comm.allgather_object(state.step))) == 1
        state.total += state.step
        state.step += 1
        time.sleep(0.05)
        state.commit()
    return state.total

total = train(state)
print("RESULT " + json.dumps(dict(label=me, size=syncdp.size(), total=total)), flush=True)
"""
)


def test_rank_0_lost_while_it_spawns_a_replacement_leaves_no_second_label_and_no_failure(
    tmp_path,
):
    # The survivor recovers again and spawns two replacements under new labels; the orphan of
    # the abandoned spawn exits on its own (or at the end) and counts as no failure.
    result = launch(
        3,
        "python",
        python_script(tmp_path, RANK0_LOST_IN_SPAWN),
        launcher_args=("--min-np", "1"),
        timeout=170,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    results = _results(result.stdout)
    assert sorted(r["label"] for r in results) == [2, 4, 5], result.stdout
    assert all(r["size"] == 3 and r["total"] == sum(range(40)) for r in results), results
    labels = re.findall(r"output \[(\d+)\]\)", result.stderr)
    assert sorted(labels) == ["4", "5"], result.stderr[-4000:]


# np=2, room for a third rank once rank 0 creates the marker at step 3; rank 0 dies in the
# spawn that grows the job.
RANK0_LOST_IN_GROWTH = (
    RANK0_DIES_IN_ITS_FIRST_SPAWN
    + """
@syncdp.elastic.run
def train(state):
    comm = runtime.communicator()
    # On until the job has grown back to 3 (every rank sees the same size at a step).
    while state.step < 40 or (syncdp.size() < 3 and state.step < 1500):
        if me == 0 and state.step == 3:
            open(sys.argv[1], "w").close()
        assert len(set(comm.allgather_object(state.step))) == 1
        state.total += state.step
        state.step += 1
        time.sleep(0.05)
        state.commit()
    return state.total, state.step

total, steps = train(state)
print("RESULT " + json.dumps(dict(label=me, size=syncdp.size(), total=total, steps=steps)))
"""
)


def test_rank_0_lost_while_it_grows_the_job_is_a_recovery_with_new_labels(tmp_path):
    # The survivor recovers (the growth's spawn abandoned, its label never used again), then
    # grows the job at a later commit; the orphan of the abandoned spawn is no failure.
    marker = tmp_path / "more-slots"
    script = f"if [ -e {marker} ]; then echo localhost:3; else echo localhost:2; fi"
    result = launch(
        2,
        "python",
        python_script(tmp_path, RANK0_LOST_IN_GROWTH),
        str(marker),
        launcher_args=("--min-np", "1", "--max-np", "3", "--host-discovery-script", script),
        timeout=170,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    results = _results(result.stdout)
    assert sorted(r["label"] for r in results) == [1, 3, 4], result.stdout
    steps = results[0]["steps"]
    assert all(r["size"] == 3 and r["steps"] == steps for r in results), results
    assert all(r["total"] == sum(range(steps)) for r in results), results
    assert re.search(r"elastic: lost rank 0 \(pid \d+ on .*\)", result.stderr), result.stderr
    labels = re.findall(r"output \[(\d+)\]\)", result.stderr)
    assert sorted(labels) == ["3", "4"], result.stderr[-4000:]


@pytest.mark.parametrize("label", [1, 0])
def test_a_rank_that_calls_sys_exit_in_training_leaves_at_once(tmp_path, label):
    """sys.exit(3) inside the training function: the rank leaves the job then and there, and
    the others recover without it from the last commit (it used to wait in MPI_Finalize for
    ranks that waited for it, until the 60 s finalize bound killed it, and the launcher then
    said its training had ended). Rank 0 leaving leaves one new rank 0."""
    started = time.monotonic()
    result = _run(tmp_path, 3, f"{label}:0:4:exit")
    _assert_finished(result, size=3, changes=1)
    assert f"rank {label} called sys.exit(3) inside elastic.run before training finished" in (
        result.stderr
    ), result.stderr[-3000:]
    assert "training had" not in result.stderr, result.stderr[-3000:]
    assert time.monotonic() - started < 60, "the others waited for the finalize bound"


# Rank 1 dies after training has finished (elastic.run returned on every rank), while rank 0
# is in a collective of its own program's end.
LOST_AFTER_TRAINING = """
import os, signal, time
import syncdp, syncdp.elastic
syncdp.init()
state = syncdp.elastic.ObjectState(step=0)

@syncdp.elastic.run
def train(state):
    while state.step < 3:
        syncdp.barrier()
        state.step += 1
        state.commit()

train(state)
if syncdp.rank() == 1:
    time.sleep(1)
    os.kill(os.getpid(), signal.SIGKILL)
syncdp.allgather_object(syncdp.rank())
"""


def test_a_rank_lost_after_training_is_not_called_a_recovery(tmp_path):
    """Nothing is left to recover: the job fails (a rank of the program's end was lost), and
    neither the launcher nor the surviving rank says it recovers."""
    result = launch(
        2,
        "python",
        python_script(tmp_path, LOST_AFTER_TRAINING),
        launcher_args=("--min-np", "1"),
        timeout=120,
    )
    err = result.stderr
    assert result.returncode != 0, err[-3000:]
    assert "recovering" not in err and "recovers without it" not in err, err[-3000:]
    assert re.search(
        r"lost rank 1 \(pid \d+ on .*\): it was killed by signal 9 \(SIGKILL\); "
        r"training had finished, so the job ends",
        err,
    ), err[-3000:]
    assert "a rank of the job was lost after training had finished" in err, err[-3000:]
