"""Surviving a lost host, in one process: the commits on disk and the launcher's restart plan.

The commits each host keeps on its local disk (syncdp.membership.commits), how the ranks agree on
the newest one and take it (syncdp.elastic), and what the launcher decides after a lost host
(syncdp.launch.restart): which hosts, how many ranks, what --min-np and --reset-limit allow. The
real thing (a link cut between namespace hosts, the job restarted and resumed) is in
tests/integration/test_elastic_hostloss.py.
"""

from __future__ import annotations

import dataclasses
import io
import os
import socket
import time
import types

import numpy as np
import pytest

from syncdp.launch import cleanup, elastic, restart, run
from syncdp.launch.lifeline import Link
from syncdp.membership import commits, jobenv

# --- The commits on each host's disk. ---


def test_a_host_keeps_its_newest_two_commits_each_written_whole(tmp_path):
    store = commits.Store(str(tmp_path / "job1"))
    assert store.newest() == 0 and store.counters() == []
    for counter in (1, 2, 3):
        store.write(counter, {"_saved": {"epoch": counter}})
    assert store.counters() == [2, 3] and store.newest() == 3
    assert store.read(3) == {"_saved": {"epoch": 3}}
    # A writer killed mid-write leaves only its temporary file, which is never taken.
    (tmp_path / "job1" / ".commit-4-hb-x1y2").write_bytes(b"\x80\x05 half a pickle")
    assert store.newest() == 3


def test_a_commit_of_another_job_or_counter_is_refused(tmp_path):
    commits.Store(str(tmp_path / "other")).write(5, {"x": 1})
    os.makedirs(tmp_path / "mine")
    os.replace(
        tmp_path / "other" / "commit-000000000005.pkl",
        tmp_path / "mine" / "commit-000000000005.pkl",
    )
    with pytest.raises(ValueError, match="not a commit of job mine"):
        commits.Store(str(tmp_path / "mine")).read(5)


def test_the_newest_commit_is_taken_from_memory_before_disk():
    rows = [(4, 4, "ha"), (4, 5, "ha"), (3, 5, "hb"), (5, 0, "hc")]
    assert commits.newest(rows) == commits.Found(5, 3, False, "hc")
    rows = [(0, 6, "ha"), (0, 6, "ha"), (0, 7, "hb"), (0, 7, "hb")]  # a restart: all on disk
    assert commits.newest(rows) == commits.Found(7, 2, True, "hb")
    assert commits.newest([(0, 0, "ha"), (0, 0, "hb")]) == commits.Found(0, 0, False, "ha")


# --- The ranks' side: commit to disk, take the newest at the sync. ---


class _Comm:
    """A communicator as one rank sees it: the others' rows and what a root sends."""

    def __init__(self, rank, size, rows, sent=None):
        self.rank, self.size, self.rows, self.sent = rank, size, rows, sent
        self.calls = []

    def allgather_object(self, obj, *, name):
        self.calls.append(name)
        rows = list(self.rows)
        rows[self.rank] = obj
        return rows

    def broadcast_object(self, obj, root=0, *, name):
        self.calls.append(f"{name} from {root}")
        return obj if self.rank == root else self.sent


@pytest.fixture
def elastic_rank(monkeypatch, tmp_path):
    """This process as rank RANK of an elastic job that keeps commits in tmp_path/job."""
    from syncdp.job import runtime
    from syncdp.watch import report

    monkeypatch.setenv(commits.COMMIT_DIR_VAR, str(tmp_path / "job"))
    monkeypatch.setattr(
        runtime, "elastic_plan", lambda: types.SimpleNamespace(script="", spare_target=0)
    )
    monkeypatch.setattr(runtime, "tend_spares", lambda: None)
    sent = []
    monkeypatch.setattr(report, "send", lambda kind, rank, message="", **f: sent.append(f))

    def be(rank, local_rank, comm=None):
        monkeypatch.setattr(runtime, "rank", lambda: rank)
        monkeypatch.setattr(runtime, "local_rank", lambda: local_rank)
        if comm is not None:
            monkeypatch.setattr(runtime, "communicator", lambda: comm)
        return commits.store()

    be.reports = sent
    return be


def test_the_lowest_local_rank_of_a_host_writes_each_commit(elastic_rank):
    from syncdp.elastic import ObjectState

    store = elastic_rank(rank=3, local_rank=1)
    state = ObjectState(epoch=0, batch=0)
    state.batch = 4
    state.commit()
    assert store.counters() == []  # not this host's writer
    elastic_rank(rank=2, local_rank=0)
    state.batch = 6
    state.commit()
    assert store.counters() == [2]
    assert store.read(2) == {"_saved": {"epoch": 0, "batch": 6}}


def test_a_restarted_rank_0_resumes_from_its_hosts_disk(elastic_rank):
    from syncdp import elastic as se
    from syncdp.elastic import ObjectState

    comm = _Comm(0, 2, [None, (0, 9, "ha")])
    store = elastic_rank(rank=0, local_rank=0, comm=comm)
    store.write(9, {"_saved": {"epoch": 2, "batch": 4}})
    state = ObjectState(epoch=0, batch=0)  # a fresh process: nothing in memory
    se._take_newest_commit(state)
    assert (state.epoch, state.batch, state._commits) == (2, 4, 9)
    assert comm.calls == ["elastic.commits", "elastic.commit_counter from 0"]
    here = socket.gethostname()  # rank 0's own row names its host
    assert elastic_rank.reports == [{"counter": 9, "source": here, "size": 2}]


def test_a_commit_on_another_hosts_disk_is_sent_to_every_rank(elastic_rank):
    from syncdp import elastic as se
    from syncdp.elastic import ObjectState

    # Rank 0 (this process) has no commit on its host; rank 1's host has commit 5.
    comm = _Comm(0, 2, [None, (0, 5, "hb")], sent=None)
    elastic_rank(rank=0, local_rank=0, comm=comm)
    state = ObjectState(epoch=0)
    comm.sent = {"_saved": {"epoch": 3}}  # what rank 1 reads and sends
    se._take_newest_commit(state)
    assert (state.epoch, state._commits) == (3, 5)
    assert comm.calls == [
        "elastic.commits",
        "elastic.commit from 1",
        "elastic.commit_counter from 0",
    ]


def test_rank_0s_memory_is_used_as_is(elastic_rank):
    from syncdp import elastic as se
    from syncdp.elastic import ObjectState

    comm = _Comm(1, 2, [(6, 6, "ha"), None], sent=6)
    elastic_rank(rank=1, local_rank=0, comm=comm)
    state = ObjectState(epoch=0)
    state._commits = 5  # behind: the sync hands out rank 0's state, and here its counter
    se._take_newest_commit(state)
    assert state._commits == 6 and comm.calls == [
        "elastic.commits",
        "elastic.commit_counter from 0",
    ]


def test_tensorflow_state_travels_to_disk_and_back(tmp_path):
    import tensorflow as tf

    from syncdp.tensorflow.elastic import TensorFlowState

    w = tf.Variable([1.0, 2.0], dtype=tf.float64)
    state = TensorFlowState([w], epoch=3)
    state.save()
    store = commits.Store(str(tmp_path / "job"))
    store.write(1, state.snapshot())
    w2 = tf.Variable([0.0, 0.0], dtype=tf.float64)
    fresh = TensorFlowState([w2], epoch=0)
    fresh.load_snapshot(store.read(1))
    fresh.restore()
    np.testing.assert_array_equal(w2.numpy(), [1.0, 2.0])
    assert fresh.epoch == 3


# --- The launcher's side. ---


def _config(*flags):
    return run.parse_args(["--min-np", "2", *flags, "python", "train.py"])


@pytest.fixture
def checked(monkeypatch):
    """Every host answers the remote-shell check, except those the test names."""
    bad: dict[str, str] = {}
    monkeypatch.setattr(restart._hosts, "host_problems", lambda hosts, shell, timeout: bad)
    return bad


def _loss(host="hb"):
    return restart.Loss(host, "no word from it for 10 s", (2, 3), time.monotonic())


def test_a_restart_goes_on_with_the_hosts_left(checked):
    config = _config("-np", "4", "-H", "ha:2,hb:2")
    assert restart.Restarts.possible(config)
    restarts = restart.Restarts(config, ["ssh"], print)
    restarts.used_hosts = {"ha", "hb"}
    new, line = restarts.next_config(config, _loss())
    assert (new.num_proc, new.hosts, new.hostfile) == (2, "ha:2", None)
    assert new.settings["max_np"] == 4  # grows back when slots return
    assert line.startswith("restart 1: starting 2 rank(s) on ha:2 without hb; the ranks resume")
    assert restarts.lost == ["hb"] and restarts.count == 1


def test_a_restart_never_goes_below_min_np_or_past_the_reset_limit(checked):
    config = run.parse_args(["--min-np", "3", "-np", "4", "-H", "ha:2,hb:2", "python", "t.py"])
    new, why = restart.Restarts(config, ["ssh"], print).next_config(config, _loss())
    assert new is None
    assert (
        why
        == "after losing hb the hosts left (ha (2 slot(s))) hold 2 rank(s), fewer than --min-np 3"
    )
    config = _config("-np", "2", "-H", "ha:1,hb:1,hc:1", "--reset-limit", "2")
    restarts = restart.Restarts(config, ["ssh"], print)
    restarts.changes = 1  # a rank was replaced before
    new, _ = restarts.next_config(config, _loss("hc"))
    # The ranks count on from the change and this restart: their next change is one too many.
    assert new.settings["reset_limit"] == 2 and restarts.resets_used == 2
    assert run.build_env(new, {}, resets_used=restarts.resets_used)["SYNCDP_RESETS_USED"] == "2"
    assert restarts.reset_budget == 0
    new, why = restarts.next_config(new, _loss("hb"))
    assert new is None and why.startswith("the reset limit (--reset-limit 2) is used up")


def test_the_discovery_script_places_a_restart_and_hosts_that_fail_the_check_are_left_out(
    tmp_path, checked
):
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\nprintf 'hc:2\\nha:2\\nhb:2\\nhd:1\\n'\n")
    script.chmod(0o755)
    config = _config(
        "-np", "4", "-H", "ha:2,hb:2,hc:2,hd:1", "--host-discovery-script", str(script)
    )
    said = []
    restarts = restart.Restarts(config, ["ssh"], said.append)
    restarts.used_hosts = {"ha", "hb"}
    checked["hd"] = "did not answer over the remote shell within 30 s"
    new, _ = restarts.next_config(config, _loss("hb"))
    assert new.hosts == "ha:2,hc:2" and new.num_proc == 4  # ha held ranks: its disk first
    assert said == [
        "elastic: host hd is left out of the restart: did not answer over the "
        "remote shell within 30 s."
    ]


def test_a_discovery_command_line_runs_in_a_shell_and_bare_hosts_get_slots_per_host(
    tmp_path, checked, monkeypatch
):
    # As in Horovod: the script may be a command line (run by a shell), and a host printed
    # without :N has --slots-per-host slots, for the ranks and for a restart alike.
    from syncdp.base import settings
    from syncdp.membership import membership

    lines = "printf 'ha\\nhb:3\\n'"
    assert membership.discover_slots(lines) == {"ha": 1, "hb": 3}
    assert membership.discover_slots(lines, 4) == {"ha": 4, "hb": 3}
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\nprintf 'hc\\nha\\nhb\\n'\n")
    script.chmod(0o755)
    flags = ("-np", "4", "-H", "ha:2,hb:2,hc:2", "--host-discovery-script", str(script))
    config = _config(*flags, "--slots-per-host", "2")
    assert not any("--slots-per-host" in note for note in config.notes)
    env = run.build_env(config, environ={})
    assert env[membership.DISCOVERY_SLOTS_VAR] == "2"
    assert membership.DISCOVERY_SLOTS_VAR in env[jobenv.CARRIED_VAR].split(",")  # spawns too
    monkeypatch.setenv(membership.DISCOVERY_SLOTS_VAR, env[membership.DISCOVERY_SLOTS_VAR])
    plan = membership.first_plan(settings.from_env(env), 4)
    alive = [membership.Member("ha", 1, 0), membership.Member("hb", 2, 1)]
    assert membership.free_slots(plan, alive) == (4, ["ha", "hb", "hc", "hc"])
    restarts = restart.Restarts(config, ["ssh"], print)
    restarts.used_hosts = {"ha", "hb"}
    new, _ = restarts.next_config(config, _loss("hb"))
    assert new.hosts == "ha:2,hc:2" and new.num_proc == 4
    # Without --slots-per-host a bare host has one slot, and nothing is passed.
    assert membership.DISCOVERY_SLOTS_VAR not in run.build_env(_config(*flags), environ={})
    # A script named relative to the working directory runs too, at the launcher's check.
    monkeypatch.chdir(tmp_path)
    assert membership.discover_slots("discover.sh", 2) == {"hc": 2, "ha": 2, "hb": 2}
    assert elastic.check_discovery("discover.sh") is None
    assert "failed" in elastic.check_discovery("missing.sh")


def test_discovery_output_is_read_line_by_line_and_a_malformed_line_is_named(capsys, monkeypatch):
    from syncdp.membership import membership

    monkeypatch.delenv(membership.DISCOVERY_SLOTS_VAR, raising=False)
    # A hostfile's syntax is not a discovery line: one host named "localhost slots=3" would
    # have become two hosts, "localhost" and "slots=3".
    hostfile = "printf 'ha:2\\n\\n  hb  \\nlocalhost slots=3\\nhc:0\\nhd:x\\n'"
    assert membership.discover_slots(hostfile) == {"ha": 2, "hb": 1}
    err = capsys.readouterr().err
    for bad in ("localhost slots=3", "hc:0", "hd:x"):
        assert f"printed {bad!r}, not 'host' or 'host:slots'" in err
    # The launcher's check before the job starts refuses it, naming the line.
    assert membership.discover_slots(hostfile, strict=True) is None
    assert "printed 'localhost slots=3'" in capsys.readouterr().err
    assert "failed" in elastic.check_discovery(hostfile)
    assert elastic.check_discovery("printf '10.0.0.7:2\\n10.0.0.8\\n'") is None


def test_one_host_or_a_job_without_hosts_cannot_restart():
    assert not restart.Restarts.possible(_config("-np", "2", "-H", "ha:2"))
    assert not restart.Restarts.possible(_config("-np", "2"))
    assert not restart.Restarts.possible(run.parse_args(["-np", "2", "-H", "a:1,b:1", "x"]))


def test_a_host_whose_supervisors_vanished_without_a_report_was_lost():
    now = time.monotonic()
    links = {
        0: Link(0, "ha", 1, now, now, closed=now),  # reported its exit
        1: Link(1, "hb", 2, now, now, closed=now),
        2: Link(2, "hb", 3, now, now - 20),  # silent
        3: Link(3, "hc", 4, now, now),  # alive
    }
    assert restart.vanished_hosts(links, reported={0}) == ["hb"]
    assert restart.vanished_hosts(links, reported={0, 2}) == []


def test_the_log_names_the_resume_and_a_used_up_reset_budget():
    out, aborted = io.StringIO(), []
    log = elastic.ElasticLog(
        out=out,
        ranks=2,
        on_abort=aborted.append,
        reset_budget=0,
        restarted=("hb", time.monotonic() - 12.0),
    )
    log.handle(
        {"kind": "resumed", "message": "resumed from commit 6, kept on ha's disk", "size": 2}
    )
    assert "elastic: resumed from commit 6, kept on ha's disk at size 2, 12." in out.getvalue()
    assert "s after hb was lost." in out.getvalue()
    log.handle({"kind": "membership", "lost": [], "added": [], "old_size": 2, "new_size": 2})
    assert aborted and "reset limit" in aborted[0]["message"]


def test_the_commits_are_removed_at_the_end(tmp_path, monkeypatch):
    directory = tmp_path / "syncdp-0" / "job"
    directory.mkdir(parents=True)
    (directory / "commit-000000000001.pkl").write_bytes(b"x")
    assert cleanup.remove_directory(str(directory), ["false"], ["localhost"]) is None
    assert not (tmp_path / "syncdp-0").exists()
    line = cleanup.remove_directory(str(directory), ["false"], ["hb"])
    assert line and line.startswith("the job's commits could not be removed from") and "hb" in line


def test_commits_go_to_var_tmp_per_user_and_job():
    assert restart.commit_directory("abc") == f"/var/tmp/syncdp-{os.getuid()}/abc"


def test_elastic_mpirun_leaves_the_finalize_fence_out_unless_told_otherwise():
    # Open MPI 5.0.11's MPI_Finalize fence never completes once a host has lost every rank it
    # started with (a replacement on a host that had none trained, then never ended).
    config = _config("-np", "2")
    cmd = run.build_command(config, run.build_env(config, environ={}))
    assert cmd[cmd.index("async_mpi_finalize") - 1 : cmd.index("async_mpi_finalize") + 2] == [
        "--mca",
        "async_mpi_finalize",
        "1",
    ]
    env = run.build_env(config, environ={"OMPI_MCA_async_mpi_finalize": "0"})
    assert "async_mpi_finalize" not in run.build_command(config, env)
    plain = run.parse_args(["-np", "2", "python", "train.py"])
    assert "async_mpi_finalize" not in run.build_command(plain, run.build_env(plain, environ={}))


def test_a_host_listed_by_address_is_lost_under_every_name(checked):
    # Issue 35.2: -H by address; the host calls itself sdpB and its lifelines come from
    # 10.77.0.12. The restart used to go back onto 10.77.0.12 ("without sdpB").
    config = _config("-np", "4", "-H", "10.77.0.11:2,10.77.0.12:2")
    restarts = restart.Restarts(config, ["ssh"], print)
    restarts.used_hosts = {"10.77.0.11", "10.77.0.12"}
    loss = restart.Loss("sdpB", "no word from it for 10 s", (2, 3), time.monotonic())
    loss = dataclasses.replace(loss, aliases=("10.77.0.12",))
    new, line = restarts.next_config(config, loss)
    assert (new.num_proc, new.hosts) == (2, "10.77.0.11:2")
    assert line.startswith("restart 1: starting 2 rank(s) on 10.77.0.11:2 without sdpB")
    assert restarts.is_lost("10.77.0.12") and restarts.is_lost("sdpB.cluster")
    assert not restarts.is_lost("10.77.0.11") and not restarts.is_lost("sdpA")


def test_the_watch_names_a_lost_host_by_its_entry_and_addresses():
    # The lifelines of the lost host came from its address; the sweeper maps that address to
    # the -H entry it was listed by.
    from syncdp.launch.hosts import Host

    now = time.monotonic()
    sweeper = cleanup.Sweeper("job", ["ssh"], [Host("10.77.0.11", 2), Host("10.77.0.12", 2)])
    links = [Link(r, "sdpB", 10 + r, now, now - 20, address="10.77.0.12") for r in (2, 3)]
    watch = restart.Watch(None, None, sweeper, None, print)
    assert watch._aliases(links) == ("10.77.0.12",)
    assert sweeper.host_of(2, "sdpB", "10.77.0.12") == "10.77.0.12"


def test_mpiruns_banners_name_the_host_whose_daemon_failed():
    # PRRTE 3.0's banners, as copy_output hands their words over (one line).
    assert (
        restart.daemon_host(
            "------ A daemon failed to report back after being spawned. This could be due to "
            "several factors ... Local host: vm Remote host: hc Daemon exit status: 255 ------"
        )
        == "hc"
    )
    assert (
        restart.daemon_host(
            "PRTE has lost communication with a remote daemon. HNP daemon : "
            "[prterun-vm-24308@0,0] on node vm Remote daemon: [prterun-vm-24308@0,1] on node "
            "10.77.0.12 This is usually due to ..."
        )
        == "10.77.0.12"
    )
    assert restart.daemon_host("MPI_ABORT was invoked on rank 0") is None


def _watch(num_proc=4, spares=()):
    """A Watch over a fake runtime of ranks 0..num_proc-1 (and spares), that can restart."""
    from syncdp.launch.cleanup import Sweeper
    from syncdp.launch.hosts import Host
    from syncdp.launch.verdict import Verdict

    said = []
    log = elastic.ElasticLog(out=io.StringIO(), spares=spares, ranks=num_proc)
    verdict = Verdict(num_proc, start_timeout=30, stall_timeout=60, elastic=log)
    config = _config("-np", str(num_proc), "-H", "ha:2,hb:2")
    restarts = restart.Restarts(config, ["ssh"], said.append)
    sweeper = Sweeper("job", ["ssh"], [Host("ha", 2), Host("hb", 2)])
    lifeline = types.SimpleNamespace(links=dict, close=lambda: None)
    watch = restart.Watch(restarts, lifeline, sweeper, verdict, said.append)
    watch._end_runtime = lambda: None  # nothing to end here
    return watch, verdict, said


def _exit(label, code=0):
    return {"kind": "exit", "rank": label, "code": code, "host": "ha", "pid": 100 + label}


def test_a_host_lost_once_the_others_are_done_restarts_nothing():
    # Issue 35.5: training finished (rank 0's "trained") and ranks 0, 1 exited 0; hb, with
    # ranks 2 and 3 still ending their program, is lost: nothing to start again, and the job
    # is a success that says so.
    watch, verdict, said = _watch()
    verdict.add({"kind": "trained", "rank": 0})
    verdict.add(_exit(0))
    verdict.add(_exit(1))
    now = time.monotonic()
    links = {r: Link(r, "hb", 10 + r, now, now - 20) for r in (2, 3)}
    watch.check_vanished(links)
    assert not watch.happened()
    assert said == [
        "elastic: host hb was lost (no word from it for 20 s, and Open MPI's runtime lost its "
        "daemon there and ended the job; ranks 2, 3 ran there) after training had finished; "
        "nothing to start again."
    ]
    outcome = verdict.decide({}, mpirun_code=1)
    assert outcome.code == 0, outcome.lines
    assert "Host hb was lost after training had finished ([2], [3] ran there" in outcome.lines[-1]


def test_a_host_lost_while_others_still_run_is_restarted_and_rank_0_is_never_excused():
    watch, verdict, said = _watch()
    verdict.add({"kind": "trained", "rank": 0})
    verdict.add(_exit(1))  # rank 0 still runs its end: a restart lets it finish
    now = time.monotonic()
    links = {r: Link(r, "hb", 10 + r, now, now - 20) for r in (2, 3)}
    watch.check_vanished(links)
    assert watch.happened() and watch.loss.host == "hb"
    # Rank 0's end (the chief's: saving the model, say) is never taken as done unseen: a host
    # lost with rank 0 on it restarts the job even when every other rank is done.
    watch, verdict, said = _watch()
    verdict.add({"kind": "trained", "rank": 0})
    for label in (2, 3):
        verdict.add(_exit(label))
    links = {r: Link(r, "ha", 10 + r, now, now - 20) for r in (0, 1)}
    watch.check_vanished(links)
    assert watch.happened() and watch.loss.host == "ha"
    log = verdict.elastic
    log.lost_after_training("ha", [0, 1])
    assert 0 in log.unfinished(4) and 1 not in log.unfinished(4)


def test_the_log_says_spares_waited_where_they_did():
    watch, verdict, said = _watch(num_proc=2, spares=(2, 3))
    loss = restart.Loss("hb", "no word from it for 10 s", (2, 3), time.monotonic())
    assert watch._who(loss) == "spares [2], [3] waited there"
    loss = restart.Loss("hb", "no word from it for 10 s", (1, 2), time.monotonic())
    assert watch._who(loss) == "rank 1 ran there; spare [2] waited there"
    assert watch._who(dataclasses.replace(loss, ranks=())) == "no rank ran there"


def test_a_daemon_that_could_not_start_is_a_lost_host_to_leave_out():
    # Issue 35.3: no rank started (the runtime stops before any does), and mpirun named hc.
    watch, verdict, said = _watch()
    watch.on_banner("A daemon failed to report back after being spawned. Remote host: hb")
    watch.check_vanished({})
    assert watch.happened() and watch.loss.host == "hb" and watch.loss.aliases == ("hb",)
    assert said[0].startswith(
        "elastic: host hb was lost (Open MPI's daemon there could not start: mpirun says it "
        "did not report back; no rank ran there)."
    )


def test_a_daemon_lost_on_a_host_that_still_answers_restarts_the_job_there_once(checked):
    # Seen in full test runs on 2 cores: rank 1 on ha was killed, then mpirun said ha's daemon
    # did not report back, though ha's supervisors had reported. The launcher took ha for lost,
    # said "no rank ran there", and, knowing ha by that name only, restarted onto ha's address
    # "without ha". Only the daemon was lost: ha is used again, once, and the log says so.
    watch, verdict, said = _watch()
    verdict.add(_exit(1, code=137))
    now = time.monotonic()
    links = {
        r: Link(r, "ha" if r < 2 else "hb", 10 + r, now, now, address=f"10.0.0.{1 + r // 2}")
        for r in range(4)
    }
    links[1].closed = now  # rank 1's supervisor reported its rank's end and left
    watch.on_banner("A daemon failed to report back after being spawned. Remote host: ha")
    watch.check_vanished(links)
    loss = watch.loss
    assert (loss.host, loss.ranks, loss.answers) == ("ha", (0, 1), True)
    assert loss.aliases == ("10.0.0.1", "ha")
    assert said[0] == (
        "elastic: Open MPI's daemon on ha was lost (mpirun says it did not report back; ranks "
        "0, 1 ran there), but the host still answers. Open MPI's runtime cannot go on without "
        "the daemon: ending it to start the job again, ha included."
    )
    restarts = watch.restarts
    restarts.used_hosts = {"ha", "hb"}
    new, line = restarts.next_config(restarts.config, loss)
    assert (new.num_proc, new.hosts) == (4, "ha:2,hb:2")
    assert line.startswith("restart 1: starting 4 rank(s) on ha:2,hb:2; the ranks resume")
    assert restarts.summary() == "1 restart(s) after a lost Open MPI daemon (ha)"
    assert not restarts.is_lost("ha") and not restarts.is_lost("10.0.0.1")
    # Its daemon lost a second time, the host is left out like any lost host.
    new, line = restarts.next_config(new, loss)
    assert (new.num_proc, new.hosts) == (2, "hb:2")
    assert "on hb:2 without ha;" in line
    assert restarts.is_lost("10.0.0.1")
    assert restarts.summary() == (
        "2 restart(s) after a lost host (ha) and a lost Open MPI daemon (ha)"
    )
    # Every supervisor there reported (one was still heard from before): the host answers.
    watch, verdict, said = _watch()
    verdict.add(_exit(1, code=137))
    verdict.add(_exit(0))
    links[0].closed = now
    watch.on_banner("A daemon failed to report back after being spawned. Remote host: ha")
    watch.check_vanished(links)
    assert watch.loss.answers
    # One supervisor there went quiet without a word (rank 0, after rank 1 had reported): the
    # host may have gone with it. Lost, under every name, with the ranks that ran there.
    watch, verdict, said = _watch()
    verdict.add(_exit(1, code=137))
    watch.on_banner("A daemon failed to report back after being spawned. Remote host: ha")
    watch.check_vanished(links)
    assert (watch.loss.ranks, watch.loss.answers) == ((0, 1), False)
    assert said[0].startswith(
        "elastic: host ha was lost (Open MPI's daemon there was lost: mpirun says it did not "
        "report back; ranks 0, 1 ran there)."
    )
    new, line = watch.restarts.next_config(watch.restarts.config, watch.loss)
    assert new.hosts == "hb:2" and watch.restarts.is_lost("10.0.0.1")


def test_a_restarted_job_never_grows_onto_a_lost_host_the_script_still_lists(tmp_path, monkeypatch):
    # Issue 35.4: the launcher tells the restarted ranks every name of the hosts lost so far
    # (SYNCDP_LOST_HOSTS); the ranks' plan holds them as vanished, so free slots the discovery
    # script still lists there are never used (growing onto hb failed in membership.grow).
    from syncdp.base import settings
    from syncdp.membership import membership

    config = _config("-np", "4", "-H", "10.77.0.11:2,10.77.0.12:2")
    restarts = restart.Restarts(config, ["ssh"], print)
    restarts.lost, restarts.lost_aliases = ["sdpB"], {"10.77.0.12"}
    env = run.build_env(config, environ={}, lost_hosts=restarts.lost_names())
    assert env[membership.LOST_HOSTS_VAR] == "10.77.0.12,sdpB"
    assert membership.LOST_HOSTS_VAR in env[jobenv.CARRIED_VAR].split(",")  # spawns too
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\nprintf '10.77.0.11:2\\n10.77.0.12:2\\n'\n")
    script.chmod(0o755)
    monkeypatch.setenv(membership.LOST_HOSTS_VAR, env[membership.LOST_HOSTS_VAR])
    plan = membership.first_plan(
        settings.from_env({"SYNCDP_HOST_DISCOVERY_SCRIPT": str(script)}), 2
    )
    assert plan.vanished == ("10.77.0.12", "sdpB")
    alive = [membership.Member("10.77.0.11", 1, 0), membership.Member("10.77.0.11", 2, 1)]
    assert membership.free_slots(plan, alive) == (0, [])
    # A job that lost nothing passes nothing.
    assert membership.LOST_HOSTS_VAR not in run.build_env(config, environ={})


def test_a_slow_discovery_script_never_holds_a_commit(tmp_path, monkeypatch):
    # Rank 0's look for room to grow runs the script in the background: a commit takes what
    # the last finished look found, and a script that takes long (or hangs) costs it nothing.
    from syncdp.membership import membership

    monkeypatch.setattr(membership, "DISCOVERY_INTERVAL_SECONDS", 3.0)
    runs = tmp_path / "runs"
    script = f"echo x >> {runs}; sleep 1; echo ha:2"
    looker = membership.Looker()
    began = time.monotonic()
    assert looker.take(script) is None  # the first look has only started
    assert looker.take(script) is None  # one look at a time
    assert time.monotonic() - began < 0.9  # neither waited for the script's second

    def until(check):
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            found = check()
            if found:
                return found
            time.sleep(0.05)
        raise AssertionError("timed out")

    assert until(lambda: looker.take(script)) == {"ha": 2}
    assert looker.take(script) is None  # taken once; the next look waits for the interval
    assert runs.read_text().count("x") == 1
    # Once the interval has passed, a take starts the next look.
    until(lambda: looker.take(script) is None and runs.read_text().count("x") == 2)
