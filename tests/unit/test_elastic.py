"""Elastic mode in one process: the launcher's flags and verdict, the state API, the callbacks.

The recovery itself (ULFM revoke, shrink, spawn, merge) is tested through the real launcher in
tests/integration/test_elastic.py.
"""

import io
import os
import signal
import time

import pytest

from syncdp.launch import elastic, run


def test_min_np_turns_elastic_mode_on_with_ulfm():
    from syncdp.base import settings

    c = run.parse_args(["-np", "3", "--min-np", "2", "python", "train.py"])
    assert c.elastic and c.settings == {"min_np": 2}
    env = run.build_env(c, environ={})
    assert env["SYNCDP_MIN_NP"] == "2"
    cmd = run.build_command(c, env)
    assert cmd[cmd.index("--with-ft") + 1] == "ulfm"
    assert "SYNCDP_MIN_NP" in cmd
    # The ranks see elastic mode on; min and max default to the job's size (membership.Plan).
    config = settings.from_env({"SYNCDP_MIN_NP": "2"})
    assert config.elastic and config.min_np == 2 and config.max_np == 0


def test_elastic_alone_keeps_np_as_the_minimum():
    from syncdp.base import settings
    from syncdp.membership import membership

    config = settings.from_env({"SYNCDP_ELASTIC": "1"})
    plan = membership.first_plan(config, 3)
    assert (plan.target, plan.min_np, plan.max_np, plan.next_label) == (3, 3, 3, 3)


def test_without_elastic_flags_nothing_changes():
    c = run.parse_args(["-np", "3", "python", "train.py"])
    assert not c.elastic
    cmd = run.build_command(c, run.build_env(c, environ={}))
    assert "--with-ft" not in cmd


def _fake_mpi(tmp_path, extensions: str) -> str:
    """A directory with an mpirun and an ompi_info that lists ``extensions``."""
    for name, text in (
        ("mpirun", "#!/bin/sh\nexit 0\n"),
        ("ompi_info", f"#!/bin/sh\necho 'options:mpi_ext:{extensions}'\n"),
    ):
        path = tmp_path / name
        path.write_text(text)
        path.chmod(0o755)
    return str(tmp_path / "mpirun")


def test_ulfm_is_found_in_this_open_mpi():
    assert elastic.check_ulfm(run._find_mpirun()) is None


def test_an_mpi_without_ulfm_is_refused_before_anything_starts(tmp_path, monkeypatch, capsys):
    mpirun = _fake_mpi(tmp_path, "affinity, cuda")
    problem = elastic.check_ulfm(mpirun)
    assert "lists no 'ftmpi' extension" in problem
    monkeypatch.setattr(run, "_find_mpirun", lambda: mpirun)
    c = run.parse_args(["-np", "2", "--min-np", "1", "python", "-c", "pass"])
    assert run.run(c) == 2
    assert "elastic mode needs Open MPI built with ULFM" in capsys.readouterr().err


def test_an_mpi_that_is_not_open_mpi_is_refused(tmp_path, monkeypatch):
    mpirun = tmp_path / "mpirun"
    mpirun.write_text("#!/bin/sh\n")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert "does not look like Open MPI" in elastic.check_ulfm(str(mpirun))


def _exit(pid, code=0, signal=None, rank=1):
    return {"kind": "exit", "rank": rank, "host": "h", "pid": pid, "code": code, "signal": signal}


def membership_report(lost, added, **fields):
    """A ``membership`` report as rank 0 sends it; ``lost`` and ``added`` hold
    ``(rank, host, pid, label)`` of each member."""

    def members(rows):
        return [dict(zip(("rank", "host", "pid", "label"), row, strict=True)) for row in rows]

    return {"kind": "membership", "lost": members(lost), "added": members(added), **fields}


def test_elastic_log_explains_losses_by_membership_changes(capsys):
    log = elastic.ElasticLog()
    assert log.handle(_exit(11, code=None, signal=9))
    assert [r["pid"] for r in log.unexplained()] == [11]
    change = membership_report(
        [(1, "h", 11, 1)],
        [(2, "h", 13, 3)],
        old_size=3,
        survivors=2,
        spawned=1,
        new_size=3,
        seconds=1.25,
    )
    assert log.handle(change)
    assert log.unexplained() == []
    for pid, label in ((10, 0), (12, 2)):
        log.handle(_exit(pid, rank=label))
        log.handle(_exit(pid, rank=label))  # a report twice is still one rank
    assert not log.finished(3)  # label 3, the replacement, has not exited
    log.handle(_exit(13, rank=3))
    assert log.finished(3)
    err = capsys.readouterr().err
    assert "lost rank 1 (pid 11 on h): it was killed by signal 9 (SIGKILL)" in err
    assert "2 rank(s) went on, 1 replacement(s) started (rank 2 (pid 13 on h, output [3]))" in err
    assert "size 3 -> 3, recovered in 1.25 s." in err
    assert log.summary() == "1 membership change(s); the job finished with 3 rank(s)."


def test_a_rank_that_raised_is_not_said_to_be_recovered_from(capsys):
    log = elastic.ElasticLog()
    assert not log.handle({"kind": "exception", "rank": 1, "host": "h", "pid": 11})
    log.handle(_exit(11, code=1))
    log.handle(_exit(12, code=1, rank=2))  # no exception of its own: ended with the job
    err = capsys.readouterr().err
    ended = "lost rank 1 (pid 11 on h): it exited with code 1; it raised an exception, so the job"
    assert ended + " ends." in err
    taken = "lost rank 2 (pid 12 on h): it exited with code 1; another rank raised an exception"
    assert taken + ", so the job ends." in err
    assert "recovering" not in err


def test_a_loss_before_any_rank_raised_is_recovered_from(capsys):
    log = elastic.ElasticLog()
    log.handle(_exit(12, code=1, rank=2))
    err = capsys.readouterr().err
    assert "lost rank 2 (pid 12 on h): it exited with code 1; recovering." in err


def test_elastic_log_needs_every_final_rank_to_exit_cleanly():
    log = elastic.ElasticLog()
    log.handle(_exit(10))
    assert not log.finished(2)
    assert not log.handle({"kind": "exception", "rank": 0})  # still the launcher's failure


def test_an_unfinished_elastic_job_names_each_final_member_that_did_not_exit_cleanly():
    # np=2; rank 1 (label 1) is lost and replaced by label 2 on host hc. At the end, label 2
    # ended by syncdp's finalize bound and label 0's supervisor went without a report (the
    # runtime ended the job after losing a daemon): the last line names both, not a count.
    from syncdp.launch.lifeline import Link
    from syncdp.launch.verdict import Verdict

    log = elastic.ElasticLog(ranks=2)
    verdict = Verdict(num_proc=2, start_timeout=10.0, elastic=log)
    for label, host in ((0, "ha"), (1, "hb"), (2, "hc")):
        verdict.add({"kind": "started", "rank": label, "host": host, "pid": 100 + label})
    verdict.add({**_exit(101, code=None, signal=9, rank=1), "host": "hb"})
    verdict.add(
        membership_report(
            [(1, "hb", 101, 1)], [(1, "hc", 102, 2)], old_size=2, survivors=1, spawned=1, new_size=2
        )
    )
    verdict.add({**_exit(102, code=None, signal=14, rank=2), "host": "hc"})
    assert log.members(2) == [0, 2]
    assert verdict.never_reported() == [0]  # the launcher sweeps its host
    now = time.monotonic()
    links = {0: Link(0, "ha", 100, now - 60, now - 1, now)}
    outcome = verdict.decide(links)
    assert outcome.code == 1
    assert outcome.lines[-1] == (
        "the job failed (0 of the final 2 ranks exited cleanly): rank 2 (pid 102 on hc) was "
        "killed by signal 14 (SIGALRM: in elastic mode, syncdp's bound on an MPI_Finalize "
        "that hangs at exit); rank 0 (pid 100 on ha) ended without a report (its supervisor "
        "was killed)"
    )


def test_an_elastic_job_whose_final_members_all_exit_cleanly_succeeds():
    from syncdp.launch.verdict import Verdict

    log = elastic.ElasticLog(ranks=2)
    verdict = Verdict(num_proc=2, start_timeout=10.0, elastic=log)
    verdict.add(_exit(100, rank=0))
    assert verdict.decide({}).code == 1  # rank 1 has not reported
    assert verdict.decide({}).lines[-1] == (
        "the job failed (1 of the final 2 ranks exited cleanly): rank 1 never started (no "
        "supervisor reached the launcher)"
    )
    verdict.add(_exit(101, rank=1))
    assert verdict.decide({}).code == 0


def test_an_elastic_loss_no_recovery_followed_is_named_so():
    from syncdp.launch.verdict import Verdict

    verdict = Verdict(num_proc=2, start_timeout=10.0, elastic=elastic.ElasticLog(ranks=2))
    verdict.add(_exit(100, rank=0))
    verdict.add(_exit(101, code=None, signal=9, rank=1))
    assert verdict.decide({}).lines[-1] == (
        "the job failed (1 of the final 2 ranks exited cleanly): rank 1 (pid 101 on h) was "
        "killed by signal 9 (SIGKILL); no recovery followed"
    )


def test_a_stall_report_kills_the_stalled_process(monkeypatch):
    killed = []
    monkeypatch.setattr(elastic, "_kill", lambda host, pid, shell: killed.append((host, pid)))
    log = elastic.ElasticLog()
    assert log.handle({"kind": "stall", "elastic": True, "ranks": [2], "pids": [["h", 77]]})
    deadline = time.monotonic() + 5
    while not killed and time.monotonic() < deadline:  # the kill runs on its own thread
        time.sleep(0.01)
    assert killed == [("h", 77)]


def test_object_state_commits_restores_and_syncs():
    from syncdp.elastic import ObjectState

    state = ObjectState(
        bcast_object=lambda obj: {"epoch": 7, "seen": [1]}, get_rank=int, epoch=0, seen=[]
    )  # Horovod calls bcast_object with the object alone
    state.epoch, state.seen = 2, [5]
    state.save()
    state.epoch = 3
    state.seen.append(6)
    state.restore()
    assert state.epoch == 2 and state.seen == [5]  # a copy: later changes do not leak in
    state.sync()  # rank 0's values (here from the fake broadcast), then saved
    assert state.epoch == 7 and state.seen == [1]
    state.epoch = 9
    state.restore()
    assert state.epoch == 7


def test_a_reset_calls_the_states_reset_before_the_callbacks():
    from syncdp.base.errors import HostsUpdatedInterrupt
    from syncdp.elastic import ObjectState

    calls = []

    class Rescaled(ObjectState):  # Horovod's hook for a state that rebuilds things on reset
        def reset(self):
            calls.append("reset")

    state = Rescaled(bcast_object=lambda obj: obj, get_rank=int, epoch=0)
    state.register_reset_callbacks([lambda: calls.append("callback")])
    state.on_reset()
    assert calls == ["reset", "callback"]
    ObjectState(bcast_object=lambda obj: obj, get_rank=int).on_reset()  # the default: nothing
    assert isinstance(HostsUpdatedInterrupt(), RuntimeError)  # as Horovod's


class _CountingState:
    def __init__(self):
        self.batch, self.epoch, self.commits = 0, 0, []

    def commit(self):
        self.commits.append((self.epoch, self.batch))

    def __eq__(self, other):  # a user's state may compare by value, and so be unhashable
        return isinstance(other, _CountingState) and vars(self) == vars(other)

    __hash__ = None


@pytest.mark.parametrize("commit_first", [True, False])
def test_commits_hold_the_counters_of_their_weights_in_any_callback_order(commit_first):
    from syncdp.keras.elastic import (
        CommitStateCallback,
        UpdateBatchStateCallback,
        UpdateEpochStateCallback,
    )

    state = _CountingState()
    commit = CommitStateCallback(state, batches_per_commit=2)
    updates = [UpdateBatchStateCallback(state), UpdateEpochStateCallback(state)]
    callbacks = [commit, *updates] if commit_first else [*updates, commit]

    def fire(name, *args):
        for c in callbacks:
            getattr(c, name)(*args)

    fire("on_train_begin")
    for epoch in range(2):  # Keras's order of calls for 2 epochs of 3 batches
        fire("on_epoch_begin", epoch)
        for batch in range(3):
            fire("on_train_batch_begin", batch)
            fire("on_train_batch_end", batch)
        fire("on_epoch_end", epoch)
    fire("on_train_end")
    # At batch 2 (2 batches done), at epoch 0's end (next epoch, 0) and again as epoch 1
    # begins, at its batch 1 (the count runs on across epochs, as Horovod's: 2 batches since
    # batch 2 of epoch 0), at epoch 1's end and again as training ends.
    assert state.commits == [(0, 2), (1, 0), (1, 0), (1, 1), (2, 0), (2, 0)]


@pytest.mark.parametrize("commit_first", [True, False])
def test_an_epochs_end_is_committed_before_a_later_callbacks_collective_meets_a_lost_rank(
    commit_first,
):
    """A rank lost during validation (before on_epoch_end) surfaces in the first collective
    after it: MetricAverageCallback's at the epoch's end. The epoch's end must be committed
    before that, with the counters of the next epoch, or the whole epoch is trained again."""
    from syncdp.base.errors import RankFailureError
    from syncdp.keras.elastic import (
        CommitStateCallback,
        UpdateBatchStateCallback,
        UpdateEpochStateCallback,
    )

    class LostRankAtEpochEnd:  # stands for MetricAverageCallback's allreduce meeting the loss
        def __getattr__(self, name):
            return lambda *args: None

        def on_epoch_end(self, epoch, logs=None):
            raise RankFailureError("a rank of the job was lost")

    state = _CountingState()
    commit = CommitStateCallback(state, batches_per_commit=0)
    updates = [UpdateBatchStateCallback(state), UpdateEpochStateCallback(state)]
    ordered = [commit, *updates] if commit_first else [*updates, commit]
    callbacks = [*ordered, LostRankAtEpochEnd()]
    with pytest.raises(RankFailureError):
        for c in callbacks:
            c.on_train_begin()
        for c in callbacks:
            c.on_epoch_begin(0)
        for batch in range(3):
            for c in callbacks:
                c.on_train_batch_begin(batch)
            for c in callbacks:
                c.on_train_batch_end(batch)
        for c in callbacks:
            c.on_epoch_end(0)
    assert state.commits == [(1, 0)]  # epoch 0 done: a resumed fit starts at epoch 1


@pytest.mark.parametrize("keras_numbering", [False, True], ids=["horovod", "initial_epoch"])
def test_epoch_state_counts_over_the_whole_training_after_a_resume(keras_numbering):
    # A reset at state.epoch == 2 of 5: Horovod's example resumes with fit(epochs=5 - 2)
    # (Keras numbers the epochs 0, 1, 2); Keras' way is fit(initial_epoch=2, epochs=5).
    from syncdp.keras.elastic import UpdateEpochStateCallback

    state = _CountingState()
    state.epoch = 2
    callback = UpdateEpochStateCallback(state)
    callback.on_train_begin()
    seen = []
    for epoch in range(2, 5) if keras_numbering else range(3):
        callback.on_epoch_begin(epoch)
        callback.on_epoch_end(epoch)
        seen.append(state.epoch)
    assert seen == [3, 4, 5]


def test_every_fit_counts_its_batches_to_a_commit_from_zero():
    # A fit interrupted after 1 batch since its last commit (a lost rank), then the resumed
    # fit: a replacement starts counting at 0, so the survivors must too (commits are
    # collectives with spares or a discovery script).
    from syncdp.keras.elastic import CommitStateCallback

    state = _CountingState()
    commit = CommitStateCallback(state, batches_per_commit=2)

    def three_batches_of_a_fit():  # the fit then stops, as a lost rank stops it
        state.batch = 0
        commit.on_train_begin()
        commit.on_epoch_begin(0)
        for batch in range(3):
            commit.on_train_batch_begin(batch)
            state.batch = batch + 1
            commit.on_train_batch_end(batch)

    three_batches_of_a_fit()
    assert state.commits == [(0, 2)]  # at batch 2's start; batch 3's count then stopped at 1
    three_batches_of_a_fit()
    assert state.commits == [(0, 2), (0, 2)]  # after 2 batches of this fit, not 1


def test_commit_state_callback_rejects_a_bad_period_and_0_commits_at_epoch_ends_only():
    from syncdp.keras.elastic import CommitStateCallback

    for bad in (-1, 1.5):
        with pytest.raises(ValueError, match="batches_per_commit must be an integer >= 0"):
            CommitStateCallback(_CountingState(), batches_per_commit=bad)
    state = _CountingState()
    commit = CommitStateCallback(state, batches_per_commit=0)
    commit.on_train_begin()
    for epoch in range(2):
        commit.on_epoch_begin(epoch)
        for batch in range(3):
            commit.on_train_batch_begin(batch)
            commit.on_train_batch_end(batch)
        commit.on_epoch_end(epoch)
        state.epoch = epoch + 1
    commit.on_train_end()
    # at each epoch's end, and again as the next epoch begins (or training ends)
    assert state.commits == [(0, 0), (1, 0), (1, 0), (2, 0)]


def test_worker_labels_a_replacement_and_tells_its_child(tmp_path, monkeypatch):
    import subprocess
    import sys

    from tests.launcher import ROOT

    env = {**os.environ, "OMPI_COMM_WORLD_RANK": "1", "PYTHONPATH": str(ROOT)}
    env.pop("SYNCDP_REPORT_ADDR", None)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "syncdp.launch.worker",
            "--replacement",
            "5",
            sys.executable,
            "-c",
            "import os; print(os.environ['SYNCDP_REPLACEMENT'])",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert out.stdout.strip() == "[6]<stdout>:6"


class _FakeWatchdog:
    ender = None  # the rank that said it ends the job (it raised), if any

    def ended_on_purpose(self):
        return self.ender


class _FakeCommunicator:
    broken = False
    watchdog = _FakeWatchdog()

    def all_agree(self, value, name):
        return value


def _elastic_loop(monkeypatch, calls):
    """syncdp.elastic's runtime faked: elastic mode on, a reset that only records itself."""
    from syncdp.job import runtime

    monkeypatch.setattr(runtime, "elastic_plan", lambda: object())
    monkeypatch.setattr(runtime, "communicator", lambda: _FakeCommunicator())
    monkeypatch.setattr(runtime, "rank", lambda: 0)
    monkeypatch.setattr(runtime, "reset", lambda grow=False: calls.append(f"heal grow={grow}"))


class _RecordingState:
    def __init__(self, calls):
        self.calls = calls

    def sync(self):
        self.calls.append("sync")

    def restore(self):
        self.calls.append("restore")

    def on_reset(self):
        self.calls.append("callbacks")


def test_run_fn_calls_reset_after_the_job_is_healed_and_before_the_callbacks(monkeypatch):
    from syncdp.base.errors import HostsUpdatedInterrupt, RankFailureError
    from syncdp.tensorflow import elastic

    calls = []
    _elastic_loop(monkeypatch, calls)
    events = [RankFailureError("a rank of the job was lost"), HostsUpdatedInterrupt(False)]

    def train(state, scale):
        calls.append("train")
        if events:
            raise events.pop(0)
        return 7 * scale

    wrapped = elastic.run_fn(train, lambda: calls.append("reset"))
    assert wrapped.__name__ == "train"
    assert wrapped(_RecordingState(calls), 2) == 14
    assert calls == [
        "sync",
        "train",
        *["restore", "heal grow=False", "reset", "callbacks"],  # a lost rank: back to the commit
        "sync",
        "train",
        *["heal grow=True", "reset", "callbacks"],  # room to grow: nothing to undo
        "sync",
        "train",
    ]


@pytest.mark.parametrize("silent_looks", [0, 2], ids=["said-at-once", "said-late"])
def test_run_fn_does_not_recover_from_a_rank_that_ended_the_job(monkeypatch, silent_looks):
    # The lost rank raised an exception and said it ends the job: no restore, no healing.
    # Between hosts the news of the loss may come before its farewell: a survivor looks for
    # it a little longer (here it is found at the third look).
    from syncdp.base.errors import ElasticAbortError, RankFailureError
    from syncdp.tensorflow import elastic

    looks = []

    def farewell(self):
        looks.append(1)
        return 2 if len(looks) > silent_looks else None

    calls = []
    _elastic_loop(monkeypatch, calls)
    monkeypatch.setattr(_FakeWatchdog, "ended_on_purpose", farewell)

    def train(state):
        calls.append("train")
        raise RankFailureError("a rank of the job was lost")

    with pytest.raises(ElasticAbortError, match="rank 2 ended the job"):
        elastic.run_fn(train, lambda: calls.append("reset"))(_RecordingState(calls))
    assert calls == ["sync", "train"]
    assert len(looks) == silent_looks + 1


def test_run_fn_reraises_an_ordinary_error_without_a_reset(monkeypatch):
    from syncdp.tensorflow import elastic

    calls = []
    _elastic_loop(monkeypatch, calls)

    def train(state):
        raise KeyError("a bug in the training function")

    with pytest.raises(KeyError):
        elastic.run_fn(train, lambda: calls.append("reset"))(_RecordingState(calls))
    assert calls == ["sync"]


def _wait_for(condition, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_a_replacement_that_ends_before_joining_ends_the_job(monkeypatch):
    monkeypatch.setattr(elastic, "JOIN_GRACE_SECONDS", 0.05)
    aborted = []
    log = elastic.ElasticLog(ranks=2, on_abort=aborted.append)
    # Rank 1 is lost; its replacement (label 2) exits 3 before it ever joins.
    assert log.handle(_exit(pid=11, code=3, rank=1))
    assert log.handle(_exit(pid=12, code=3, rank=2))
    assert _wait_for(lambda: aborted)
    (report,) = aborted
    assert report["kind"] == "elastic_abort" and report["rank"] == 2
    assert "replacement [2] (pid 12 on h) exited with code 3 before it joined" in report["message"]


def test_a_replacement_whose_spawn_lost_rank_0_waits_for_the_change_that_abandoned_it(
    monkeypatch,
):
    # Rank 0 (pid 10) grows the job: its spawn takes label 2, rank 0 dies during it, and the
    # orphan [2] exits before the survivors' recovery reports that it abandoned label 2.
    monkeypatch.setattr(elastic, "JOIN_GRACE_SECONDS", 0.05)
    aborted, out = [], io.StringIO()
    log = elastic.ElasticLog(out=out, ranks=2, on_abort=aborted.append)
    alive = [["h", 10], ["h", 11]]
    spawning = {"kind": "spawning", "rank": 0, "host": "h", "pid": 10}
    assert log.handle(dict(spawning, labels=[2], members=alive))
    assert log.handle(_exit(pid=10, code=None, signal=9, rank=0))
    assert log.handle(_exit(pid=12, code=1, rank=2))
    time.sleep(0.6)  # well past the join grace: still waiting for the change
    assert not aborted
    log.handle(membership_report([(0, "h", 10, 0)], [(1, "h", 13, 3)], abandoned=[2]))
    assert _wait_for(lambda: "the recovery that started it was abandoned" in out.getvalue())
    assert not aborted
    # Rank 1 (pid 11) is lost, and its loss is reported only after the spawn of its
    # replacement [4] began (the reports travel apart): no process alive at that spawn was
    # lost, so a replacement that ends unjoined is judged at once (the survivors wait for it
    # in the spawn).
    alive = [["h", 13]]
    assert log.handle(dict(spawning, pid=13, labels=[4], members=alive))
    assert log.handle(_exit(pid=11, code=None, signal=9, rank=1))
    assert log.handle(_exit(pid=14, code=3, rank=4))
    assert _wait_for(lambda: aborted)
    message = aborted[0]["message"]
    assert "replacement [4] (pid 14 on h) exited with code 3 before it joined" in message


def test_a_spare_lost_during_a_spawn_makes_its_replacements_wait_for_the_change(monkeypatch):
    monkeypatch.setattr(elastic, "JOIN_GRACE_SECONDS", 0.05)
    aborted, out = [], io.StringIO()
    log = elastic.ElasticLog(out=out, spares=[2], on_abort=aborted.append)
    spawning = {"kind": "spawning", "rank": 0, "host": "h", "pid": 10}
    assert log.handle(dict(spawning, labels=[3], members=[["h", 10], ["h", 11], ["h", 12]]))
    assert log.handle(_exit(pid=12, code=None, signal=9, rank=2))  # the spare
    assert log.handle(_exit(pid=13, code=1, rank=3))
    time.sleep(0.6)
    assert not aborted
    log.handle(membership_report([], [], abandoned=[3]))
    assert _wait_for(lambda: "the recovery that started it was abandoned" in out.getvalue())
    assert not aborted


def test_a_replacement_that_joined_is_an_ordinary_loss(monkeypatch):
    monkeypatch.setattr(elastic, "JOIN_GRACE_SECONDS", 0.05)
    aborted = []
    log = elastic.ElasticLog(ranks=2, on_abort=aborted.append)
    joined = {"label": 2, "rank": 1, "host": "h", "pid": 12}
    # Its exit may arrive before the report of the recovery that added it, or that lost it.
    assert log.handle(_exit(pid=12, code=None, signal=9, rank=2))
    log.handle({"kind": "membership", "added": [joined], "lost": [], "new_size": 2})
    time.sleep(0.3)
    assert not aborted
    assert [r["pid"] for r in log.unexplained()] == [12]  # until a change lists it as lost
    log.handle({"kind": "membership", "added": [], "lost": [joined], "new_size": 2})
    assert not log.unexplained() and not aborted
    # Original ranks and spares are never taken for replacements.
    spare_log = elastic.ElasticLog(ranks=2, spares=[2], on_abort=aborted.append)
    spare_log.handle(_exit(pid=13, code=1, rank=1))
    time.sleep(0.2)
    assert not aborted


def test_an_elastic_rank_bounds_mpi_finalize_at_exit(monkeypatch):
    # Open MPI 5.0.11's MPI_Finalize can hang after some spawns; the launcher would wait for
    # that rank's exit forever. The bound is SIGALRM's default action: a named failure.
    import mpi4py

    from syncdp.base import mpi
    from syncdp.job import runtime

    alarms = []
    handlers = []
    monkeypatch.setattr(mpi, "loaded", lambda: True)
    monkeypatch.setattr(mpi.signal, "alarm", alarms.append)
    monkeypatch.setattr(mpi.signal, "signal", lambda num, what: handlers.append((num, what)))
    monkeypatch.setattr(mpi4py.rc, "finalize", None)
    runtime._bound_finalize(12.5)
    assert alarms == [13]  # whole seconds, never fewer than asked
    assert handlers == [(signal.SIGALRM, signal.SIG_DFL)]
    monkeypatch.setattr(mpi4py.rc, "finalize", False)  # the program finalizes MPI itself
    runtime._bound_finalize(12.5)
    assert alarms == [13]
    from syncdp.base import settings

    assert settings.from_env({}).finalize_timeout == 60.0
    assert settings.from_env({"SYNCDP_FINALIZE_TIMEOUT": "15"}).finalize_timeout == 15.0


def test_the_launcher_names_the_finalize_bound():
    from syncdp.launch.worker import describe_exit

    text = describe_exit(-signal.SIGALRM)
    assert text.startswith("was killed by signal 14 (SIGALRM")
    assert "bound on an MPI_Finalize that hangs at exit" in text
    assert describe_exit(-9) == "was killed by signal 9 (SIGKILL)"


def test_each_spawn_takes_its_labels_first_and_a_failed_one_blames_only_free_hosts(
    monkeypatch, capsys
):
    # recover(), grow() and reseat() spawn through membership._Spawns.
    from syncdp.membership import membership

    class Comm:
        def Get_rank(self):
            return 0

    spawned = []

    def spawn(comm, plan, count, hosts, first_label):
        spawned.append((first_label, count))
        if len(spawned) < 3:
            raise RuntimeError("the spawn failed")
        return "merged"

    monkeypatch.setattr(membership, "_spawn", spawn)
    plan = membership.Plan(target=4, min_np=1, max_np=4, next_label=3)
    alive = [membership.Member("a", 1, 0), membership.Member("a", 2, 1)]
    spawns = membership._Spawns()
    # Attempt 1: two replacements on b and a; the spawn fails with nobody lost.
    spawns.attempt(Comm(), plan, alive)
    with pytest.raises(RuntimeError):
        spawns.spawn(Comm(), plan, 2, ["b", "a"], alive)
    spawns.failed()
    assert plan.next_label == 5 and spawns.abandoned == [3, 4]
    # Attempt 2: b is left out (a, where ranks run, never is); this spawn fails with a rank
    # lost, so its host is not blamed.
    spawns.attempt(Comm(), plan, alive)
    assert plan.vanished == ("b",)
    assert "could not start on b; leaving it out" in capsys.readouterr().err
    with pytest.raises(RuntimeError):
        spawns.spawn(Comm(), plan, 1, ["c"], alive)
    spawns.failed()
    spawns.attempt(Comm(), plan, alive[:1])
    assert plan.vanished == ("b",)
    # Attempt 3's spawn works, but the change fails after it (a rank lost as the seats are
    # taken): its process never joins either, and what the spawn made is revoked.
    revoked = []
    monkeypatch.setattr(membership, "revoke", revoked.append)
    spawns.attempt(Comm(), plan, alive[:1])
    assert spawns.spawn(Comm(), plan, 1, ["c"], alive[:1]) == "merged"
    spawns.failed("merged")
    assert revoked == ["merged"]
    # Attempt 4 completes with the next label: no label was given to two spawns.
    spawns.attempt(Comm(), plan, alive[:1])
    assert spawns.spawn(Comm(), plan, 1, ["c"], alive[:1]) == "merged"
    spawns.done()
    spawns.failed()  # nothing under way: nothing more abandoned
    assert spawned == [(3, 2), (5, 1), (6, 1), (7, 1)]
    assert plan.next_label == 8 and spawns.abandoned == [3, 4, 5, 6]


def test_a_lost_process_is_named_by_its_rank_now_and_its_output_label():
    # Rank 1 of 3 is lost; its replacement [3] becomes rank 2 and [2] rank 1. Later losses
    # name the rank each is now and the label its output lines carry.
    out = io.StringIO()
    log = elastic.ElasticLog(out=out, ranks=3)
    log.handle(_exit(pid=11, code=None, signal=9, rank=1))
    log.handle(membership_report([(1, "h", 11, 1)], [(2, "h", 13, 3)]))
    log.handle(_exit(pid=13, code=None, signal=9, rank=3))
    log.handle(_exit(pid=12, code=None, signal=9, rank=2))
    log.handle(_exit(pid=10, code=None, signal=9, rank=0))
    lines = [line for line in out.getvalue().splitlines() if ": it was killed" in line]
    assert [line.split(": it was")[0].split("lost ")[1] for line in lines] == [
        "rank 1 (pid 11 on h)",
        "rank 2 (output [3], pid 13 on h)",
        "rank 1 (output [2], pid 12 on h)",
        "rank 0 (pid 10 on h)",
    ]


def test_a_spare_that_exits_as_elastic_mode_ends_the_job_is_not_said_to_leave_training_on():
    out = io.StringIO()
    log = elastic.ElasticLog(out=out, ranks=2, spares=[2, 3])
    log.handle(_exit(pid=12, code=1, rank=2))
    assert "spare [2] (pid 12 on h) exited with code 1 while waiting; 1 spare(s) left" in (
        out.getvalue()
    )
    log.handle({"kind": "elastic_abort", "rank": 0, "message": "the reset limit (1) was reached"})
    log.handle(_exit(pid=13, code=1, rank=3))
    assert (
        "spare [3] (pid 13 on h) exited with code 1 while waiting; elastic mode could not go on"
        in (out.getvalue())
    )


@pytest.mark.parametrize("package", ["keras", "tf_keras"])
def test_the_state_of_a_model_not_yet_built_is_refused_by_name(package):
    # Its optimizer would be built for no variables, and fit() would later fail naming the
    # optimizer ("Unknown variable"), not the model.
    import importlib

    from syncdp.tensorflow.elastic import TensorFlowKerasState

    keras = importlib.import_module(package)
    model = keras.Sequential([keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    with pytest.raises(ValueError, match="must be built"):
        TensorFlowKerasState(model, epoch=0)
    model.build((None, 3))
    state = TensorFlowKerasState(model, epoch=0)
    assert len(state.model.variables) == 2


def test_the_state_keeps_the_loss_scale_compile_wraps_the_given_optimizer_in():
    # Under mixed precision compile() wraps the optimizer in a LossScaleOptimizer. A state
    # given the inner optimizer (Horovod's examples pass it) must keep the loss scale too: a
    # replacement that scaled differently from the survivors would round differently.
    import keras

    from syncdp.tensorflow.elastic import TensorFlowKerasState

    policy = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        opt = keras.optimizers.SGD(0.1)
        model.compile(optimizer=opt, loss="mse")
    finally:
        keras.mixed_precision.set_global_policy(policy)
    assert model.optimizer is not opt and model.optimizer.inner_optimizer is opt
    state = TensorFlowKerasState(model, optimizer=opt, epoch=0)
    assert state.optimizer is model.optimizer
    scale = model.optimizer.dynamic_scale
    assert any(v is scale for v in state._variables())
    other = keras.optimizers.SGD(0.2)  # not the compiled one's: taken as given
    assert TensorFlowKerasState(model, optimizer=other, epoch=0).optimizer is other
