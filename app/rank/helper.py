"""The serving helper program: a rank's process serving its address, started by the rank's supervisor.

app.rank.supervisor says why a helper exists, how it is started and watched.  Its command line is
``python [the rank's flags] -c BOOTSTRAP serving-helper --for-pid PID`` and says no more; its stdin is its
end of the channel (app.rank.channel), from which it reads everything else.  It serves the same collector
and WSGI app as any owner and imports nothing of the rank's own code (the Exporter, the endpoint, the
supervisor): only the serving core and app.health.

Its life, in order (``main``):

1. A clean slate: no blocked signal (a host may block SIGTERM to ``sigwait`` on it), the host's ignored
   SIGTERM and SIGCHLD back to their defaults, the terminal's signals ignored (they are for the rank).
2. Every module it serves with is imported, then it forks: the parent (the launcher, the rank's child) only
   waits until the child is ready, or dead, and exits with what became of it (0: ready; the child's status;
   128 + N: killed by signal N).  So the rank learns how a helper that failed to start ended, and reaps the
   launcher; the helper itself is nobody's child in the host once the launcher is gone (init, or the
   nearest subreaper, reaps it): a host that waits for all its children never waits for it.
3. It opens a pidfd of its rank, says so (``W`` and its pid), and only then receives the listener and the
   lock (SCM_RIGHTS) with the state: a rank that dies while its helper starts (an interpreter's start) has
   given it nothing, and its standbys take the address over at once.
4. It serves, says ``R``, and watches: its rank's pidfd, the channel (pings, LEAVE, QUIT, or the end of
   file when the rank execs or dies), its serving thread.  Once its rank is gone it serves on for departed
   ranks (app.rank.linger) or goes.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.rank.channel import (
    ERROR,
    LEAVE,
    MAX_MESSAGE,
    PING,
    PONG,
    QUIT,
    READY,
    STATE,
    TRANSIENT_EXIT,
    WATCHING,
    ChannelHandler,
)

if TYPE_CHECKING:
    from app.rank.linger import Linger

log = logging.getLogger("nixl_prometheus_mp.helper")

WATCH_S = 1.0  # how often the helper checks its serving thread (and the supervisor lets the endpoint check)
KILL_WAIT_S = 2.0  # how long a helper that goes waits for the answers being written
_PONG_RETRY_S = 0.05  # an answer to a ping that found the channel full is sent again this soon
# The terminal's signals, which are for the rank: the helper is in a session of its own, so a terminal does not
# send them to it, and it ignores them in case someone sends them to its process group by hand.
_TERMINAL_SIGNALS = (signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU)
_DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGCHLD)  # a host may have ignored them: exec keeps SIG_IGN
_SCARCE = frozenset({errno.EAGAIN, errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})


@dataclass(frozen=True)
class HelperArgs:
    """Everything a helper is told with its descriptors (the ``S`` message), besides their contents."""

    for_pid: int  # the rank: the helper serves until it exits
    address: str
    directory: Path
    has_lock: bool  # False: the election fell back to the bind (no usable lock); only the listener is sent
    problem: str | None  # why the lock is unusable, for /healthz
    agent_name: str | None
    stale_ttl_s: float
    serving_since: float | None
    replaced_at: float | None  # when the rank found its directory replaced, for /healthz
    log_level: int

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["directory"] = str(self.directory)
        return doc

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> HelperArgs:
        return cls(**{**doc, "directory": Path(doc["directory"])})


def exit_code(exc: BaseException) -> int:
    """The exit status of a helper that failed with ``exc``: TRANSIENT_EXIT for a shortage of the system."""
    if isinstance(exc, MemoryError) or (isinstance(exc, OSError) and exc.errno in _SCARCE):
        return TRANSIENT_EXIT
    if isinstance(exc, RuntimeError) and "thread" in str(exc):  # "can't start new thread": RLIMIT_NPROC
        return TRANSIENT_EXIT
    return 1


def _fail(channel: socket.socket, exc: BaseException) -> int:
    """Say why we fail (best effort, never blocking) and return the exit status."""
    try:
        channel.send(ERROR + f"{type(exc).__name__}: {exc}".encode(errors="replace")[:4000], socket.MSG_DONTWAIT)
    except OSError:
        pass
    return exit_code(exc)


def main() -> None:
    """The helper's program (see the module's doc); never returns."""
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    for signum in _TERMINAL_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    for signum in _DEFAULT_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)
    for_pid = int(sys.argv[sys.argv.index("--for-pid") + 1])
    channel = socket.socket(fileno=0)
    try:
        serving = _import_serving()
        ready_r, ready_w = os.pipe()
        child = os.fork()
    except BaseException as exc:
        os._exit(_fail(channel, exc))
    if child:
        os.close(ready_w)
        channel.detach()
        os.close(0)  # the channel is the helper's alone now: its end of file is the helper's death
        os._exit(_launch(child, ready_r))
    os.close(ready_r)
    os._exit(_run(for_pid, channel, ready_w, serving))


def _launch(child: int, ready_r: int) -> int:
    """(The launcher) until the helper is ready (0) or dead (its status, 128 + N if killed by signal N)."""
    try:
        pidfd = os.pidfd_open(child)  # (in the launcher: 0-2 are open here)
        poller = select.poll()
        poller.register(ready_r, select.POLLIN)
        poller.register(pidfd, select.POLLIN)
        while True:
            events = dict(poller.poll())
            if ready_r in events and os.read(ready_r, 1) == READY:
                return 0
            if pidfd in events or ready_r in events:
                break
    except OSError:
        pass
    _, status = os.waitpid(child, 0)
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def _run(for_pid: int, channel: socket.socket, ready_w: int, serving: Any) -> int:
    """(The helper) watch the rank, receive the descriptors, serve, watch; returns the exit status."""
    try:
        rank = os.pidfd_open(for_pid)
    except ProcessLookupError:
        return 0  # the rank is gone already: nothing was given to us
    except OSError as exc:
        return _fail(channel, exc)
    try:
        channel.send(WATCHING + str(os.getpid()).encode())
        data, fds, flags, _ = socket.recv_fds(channel, MAX_MESSAGE, 2)
    except OSError as exc:
        return _fail(channel, exc)
    if not data.startswith(STATE):
        return 0  # end of file: the rank is gone, or stopped us, before it gave us anything
    if flags & socket.MSG_CTRUNC:  # no descriptor free for what it sent
        return _fail(channel, OSError(errno.EMFILE, os.strerror(errno.EMFILE)))
    args = HelperArgs.from_json(json.loads(data[1:]))
    listener = socket.socket(fileno=fds[0])
    lock_fd = fds[1] if args.has_lock and len(fds) > 1 else None
    helper_log = logging.getLogger("nixl_prometheus_mp")
    helper_log.addHandler(ChannelHandler(channel, f"serving helper (pid {os.getpid()}): "))
    helper_log.setLevel(args.log_level)
    helper_log.propagate = False
    try:
        server, thread, linger = _serve(serving, args, listener, lock_fd)
    except BaseException as exc:
        return _fail(channel, exc)
    with contextlib.suppress(OSError):  # EPIPE: the rank exited as we started; _watch sees it gone, we linger
        channel.send(READY)
    os.write(ready_w, READY)  # the launcher exits: from now on the helper is nobody's child in the host
    os.close(ready_w)
    leaving = _watch(rank, channel, thread)
    if leaving is None:
        return 1
    # The rank is gone, or leaves the address to us.  With no live writer left, nobody else would serve the
    # departed stores: serve on for their last values (app.rank.linger), unless the election fell back to the
    # bind (no lock: a new rank would take a held port for a foreign service and back off for seconds).
    if leaving and lock_fd is not None:
        why = linger.run()
        log.info("%s: %s", "no longer serving the departed ranks" if linger.since is not None else
                 "the rank is gone; leaving the address", why)
    # Without any clean-up that could be slow.  The port first: the lock's release (as we exit) wakes a standby
    # at once, which must find it free; then the answers being written (the one that served the last values).
    server.abandon()
    listener.close()
    deadline = time.monotonic() + KILL_WAIT_S
    while server.busy() and time.monotonic() < deadline:
        time.sleep(0.005)
    return 0


def _watch(rank: int, channel: socket.socket, thread: threading.Thread) -> bool | None:
    """Until the rank is gone or says otherwise: True to linger (gone, left), False to quit, None on failure."""
    poller = select.poll()
    poller.register(rank, select.POLLIN)
    poller.register(channel.fileno(), select.POLLIN)
    pong_owed = False
    while True:
        events = dict(poller.poll(int((_PONG_RETRY_S if pong_owed else WATCH_S) * 1000)))
        if rank in events:
            return True
        if channel.fileno() in events:
            try:
                message = channel.recv(MAX_MESSAGE)
            except OSError:
                message = b""
            if not message or message == LEAVE:  # end of file: the rank died or exec'd another program
                return True
            if message == QUIT:
                return False
            pong_owed = pong_owed or message == PING
        if pong_owed:
            try:
                channel.send(PONG, socket.MSG_DONTWAIT)
                pong_owed = False
            except BlockingIOError:
                pass  # full of log records the rank has not read yet: again in a moment
            except OSError:
                return True
        if not thread.is_alive():
            log.error("the serving thread ended; exiting so that the rank starts a new helper")
            return None


def _import_serving() -> Any:
    """Everything the helper serves with, imported before the launcher forks: a failure is its exit status."""
    import app.collector
    import app.health
    import app.rank.linger
    import app.server
    import app.web
    import election
    import election.standby

    return (app.collector, app.health, app.rank.linger, app.server, app.web, election, election.standby)


def _serve(serving: Any, args: HelperArgs, listener: socket.socket,
           lock_fd: int | None) -> tuple[Any, threading.Thread, Linger]:
    collector, health, linger_mod, server_mod, web, election, standby = serving
    owner_election = election.OwnerElection(args.directory, args.address, problem=args.problem)
    # The rank logs duplicate owners, from its supervisor's watch.
    owners = health.OwnerWatch(args.directory, args.address, logs=False)
    linger = linger_mod.Linger(args.directory, args.stale_ttl_s,
                               waiting=lambda: [] if lock_fd is None else standby.waiting_pids(lock_fd))

    def owner() -> dict[str, Any]:
        return health.owner_doc(pid=args.for_pid, agent_name=args.agent_name, address=args.address,
                                mode="in-process", flock=args.problem is None, since=args.serving_since,
                                server_pid=os.getpid(), serving="helper", lingering=linger.doc())

    def warnings() -> list[Any]:
        replaced = [] if args.replaced_at is None else [health.replaced_warning(args.directory, args.replaced_at)]
        return replaced + health.health_warnings(owners, owner_election)

    metrics_app = web.MetricsApp(collector.Collector(args.directory, args.stale_ttl_s), owner, warnings)
    metrics_app.on_served = linger.served
    server, thread = server_mod.serve_in_thread(listener, metrics_app, f"nixl-helper-{args.address}")
    return server, thread, linger
