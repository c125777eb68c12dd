"""The address server's program, and its spare's: one server per scrape address, serving what the directory
publishes, and one spare waiting to replace it.

The rank that wins an address's election starts the server (app.launch) and hands it the election's
lock and the bound listener, then keeps no copy of either: from then on this process alone holds the address.
It belongs to the job, not to the rank that started it:

* **It publishes what any owner publishes, for as long as that lasts**: every live store, and every departed
  one until its TTL after its last update.  A rank's death or close() changes nothing here.
* **It exits only when nothing is left to publish**: no store live, none within its TTL.  Then its spare goes,
  the port is closed and the lock released, in that order (whoever wins the lock next must find the port
  free).  While nobody scrapes it looks at the directory only when something can have ended: every CHECK_S
  while a store is live (a live writer may depart at any moment; its values then stay for the TTL anyway),
  and at the instant the last departed store's TTL runs out otherwise.  No polling in between.
* **It guards its own succession with a spare**: a process of ours, started like the server, that holds a copy
  of the listener and blocks in ``flock(LOCK_EX)`` on a description of its own of the lock file.  The
  server's death (a crash, an OOM kill, an operator's kill) hands the lock to the spare, which serves the
  same socket at once (connections waiting in the backlog are answered, none refused), then starts its own
  spare.  A server the kernel reports stopped (state T: SIGSTOP, a debugger) is killed by its spare, which
  then takes over the same way.  A slow server is never replaced: nothing but the kernel decides that a
  process is gone.  The server starts a new spare whenever its spare dies.
* **It gives the port up to a new run** of another directory (SIGUSR1 from that run's rank, which found the
  port held): at once if nothing here is live, else it keeps it and the newcomer warns naming this process.
  Of its own directory removed and recreated, it gives the port up to the rank elected on the new lock file,
  when that rank asks, and only then.
* **Its logs** go to a bounded file in the directory (app.address.confine), from the start, which /healthz names.  Never
  to a terminal: its stdout is its starter's status pipe (then /dev/null), its stderr /dev/null.

Signals: SIGTERM means finish, then go: with no rank live, it goes on publishing the departed ranks' final
values (new connections included) until their TTL, at most ``drain_max_s``, and /healthz says until when; with a
rank live, it gives the address up at once (the job's ranks take it over).  A second SIGTERM, SIGINT or SIGQUIT
ends it at once.  SIGUSR1 asks it to yield the port; the terminal's other signals are ignored (its session is
its own: they can only come from someone who means the job).  Handlers only write to the wake pipe: one loop
(``_Server.run``) decides everything, as gunicorn's arbiter does.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import logging.handlers
import os
import select
import signal
import socket
import time
from typing import Any

from app.address.confine import LogFile, drop_capabilities, log_path, log_to_file
from app.collector import Collection, Collector, drain_s
from app.config import DRAIN_ENV
from app.health import (
    OwnerWatch,
    draining_warning,
    health_warnings,
    owner_doc,
    pid_namespace_warning,
    replaced_warning,
)
from app.launch import ERROR, READY, WARNING, ServerArgs, Started, StartFailed, launch
from app.malloc import give_large_frees_back
from app.probe import SERVER_COMM, SPARE_COMM, is_address_server, process_state
from app.server import serve_in_thread
from app.threads import new_thread, set_os_name
from app.web import MetricsApp
from election import OwnerElection

log = logging.getLogger("nixl_prometheus_mp")

CHECK_S = 10.0  # while a store is live: how often the directory is looked at (at most the TTL, at least MIN_CHECK_S)
MIN_CHECK_S = 1.0
KILL_WAIT_S = 2.0  # how long an exiting server lets the answers being written finish
STOP_LOOK_S = 1.0  # how often a spare asks the kernel whether its server is stopped (the server's death wakes it)
SPARE_RETRY_MIN_S, SPARE_RETRY_MAX_S = 0.5, 30.0  # between starts of a spare that keeps failing to start
_SPARE_EXIT_WAIT_S = 5.0  # an exiting server waits this long for its spare's end (SIGKILLed: milliseconds)
_TERMINAL_SIGNALS = (signal.SIGHUP, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU)
_SCARCE = frozenset({errno.EAGAIN, errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
_STATUS_FD = 1  # the starter's status pipe, until this process serves (or, a spare, waits)


def next_check_s(collection: Collection, ttl_s: float) -> float | None:
    """How long until the directory can next have changed what is published; None: nothing is left.

    Only a live writer's departure, or a departed store's TTL, ends a store's publication; a new store only
    prolongs it, so it need not be seen any sooner.
    """
    if collection.live:
        return max(MIN_CHECK_S, min(CHECK_S, ttl_s))
    pending = [view.reap_in_s for view in collection.stale if view.reap_in_s is not None and view.reap_in_s > 0]
    return max(pending, default=None)


def main(state_json: str) -> None:
    """The program (the bootstrap forked already: this process is nobody's child in the host); never returns."""
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    for signum in _TERMINAL_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT):
        # Until the server's loop handles them (a spare, all its life): end at once, quietly (not Python's
        # KeyboardInterrupt, nor SIGQUIT's core dump); a host's SIG_IGN, which exec keeps, is undone.
        signal.signal(signum, lambda signum, frame: os._exit(0))
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # a host may have ignored it: exec keeps SIG_IGN
    give_large_frees_back()
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)  # (stdin was the bootstrap)
    os.close(null)
    try:
        state = json.loads(state_json)
        args = ServerArgs.from_json(state["args"])
        spare = state["role"] == "spare"
        set_os_name(SPARE_COMM if spare else SERVER_COMM)
        nowhere = log_to_file(args)
        if nowhere is not None:
            _tell_starter(WARNING + nowhere)
        contained = pid_namespace_warning()
        for problem in (drop_capabilities(args.directory), None if contained is None else str(contained["message"])):
            if problem is not None:
                log.warning("%s", problem)
                if not spare:  # (the server it replaces said it already)
                    _tell_starter(WARNING + problem)
        listener = socket.socket(fileno=state["listener_fd"])
        lock_fd = state["lock_fd"]
        if spare:
            _wait_for_the_lock(lock_fd, int(state["server_pid"]), args.address)
            set_os_name(SERVER_COMM)
            args = ServerArgs.from_json({**args.to_json(), "serving_since": time.time()})
        server = _Server(args, listener, lock_fd, tell_starter=not spare)
    except BaseException as exc:
        log.error("the address server of %s could not start", state_json[:200], exc_info=True)
        _tell_starter(ERROR + f"{type(exc).__name__}: {exc}".replace("\n", " ")[:4000])
        os._exit(75 if _is_scarce(exc) else 1)  # (EX_TEMPFAIL: the starter may try again later)
    os._exit(server.run())


def _is_scarce(exc: BaseException) -> bool:
    """A shortage of the system (a process, a thread, a descriptor, memory), which may pass."""
    return (isinstance(exc, MemoryError) or (isinstance(exc, OSError) and exc.errno in _SCARCE)
            or (isinstance(exc, RuntimeError) and "thread" in str(exc)))


def _tell_starter(line: str) -> None:
    """One status line to whoever started us (never blocking: a starter that is gone reads nothing)."""
    with contextlib.suppress(OSError):
        os.set_blocking(_STATUS_FD, False)
        os.write(_STATUS_FD, line.encode(errors="replace") + b"\n")


def _done_telling_starter() -> None:
    """The status pipe's end of file: the starter stops listening, and holds no descriptor of ours any more."""
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, _STATUS_FD)
    os.close(null)


# -- the spare -------------------------------------------------------------------------------------------------

def _wait_for_the_lock(lock_fd: int, server_pid: int, address: str) -> None:
    """(The spare) Return holding the lock: the kernel hands it over as the server's last descriptor of it
    closes, however the server went.  A server the kernel reports stopped is killed first."""
    try:
        pidfd = os.pidfd_open(server_pid)
    except OSError:
        pidfd = -1  # gone already: the lock is free, or whoever holds it now is waited for like the server
    if pidfd >= 0 and not is_address_server(server_pid, address):
        os.close(pidfd)  # (the pid is another process's by now: the server is gone)
        pidfd = -1
    _tell_starter(READY + str(os.getpid()))
    _done_telling_starter()
    if pidfd >= 0:
        new_thread(_replace_if_stopped, "nixl-spare-watch", "nixl-watch", (pidfd, server_pid, address)).start()
    fcntl.flock(lock_fd, fcntl.LOCK_EX)  # no GIL, no CPU: the kernel wakes us
    log.warning("the address server of %s (pid %d) is gone; its spare (pid %d) serves the address now",
                address, server_pid, os.getpid())


def _replace_if_stopped(pidfd: int, server_pid: int, address: str) -> None:
    """(The spare's watch thread) Until the server is gone: if the kernel says it is stopped, kill it.

    A stopped server holds the lock and the port and answers nobody (SIGSTOP, a debugger).  A slow one is
    never killed: only its state, which the kernel keeps, is looked at.
    """
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    while not poller.poll(int(STOP_LOOK_S * 1000)):
        if process_state(server_pid) in ("T", "t"):
            log.warning("the address server of %s (pid %d) is stopped (SIGSTOP, or a debugger); its spare kills "
                        "it and serves the address", address, server_pid)
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)  # a pidfd never names a reused pid
            break
    os.close(pidfd)


# -- the server ------------------------------------------------------------------------------------------------

class _Spare:
    """The server's spare, from its launch until its end."""

    def __init__(self, started: Started) -> None:
        self.started = started
        self.pid: int | None = None
        self.pidfd = -1
        self.said: str | None = None  # why it failed, if it said so

    def close(self) -> None:
        self.started.close()
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


class _Server:
    def __init__(self, args: ServerArgs, listener: socket.socket, lock_fd: int | None, tell_starter: bool) -> None:
        self.args = args
        self.listener = listener
        self.log_file = log_path(args.directory, args.address)
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._signals: set[int] = set()
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGUSR1):
            signal.signal(signum, self._on_signal)
        self._drain_until: float | None = None  # (CLOCK_MONOTONIC) after a SIGTERM: when to go
        self._drain_until_wall: float | None = None  # ... the same, for /healthz
        election = self.election = OwnerElection(args.directory, args.address, problem=args.problem)
        if lock_fd is not None:
            election.adopt(lock_fd)  # (no unlock and relock: the lock stays held throughout)
        owners = OwnerWatch(args.directory, args.address)
        self.collector = Collector(args.directory, args.stale_ttl_s)
        logs_nowhere = not any(isinstance(h, LogFile) for h in logging.getLogger("nixl_prometheus_mp").handlers)

        def owner() -> dict[str, Any]:
            return owner_doc(pid=os.getpid(), agent_name=args.agent_name, address=args.address, mode="in-process",
                             flock=args.problem is None, since=args.serving_since, server_pid=os.getpid(),
                             serving="helper", started_by=args.started_by,
                             log_file=None if logs_nowhere else str(self.log_file))

        contained = [warning] if (warning := pid_namespace_warning()) is not None else []

        def warnings() -> list[Any]:
            replaced = [] if args.replaced_at is None else [replaced_warning(args.directory, args.replaced_at)]
            until = self._drain_until_wall
            return (replaced + ([] if until is None else [draining_warning(until)]) + contained
                    + health_warnings(owners, election))

        self.app = MetricsApp(self.collector, owner, warnings, on_scrape=owners.poll,
                              draining=lambda: self._drain_until is not None)
        self.server, self.thread = serve_in_thread(listener, self.app, f"nixl-server-{args.address}")
        if tell_starter:
            _tell_starter(READY + str(os.getpid()))
            _done_telling_starter()
        self._spare: _Spare | None = None
        self._spare_failures = 0
        self._spare_at = time.monotonic()  # no new spare before this (CLOCK_MONOTONIC)

    def _on_signal(self, signum: int, frame: Any) -> None:
        # Only queue it: the loop decides (a handler may interrupt anything, the serving threads' locks included).
        self._signals.add(signum)
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"!")

    def run(self) -> int:
        why = self._loop()
        log.info("giving %s up: %s", self.args.address, why)
        # The spare first (it holds a copy of the listener, and would take the lock up), then the port, then
        # the lock: whoever wins the lock next must find the port free.  Then the answers being written finish
        # (bounded) before the process exits.
        self._end_spare()
        self.server.abandon()
        self.listener.close()
        self.election.release()
        deadline = time.monotonic() + KILL_WAIT_S
        while self.server.busy() and time.monotonic() < deadline:
            time.sleep(0.005)
        logging.shutdown()
        return 0 if why is not None else 1

    def _loop(self) -> str | None:
        """Serve until nothing is left to publish (why, for the log), or the serving thread died (None)."""
        check_at = time.monotonic()
        lost_since: float | None = None  # the directory has been out of sight since then
        while True:
            now = time.monotonic()
            if self._drain_until is not None and now >= self._drain_until:
                return "told to stop (SIGTERM), once the departed ranks' final values were published"
            if now >= check_at:
                collection = self.collector.census()
                left_s = None if collection.scan_error is not None else next_check_s(collection, self.args.stale_ttl_s)
                # A lock file at our path that is not ours does not make us leave: a rank of a new run elected on
                # it asks for the port (SIGUSR1, below) once its store is there to publish; another process may
                # have made it and let it go (a C++ rank re-electing as it exports) and asks nothing.
                lost = collection.scan_error or ("the directory was removed and recreated"
                                                 if self.election.lock_file_replaced() else None)
                if left_s is None and lost is not None:
                    # Out of sight: unlistable (removed, its permissions changed; /healthz says so with a 503), or
                    # recreated and nothing in it yet.  The ranks may still live: each recreates its store at its
                    # next export, which a check between the two would miss.  Nothing comes back after the TTL.
                    if lost_since is None and collection.scan_error is None:  # (unlistable: /healthz's 503 says so)
                        log.warning("%s was removed and recreated: its ranks are missing from /metrics until they "
                                    "record again; %s is kept for them for the TTL (%g s), then given up",
                                    self.args.directory, self.args.address, self.args.stale_ttl_s)
                    lost_since = now if lost_since is None else lost_since
                    if now - lost_since >= self.args.stale_ttl_s:
                        return f"{lost} for the TTL"
                    check_at = now + MIN_CHECK_S
                elif left_s is None:
                    return "no rank is live and every departed rank's TTL has passed"
                else:
                    lost_since = None
                    check_at = now + left_s
            if self._spare is None and self.election.held and now >= self._spare_at:
                self._start_spare()
            poller = select.poll()
            poller.register(self._wake_r, select.POLLIN)
            wake_at = check_at if self._spare is not None or not self.election.held else min(check_at, self._spare_at)
            if self._drain_until is not None:
                wake_at = min(wake_at, self._drain_until)
            if self._spare is not None:
                if self._spare.started.status_fd >= 0:
                    poller.register(self._spare.started.status_fd, select.POLLIN)
                if self._spare.pidfd >= 0:
                    poller.register(self._spare.pidfd, select.POLLIN)
                if self._spare.started.launcher is not None:
                    wake_at = min(wake_at, now + 0.05)  # (it exits within milliseconds: reaped at the next turn)
            watched = (-1, -1) if self._spare is None else (self._spare.started.status_fd, self._spare.pidfd)
            events = dict(poller.poll(int(max(0.0, wake_at - time.monotonic()) * 1000) + 1))
            if self._spare is not None:
                # (by the numbers polled: one closed meanwhile may be reused before this looks at them)
                self._look_at_spare({fd for fd in watched if fd >= 0 and fd in events})
            if self._wake_r in events:
                with contextlib.suppress(OSError):
                    os.read(self._wake_r, 4096)
                signals, self._signals = self._signals, set()
                if signals & {signal.SIGINT, signal.SIGQUIT}:
                    return "SIGINT or SIGQUIT"
                if signal.SIGTERM in signals:
                    if self._drain_until is not None:
                        return "a second SIGTERM"
                    left_s = drain_s(self.collector.census(), self.args.drain_max_s)
                    if left_s is None:
                        return "SIGTERM"
                    self._drain_until, self._drain_until_wall = now + left_s, time.time() + left_s
                    log.info("SIGTERM: no rank of %s is live; %s goes on publishing their final values for %.1f s "
                             "(until their TTL, at most %s=%g s), then exits; a second SIGTERM ends it at once",
                             self.args.directory, self.args.address, left_s, DRAIN_ENV, self.args.drain_max_s)
                if signal.SIGUSR1 in signals:
                    collection = self.collector.census()
                    if self._replaced():
                        return "the directory was removed and recreated, and a rank of the new one asks for the port"
                    if collection.scan_error is None and not collection.live:
                        return "a rank of another run asks for the port, and no rank is live here"
                    log.info("a rank of another run asks for %s, but %d rank(s) of %s are live: keeping it",
                             self.args.address, len(collection.live), self.args.directory)
            if not self.thread.is_alive():
                log.error("the serving thread of %s ended; exiting so that the spare takes the address over",
                          self.args.address)
                return None

    def _replaced(self) -> bool:
        """The lock file at our path is another one than ours: a new directory took the old one's place."""
        return self.election.path.exists() and self.election.lock_file_replaced()

    # -- the spare -------------------------------------------------------------------------------------------

    def _start_spare(self) -> None:
        """Launch a spare on a description of the lock file of its own (ours would share our lock with it)."""
        lock_fd = self.election.descriptor
        assert lock_fd is not None
        spare_lock = -1
        try:
            spare_lock = os.open(f"/proc/self/fd/{lock_fd}", os.O_RDWR | os.O_CLOEXEC | os.O_NOCTTY)
            started = launch("spare", self.args, self.listener.fileno(), spare_lock, {"server_pid": os.getpid()})
        except (OSError, StartFailed) as exc:
            self._spare_failed(str(exc))
            return
        finally:
            if spare_lock >= 0:
                os.close(spare_lock)
        self._spare = _Spare(started)

    def _look_at_spare(self, ready: set[int]) -> None:
        """The spare's descriptors that the last poll found ready: its status, its pidfd."""
        spare = self._spare
        assert spare is not None
        spare.started.reap()
        if spare.started.status_fd in ready and _read_status(spare):
            self._spare = None
            spare.close()
            self._spare_failed(f"it exited before it was ready ({spare.said or 'killed?'})")
        elif spare.pidfd >= 0 and spare.pidfd in ready:
            log.warning("the spare of the address server of %s (pid %s) is gone; starting another",
                        self.args.address, spare.pid)
            self._spare = None
            spare.close()
        elif spare.pid is not None:
            self._spare_failures = 0

    def _spare_failed(self, words: str) -> None:
        self._spare_failures += 1
        pause_s = min(SPARE_RETRY_MIN_S * 2 ** (self._spare_failures - 1), SPARE_RETRY_MAX_S)
        self._spare_at = time.monotonic() + pause_s
        log.warning("the spare of the address server of %s cannot be started (%s); trying again in %.1f s. Until "
                    "one runs, this server's death leaves the address to the next rank that records",
                    self.args.address, words, pause_s)

    def _end_spare(self) -> None:
        """Kill the spare and wait (bounded) for its end: it holds a copy of the listener."""
        spare, self._spare = self._spare, None
        if spare is None:
            return
        deadline = time.monotonic() + _SPARE_EXIT_WAIT_S
        poller = select.poll()
        if spare.pid is None and spare.started.status_fd >= 0:  # still starting: its pid comes first
            poller.register(spare.started.status_fd, select.POLLIN)
            while time.monotonic() < deadline and poller.poll(int((deadline - time.monotonic()) * 1000) + 1):
                if _read_status(spare) or spare.pid is not None:
                    break
        if spare.pidfd >= 0:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(spare.pidfd, signal.SIGKILL)
            poller = select.poll()
            poller.register(spare.pidfd, select.POLLIN)
            poller.poll(int(max(0.0, deadline - time.monotonic()) * 1000) + 1)
        spare.started.reap()
        spare.close()


def _read_status(spare: _Spare) -> bool:
    """Read what the spare said (its pid, once it waits for the lock); whether it ended without being ready."""
    lines, ended = spare.started.read_status()
    for line in lines:
        if line.startswith(READY) and spare.pid is None:
            with contextlib.suppress(OSError, ValueError):
                spare.pidfd = os.pidfd_open(int(line[1:]))
                spare.pid = int(line[1:])
        elif line.startswith(ERROR):
            spare.said = line[1:]
    return ended and spare.pid is None
