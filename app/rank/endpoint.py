"""The scrape endpoint: claim the address, serve it, give it back.

The election decides who may bind; the bind can still fail when something
outside the run holds the port.  Then nothing aggregates the directory on
that address, so the winner warns and concedes the election: once the port
frees, whichever rank wins next takes the address over.

A winner serves from its serving helper process (app.rank.supervisor) where one can
run, from a thread of its own until the helper is ready and whenever the
helper is gone, and only from a thread where no helper can run or
NIXL_PROMETHEUS_MP_SERVE=thread asks for it.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from app.health import WarningDoc, owner_doc, replaced_warning
from app.rank import standby
from app.rank.claims import NEVER, RETRY_NS, Claim, ClaimLog, TakeOver
from app.rank.supervisor import HelperSpec, HelperState, HelperSupervisor, helper_unusable
from app.server import BoundedServer, bind_listener, close_listener, serve_in_thread
from app.web import MetricsApp
from election import Outcome, OwnerElection
from election.lock import SCARCE
from election.standby import LockWaiter
from election.standby import holding_off_fork as holding_off_waiter_fork

log = logging.getLogger("nixl_prometheus_mp.endpoint")

WATCH_NS = 1_000_000_000  # the owner checks that its lock file is still the directory's at most every 1 s
CLOSE_WAIT_S = 10.0  # close() waits this long for another thread's takeover (a bind and a thread start) to finish
_CALLBACK_WAIT_S = 0.05  # the supervisor's callbacks retry the endpoint's lock at this pace until it stops
# A standby that just won the lock may find the port still bound for a moment: the departed holder's
# descriptors close one by one as it exits (the lock's can go before the listener's).  It retries the bind
# at this pace for this long before it concludes that something outside the run holds the port.
_BUSY_PORT_RETRY_S, _BUSY_PORT_WINDOW_S = 0.005, 0.5


_endpoints: weakref.WeakSet[ScrapeEndpoint] = weakref.WeakSet()


class ScrapeEndpoint:
    """This process's claim on one scrape address.

    ``_lock`` is reentrant because close() must work from a signal handler that interrupted this very
    thread inside claim(): close() then undoes what is published and marks the endpoint closed, and the
    interrupted claim, on resuming, undoes what it made since (see _take_over).
    """

    def __init__(self, election: OwnerElection, host: str, port: int, app: MetricsApp,
                 helper: HelperSpec | None = None, on_watch: Callable[[], None] = lambda: None) -> None:
        self.election = election
        self.host, self.port = host, port
        self.app = app
        self.helper = helper  # None: serve from a thread only (NIXL_PROMETHEUS_MP_SERVE=thread)
        self._on_watch = on_watch  # the owner's other periodic checks, made with watch()'s (see there)
        self.serving_since: float | None = None
        self.replaced_at: float | None = None  # when the directory was found replaced while we served
        self._listener: socket.socket | None = None  # held from the bind until we stop serving, whoever accepts
        self._server: BoundedServer | None = None  # our thread server, while it accepts
        self._retired: list[BoundedServer] = []  # thread servers that handed over, finishing their connections
        self._supervisor: HelperSupervisor | None = None
        self._lock = threading.RLock()
        self._log = ClaimLog(election, port)  # the operator's lines, written outside the lock
        self._closed = False
        _endpoints.add(self)

    @property
    def address(self) -> str:
        return self.election.address

    @property
    def serving(self) -> bool:
        return self._listener is not None

    def claim(self, now_ns: int | None = None) -> int:
        """Run the election (and bind if won); returns when to try again (ns).

        While serving, check that the lock file we hold is still the directory's (see watch()).
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
            outcome = self._take_over()
        finally:
            self._lock.release()
        self._log.report(outcome)
        return outcome.next_claim_ns(now_ns)

    def watch(self) -> None:
        """While serving: notice a replaced directory, then run ``on_watch``.

        Called from the thread server's scrapes and every WATCH_S by a helper's supervisor: an idle owner
        makes no other periodic call, and with a helper its scrapes reach another process.
        """
        if self._listener is None:
            return
        if self._lock.acquire(blocking=False):
            try:
                if self._listener is not None and not self._closed:
                    self._check_lock_file()
            finally:
                self._lock.release()
        self._on_watch()

    @property
    def lock_path(self) -> Path:
        """(standby.Standing) The lock file this endpoint elects on."""
        return self.election.path

    def _take_over(self) -> TakeOver:
        """Win the election, bind and serve, or give it all back; the outcome is the caller's to report."""
        if self.election.try_win() is Outcome.LOST:
            shortage = self.election.shortage
            if shortage is not None:
                return TakeOver(Claim.SHORT, reason=shortage)
            standby.stand_by(self)  # the export path keeps re-electing too: for what no waiter covers
            return TakeOver(Claim.LOST)
        outcome = self._serve(lambda: True, busy_port_window_s=0.0)
        if outcome.claim in (Claim.SHORT, Claim.UNBOUND):
            self.election.release()  # give it back at once, so that any other rank can take it meanwhile
        else:
            standby.stand_down(self)  # serving (or closed): a standby that failed to serve stays one
        return outcome

    def take_over_from(self, waiter: LockWaiter) -> bool:
        """(standby.Standing, on the waiter's thread) Serve with the lock the waiter just won; False to turn it
        down (the waiter then releases it and pauses before it contends again)."""
        if not self._lock.acquire(timeout=_CALLBACK_WAIT_S * 20):
            return False  # this endpoint is busy claiming or closing: it re-elects itself if it needs to
        try:
            if self._closed or self._listener is not None or self.election.held:
                return False

            def adopt() -> bool:
                with holding_off_waiter_fork():  # the descriptor is recorded somewhere at any fork
                    fd = waiter.hand_over()
                    if fd is None:
                        return False  # detached meanwhile: it holds nothing any more
                    self.election.adopt(fd)
                return True

            # Adopted only once bound: a failed bind is conceded by the waiter (never a tight loop).
            outcome = self._serve(adopt, busy_port_window_s=_BUSY_PORT_WINDOW_S)
        finally:
            self._lock.release()
        self._log.report(outcome)
        return outcome.claim in (Claim.SERVING, Claim.CLOSED)

    def _serve(self, adopt: Callable[[], bool], busy_port_window_s: float) -> TakeOver:
        """Elected: bind, serve from a thread, start the helper; nothing is held if it cannot."""
        listener = None
        deadline = time.monotonic() + busy_port_window_s
        try:
            while True:
                try:
                    listener = bind_listener(self.host, self.port)
                    break
                except OSError as exc:
                    if exc.errno != errno.EADDRINUSE or time.monotonic() >= deadline:
                        raise
                    time.sleep(_BUSY_PORT_RETRY_S)
            self._server, _ = serve_in_thread(listener, self.app, f"nixl-metrics-{self.port}")
        except (OSError, RuntimeError, MemoryError) as exc:
            # Whatever failed (the bind, werkzeug's descriptor, the thread), nothing serves.
            if listener is not None:
                close_listener(listener)
            if isinstance(exc, OSError) and exc.errno in SCARCE:
                return TakeOver(Claim.SHORT, reason=os.strerror(exc.errno))
            if isinstance(exc, OSError) and exc.errno is not None:
                return TakeOver(Claim.UNBOUND, bind_error=exc)
            return TakeOver(Claim.SHORT, reason=f"{type(exc).__name__}: {exc}")
        # Serving from here (the thread server answers already, naming this process the owner): ``serving`` says
        # so from the same instant, and stops saying it if the election is not ours after all.
        self._listener = listener
        if not adopt():
            server, self._server = self._server, None
            self._listener = None
            if server is not None:
                server.stop()
            close_listener(listener)
            return TakeOver(Claim.LOST)
        self.serving_since = time.time()
        no_helper = self._start_helper()
        if self._closed:  # close() ran in a signal handler while we were taking over: undo it all
            self._stop()
            return TakeOver(Claim.CLOSED)
        return TakeOver(Claim.SERVING, no_helper=no_helper)

    # -- the serving helper (app.rank.supervisor) ------------------------------------------------------------
    #
    # The thread server started by the takeover answers at once; the supervisor's thread starts the helper (an
    # interpreter's start, a fraction of a second to a second), and the thread server is retired once the
    # helper is ready.  The callbacks below run on the supervisor's thread and act only if that supervisor is
    # still ours: a close() or a re-election in between has made it a stale one.

    def _start_helper(self) -> str | None:
        """Start the helper's supervisor; why no helper can serve instead (None: one will, or none is wanted)."""
        if self.helper is None:
            return None
        reason = helper_unusable()
        if reason is None:
            supervisor = HelperSupervisor(self.helper, self)
            try:
                supervisor.start()
            except RuntimeError as exc:  # the process is at its thread limit
                return f"no thread to supervise it: {exc}"
            self._supervisor = supervisor
        return reason

    @contextlib.contextmanager
    def helper_state(self, supervisor: HelperSupervisor) -> Iterator[HelperState | None]:
        """(HelperHost) What a helper starts with, under our lock: a close() waits until the helper has it."""
        if not self._locked_for(supervisor):
            yield None
            return
        try:
            listener = self._listener
            yield None if listener is None else HelperState(
                listener_fd=listener.fileno(), lock_fd=self.election.descriptor, problem=self.election.problem,
                serving_since=self.serving_since, replaced_at=self.replaced_at)
        finally:
            self._lock.release()

    def _locked_for(self, supervisor: HelperSupervisor) -> bool:
        """Take the lock for a callback of ``supervisor``; False (not taken) once it is stopping or stale."""
        while not supervisor.stopping:
            if self._lock.acquire(timeout=_CALLBACK_WAIT_S):
                if self._supervisor is supervisor and not self._closed:
                    return True
                self._lock.release()
                return False
        return False

    def helper_ready(self, supervisor: HelperSupervisor) -> None:
        """(HelperHost) The helper accepts connections: our thread server stops accepting, its connections
        finish."""
        if not self._locked_for(supervisor):
            return
        try:
            server, self._server = self._server, None
            self._retired = [s for s in self._retired if s.busy()]
            if server is not None:
                server.retire()
                self._retired.append(server)
        finally:
            self._lock.release()

    def helper_gone(self, supervisor: HelperSupervisor) -> None:
        """(HelperHost) The helper died: serve from a thread again, at once, while the supervisor starts
        another."""
        if not self._locked_for(supervisor):
            return
        shortage = None
        try:
            if self._server is None and self._listener is not None:
                self._server, _ = serve_in_thread(self._listener, self.app, f"nixl-metrics-{self.port}")
        except (OSError, RuntimeError, MemoryError) as exc:
            shortage = f"no thread server while the helper restarts: {exc}"
        finally:
            self._lock.release()
        if shortage is not None:
            self._log.shortage(shortage)

    def _check_lock_file(self) -> None:
        """The directory was removed and recreated under us: elect on the new lock file, or step down.

        Ranks starting now lock the new file, win, and cannot bind the port we hold; ranks already
        running lose on it to whoever holds it.  Holding the new file ourselves makes us the owner again;
        if another process holds it, that process is elected and we give the port up to it.
        """
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
        if moved and self._supervisor is not None:
            self._supervisor.restart()  # it holds the old lock file, and must say the directory was replaced
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
        """/healthz's owner, as our thread server answers it (the helper answers its own)."""
        return owner_doc(pid=os.getpid(), agent_name=agent_name, address=self.address, mode=mode,
                         flock=not self.election.problem, since=self.serving_since, server_pid=os.getpid(),
                         serving="thread")

    def stand_down(self) -> None:
        """Stop standing by for the address (the first step of closing; bounded, from anywhere)."""
        standby.stand_down(self)

    def close(self, hand_off: bool = False) -> None:
        """Stop serving and free the port, THEN release the election.

        The other order would let a sibling win the election and fail to
        bind the port we still hold, then back off for seconds.  Safe from a
        signal handler and from atexit at any moment (see the class doc).

        ``hand_off``: if a serving helper is ready (close() never waits for one that is starting), leave the
        address to it instead: it serves the departed stores, this rank's among them, until each was served
        once, or goes at once to a live rank (app.rank.linger); the port and the election go with it.
        """
        self._closed = True  # first: an interrupted claim sees it when it resumes
        standby.stand_down(self)
        if not self._lock.acquire(timeout=CLOSE_WAIT_S):
            log.warning("closing %s: another thread is stuck taking the address over; it gives it back when "
                        "it returns", self.address)
            return
        try:
            self._stop(hand_off)
        finally:
            self._lock.release()

    def _stop(self, hand_off: bool = False) -> None:
        # The helper first: it holds the listener and the lock too, and the port is free only once it is gone.
        supervisor, self._supervisor = self._supervisor, None
        server, self._server = self._server, None
        retired, self._retired = self._retired, []
        listener, self._listener = self._listener, None
        self.serving_since = self.replaced_at = None
        handed_off = False
        if supervisor is not None:
            handed_off = hand_off and self.election.descriptor is not None and supervisor.leave(0.0)
            if not handed_off:
                supervisor.stop()
        for thread_server in [*retired, *([server] if server is not None else [])]:
            thread_server.stop()
        if listener is not None:
            close_listener(listener)  # our descriptor only: a helper that stays on keeps the port
        if handed_off:
            self.election.hand_off()
        else:
            self.election.release()

    def _after_fork_in_child(self) -> None:
        """A forked child never serves the parent's socket nor holds its election (nor stands by: app.standby).

        (The listeners themselves were closed by app.server's fork hook.)
        """
        self._lock = threading.RLock()
        if self._supervisor is not None:
            self._supervisor.forget_after_fork()
        self._supervisor = self._server = self._listener = None
        self._retired = []
        self.serving_since = self.replaced_at = None
        self.election.forget_after_fork()


def _after_fork_in_child() -> None:
    # (app.server's own hook, registered first, has closed the child's copies of the listeners.)
    for endpoint in list(_endpoints):
        endpoint._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
