"""Warm spares in one process: who sits where after a change, the launcher's flag, the log.

The waiting and the recovery themselves are tested through the real launcher in
tests/integration/test_spares.py.
"""

from __future__ import annotations

import time
import types

import pytest

from syncdp.base import settings
from syncdp.launch import elastic, run
from syncdp.membership import membership, refill, spares
from tests.unit.test_elastic import membership_report


@pytest.mark.parametrize(
    ("trainers", "waiting", "take", "spawned"),
    [(2, 1, 1, 0), (2, 2, 1, 0), (3, 0, 0, 1), (1, 2, 2, 1), (2, 3, 0, 0), (4, 2, 0, 2)],
)
def test_every_process_gets_its_own_seat_ranks_first(trainers, waiting, take, spawned):
    total = trainers + waiting + spawned
    seats = [spares.seat(i, trainers, waiting, take, spawned) for i in range(total)]
    assert sorted(key for _, key in seats) == list(range(total))
    ranks = trainers + take + spawned
    assert sorted(key for trains, key in seats if trains) == list(range(ranks))
    # Survivors keep their ranks; the taken spares come next, then the spawned processes.
    assert seats[:trainers] == [(True, i) for i in range(trainers)]
    assert [key for _, key in seats[trainers : trainers + take]] == list(
        range(trainers, trainers + take)
    )
    assert all(not trains for trains, _ in seats[trainers + take : trainers + waiting])


def test_a_seat_outside_the_reserve_or_a_bad_take_is_refused():
    with pytest.raises(ValueError, match="take must be between 0 and spares"):
        spares.seat(0, 2, 1, 2, 0)
    with pytest.raises(ValueError, match="index 3 is not in a reserve of 3"):
        spares.seat(3, 2, 1, 0, 0)


def test_the_spare_count_comes_from_the_launcher():
    assert spares.count({}) == 0
    assert spares.count({spares.SPARES_VAR: "2"}) == 2
    assert spares.count({spares.SPARES_VAR: "x"}) == 0
    # One of the launcher's own variables, which the settings never reject.
    settings.from_env({spares.SPARES_VAR: "2"})


def _plan(target=3, **kw):
    return membership.Plan(target=target, min_np=1, max_np=kw.pop("max_np", target), **kw)


def _members(n, host="h"):
    return [membership.Member(host, 100 + i, i) for i in range(n)]


def test_spares_fill_lost_places_first_and_spawning_covers_the_rest():
    plan, take, count, _ = membership._decide_seats(_plan(3, next_label=4), _members(3), 2, False)
    assert (take, count) == (1, 0) and plan.spares == ()
    plan, take, count, _ = membership._decide_seats(_plan(3, next_label=4), _members(2), 1, False)
    assert (take, count) == (1, 1)
    alive = _members(4)
    plan, take, count, _ = membership._decide_seats(_plan(3, next_label=5), alive, 3, False)
    assert (take, count) == (0, 0) and plan.spares == (alive[3],)


def test_growing_leaves_the_spares_waiting(tmp_path):
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho h:5\n")
    script.chmod(0o755)
    plan = _plan(2, max_np=4, next_label=3, script=str(script))
    alive = _members(3)  # 2 ranks and 1 spare hold 3 of the 5 slots
    plan, take, count, _ = membership._decide_seats(plan, alive, 2, True)
    assert (take, count) == (0, 2) and plan.spares == (alive[2],)
    assert plan.target == 2  # raised once they are in: a failure meanwhile is a recovery


def test_spares_need_elastic_mode(capsys):
    with pytest.raises(SystemExit) as e:
        run.parse_args(["-np", "2", "--spares", "1", "python", "t.py"], environ={})
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--spares 1 needs elastic mode: add --min-np" in err[0]


def test_spares_hold_slots(capsys):
    argv = ["-np", "2", "--min-np", "1", "--spares", "1", "-H", "localhost:2", "python", "t.py"]
    with pytest.raises(SystemExit) as e:
        run.parse_args(argv, environ={})
    assert e.value.code == 2
    assert "need 3 slots, and the hosts have 2; spares hold slots too" in capsys.readouterr().err


def test_mpirun_starts_ranks_and_spares_and_every_rank_learns_how_many():
    c = run.parse_args(["-np", "2", "--min-np", "2", "--spares", "2", "python", "t.py"], environ={})
    assert c.num_proc == 2 and c.spares == 2
    env = run.build_env(c, environ={spares.SPARES_VAR: "9"})
    assert env[spares.SPARES_VAR] == "2"
    cmd = run.build_command(c, env)
    assert cmd[1:3] == ["-np", "4"]
    assert ["-x", spares.SPARES_VAR] == cmd[
        cmd.index(spares.SPARES_VAR) - 1 : cmd.index(spares.SPARES_VAR) + 1
    ]
    plain = run.parse_args(["-np", "2", "--min-np", "2", "python", "t.py"], environ={})
    assert spares.SPARES_VAR not in run.build_env(plain, environ={spares.SPARES_VAR: "9"})


def _exit(rank, pid, code=0, signal=None):
    return {"kind": "exit", "rank": rank, "host": "h", "pid": pid, "code": code, "signal": signal}


def test_a_spare_that_dies_waiting_is_no_failure_and_no_rank(capsys):
    log = elastic.ElasticLog(spares=range(2, 4))
    assert log.handle(_exit(3, 13, code=None, signal=9))
    assert log.unexplained() == []
    err = capsys.readouterr().err
    assert "spare [3] (pid 13 on h) was killed by signal 9 (SIGKILL) while waiting; 1 spare(s)" in (
        err
    )
    log.handle(_exit(2, 12))  # a released spare exits 0: not one of the ranks
    log.handle(_exit(0, 10))
    assert not log.finished(2)
    log.handle(_exit(1, 11))
    assert log.finished(2)
    assert log.summary() == "no rank was lost. 1 spare(s) died while waiting."


def test_a_spare_that_took_over_counts_as_a_rank():
    log = elastic.ElasticLog(spares=[2])
    log.handle(_exit(1, 11, code=None, signal=9))
    log.handle(
        membership_report(
            [(1, "h", 11, 1)],
            [(1, "h", 12, 2)],
            old_size=2,
            survivors=1,
            spawned=0,
            spares_used=1,
            spares_left=0,
            new_size=2,
            seconds=0.1,
        )
    )
    assert log.unexplained() == []
    log.handle(_exit(0, 10))
    log.handle(_exit(2, 12))
    assert log.finished(2)


def test_spares_still_running_after_the_ranks_are_killed(monkeypatch):
    killed = []
    monkeypatch.setattr(elastic, "_kill", lambda host, pid, shell: killed.append((host, pid)))
    monkeypatch.setattr(elastic, "SPARE_GRACE_SECONDS", 0.05)
    log = elastic.ElasticLog(spares=[2])
    log.handle({"kind": "started", "rank": 2, "host": "h", "pid": 12})
    log.handle(_exit(0, 10))
    assert not killed
    log.handle(_exit(1, 11))
    deadline = time.monotonic() + 5
    while not killed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert killed == [("h", 12)]


def test_a_spare_started_in_the_background_that_dies_is_a_spares_exit(capsys):
    # Labels 0, 1 are ranks, 2 the first spare; [3] is started in the background. Its death
    # before it joined is no stuck recovery (a replacement's would be) and no failure.
    aborted = []
    log = elastic.ElasticLog(spares=[2], ranks=2, on_abort=aborted.append)
    assert log.handle({"kind": "spare_started", "rank": 3, "host": "h", "pid": 13})
    assert "starting a new spare [3] (pid 13 on h) in the background" in capsys.readouterr().err
    assert log.handle(_exit(3, 13, code=None, signal=9))
    time.sleep(elastic.JOIN_GRACE_SECONDS / 50)
    assert aborted == [] and log.unexplained() == []
    log.handle(_exit(0, 10))
    log.handle(_exit(1, 11))
    assert log.finished(2)


def test_a_spare_started_in_the_background_and_never_released_is_killed(monkeypatch):
    killed = []
    monkeypatch.setattr(elastic, "_kill", lambda host, pid, shell: killed.append((host, pid)))
    monkeypatch.setattr(elastic, "SPARE_GRACE_SECONDS", 0.05)
    log = elastic.ElasticLog(spares=[2], ranks=2)
    log.handle(_exit(2, 12))  # the first spare was released
    log.handle({"kind": "spare_started", "rank": 3, "host": "h", "pid": 13})
    log.handle(_exit(0, 10))
    log.handle(_exit(1, 11))
    deadline = time.monotonic() + 5
    while not killed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert killed == [("h", 13)]


def _keeper(monkeypatch, started):
    """A Keeper whose background spawn only records its arguments (no MPI)."""
    keeper = refill.Keeper()

    def spawn(args, hosts, label):
        started.append((args, hosts, label))

    monkeypatch.setattr(keeper, "_spawn", spawn)
    return keeper


def _kept_plan(waiting: int, target: int = 1, script: str = "") -> membership.Plan:
    members = tuple(membership.Member("h", 100 + i, 2 + i) for i in range(waiting))
    return membership.Plan(
        target=2,
        min_np=2,
        max_np=2,
        next_label=5,
        spares=members,
        spare_target=target,
        script=script,
        command=("python", "train.py"),
    )


def test_the_keeper_starts_one_spare_at_a_time_and_adopts_it_once_it_waits(monkeypatch):
    started = []
    keeper = _keeper(monkeypatch, started)
    plan = _kept_plan(waiting=0, target=2)
    assert keeper.order(plan, []) is None  # nothing to adopt yet; one start begins
    keeper._thread.join(5)
    assert [label for _, _, label in started] == [5]
    args = started[0][0]
    assert args[:6] == ["-P", "-m", "syncdp.launch.worker", "--replacement", "5", "--spare"]
    assert args[6:] == ["python", "train.py"] and plan.next_label == 6
    assert keeper.order(plan, []) is None and len(started) == 1  # still starting: no second
    keeper._started = ("pair", "port", 5)  # the new spare waits
    assert keeper.order(plan, []) == (False, True)


def test_the_keeper_starts_nothing_with_enough_spares_or_no_free_slot(monkeypatch, tmp_path):
    started = []
    keeper = _keeper(monkeypatch, started)
    assert keeper.order(_kept_plan(waiting=1, target=1), []) is None
    assert keeper._thread is None and started == []
    script = tmp_path / "hosts.sh"
    script.write_text("#!/bin/sh\necho h:3\n")
    script.chmod(0o755)
    members = [membership.Member("h", 10 + i, i) for i in range(3)]  # every slot taken
    assert keeper.order(_kept_plan(waiting=0, target=1, script=str(script)), members) is None
    assert keeper._thread is None and started == []


def test_the_keeper_stops_after_three_failed_starts(monkeypatch, capsys):
    class Refused(Exception):
        pass

    class Self:
        def Spawn(self, *args, **kwargs):
            raise Refused("no slot")

    monkeypatch.setattr(
        refill.mpi, "load", lambda: types.SimpleNamespace(Exception=Refused, COMM_SELF=Self())
    )
    monkeypatch.setattr(
        refill.membership, "spawn_where", lambda hosts: types.SimpleNamespace(Free=lambda: None)
    )
    keeper = refill.Keeper()
    plan = _kept_plan(waiting=0, target=1)
    for _ in range(6):
        assert keeper.order(plan, []) is None
        thread = keeper._thread  # the failed start clears it from inside
        if thread is not None:
            thread.join(5)
    assert plan.next_label == 5 + 3  # three starts, then none
    err = capsys.readouterr().err
    assert "a new spare [5] could not be started (no slot); trying again later" in err
    assert "a new spare [7] could not be started (no slot); 3 starts failed, so no spare" in err


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        # Issue 35.7: each was accepted and ran (1,000 spares would be 1,002 TensorFlow
        # processes; --min-np 0 silently turned elastic mode off).
        (
            ["-np", "2", "--min-np", "1", "--spares", "1000"],
            "--spares 1000 is more than -np 2: a job never needs more spares than ranks",
        ),
        (["-np", "2", "--min-np", "0"], "--min-np 0: the fewest ranks the job goes on with must"),
        (["-np", "2", "--max-np", "0"], "--max-np 0: the most ranks the job grows to must be"),
        (
            ["-np", "2", "--reset-limit", "3"],
            "--reset-limit counts the membership changes of an elastic job, and this job is not",
        ),
    ],
)
def test_elastic_limits_that_mean_nothing_are_refused_at_start(argv, said, capsys):
    with pytest.raises(SystemExit) as e:
        run.parse_args([*argv, "python", "t.py"], environ={})
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert said in err and err.count("\n") == 1, err


def test_the_documented_zero_of_the_variables_still_means_np():
    # SYNCDP_MIN_NP=0 is the setting's default ("0: -np"); only a spelled-out 0 is refused.
    c = run.parse_args(
        ["-np", "2", "--elastic", "--spares", "2", "--reset-limit", "1", "python", "t.py"],
        environ={"SYNCDP_MIN_NP": "0"},
    )
    assert c.elastic and c.spares == 2 and c.settings["reset_limit"] == 1
