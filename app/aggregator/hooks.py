"""The aggregator's election: what gunicorn's hooks (app/gunicorn_conf.py) and ``python -m app serve`` run.

The gunicorn master holds the address's owner election for as long as it
runs, exactly as an in-process owner would: the ranks of the pod stay quiet
writers, and if the aggregator dies the kernel drops its lock and a rank
takes the address over in-process.  Workers only serve (app.aggregator.wsgi).
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import time

from app.config import Config
from app.probe import die_with_parent, get_healthz, lock_holder_pid, port_holders
from election import Outcome, OwnerElection, lock_file_name

log = logging.getLogger("nixl_prometheus_mp.standalone")


class _MasterState:
    """Set in the process that holds the election; inherited by forked workers."""

    election: OwnerElection | None = None
    pid: int | None = None
    since: float | None = None


master = _MasterState()
_WAIT_S = 0.2  # how often a waiting aggregator retries the election (as often as a rank's writers do)


def hold_election(config: Config) -> Outcome:
    """Block until this process owns ``config.address`` (or the lock is unusable).

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
        time.sleep(_WAIT_S)
    master.election, master.pid, master.since = election, os.getpid(), time.time()
    return outcome


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


