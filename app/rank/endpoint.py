"""A rank's claim on its scrape address: a small state machine, driven from one place.

The address belongs to the job, not to a rank.  The rank that wins the election starts the address server
(app.address.server) and hands it the lock and the bound listener, keeping no copy of either: the server
alone holds the address from then on, and serves the directory until nothing in it is left to publish.  A
rank's death or close() never moves the address.

A rank is always in one of three states, changed only under ``_lock`` by ``claim`` (the constructor's and the
export path's LOCK_NB election) and ``take_over_from`` (a standby's win, on its thread):

* STANDBY: another process holds the address (an address server, a C++ owner, the gunicorn aggregator).  The
  rank records, and waits for the lock in the kernel (app.rank.standby) for that holder's death.
* SERVING, thread mode only (NIXL_PROMETHEUS_MP_SERVE=thread, or where no address server can run): the rank
  holds the lock and serves from a thread of its own, as the C++ plug-in does; it dies with its rank.
* CLOSED: close() ran.

Winning, in the default mode, is a transition, not a state: bind, start the server (queued its descriptors
before it even runs: app.rank.spawn), close our copies, stand by again for that server's death.  A start
that fails is retried with a growing back-off.  The only thread this leaves besides the standby is the
carrier of the server's log records (app.rank.carrier), while the starting rank and its server both live.

The election decides who may bind; the bind can still fail when something outside the run holds the port.
The address server of another directory that publishes only departed ranks is asked to give it up
(SIGUSR1), and does at once; anything else makes the winner warn and concede the election: once the port
frees, whichever rank wins next takes the address over.
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
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.channel import ServerArgs
from app.health import WarningDoc, owner_doc, replaced_warning
from app.probe import is_address_server, listening_pids
from app.rank import standby
from app.rank.carrier import Carrier
from app.rank.claims import NEVER, RETRY_NS, Claim, ClaimLog, TakeOver
from app.rank.spawn import StartFailed, helper_unusable, launch
from app.server import BoundedServer, bind_listener, close_listener, holding_off_fork, serve_in_thread
from app.web import MetricsApp
from election import Outcome, OwnerElection
from election.lock import SCARCE
from election.standby import LockWaiter
from election.standby import holding_off_fork as holding_off_waiter_fork
from store.fds import close_quietly
from store.warnonce import OnceWarner

log = logging.getLogger("nixl_prometheus_mp.endpoint")
_warner = OnceWarner(log)

WATCH_NS = 1_000_000_000  # a serving thread-mode rank checks that its lock file is still the directory's every 1 s
CLOSE_WAIT_S = 10.0  # close() waits this long for another thread's takeover (a bind and a process start) to finish
# A standby that just won the lock may find the port still bound for a moment: the departed holder's
# descriptors close one by one as it exits.  It retries the bind at this pace for this long before it
# concludes that something outside the run holds the port; YIELD_WAIT_S once it asked another run's server.
_BUSY_PORT_RETRY_S, _BUSY_PORT_WINDOW_S, YIELD_WAIT_S = 0.005, 0.5, 1.0
START_BACKOFF_MIN_S, START_BACKOFF_MAX_S = 0.05, 5.0  # between starts of a server that keeps failing to start

_endpoints: weakref.WeakSet[ScrapeEndpoint] = weakref.WeakSet()


@dataclass(frozen=True)
class ServerSpec:
    """What an address server must know of the rank that starts it, besides the descriptors."""

    directory: Path
    stale_ttl_s: float
    address: str
    agent_name: str | None


class ScrapeEndpoint:
    """This process's claim on one scrape address (see the module's doc for its states).

    ``_lock`` is reentrant because close() must work from a signal handler that interrupted this very
    thread inside claim(): close() then marks the endpoint closed and undoes what is published, and the
    interrupted claim, on resuming, undoes what it made since.
    """

    def __init__(self, election: OwnerElection, host: str, port: int, app: MetricsApp, spec: ServerSpec | None,
                 on_watch: Callable[[], None], has_store: Callable[[], bool] = lambda: True) -> None:
        self.election, self.host, self.port, self.app = election, host, port, app
        # Whether this rank's store is on disk: one whose directory was replaced has none until it records again,
        # and a server started for a directory with nothing to publish would exit at once (and again, and again).
        self._has_store = has_store
        # None: thread mode (asked for, or no address server can run here: said once, when it matters).
        self.spec = spec
        self._no_server = None if spec is None else helper_unusable()
        self._on_watch = on_watch
        self._lock = threading.RLock()
        self._closed = False
        self._closing = threading.Event()  # wakes a start that waits out its back-off
        self._log = ClaimLog(election, port)
        self._carrier: Carrier | None = None  # the server this rank started, while both live
        self._server_lock: int | None = None  # what our standby waits on: see take_server_lock
        self._failures = 0  # starts in a row whose server died before it was ready
        self._retry_at_ns = 0  # (CLOCK_MONOTONIC) no start before this
        self._server: BoundedServer | None = None  # thread mode: our server and listener
        self._listener: socket.socket | None = None
        self.serving_since: float | None = None
        self.replaced_at: float | None = None
        _endpoints.add(self)

    @property
    def address(self) -> str:
        return self.election.address

    @property
    def serving(self) -> bool:
        """This process serves the address: from its thread, or through the server it started and has not seen
        end (from the instant it handed the address over: connections wait in the backlog until it accepts)."""
        carrier = self._carrier
        return self._listener is not None or (carrier is not None and carrier.running)

    @property
    def lock_path(self) -> Path:
        """(standby.Standing) The lock file this endpoint elects on."""
        return self.election.path

    @property
    def closed(self) -> bool:
        """(standby.Standing) close() ran: never offered the lock again."""
        return self._closed

    @property
    def stands_by_after_takeover(self) -> bool:
        """(standby.Standing) A rank that handed the address to a server waits for that server's death."""
        return self._listener is None and not self._closed

    def take_server_lock(self) -> int | None:
        """(standby.Standing) A new description of the lock file just handed to our server, holding nothing: our
        standby waits on it for that server's death, whatever file the path names by then (see hand_off)."""
        fd, self._server_lock = self._server_lock, None
        return fd

    def claim(self, now_ns: int | None = None) -> int:
        """Run the election (and take the address over if won); returns when to try again (ns).

        While serving from a thread, check that the lock file we hold is still the directory's (see watch()).
        Never raises for the environment: a failure to serve is conceded and retried later.
        """
        now_ns = time.monotonic_ns() if now_ns is None else now_ns
        if not self._lock.acquire(blocking=False):
            return now_ns + RETRY_NS  # another thread of ours is claiming right now
        try:
            if self._closed:
                return NEVER
            if self._listener is not None:
                self._check_lock_file()
                return now_ns + WATCH_NS
            if now_ns < self._retry_at_ns:
                return self._retry_at_ns  # a start failed: the export path never waits out its back-off
            if self.election.try_win() is Outcome.LOST:
                shortage = self.election.shortage
                if shortage is not None:
                    outcome = TakeOver(Claim.SHORT, reason=shortage)
                else:
                    standby.stand_by(self)  # the export path keeps re-electing too: for what no waiter covers
                    outcome = TakeOver(Claim.LOST)
            else:
                outcome = self._take_over(busy_port_window_s=0.0, wait_backoff=False)
                if outcome.claim is Claim.SERVING and self._listener is None:
                    standby.stand_by(self)  # handed to a server: this rank waits for that server's death
        finally:
            self._lock.release()
        self._log.report(outcome)
        return outcome.next_claim_ns(now_ns)

    def take_over_from(self, waiter: LockWaiter) -> bool:
        """(standby.Standing, on the waiter's thread) Take the address over with the lock the waiter just won;
        False to turn it down (the waiter then releases it and pauses before it contends again)."""
        if not self._lock.acquire(timeout=CLOSE_WAIT_S):
            return False  # this endpoint is busy claiming or closing: it re-elects itself if it needs to
        try:
            if self._closed or self._listener is not None or self.election.held:
                return False
            with holding_off_waiter_fork():  # the descriptor is recorded somewhere at any fork
                fd = waiter.hand_over()
                if fd is None:
                    return False  # detached meanwhile: it holds nothing any more
                self.election.adopt(fd)
            outcome = self._take_over(busy_port_window_s=_BUSY_PORT_WINDOW_S, wait_backoff=True)
        finally:
            self._lock.release()
        self._log.report(outcome)
        return outcome.claim in (Claim.SERVING, Claim.CLOSED)

    # -- winning --------------------------------------------------------------------------------------------

    def _take_over(self, busy_port_window_s: float, wait_backoff: bool) -> TakeOver:
        """Elected (the election is held): start the server, or serve from a thread; nothing is held if not.

        ``wait_backoff``: on a standby's thread, a start that failed a moment ago is followed by its back-off,
        the lock held (nobody could start one sooner); elsewhere (the export path) the lock is given back.
        """
        if self.spec is not None and self._no_server is None:
            if not self._has_store():  # nothing of ours to publish yet: the export path recreates it, then elects
                self.election.release()
                return TakeOver(Claim.LOST)
            wait_s = (self._retry_at_ns - time.monotonic_ns()) / 1e9
            if wait_s > 0 and (not wait_backoff or self._closing.wait(wait_s)):
                self.election.release()
                return TakeOver(Claim.CLOSED if self._closed else Claim.LOST)
        try:
            listener = self._bind(busy_port_window_s)
        except (OSError, RuntimeError, MemoryError) as exc:
            self.election.release()  # give it back at once, so that any other rank can take it meanwhile
            return _failure(exc)
        if self.spec is not None and self._no_server is None:
            return self._start_server(listener)
        return self._serve_from_thread(listener)

    def _bind(self, busy_port_window_s: float) -> socket.socket:
        deadline = time.monotonic() + busy_port_window_s
        asked = False
        while True:
            try:
                return bind_listener(self.host, self.port)
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise
                if not asked:
                    asked = True
                    if self._ask_to_yield():
                        deadline = max(deadline, time.monotonic() + YIELD_WAIT_S)
                if time.monotonic() >= deadline:
                    raise
                time.sleep(_BUSY_PORT_RETRY_S)

    def _ask_to_yield(self) -> bool:
        """The port is held: if by an address server (of another run, or of this directory before it was
        replaced), ask it to give the port up; it does at once unless it has live ranks.  Whether we asked.

        Found through /proc, not by asking its /healthz: an owner answering /healthz looks at the election
        (duplicate owners, a replaced lock file), and would see ours, held for this moment only.
        """
        asked = False
        for pid in listening_pids(self.port):
            if pid != os.getpid() and is_address_server(pid):
                with contextlib.suppress(OSError):  # gone, or another user's: the bind's failure is warned as usual
                    os.kill(pid, signal.SIGUSR1)
                    asked = True
        return asked

    def _start_server(self, listener: socket.socket) -> TakeOver:
        assert self.spec is not None
        since = time.time()
        args = ServerArgs(address=self.address, directory=self.spec.directory, has_lock=self.election.descriptor
                          is not None, problem=self.election.problem, started_by=os.getpid(),
                          agent_name=self.spec.agent_name, stale_ttl_s=self.spec.stale_ttl_s, serving_since=since,
                          replaced_at=self.replaced_at, log_level=logging.getLogger("nixl_prometheus_mp")
                          .getEffectiveLevel())
        try:
            with holding_off_fork():  # a fork meanwhile finds the channel recorded (and closes its copy), or none
                launched = launch(self.election.descriptor, listener, args)
                carrier = Carrier(launched, self.address, self._server_ended)
        except StartFailed as failure:
            close_listener(listener)
            self.election.release()
            self._back_off()  # (said in one line, the shortage's)
            return TakeOver(Claim.SHORT, reason=f"the address server cannot be started: {failure.words}")
        # The server holds them now (queued on its channel): our copies go, the lock and the port stay.
        close_listener(listener)
        # Reopened and recorded before any fork can copy it: a child's copy would share the lock once our standby
        # wins it on that description, and keep it held after our server's death (see app.rank.standby).
        with holding_off_waiter_fork():
            self._drop_server_lock()
            self._server_lock = self.election.hand_off()
        self.serving_since = since
        self._carrier = carrier
        try:
            carrier.start()
        except RuntimeError:  # out of threads: the server serves all the same, its records go to its file
            self._carrier = None
            carrier.close()
        if self._closed:  # close() ran in a signal handler meanwhile: the server is the job's, it stays
            self._stop()
            return TakeOver(Claim.CLOSED)
        return TakeOver(Claim.SERVING)

    def _server_ended(self, ready: bool, how: str) -> None:
        """(The carrier's thread) The server this rank started is gone; a standby (maybe ours) starts another."""
        if ready:
            self._failures, self._retry_at_ns = 0, 0
            log.warning("the address server of %s %s; a standby rank takes the address over", self.address, how)
            return
        self._back_off()
        _warner.warn(("start", self.address), "the address server of %s %s before it was ready; the next start "
                     "waits a growing pause (at most %.0f s)", self.address, how, START_BACKOFF_MAX_S)

    def _back_off(self) -> None:
        """A start failed: the next one of this rank waits a pause that doubles with each failure in a row."""
        self._failures += 1
        backoff_s = min(START_BACKOFF_MIN_S * 2 ** (self._failures - 1), START_BACKOFF_MAX_S)
        self._retry_at_ns = time.monotonic_ns() + int(backoff_s * 1e9)

    def _serve_from_thread(self, listener: socket.socket) -> TakeOver:
        try:
            self._server, _ = serve_in_thread(listener, self.app, f"nixl-metrics-{self.port}")
        except (OSError, RuntimeError, MemoryError) as exc:
            close_listener(listener)
            self.election.release()
            return _failure(exc)
        self._listener = listener
        self.serving_since = time.time()
        standby.stand_down(self)
        if self._closed:  # close() ran in a signal handler while we were taking over: undo it all
            self._stop()
            return TakeOver(Claim.CLOSED)
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
        """Stand down; stop carrying the server's records (the server is the job's: it serves on); in thread
        mode, stop serving and free the port, THEN release the election.

        The other order would let a sibling win the election and fail to bind the port we still hold, then
        back off for seconds.  Safe from a signal handler and from atexit at any moment (see the class doc).
        """
        self._closed = True  # first: an interrupted claim sees it when it resumes
        self._closing.set()
        standby.stand_down(self)
        if not self._lock.acquire(timeout=CLOSE_WAIT_S):
            log.warning("closing %s: another thread is stuck taking the address over; it gives it back when "
                        "it returns", self.address)
            return
        try:
            self._stop()
        finally:
            self._lock.release()

    def _stop(self) -> None:
        carrier, self._carrier = self._carrier, None
        server, self._server = self._server, None
        listener, self._listener = self._listener, None
        self.serving_since = self.replaced_at = None
        self._drop_server_lock()
        if carrier is not None:
            carrier.close()
        if server is not None:
            server.stop()
        if listener is not None:
            close_listener(listener)  # the port first: a standby that wins the lock must find it free
        self.election.release()  # (a writer's too: the descriptor its lost elections probe with)

    def _after_fork_in_child(self) -> None:
        """A forked child never serves the parent's socket nor holds its election (nor stands by: app.standby).

        (The listeners were closed by app.server's fork hook, the carrier's descriptors by its own.)
        """
        self._lock = threading.RLock()
        self._carrier = self._server = self._listener = None
        self.serving_since = self.replaced_at = None
        self._drop_server_lock()  # (the child's copy: it holds nothing, and the parent's stays)
        self.election.forget_after_fork()

    def _drop_server_lock(self) -> None:
        close_quietly(self.take_server_lock())


def _failure(exc: BaseException) -> TakeOver:
    """How a failed bind or thread start is conceded."""
    if isinstance(exc, OSError) and exc.errno in SCARCE:
        return TakeOver(Claim.SHORT, reason=os.strerror(exc.errno))
    if isinstance(exc, OSError) and exc.errno is not None:
        return TakeOver(Claim.UNBOUND, bind_error=exc)
    return TakeOver(Claim.SHORT, reason=f"{type(exc).__name__}: {exc}")


def _after_fork_in_child() -> None:
    # (app.server's own hook, registered first, has closed the child's copies of the listeners.)
    for endpoint in list(_endpoints):
        endpoint._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
