"""An elastic job that loses a host: end what is left of Open MPI's runtime, start the job again.

ULFM heals a job that loses processes, but PRRTE 3.0, the runtime in Open MPI 5.0.11, cannot run
on without one of its daemons: when a host is lost (its link cut, powered off, its daemon
killed) the survivors wait for it, mpirun reports "lost communication with a remote daemon"
and nothing recovers. So the launcher survives a lost host above the runtime:

1. **Noticed.** A host is lost when every supervisor on it has been silent on its lifeline
   for :data:`HOST_LOST_SECONDS` (:mod:`syncdp.launch.lifeline`; a stopped launcher judges nothing),
   or when mpirun ended with training unfinished while a host's supervisors vanished without a
   report (its daemon was killed, and the runtime ended the job).
2. **Ended.** The launcher closes the lifeline (the supervisors on the other hosts then end
   their ranks and Open MPI's daemon), stops mpirun, and sweeps the hosts still reachable
   (:mod:`syncdp.launch.cleanup`); each step is bounded, so this takes seconds. On the lost host the
   supervisors end everything themselves once the launcher stops answering (the same
   :data:`HOST_LOST_SECONDS` in elastic mode).
3. **Placed.** The hosts to go on with are the discovery script's current list, or the
   ``-H``/``--hostfile`` hosts, less every host lost so far (never used again by this launcher),
   each checked over the remote shell like at the start; hosts that held ranks come first
   (their disks hold the commits). The job gets ``-np`` ranks, or as many as the slots allow,
   and no fewer than ``--min-np``.
4. **Resumed.** The job starts again on them with the same commit directory: every rank's
   first sync finds the newest commit on the hosts' local disks and resumes from it
   (:mod:`syncdp.membership.commits`), so what is lost is at most the work after the last commit.

``--reset-limit`` counts each restart as a membership change, together with those the ranks
made; a restart it does not allow ends the job with a last line that says so. Every restart
removes at least one host for good, so there are never more restarts than hosts.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import subprocess
import threading
import time
from collections.abc import Callable, Collection, Mapping

from syncdp.launch import cleanup, supervision
from syncdp.launch import hosts as _hosts
from syncdp.launch.cli import LaunchConfig
from syncdp.launch.lifeline import ELASTIC_LOST_SECONDS, Link
from syncdp.membership import membership

__all__ = [
    "HOST_LOST_SECONDS",
    "Loss",
    "Watch",
    "Restarts",
    "commit_directory",
    "daemon_host",
    "vanished_hosts",
]

# Silence on every lifeline of a host after which an elastic job restarts without it; the
# supervisors there give up on the launcher after as long.
HOST_LOST_SECONDS = ELASTIC_LOST_SECONDS
# Every candidate host must answer the remote-shell check within this long.
_CHECK_SECONDS = 30.0
# mpirun, which may wait for the lost host's daemon, gets this long after SIGTERM.
_STOP_SECONDS = 2.0


@dataclasses.dataclass(frozen=True)
class Loss:
    """A host lost by a job, as the launcher saw it.

    Attributes:
        host: The host's name, as its supervisors gave it.
        why: In words (``no word from hb for 10 s``).
        ranks: The ranks (output labels) that ran there.
        at: ``time.monotonic()`` when the launcher noticed.
        aliases: The host's other names: the ``-H``/``--hostfile`` entry it was reached by and
            the addresses its lifelines came from (the same host, however it is listed).
        answers: Only Open MPI's daemon there was lost: when mpirun ended, every supervisor
            there had reported how its rank ended or was still heard from, so the host itself
            answers (a restart may use it again, once: :meth:`Restarts.keeps`).
    """

    host: str
    why: str
    ranks: tuple[int, ...]
    at: float
    aliases: tuple[str, ...] = ()
    answers: bool = False


def commit_directory(job_id: str) -> str:
    """Where each host keeps this job's commits: on its local disk, per user, per job.

    ``/var/tmp``, not ``/tmp``: the FHS's place for temporary files kept on disk, where ``/tmp``
    is often memory (a large model's commit would take RAM from training)."""
    return os.path.join("/var/tmp", f"syncdp-{os.getuid()}", job_id)


# mpirun's banners that name a host whose daemon did not start or was lost (PRRTE 3.0).
_DAEMON_BANNERS = (
    re.compile(r"A daemon failed to report back.*?Remote host: *(\S+)"),
    re.compile(r"lost communication with a remote daemon.*?Remote daemon: *\S+ on node (\S+)"),
)


def daemon_host(words: str) -> str | None:
    """The host an Open MPI banner (its words, one line) says a daemon failed on, or None."""
    for pattern in _DAEMON_BANNERS:
        found = pattern.search(words)
        if found is not None:
            return found[1]
    return None


def _names(link: Link, host: str) -> bool:
    """Whether ``host`` (as mpirun's banner names it) is ``link``'s host: the name its
    supervisor gave, its short name, or the address its lifeline came from."""
    if host in (link.host, link.address):
        return True
    return bool(link.host) and link.host.split(".")[0] == host.split(".")[0]


def vanished_hosts(links: Mapping[int, Link], reported: Collection[int]) -> list[str]:
    """Hosts whose every supervisor went away without a report: their daemon was lost.

    Args:
        links: Each rank's lifeline (by output label), with the host its supervisor named.
        reported: The labels whose supervisors reported how their ranks ended.

    Returns:
        The hosts, sorted, where no rank reported and every lifeline closed or fell silent.
    """
    by_host: dict[str, list[Link]] = {}
    for link in links.values():
        by_host.setdefault(link.host or "?", []).append(link)
    now = time.monotonic()
    return [
        host
        for host, found in sorted(by_host.items())
        if not any(link.rank in reported for link in found)
        and all(link.closed is not None or link.silent(now) for link in found)
    ]


class Watch:
    """Watches one runtime of an elastic job for a lost host, and ends that runtime when one is.

    Args:
        restarts: The job's restarts, or None when it cannot restart (then a lost host ends
            the job, named, instead of leaving it waiting).
        lifeline: The runtime's lifeline server.
        sweeper: The runtime's sweeper (:mod:`syncdp.launch.cleanup`).
        verdict: The runtime's verdict.
        say: Prints one line of the launcher's log.

    Attributes:
        loss: The first host lost, once one was.
        process: The runtime's mpirun, once started.
    """

    def __init__(self, restarts, lifeline, sweeper, verdict, say: Callable[[str], None]):
        self.restarts = restarts
        self.lifeline = lifeline
        self.sweeper = sweeper
        self.verdict = verdict
        self.say = say
        self.loss: Loss | None = None
        self.process: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._ended = threading.Event()
        self._swept: str | None = None
        self.seconds = 0.0  # how long ending the runtime took
        # Hosts whose Open MPI daemon could not start or was lost, as mpirun's banners name
        # them (the host as the runtime was given it).
        self.daemons_lost: list[str] = []
        self._finished_losses: set[str | None] = set()

    def happened(self) -> bool:
        """Whether a host was lost (the runtime is being, or was, ended)."""
        return self.loss is not None

    def on_lost(self, host: str | None, links: list[Link]) -> None:
        """For :class:`syncdp.launch.lifeline.LifelineServer`: ``host``'s supervisors fell
        silent."""
        now = time.monotonic()
        everyone = [link for link in self.lifeline.links().values() if link.host == host]
        if any(link.closed is None and not link.silent(now) for link in everyone):
            return  # one stopped supervisor, not a lost host: the stall timeout handles its rank
        seconds = max(link.silent_for(now) for link in links)
        ranks = tuple(sorted(link.rank for link in everyone if isinstance(link.rank, int)))
        why = f"no word from it for {seconds:.0f} s"
        if self._finished_without(ranks):
            self._after_training(host or "?", why, ranks, now)
            return
        self.lost(Loss(host or "?", why, ranks, now, self._aliases(everyone)))

    def _after_training(self, host: str, why: str, ranks: tuple[int, ...], now: float) -> None:
        """``host`` was lost once training had finished: nothing to start again. Its ranks need
        not report how their program ended (rank 0 excepted, :meth:`ElasticLog.unfinished`),
        and mpirun, which may wait for the lost daemon, is stopped once the others have
        (supervision's grace)."""
        with self._lock:
            if host in self._finished_losses:
                return
            self._finished_losses.add(host)
        self.verdict.elastic.lost_after_training(host, ranks)
        who = self._who(Loss(host, why, ranks, now))
        self.say(
            f"elastic: host {host} was lost ({why}; {who}) after training had finished; "
            "nothing to start again."
        )

    def _finished_without(self, there: tuple[int, ...]) -> bool:
        """Whether the job is done but for the ranks ``there`` (output labels): training
        finished, and every other rank of the final membership exited 0.

        Not when others still run their program's end: Open MPI's runtime ends every rank once
        it loses a daemon, and their MPI_Finalize cannot complete while a host is unreachable,
        so only a restart lets them finish (it redoes the steps since the last commit)."""
        elastic = self.verdict.elastic if self.verdict is not None else None
        if elastic is None or not self.verdict.num_proc:
            return False
        unfinished = elastic.unfinished(self.verdict.num_proc)
        others = [label for label in unfinished if label not in there]
        # Rank 0's end (the chief's: saving the model, say) is never taken as done unseen.
        rank0 = min(elastic.members(self.verdict.num_proc), default=None)
        return (elastic.trained or not unfinished) and not others and rank0 not in unfinished

    def on_banner(self, words: str) -> None:
        """For :func:`syncdp.launch.output.copy_output`: notes a host whose daemon mpirun says it
        could not start or lost."""
        host = daemon_host(words)
        if host is not None and host not in self.daemons_lost:
            self.daemons_lost.append(host)

    def _aliases(self, links) -> tuple[str, ...]:
        """Every other name of the host of ``links``: its listed entry, its addresses."""
        found = set()
        for link in links:
            if isinstance(link.rank, int):
                found.add(self.sweeper.host_of(link.rank, link.host, link.address))
            if link.address:
                found.add(link.address)
        return tuple(sorted(found))

    def check_vanished(self, links: Mapping[int, Link]) -> None:
        """After mpirun ended by itself: a host whose supervisors all vanished without a report,
        while training was unfinished, was lost (its daemon died and the runtime ended the job)."""
        elastic = self.verdict.elastic
        if self.restarts is None or elastic is None or self.verdict.num_proc == 0:
            return
        first = self.verdict.first_failure()
        if (first or {}).get("kind") == "exception":
            return  # a program error that a restart would only repeat
        now = time.monotonic()
        finished = False
        for host in vanished_hosts(links, elastic.reported()):
            ranks = tuple(sorted(r for r, link in links.items() if link.host == host))
            there = [link for link in links.values() if link.host == host]
            finished = self._finished_without(ranks)
            silent = [link for link in there if link.closed is None]
            if silent:  # a cut link: the supervisors there may well be alive
                seconds = max(link.silent_for(now) for link in silent)
                why = (
                    f"no word from it for {seconds:.0f} s, and Open MPI's runtime lost its "
                    "daemon there and ended the job"
                )
            else:
                why = "its processes vanished without a word, and Open MPI's runtime ended the job"
            if finished:
                self._after_training(host, why, ranks, now)
                continue
            self.lost(Loss(host, why, ranks, now, self._aliases(there)))
            return
        if finished or self._finished_without(()):
            return
        for host in self.daemons_lost:
            there = {r: link for r, link in links.items() if _names(link, host)}
            if there:
                # Ranks ran there: the log names them, and the loss every name of the host.
                # The host answers, and only its daemon was lost, when every supervisor there
                # reported how its rank ended or is still heard from (seen under load on 2
                # cores, after a rank there was killed); one that went quiet without a word
                # may have gone with its host.
                reported = elastic.reported()
                answers = all(
                    r in reported or (link.closed is None and not link.silent(now))
                    for r, link in there.items()
                )
                why = "mpirun says it did not report back"
                if not answers:
                    why = f"Open MPI's daemon there was lost: {why}"
                aliases = tuple(sorted({host, *self._aliases(there.values())}))
                self.lost(Loss(host, why, tuple(sorted(there)), now, aliases, answers=answers))
                return
            # No rank ran there (a daemon that cannot start stops the runtime before any rank
            # starts), so no lifeline names the host: mpirun's own words do.
            start = "could not start" if not links else "was lost"
            why = f"Open MPI's daemon there {start}: mpirun says it did not report back"
            self.lost(Loss(host, why, (), now, (host,)))
            return

    def _who(self, loss: Loss) -> str:
        """Who was on the lost host, in words: its ranks, and its spares (which train nothing)."""
        elastic = self.verdict.elastic if self.verdict is not None else None
        waiting = elastic.waiting_spares() if elastic is not None else set()
        ranks = [r for r in loss.ranks if r not in waiting]
        spares = [r for r in loss.ranks if r in waiting]
        said = []
        if ranks:
            said.append(("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks)))
            said[-1] += " ran there"
        if spares:
            labels = ", ".join(f"[{r}]" for r in spares)
            said.append(f"{'spare' if len(spares) == 1 else 'spares'} {labels} waited there")
        return "; ".join(said) or "no rank ran there"

    def lost(self, loss: Loss) -> None:
        """Records ``loss`` and ends the runtime (the first loss only; others are logged)."""
        on = self._who(loss)
        if self.restarts is None:
            message = (
                f"host {loss.host} was lost ({loss.why}; {on}); Open MPI's runtime "
                "cannot go on without it, and this job has no other hosts to start again on "
                "(list several with -H or --hostfile, or give --host-discovery-script)"
            )
            self.say(f"elastic: {message}; ending the job.")
            self.verdict.add({"kind": "elastic_abort", "rank": None, "message": message})
            return
        with self._lock:
            first = self.loss is None
            if first:
                self.loss = loss
        if not first:
            if loss.host != self.loss.host:
                self.say(f"elastic: host {loss.host} was lost too ({loss.why}).")
            if loss.host not in self.restarts.lost:
                self.restarts.lost.append(loss.host)
            self.restarts.lost_aliases |= set(loss.aliases)
            return
        if self.verdict is not None and self.verdict.elastic is not None:
            # The ranks ended with this runtime are not losses to recover from: the restart
            # is the launcher's account of them.
            self.verdict.elastic.hush()
        if self.restarts.keeps(loss):
            self.say(
                f"elastic: Open MPI's daemon on {loss.host} was lost ({loss.why}; {on}), but "
                "the host still answers. Open MPI's runtime cannot go on without the daemon: "
                f"ending it to start the job again, {loss.host} included."
            )
        else:
            self.say(
                f"elastic: host {loss.host} was lost ({loss.why}; {on}). Open MPI's "
                "runtime cannot go on without it: ending it to start the job again without "
                f"{loss.host}."
            )
        threading.Thread(target=self._end_runtime, name="syncdp-restart", daemon=True).start()

    def _end_runtime(self) -> None:
        started = time.monotonic()
        try:
            # mpirun first, so that the ranks are told the job ends; it may wait for the lost
            # daemon, so not for long.
            if self.process is not None:
                supervision.stop(self.process, grace=_STOP_SECONDS)
            # Every supervisor still connected now ends its rank and Open MPI's daemon.
            self.lifeline.close()
            for link in self.lifeline.links().values():
                if isinstance(link.rank, int):
                    self.sweeper.start(self.sweeper.host_of(link.rank, link.host, link.address))
            # Hosts without ranks hold a daemon too, which no supervisor there can end.
            self.sweeper.start_all()
            self._swept = self.sweeper.finish([], {})
        finally:
            self.seconds = time.monotonic() - started
            self._ended.set()

    def finish(self) -> None:
        """Waits until the runtime is ended (bounded), and says what was cleaned up."""
        self._ended.wait(timeout=_STOP_SECONDS * 2 + cleanup.SWEEP_SECONDS + 5)
        done = f"in {self.seconds:.1f} s" if self._ended.is_set() else "(not confirmed)"
        swept = f"; {self._swept}" if self._swept else ""
        self.say(f"elastic: the runtime that lost {self.loss.host} was ended {done}{swept}.")


class Restarts:
    """What the launcher knows across the runtimes of one elastic job, and where it goes next.

    Args:
        config: The job as the command line gave it.
        shell: The remote shell (:func:`syncdp.launch.hosts.remote_shell`).
        say: Prints one line of the launcher's log.
    """

    def __init__(self, config: LaunchConfig, shell: list[str], say: Callable[[str], None]):
        self.config = config
        self.shell = shell
        self.say = say
        self.count = 0
        self.lost: list[str] = []  # hosts never used again, in the order they were lost
        self.lost_aliases: set[str] = set()  # every name and address of those hosts
        # Hosts that answered when their Open MPI daemon was lost, used again once (in order).
        self.daemons: list[str] = []
        self._daemon_names: set[str] = set()  # every name and address of those hosts
        self.used_hosts: set[str] = set()  # hosts that ran a rank (their disks hold commits)
        self.changes = 0  # membership changes the ranks made, over every runtime
        self.last: Loss | None = None
        # The membership changes and restarts used before the current runtime (the ranks
        # count on from it: SYNCDP_RESETS_USED), and the changes that runtime may make before
        # the launcher ends it (None: no limit; the ranks end it first, before any spawn).
        self.resets_used = 0
        self.reset_budget: int | None = None

    @staticmethod
    def possible(config: LaunchConfig) -> bool:
        """Whether a job can be started again elsewhere: elastic, on hosts the launcher was
        given (``-H``/``--hostfile``), with another to go on with (several listed, or a
        discovery script). In a Slurm allocation of several nodes, an elastic job without ``-H``
        is given the allocation's nodes as its hosts when its command line is read
        (:func:`syncdp.launch.hosts.slurm_allocation`)."""
        listed = _hosts.listed(config.hosts, config.hostfile) or []
        script = config.settings.get("host_discovery_script")
        return config.elastic and bool(listed) and (len(listed) > 1 or bool(script))

    def keeps(self, loss: Loss) -> bool:
        """Whether the restart after ``loss`` uses its host again: only its Open MPI daemon
        was lost (the host still answers), and not before in this job. A host whose daemon is
        lost twice is left out like any lost host."""
        return loss.answers and not self._daemon_names & {loss.host, *loss.aliases}

    def summary(self) -> str:
        """The restarts so far, in words: ``2 restart(s) after a lost host (hb, hc)``."""
        causes = []
        if self.lost:
            causes.append(f"a lost host ({', '.join(self.lost)})")
        if self.daemons:
            causes.append(f"a lost Open MPI daemon ({', '.join(self.daemons)})")
        return f"{self.count} restart(s) after {' and '.join(causes) or 'a lost host'}"

    @property
    def limit(self) -> int:
        return int(self.config.settings.get("reset_limit") or 0)

    def _candidates(self) -> list[_hosts.Host]:
        script = self.config.settings.get("host_discovery_script")
        found = None
        if script:
            slots = membership.discover_slots(script, self.config.slots_per_host or 1)
            if slots is None:
                self.say("elastic: the host discovery script failed; using the hosts of -H.")
            else:
                found = [_hosts.Host(name, count) for name, count in slots.items() if count > 0]
        if found is None:
            found = _hosts.listed(self.config.hosts, self.config.hostfile) or []
        found = [h for h in found if not self.is_lost(h.name)]
        # Hosts that ran ranks first: mpirun fills hosts in order, and their disks hold commits.
        return sorted(found, key=lambda h: h.name not in self.used_hosts)

    def lost_names(self) -> set[str]:
        """Every name and address of the hosts lost so far."""
        return set(self.lost) | self.lost_aliases

    def is_lost(self, name: str) -> bool:
        """Whether ``name`` is a host this job lost: under the name it gave itself, the entry
        it was listed by, an address its lifelines came from, or a name that resolves here to
        one of those addresses."""
        lost = set(self.lost) | self.lost_aliases
        if name in lost:
            return True
        try:
            ipaddress.ip_address(name)
        except ValueError:  # a name: the same host by its short name (hb, hb.cluster)
            if name.split(".")[0] in {n.split(".")[0] for n in self.lost}:
                return True
        return _hosts.resolve(name) in lost

    def next_config(self, attempt: LaunchConfig, loss: Loss) -> tuple[LaunchConfig | None, str]:
        """The job's next runtime after ``loss``, or None and why it cannot go on.

        Args:
            attempt: The runtime that was lost.
            loss: What was lost.

        Returns:
            ``(config of the next runtime, a line for the log)``, or ``(None, the reason)``.
        """
        self.last = loss
        kept = self.keeps(loss)
        if kept:
            self.daemons.append(loss.host)
            self._daemon_names |= {loss.host, *loss.aliases}
        else:
            if loss.host not in self.lost:
                self.lost.append(loss.host)
            self.lost_aliases |= set(loss.aliases)
        used = self.changes + self.count
        if self.limit and used + 1 > self.limit:
            return None, (
                f"the reset limit (--reset-limit {self.limit}) is used up ({self.changes} "
                f"membership change(s) and {self.count} restart(s) so far), so the job cannot "
                f"restart{'' if kept else ' without ' + loss.host}"
            )
        candidates = self._candidates()
        problems = _hosts.host_problems(candidates, self.shell, _CHECK_SECONDS)
        for name, why in problems.items():
            self.say(f"elastic: host {name} is left out of the restart: {why}.")
        chosen = [h for h in candidates if h.name not in problems]
        slots = sum(h.slots for h in chosen)
        min_np = int(self.config.settings.get("min_np") or 0) or self.config.num_proc
        ranks = min(self.config.num_proc, slots)
        if ranks < min_np:
            left = ", ".join(f"{h.name} ({h.slots} slot(s))" for h in chosen) or "none"
            return None, (
                f"after losing {', '.join(self.lost)} the hosts left ({left}) hold {ranks} "
                f"rank(s), fewer than --min-np {min_np}"
            )
        settings = dict(attempt.settings)
        # Grow back to -np later if the discovery script offers slots again.
        settings["max_np"] = max(int(settings.get("max_np") or 0), self.config.num_proc)
        spares = min(self.config.spares, slots - ranks)
        self.count += 1
        self.resets_used = used + 1
        self.reset_budget = self.limit - used - 1 if self.limit else None
        config = dataclasses.replace(
            attempt,
            num_proc=ranks,
            spares=spares,
            hosts=_hosts.format_hosts(chosen),
            hostfile=None,
            settings=settings,
        )
        fresh = not any(h.name in self.used_hosts for h in chosen)
        resume = (
            "no host left has run a rank of this job, so no commit is on their disks: "
            "training starts over"
            if fresh
            else "the ranks resume from the newest commit on these hosts' disks"
        )
        without = f" without {', '.join(self.lost)}" if self.lost else ""
        return (
            config,
            f"restart {self.count}: starting {ranks} rank(s) on {config.hosts}{without}; {resume}.",
        )
