"""A rank's claim on its scrape address: a non-blocking election on the recording path, and nothing else.

The address belongs to the job, not to a rank.  A rank runs the election (``flock(LOCK_EX|LOCK_NB)``) when its
Exporter is created and then at most every RETRY_NS as it records, as the C++ plug-in's ranks do.  The rank that
wins binds the port, starts the address server (app.launch) handing it the lock and the listener, and
closes its own copies: from then on the server, and its spare after it, hold the address; the rank goes on
recording and never waits for the start.  The server says on a pipe whether it serves, which the rank reads,
without waiting, at its next claims; a start that fails is said once with its cause and retried with a growing
back-off.  A rank's death or close() never moves the address.  If the server and its spare are both gone (or
a C++ owner died), the next rank to record wins the election and starts another.

With ``NIXL_PROMETHEUS_MP_SERVE=thread`` (or where no address server can run) the rank that wins serves from a
thread of its own, as the C++ plug-in does: it holds the lock and the listener until it closes or dies.

No thread, no signal handler, no timed wait of ours runs in a rank (thread mode's server aside).  Two things
need a fork hook (app.rank.exporter registers the one hook): fork() waits while a claim holds what a child must
never share (a won lock's description, the listener, for the moment of a hand-over: ``fork_lock``), and a
child closes what thread mode holds.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.health import WarningDoc, owner_doc, replaced_warning
from app.launch import ERROR, READY, WARNING, ServerArgs, Started, StartFailed, launch, unusable
from app.listener import bind_listener
from app.probe import holds_file, is_address_server, listening_pids, signal_address_server
from app.rank.claims import NEVER, RETRY_NS, Claim, ClaimLog, TakeOver
from election import Outcome, OwnerElection
from election.lock import SCARCE
from store.warnonce import OnceWarner

if TYPE_CHECKING:
    from app.server import BoundedServer
    from app.web import MetricsApp

log = logging.getLogger("nixl_prometheus_mp.endpoint")
_warner = OnceWarner(log)

WATCH_NS = 1_000_000_000  # a serving thread-mode rank checks that its lock file is still the directory's every 1 s
ASK_AGAIN_NS = 5_000_000_000  # another run's server that kept the port is asked again after this long
YIELD_WAIT_S = 1.0  # the constructor's wait for the port that server gives up
START_BACKOFF_MIN_S, START_BACKOFF_MAX_S = 0.05, 5.0  # between starts of a server that keeps failing to start

# Held by a claim from its win until the lock and the listener are the server's alone (or the rank's own
# thread serves them), and by fork() (app.rank.exporter's hook): a child never holds a copy of either.
# Reentrant: a host's signal handler may fork from the very thread that holds it.
fork_lock = threading.RLock()


@dataclass(frozen=True)
class ServerSpec:
    """What an address server must know of the rank that starts it, besides the descriptors."""

    directory: Path
    stale_ttl_s: float
    drain_max_s: float
    address: str
    agent_name: str | None


class _PortStillHeld(Exception):
    """Won the election the instant its last holder lost it, before the port followed: our server's spare
    (which serves the port, and wins the lock as soon as we give it back), or the last of our processes that
    held the port, still ending (a server and its spare killed together: the server's lock goes a few
    milliseconds before the spare's copy of the port).  Given back and tried again soon, without a word."""


class ScrapeEndpoint:
    """This process's claim on one scrape address.

    ``_lock`` (one claim at a time) is reentrant because close() may run in a signal handler that interrupted
    this very thread inside claim(): close() then only marks the endpoint closed, and the claim undoes what
    it made as it returns.
    """

    def __init__(self, election: OwnerElection, host: str, port: int, make_app: Callable[[], MetricsApp],
                 spec: ServerSpec | None, on_watch: Callable[[], None],
                 has_store: Callable[[], bool] = lambda: True) -> None:
        self.election, self.host, self.port = election, host, port
        # Whether this rank's store is on disk: one whose directory was replaced has none until it records again,
        # and a server started for a directory with nothing to publish would exit at once (and again, and again).
        self._has_store = has_store
        # None: thread mode (asked for, or no address server can run here: said once, when it matters).
        self.spec = spec
        self._no_server = None if spec is None else unusable()
        # Thread mode's server and app, loaded now where this rank may serve from a thread (a takeover would pay
        # werkzeug's import, ~100 ms), and nowhere else: a rank that starts address servers loads no HTTP server.
        self.app: MetricsApp | None = None
        if spec is None or self._no_server is not None:
            import app.server  # noqa: F401

            self.app = make_app()
        self._on_watch = on_watch
        self._lock = threading.RLock()
        self._closed = False
        self._log = ClaimLog(election, port)
        self._starting: Started | None = None  # the server this rank started, until it said whether it serves
        self._server_pid: int | None = None  # ... once it said it serves
        self._failures = 0  # starts in a row whose server ended before it was ready
        self._retry_at_ns = 0  # (CLOCK_MONOTONIC) no start before this
        self._asked_at_ns: int | None = None  # when another run's server was last asked to yield the port
        self._unheld = False  # the last won election found the port held by no process this one can see
        self._server: BoundedServer | None = None  # thread mode: our server and listener
        self._listener: socket.socket | None = None
        self._socket_ids: list[tuple[int, int]] = []  # thread mode: (descriptor, inode) of both listening sockets
        self.serving_since: float | None = None
        self.replaced_at: float | None = None

    @property
    def address(self) -> str:
        return self.election.address

    @property
    def serving(self) -> bool:
        """This process serves the address: from its thread, or through the server it started, from the
        instant it handed the address over (connections wait in the backlog) for as long as that server lives."""
        if self._closed:
            return False
        if self._listener is not None:
            return True
        pid = self._server_pid
        if pid is not None:
            return is_address_server(pid, self.address)
        return self._starting is not None and self._starting.status_fd >= 0

    def claim(self, now_ns: int | None = None, constructing: bool = False) -> int:
        """Run the election (and take the address over if won); returns when to try again (ns).

        While serving from a thread, check that the lock file we hold is still the directory's (see watch()).
        Never waits (but ``constructing``: see _bind and _start_server), and never raises for the environment: a failure
        to serve is conceded and retried later.
        """
        now_ns = time.monotonic_ns() if now_ns is None else now_ns
        if not self._lock.acquire(blocking=False):
            return now_ns + RETRY_NS  # another thread of ours is claiming right now
        try:
            if self._closed:
                return NEVER
            if self._starting is not None:
                self._hear_from_server()
            if self._listener is not None:
                self._check_lock_file()
                return now_ns + WATCH_NS
            if now_ns < self._retry_at_ns:
                return self._retry_at_ns  # a start failed: the export path never waits out its back-off
            with fork_lock:
                if self.election.try_win() is Outcome.LOST:
                    shortage = self.election.shortage
                    outcome = TakeOver(Claim.SHORT, reason=shortage) if shortage else TakeOver(Claim.LOST)
                else:
                    outcome = self._take_over(now_ns, constructing)
            if self._closed:  # close() ran in a signal handler meanwhile: undo what is ours (a server stays)
                self._stop()
                outcome = TakeOver(Claim.CLOSED)
        finally:
            self._lock.release()
        self._log.report(outcome)
        return outcome.next_claim_ns(now_ns)

    # -- winning --------------------------------------------------------------------------------------------

    def _take_over(self, now_ns: int, constructing: bool) -> TakeOver:
        """Elected (the election is held): start the server, or serve from a thread; nothing is held if not."""
        helper = self.spec is not None and self._no_server is None
        if helper and not self._has_store():  # nothing of ours to publish yet: the export path recreates it first
            self.election.release()
            return TakeOver(Claim.LOST)
        try:
            listener = self._bind(now_ns, constructing)
        except _PortStillHeld:
            self.election.release()
            return TakeOver(Claim.LOST)
        except (OSError, RuntimeError, MemoryError) as exc:
            self.election.release()  # give it back at once, so that any other rank can take it meanwhile
            if (isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE and self._asked_at_ns == now_ns
                    and not constructing):  # (the constructor waited already: the port was kept, said below)
                return TakeOver(Claim.ASKED)
            return _failure(exc)
        if helper:
            return self._start_server(listener, constructing)
        return self._serve_from_thread(listener)

    def _bind(self, now_ns: int, constructing: bool) -> socket.socket:
        try:
            listener = bind_listener(self.host, self.port)
            self._unheld = False
            return listener
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            holders = listening_pids(self.port)
            # A port that no process holds twice in a row is held by one this process cannot see (another
            # user's, another PID namespace's): said, as any foreign program is, below.
            ending, self._unheld = not holders and not self._unheld, not holders
            holders = [pid for pid in holders if pid != os.getpid()]
            if ending or self._held_by_our_spare(holders):
                raise _PortStillHeld() from None
            if self._asked_at_ns is not None and now_ns - self._asked_at_ns < ASK_AGAIN_NS:
                raise
            # The address server of another run (or of this directory before it was replaced): it gives the port
            # up at once unless it has live ranks, and the next claim binds.  Found through /proc, not its
            # /healthz, which would look at the election and see ours, held for this moment only.
            if not any([signal_address_server(pid, self.address, signal.SIGUSR1) for pid in holders]):
                raise
            self._asked_at_ns = now_ns
            if not constructing:
                raise  # the export path never waits: the next claim binds
        # The Exporter's constructor: a rank that records nothing for a while (a job's set-up) would claim no
        # more; it waits for the port the server gives up (milliseconds), bounded by YIELD_WAIT_S.
        deadline = time.monotonic() + YIELD_WAIT_S
        while True:
            try:
                return bind_listener(self.host, self.port)
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE or time.monotonic() >= deadline:
                    raise
                time.sleep(0.005)

    def _held_by_our_spare(self, holders: list[int]) -> bool:
        """Whether a process holding the port also holds the lock file we just won: our server's spare (from its
        start, before it even waits for the lock), which we beat to the lock the instant the server died."""
        fd = self.election.descriptor
        if fd is None:
            return False
        try:
            ours = os.fstat(fd)
        except OSError:
            return False
        return any(holds_file(pid, ours) for pid in holders)

    def _start_server(self, listener: socket.socket, constructing: bool) -> TakeOver:
        assert self.spec is not None
        since = time.time()
        args = ServerArgs(address=self.address, directory=self.spec.directory, has_lock=self.election.descriptor
                          is not None, problem=self.election.problem, started_by=os.getpid(),
                          agent_name=self.spec.agent_name, stale_ttl_s=self.spec.stale_ttl_s,
                          drain_max_s=self.spec.drain_max_s, serving_since=since,
                          replaced_at=self.replaced_at, log_level=logging.getLogger("nixl_prometheus_mp")
                          .getEffectiveLevel())
        try:
            started = launch("server", args, listener.fileno(), self.election.descriptor)
        except StartFailed as failure:
            self.election.release()
            self._back_off()
            return TakeOver(Claim.SHORT, reason=f"the address server cannot be started: {failure.words}")
        finally:
            listener.close()  # the server holds it now, or nobody
        self.election.forget()  # the lock stays: the server holds the same open file description
        if constructing and started.launcher is not None:
            # The launcher forks the server and exits as its interpreter starts (tens of milliseconds): reaped
            # now, in the Exporter's constructor, so that a rank that never records (nor claims again) keeps no
            # zombie child.  From the export path, it is reaped at a later claim instead: that path never waits.
            started.launcher.wait()
            started.launcher = None
        self._starting, self._server_pid = started, None
        self.serving_since = since
        return TakeOver(Claim.STARTED)

    def _hear_from_server(self) -> None:
        """What the server this rank started said (never waiting): that it serves, or why it failed."""
        started = self._starting
        assert started is not None
        if started.status_fd >= 0:
            lines, ended = started.read_status()
            said = None
            for line in lines:
                if line.startswith(READY):
                    self._server_pid, self._failures = int(line[1:]), 0
                elif line.startswith(WARNING):  # (once: each new server of the address may say the same)
                    _warner.warn(("server", self.address, line), "%s", line[1:])
                elif line.startswith(ERROR):
                    said = line[1:]
            if ended and self._server_pid is None and not started.lost:
                self._back_off()
                _warner.warn(("start", self.address, said), "the address server of %s could not start (%s); the "
                             "next start waits a growing pause (at most %.0f s)", self.address,
                             said or "it was killed, or exited before it was ready", START_BACKOFF_MAX_S)
        if started.status_fd < 0 and started.reap():
            self._starting = None

    def _back_off(self) -> None:
        """A start failed: the next one of this rank waits a pause that doubles with each failure in a row."""
        self._failures += 1
        backoff_s = min(START_BACKOFF_MIN_S * 2 ** (self._failures - 1), START_BACKOFF_MAX_S)
        self._retry_at_ns = time.monotonic_ns() + int(backoff_s * 1e9)

    def _serve_from_thread(self, listener: socket.socket) -> TakeOver:
        from app.server import serve_in_thread

        assert self.app is not None
        try:
            self._server, _ = serve_in_thread(listener, self.app, f"nixl-metrics-{self.port}")
        except (OSError, RuntimeError, MemoryError) as exc:
            listener.close()
            self.election.release()
            return _failure(exc)
        self._listener = listener
        # What a forked child closes (by number, once it proves the number still names the socket): a socket
        # object being closed by another thread at the fork has forgotten its number before its close(2) ran.
        self._socket_ids = [(sock.fileno(), os.fstat(sock.fileno()).st_ino) for sock in (listener, self._server.socket)]
        self.serving_since = time.time()
        return TakeOver(Claim.SERVING, no_helper=self._no_server)

    # -- serving from a thread --------------------------------------------------------------------------------

    def watch(self) -> None:
        """Serving from a thread: notice a replaced directory, then run ``on_watch`` (called on its scrapes)."""
        if self._listener is None:
            return
        if self._lock.acquire(blocking=False):
            try:
                if self._listener is not None and not self._closed:
                    self._check_lock_file()
            finally:
                self._lock.release()
        self._on_watch()

    def _check_lock_file(self) -> None:
        """The directory was removed and recreated under us: elect on the new lock file, or step down."""
        if not self.election.lock_file_replaced():
            return
        if self.replaced_at is None:
            self.replaced_at = time.time()
            log.warning("%s was removed or replaced while this process served %s: ranks that started before "
                        "are missing from /metrics until they record again. Re-running the election on the "
                        "new directory.", self.election.directory, self.address)
        try:
            moved = self.election.move_to_current()
        except OSError:
            return  # not back yet: keep serving what is there and retry at the next check
        if not moved:
            log.warning("another process holds the new owner lock of %s; this process stops serving it",
                        self.address)
            self._stop()

    def warnings(self) -> list[WarningDoc]:
        """The endpoint's own /healthz warnings."""
        if self.replaced_at is None or self._listener is None:
            return []
        return [replaced_warning(self.election.directory, self.replaced_at)]

    def owner_info(self, agent_name: str | None, mode: str) -> dict[str, Any]:
        """/healthz's owner, as our thread server answers it."""
        return owner_doc(pid=os.getpid(), agent_name=agent_name, address=self.address, mode=mode,
                         flock=not self.election.problem, since=self.serving_since, server_pid=os.getpid(),
                         serving="thread", started_by=os.getpid())

    # -- closing ----------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop listening to the server this rank started (the server is the job's: it serves on); in thread
        mode, stop serving and free the port, THEN release the election.

        The other order would let a sibling win the election and fail to bind the port we still hold.  From a
        signal handler that interrupted this thread's claim, only marks the endpoint closed: the claim undoes
        what it made as it returns.  Otherwise waits for another thread's claim (which never waits) to end.
        """
        self._closed = True  # first: an interrupted claim sees it when it resumes
        if self._lock._is_owned():  # type: ignore[attr-defined]
            return
        with self._lock:
            self._stop()

    def _stop(self) -> None:
        started, self._starting = self._starting, None
        self.serving_since = self.replaced_at = self._server_pid = None
        if started is not None:
            started.close()
            if started.launcher is not None:
                started.launcher.wait()  # it forks and exits as it starts: never a child of ours left behind
        # Forgotten only once closed: a child forked meanwhile (stopping joins the serving threads, up to a poll
        # interval) finds them where its fork hook closes its copies.
        if self._server is not None:
            self._server.stop()
        if self._listener is not None:
            self._listener.close()  # the port first: a rank that wins the lock next must find it free
        self._server = self._listener = None
        self._socket_ids = []
        self.election.release()

    def forget_after_fork(self) -> None:
        """In a forked child: the parent's server, listener, launcher and lock are the parent's.  Drop our
        copies without a word to any of them (no shutdown, no unlock, no wait)."""
        self._lock = threading.RLock()
        started, self._starting = self._starting, None
        if started is not None:
            if started.launcher is not None:
                started.launcher.returncode = 0  # not this process's child: Popen must never wait for it here
            started.close()
        for sock in (self._listener, None if self._server is None else self._server.socket):
            if sock is not None:
                sock.detach()  # the object forgets its number: its finalizer never closes one the child reuses
        for fd, inode in self._socket_ids:  # the child's copies only (the parent keeps listening)
            with contextlib.suppress(OSError):
                if os.fstat(fd).st_ino == inode:
                    os.close(fd)
        self._server = self._listener = None
        self._socket_ids = []
        self._server_pid = None
        self.serving_since = self.replaced_at = None
        self.election.forget()


def _failure(exc: BaseException) -> TakeOver:
    """How a failed bind or thread start is conceded."""
    if isinstance(exc, OSError) and exc.errno in SCARCE:
        return TakeOver(Claim.SHORT, reason=os.strerror(exc.errno))
    if isinstance(exc, OSError) and exc.errno is not None:
        return TakeOver(Claim.UNBOUND, bind_error=exc)
    return TakeOver(Claim.SHORT, reason=f"{type(exc).__name__}: {exc}")
