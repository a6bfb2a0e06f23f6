"""The examples run end to end under the real launcher, with short settings."""

import re

import pytest

from tests.launcher import ROOT, check, launch


def _accuracy(stdout: str) -> float:
    found = re.findall(r"\[0\]<stdout>:held-out accuracy: ([0-9.]+)", stdout)
    assert found, f"no held-out accuracy printed by rank 0:\n{stdout[-3000:]}"
    return float(found[-1])


def test_hello_at_np2():
    result = check(launch(2, "python", "examples/hello.py", timeout=300))
    for rank in (0, 1):
        assert f"[{rank}]<stdout>:hello from rank {rank} of 2" in result.stdout
        assert f"[{rank}]<stdout>:rank {rank}: sum of ranks = 1 (expected 1)" in result.stdout


@pytest.mark.parametrize("np, np_again", [(1, 2), (2, 1)])
def test_train_learns_and_resumes_under_another_number_of_ranks(tmp_path, np, np_again):
    train = str(ROOT / "examples" / "train.py")
    flags = ("--warmup-epochs", "1")
    first = launch(np, "python", train, "--epochs", "3", *flags, cwd=tmp_path, timeout=400)
    check(first)
    # Ten classes: chance is 0.1; three epochs of this MLP get well past 0.8.
    assert _accuracy(first.stdout) > 0.8
    assert "Epoch 3/3" in first.stdout
    assert "<stdout>:Epoch" not in first.stdout.replace("[0]<stdout>:Epoch", "")  # rank 0 only
    # The folders are named, under the current directory.
    assert f"[0]<stdout>:checkpoints: {tmp_path / 'runs' / 'digits' / 'checkpoints'}" in (
        first.stdout
    )
    assert len(list((tmp_path / "runs" / "digits" / "data" / "train").glob("*.tfrecord"))) == 8

    again = launch(np_again, "python", train, "--epochs", "4", *flags, cwd=tmp_path, timeout=400)
    check(again)
    # Epochs are counted in samples: the same epoch whatever the number of ranks, and said.
    assert "Resuming after epoch 3" in again.stdout
    assert f"written by a run of {np} rank(s), global batch {32 * np}" in again.stdout
    assert "Epoch 4/4" in again.stdout and "Epoch 1/4" not in again.stdout
    assert _accuracy(again.stdout) > 0.8
    assert f"epochs 1-3 by a run of {np} rank(s)" in again.stdout

    fresh = launch(
        np_again,
        "python",
        train,
        "--epochs",
        "1",
        "--fresh",
        *flags,
        cwd=tmp_path,
        timeout=400,
    )
    check(fresh)
    assert "Resuming" not in fresh.stdout and "by a run of" not in fresh.stdout
    assert f"({np_again} ranks, global batch {32 * np_again}, 1 epochs)" in fresh.stdout


def test_the_main_job_gives_the_readmes_accuracy(tmp_path):
    # The README's Quick start command, as it is, in a fresh directory: "a run gives 0.96-0.98".
    result = check(
        launch(2, "python", str(ROOT / "examples" / "train.py"), cwd=tmp_path, timeout=600)
    )
    assert 0.96 <= _accuracy(result.stdout) <= 0.98, result.stdout[-2000:]


def test_custom_loop_learns_at_np2():
    result = check(launch(2, "python", "examples/custom_loop.py", "--steps", "80", timeout=400))
    assert _accuracy(result.stdout) > 0.6
    assert "[1]<stdout>:step" not in result.stdout


def test_tf1_monitored_session_example_at_np2():
    result = check(launch(2, "python", "examples/tf1_monitored_session.py", timeout=300))
    firsts = [float(t) for t in re.findall(r"first step done at ([0-9.]+)", result.stdout)]
    assert len(firsts) == 2
    assert max(firsts) - min(firsts) < 1.0  # no rank waits for a chief
    accuracies = re.findall(r"accuracy on all digits ([0-9.]+)", result.stdout)
    assert len(accuracies) == 2 and len(set(accuracies)) == 1  # identical replicas
    assert float(accuracies[0]) > 0.9  # ten classes: chance is 0.1
