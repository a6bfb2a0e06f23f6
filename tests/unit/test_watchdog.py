"""The watchdog: it never frees a communicator its thread still uses, says where each missing
rank of a stall is, and names a rank whose process ended while others wait for it."""

import os
import select
import subprocess
import sys
import threading
import time

from syncdp.base import mpi, settings
from syncdp.watch.watchdog import Watchdog


def test_stop_waits_for_a_busy_thread_before_freeing_its_communicator():
    MPI = mpi.load()
    dog = Watchdog(MPI.COMM_SELF, settings.from_env({}))
    busy, seen = threading.Event(), []

    def slow_answer():  # the thread, in the middle of talking to the other ranks
        busy.set()
        time.sleep(3)  # longer than the 2 s the old stop() waited
        seen.append(dog._side is not None and dog._side != MPI.COMM_NULL)

    dog._can_ask = True
    dog._answer_questions = slow_answer
    assert busy.wait(5)
    dog.stop()
    assert not dog._thread.is_alive()
    assert seen == [True], "the communicator was freed while the thread still used it"
    assert dog._side is None


class _FakeWorld:
    """MPI with COMM_WORLD.Abort recorded instead of run."""

    def __init__(self, real):
        self._real = real
        self.aborted = []
        self.COMM_WORLD = self

    def Abort(self, code):  # noqa: N802 - MPI's name
        self.aborted.append(code)

    def __getattr__(self, name):
        return getattr(self._real, name)


def _dog(monkeypatch, hosts, replies, parents=None):
    """A watchdog of rank 0 among ``len(hosts)`` ranks, whose questions get ``replies``."""
    from syncdp.watch import watchdog as module

    MPI = mpi.load()
    dog = Watchdog(MPI.COMM_SELF, settings.from_env({"SYNCDP_STALL_TIMEOUT": "60"}))
    dog.size = len(hosts)
    dog._job_rank = list(range(len(hosts)))
    parents = parents or [os.getpid()] * len(hosts)
    dog.processes = [module.Process(h, 1000 + r, parents[r], "space") for r, h in enumerate(hosts)]
    dog._can_ask = True
    dog.ask_others = lambda grace=0, ranks=None: dict(replies)
    dog._said_farewell = lambda r: False
    dog._MPI = _FakeWorld(MPI)
    dog.farewell = lambda: dog._MPI.aborted.append("farewell")
    sent = []
    monkeypatch.setattr(module.report, "send", lambda *a, **k: sent.append((a, k)))
    monkeypatch.setattr(module, "_END_SECONDS", 0.01)
    monkeypatch.delenv("SYNCDP_REPORT_ADDR", raising=False)
    return dog, sent


def test_a_stall_says_where_each_missing_rank_is(monkeypatch, capsys):
    replies = {1: (7, "grads", 6), 3: (None, None, 6), 4: (9, "other", 8), 5: (None, "exit", 6)}
    dog, sent = _dog(monkeypatch, ["h"] * 6, replies)
    dog._abort(7, "grads", 61.0)
    dog.stop()
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == (
        "syncdp: ranks 2, 3, 4, 5 stalled: collective #7 grads waited 61.0 s for them on rank 0 "
        "(stall timeout 60 s)."
    )
    assert lines[1] == (
        "syncdp: ranks that have not arrived: 2 (did not answer), 3 (in no collective: "
        "computing, or stuck outside syncdp), 4 (in collective #9 other), 5 (finished its "
        "program)"
    )
    assert lines[2:6] == [
        "  rank 2: did not answer (stopped, hung or dead).",
        "  rank 3: in no collective: computing, or stuck outside syncdp (last finished #6).",
        "  rank 4: in collective #9 other instead (the ranks took different code paths).",
        "  rank 5: has finished its program (last collective #6).",
    ]
    ((args, fields),) = sent
    assert args[0] == "stall" and fields["ranks"] == [2, 3, 4, 5]
    assert fields["where"]["3"] == "in no collective: computing, or stuck outside syncdp"
    assert fields["collective"] == "grads" and fields["seq"] == 7
    assert dog._MPI.aborted == ["farewell", 1]


def test_a_stall_names_the_hosts_when_the_job_spans_hosts(monkeypatch, capsys):
    dog, sent = _dog(monkeypatch, ["h1", "h1", "h2", "h2"], {1: (3, "b", 2), 2: (3, "b", 2)})
    dog._abort(3, "b", 61.0)
    dog.stop()
    err = capsys.readouterr().err
    assert "syncdp: ranks that have not arrived: 3 on h2 (did not answer)" in err.splitlines(), err
    assert "  rank 3 on h2: did not answer (stopped, hung or dead)." in err
    assert sent[0][1]["hosts"] == {"3": "h2"}


def test_a_rank_gone_while_others_wait_is_named_with_them(monkeypatch, capsys):
    replies = {2: (7, "grads", 6), 3: (None, None, 6)}
    dog, sent = _dog(monkeypatch, ["h"] * 4, replies)
    dog.gone = [1]
    dog._name_gone(7, "grads")
    dog.stop()
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith(
        "syncdp: rank 1 (pid 1001 on h) exited while ranks 0, 2 wait for it in collective #7 "
        "grads: its process ended without syncdp's exit handshake"
    ), lines
    assert lines[1] == (
        "  rank 3: in no collective: computing, or stuck outside syncdp (last finished #6)."
    )
    ((args, fields),) = sent
    assert args[:2] == ("exit_early", 1)
    assert fields["ranks"] == [0, 2] and fields["gone"] == [1]
    assert (fields["pid"], fields["host"], fields["seq"]) == (1001, "h", 7)
    assert dog._MPI.aborted == [
        "farewell",
        1,
    ]  # MPI did not end the job itself, so the watchdog did


def test_only_the_lowest_waiting_rank_names_a_gone_rank(monkeypatch, capsys):
    dog, sent = _dog(monkeypatch, ["h"] * 3, {0: (7, "grads", 6)})
    dog.rank = 2  # rank 0 waits too and speaks
    dog.gone = [1]
    dog._name_gone(7, "grads")
    dog.stop()
    assert capsys.readouterr().err == "" and sent == []


def test_a_gone_rank_that_said_farewell_is_not_named_again(monkeypatch, capsys):
    dog, sent = _dog(monkeypatch, ["h"] * 2, {})
    dog._said_farewell = lambda r: r == 1  # it raised, reported and aborted the job itself
    dog.gone = [1]
    dog._name_gone(3, "grads")
    dog.stop()
    assert capsys.readouterr().err == "" and sent == []


def test_a_rank_whose_supervisor_died_first_is_left_to_the_launcher(monkeypatch, capsys):
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    dog, sent = _dog(monkeypatch, ["h"] * 2, {}, parents=[os.getpid(), ended.pid])
    dog.gone = [1]
    dog._name_gone(3, "grads")
    dog.stop()
    assert capsys.readouterr().err == "" and sent == []


def test_the_watchdog_watches_the_processes_of_its_host_only():
    from syncdp.watch.watchdog import Process

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    dog = Watchdog(mpi.load().COMM_SELF, settings.from_env({}))
    dog.stop()
    me = Process.this()
    dog.size = 3
    dog.processes = [me, me._replace(pid=child.pid), me._replace(pid=1, space="elsewhere")]
    fds = dog._open_pidfds()
    assert list(fds.values()) == [1]  # rank 2's pid means nothing here
    child.wait()
    fd = next(iter(fds))
    assert select.select([fd], [], [], 2)[0] == [fd]  # readable: that process has ended
    os.close(fd)


def test_a_rank_in_another_communicators_collective_says_so_and_a_stopped_dog_is_forgotten():
    from syncdp.watch import watchdog as module

    MPI = mpi.load()
    job = Watchdog(MPI.COMM_SELF, settings.from_env({}))
    pair = Watchdog(MPI.COMM_SELF, settings.from_env({}), scope="the process set of ranks 0, 2")
    try:
        assert job._where() == (None, None, 0)  # in no collective anywhere
        pair.enter(3, "allreduce.bucket0")
        seq, name, done = job._where()
        assert seq is None and done == 0  # not one of job's collectives: never "arrived"
        assert name == "collective #3 allreduce.bucket0 of the process set of ranks 0, 2"
        assert job._whereabouts((seq, name, done))[1] == f"in {name} instead."
        assert pair._where() == (3, "allreduce.bucket0", 0)
        assert pair._collective(3, "x") == "collective #3 x of the process set of ranks 0, 2"
        assert job._collective(3, "x") == "collective #3 x"
        job.exiting = True  # at the program's end a rank says so, wherever else it may be
        assert job._where() == (None, "exit", 0)
        job.exiting = False
        pair.leave(3)
    finally:
        pair.stop()
    assert pair not in module._RUNNING
    job.enter(1, "barrier")
    try:
        other = Watchdog(MPI.COMM_SELF, settings.from_env({}))
        assert other._where() == (None, "collective #1 barrier of the whole job", 0)
        other.stop()
    finally:
        job.leave(1)
        job.stop()
    assert job not in module._RUNNING


def test_ahead_names_a_rank_in_a_collective_this_rank_has_not_reached():
    MPI = mpi.load()
    dog = Watchdog(MPI.COMM_SELF, settings.from_env({}))
    try:
        dog.size = 3
        dog._job_rank = [0, 4, 7]  # a process set's ranks, by their job numbers
        dog.enter(2, "barrier")
        dog.leave(2)
        replies = {1: (2, "barrier", 1), 2: (3, "allreduce", 2)}
        dog.ask_others = lambda grace=0, ranks=None: dict(replies)
        assert dog.ahead(grace=0) == (7, 3, "allreduce")
        replies[2] = (None, "collective #5 x of the whole job", 2)  # elsewhere: not ahead
        assert dog.ahead(grace=0) is None
    finally:
        dog.stop()
