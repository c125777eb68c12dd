"""The aggregator's election: what gunicorn's hooks (app/gunicorn_conf.py) and ``python -m app serve`` run.

The gunicorn master holds the address's owner election for as long as it
runs, exactly as an in-process owner would: the ranks of the pod stay quiet
writers, and if the aggregator dies the kernel drops its lock and a rank
takes the address over in-process.  Workers only serve (app.aggregator.wsgi).
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import signal
import socket
import struct
import time
from collections.abc import Callable
from typing import Any

from app.collector import Collector, drain_s
from app.config import DRAIN_ENV, Config
from app.probe import die_with_parent, get_healthz, lock_holder_pid, port_holders
from election import Outcome, OwnerElection, lock_file_name

log = logging.getLogger("nixl_prometheus_mp.standalone")


class _MasterState:
    """Set in the process that holds the election; inherited by forked workers."""

    election: OwnerElection | None = None
    pid: int | None = None
    since: float | None = None
    # After a SIGTERM, when the master exits (time.time()): in a page shared with the workers, which were forked
    # before the signal and answer /healthz.
    _drain_page = mmap.mmap(-1, 8)

    @property
    def draining_until(self) -> float | None:
        until = struct.unpack_from("d", self._drain_page)[0]
        return until or None

    @draining_until.setter
    def draining_until(self, until: float) -> None:
        struct.pack_into("d", self._drain_page, 0, until)


master = _MasterState()
_WAIT_S = 0.2  # how often a waiting aggregator retries the election (as often as a rank's writers do)


def hold_election(config: Config, wait: Callable[[float], bool]) -> Outcome | None:
    """Block until this process owns ``config.address`` (or the lock is unusable); None once ``wait`` (which
    sleeps up to the given seconds) says a stop signal came: as a container's PID 1, a process has no default
    action for SIGTERM, so a wait without a handler would ignore it until the grace period's SIGKILL.

    While another process holds the election (a rank serving in-process,
    another aggregator), the aggregator waits rather than fight it for the
    port, and names it: again whenever another process takes the address over.
    """
    election = OwnerElection(config.directory, config.address)
    lock_path = config.directory / lock_file_name(config.address)
    holder_pid: int | None = None
    logged = named = False
    while (outcome := election.try_win()) is Outcome.LOST:
        pid = lock_holder_pid(lock_path)
        if pid is not None and pid != holder_pid:  # None: between two holders, or in another pid namespace
            if holder_pid is not None:
                logged = named = False  # a new holder: say who it is
            holder_pid = pid
        # The holder binds only after winning, so it may not answer yet: say so, then name it once it does.
        if not named:
            holder, named = describe_holder(config, holder_pid)
            if named or not logged:
                logged = True
                log.warning("%s holds the owner election of %s; the aggregator waits for the address (until "
                            "that process exits: an address server does once its job's ranks are gone and past "
                            "their TTL)", holder, config.address)
        if wait(_WAIT_S):
            election.release()
            log.info("told to stop while waiting for %s: exiting", config.address)
            return None
    master.election, master.pid, master.since = election, os.getpid(), time.time()
    return outcome


def drain_time(config: Config) -> float | None:
    """SIGTERM means finish, then go: how long to go on publishing the departed ranks' final values (None: go at
    once), said in the log and, through ``master.draining_until``, in /healthz."""
    left_s = drain_s(Collector(config.directory, config.stale_ttl_s).census(), config.drain_max_s)
    if left_s is not None:
        master.draining_until = time.time() + left_s
        log.info("SIGTERM: no rank of %s is live; the aggregator goes on publishing their final values for %.1f s "
                 "(until their TTL, at most %s=%g s), then exits; a second SIGTERM ends it at once",
                 config.directory, left_s, DRAIN_ENV, config.drain_max_s)
    return left_s


def drain_on_sigterm(arbiter: Any, config: Config) -> None:
    """(gunicorn's when_ready) Make the arbiter's SIGTERM a drain: its handler only queues the signal, and the
    arbiter's loop runs ``handle_term``, replaced here.  The drain's end is a SIGTERM queued by an alarm (the
    second, which stops gunicorn gracefully, as its own SIGTERM does); SIGINT and SIGQUIT stay immediate."""
    stop = arbiter.handle_term

    def handle_term() -> None:
        if master.draining_until is None:
            left_s = drain_time(config)
            if left_s is not None:
                signal.signal(signal.SIGALRM, lambda signum, frame: arbiter.signal(signal.SIGTERM, frame))
                signal.setitimer(signal.ITIMER_REAL, left_s)
                return
        stop()
    arbiter.handle_term = handle_term


def describe_holder(config: Config, pid: int | None) -> tuple[str, bool]:
    """Who holds ``config.address``'s election, and whether that is final.

    Its /healthz says pid, host, mode and agent. A holder without /healthz
    (NIXL's C++ plug-in serves none) or not serving yet is named by ``pid``,
    the pid the kernel reports for the lock (/proc/locks).
    """
    host = "127.0.0.1" if config.host == "0.0.0.0" else config.host
    answer = get_healthz(host, config.port)
    owner = answer.owner
    if owner is not None:
        if owner.get("serving") == "helper":  # a job's address server: it goes once nothing is left to publish
            return (f"the address server pid {owner.get('pid')} on {owner.get('hostname')} (started by rank pid "
                    f"{owner.get('started_by')}, agent {owner.get('agent_name')})"), True
        what = f"pid {owner.get('pid')} on {owner.get('hostname')} ({owner.get('mode')}"
        return what + (f", agent {owner['agent_name']})" if owner.get("agent_name") else ")"), True
    serving = answer.status is not None  # it answers HTTP, without our /healthz; else nothing answers (yet)
    who = f"pid {pid}" if pid else "another process"
    if serving:
        return f"{who} (serving {config.address} without /healthz: NIXL's C++ plug-in?)", True
    return f"{who} (its /healthz does not answer yet)", False


def refuse_reexec(config: Config) -> None:
    """In the child gunicorn forks for a USR2 upgrade: exit instead of exec'ing a new master.

    The old master holds the owner election until it exits, and the
    operator only stops it once the new master serves: the new master
    would wait for the election forever.
    """
    log.error("USR2 upgrade refused: this master (pid %d) holds the owner election of %s until it exits, so a "
              "new master could never take over; restart the aggregator instead (a rank that exports serves "
              "the address in the gap)", os.getppid(), config.address)
    os._exit(1)


def port_problem(config: Config) -> str | None:
    """Why the address cannot be bound now (held by whom), or None.  Checked once the election is ours, so
    that a port held by something outside the run (a local Prometheus on its own 9090, say) is refused in one
    line naming it, not with gunicorn's five "Connection in use" retries."""
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds: TIME_WAIT is fine
        try:
            probe.bind((config.host, config.port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return (f"cannot bind {config.address}: the port is in use by {port_holders(config.port)}: stop "
                        "it, or give the aggregator and the ranks another NIXL_TELEMETRY_PROMETHEUS_PORT")
            return f"cannot bind {config.address}: {os.strerror(exc.errno or 0)}"
    return None


def release_election() -> None:
    if master.election is not None and master.pid == os.getpid():
        master.election.release()


def worker_forked() -> None:
    """In a gunicorn worker: drop the inherited election descriptor, never unlocking it.

    And die with the master: gunicorn's workers only notice a dead master
    about a second later, and until they exit they keep listening on the
    address, so the rank that wins the released election could not bind it
    and would back off for seconds.
    """
    if master.election is not None and master.pid != os.getpid():
        master.election.forget()
        die_with_parent(master.pid)


