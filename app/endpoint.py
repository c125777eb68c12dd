"""The scrape endpoint: claim the address, serve it, give it back.

The election decides who may bind; the bind can still fail when something
outside the run holds the port.  Then nothing aggregates the directory on
that address, so the winner warns and concedes the election: once the port
frees, whichever rank wins next takes the address over.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import importlib.metadata
import logging
import os
import socket
import threading
import time
import weakref
from typing import Any

from werkzeug.serving import ThreadedWSGIServer, WSGIRequestHandler

from app.web import MetricsApp, WarningDoc, owner_doc
from election import Outcome, OwnerElection, held_addresses_except
from election.lock import SCARCE
from store.warnonce import OnceWarner

log = logging.getLogger("nixl_prometheus_mp.endpoint")
_warner = OnceWarner(log)

# werkzeug's server constructor looks its own version up with
# importlib.metadata.  Done for the first time in a takeover, importing that
# module and filling its path caches would cost milliseconds between the old
# owner's death and the first scrape served; done here, it costs them once, at
# import, and a takeover only pays the (cached) lookup itself.
with contextlib.suppress(Exception):
    importlib.metadata.version("werkzeug")

RETRY_NS = 200_000_000  # a writer re-runs the election at most every 200 ms
BACKOFF_NS = 5_000_000_000  # ... but every 5 s once a won election failed to bind
WATCH_NS = 1_000_000_000  # the owner checks that its lock file is still the directory's at most every 1 s
NEVER = 1 << 63
_POLL_S = 0.1  # serve_forever's shutdown poll: bounds close() latency
_REQUEST_TIMEOUT_S = 10.0  # a connection is cut this long after it was accepted, whatever the client does
MAX_CONNECTIONS = 64  # connections served at once (one thread each); more are refused with a 503
_STOP_JOIN_S = 5.0  # close() waits at most this long for the serving and connection threads to end
CLOSE_WAIT_S = 10.0  # ... and this long for another thread's takeover (a bind and a thread start) to finish
_ACCEPT_BACKOFF_MIN_S, _ACCEPT_BACKOFF_MAX_S = 0.01, 1.0  # accept() pauses while descriptors run out
_MAX_DRAIN_BYTES = 1 << 20  # what we read of a request body nobody needs before closing
_DRAIN_CHUNK = 64 << 10
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: 33\r\n"
         b"Retry-After: 1\r\nConnection: close\r\n\r\ntoo many concurrent connections\r\n")


class _CappedReader:
    """The request stream, of which at most ``limit`` bytes are ever read, at most one chunk at a time.

    After the response werkzeug drains what the client sent, up to 10 GB in 10 MB reads; neither endpoint
    reads a body, so a client streaming one must cost neither memory nor its thread's time.
    """

    def __init__(self, stream: Any, limit: int) -> None:
        self._stream = stream
        self._left = limit

    def read(self, size: int | None = -1) -> bytes:
        if self._left <= 0:
            return b""
        want = self._left if size is None or size < 0 else min(size, self._left)
        data = self._stream.read1(min(want, _DRAIN_CHUNK))
        self._left -= len(data)
        return data

    def readline(self, size: int | None = -1) -> bytes:
        if self._left <= 0:
            return b""
        want = self._left if size is None or size < 0 else min(size, self._left)
        data = self._stream.readline(min(want, _DRAIN_CHUNK))
        self._left -= len(data)
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class _QuietHandler(WSGIRequestHandler):
    """One log line per scrape would drown the rank's own logs.

    So would one per malformed or timed-out request, which a client controls: those go to DEBUG.
    """

    timeout = _REQUEST_TIMEOUT_S

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        pass

    def log(self, type: str, message: str, *args: Any) -> None:
        log.debug("telemetry endpoint, client %s: " + message, self.address_string(), *args)

    def run_wsgi(self) -> None:
        self.rfile = _CappedReader(self.rfile, _MAX_DRAIN_BYTES)  # type: ignore[assignment]
        super().run_wsgi()


# -- listeners and fork ---------------------------------------------------------------------------------------
#
# A child forked without exec inherits every descriptor, listeners included: a child holding our listener
# keeps the port bound after we close it (no rank can take the address over) and its backlog swallows
# scrapes.  SOCK_CLOEXEC does nothing for a fork without exec, so every listener this process opens is
# registered here from the instant its descriptor exists until the instant it is closed, both under
# _listeners_lock, and the fork hooks hold that lock across fork(): the child closes exactly the listeners
# the parent had open at that instant, whatever the parent was doing (binding, taking over, closing).

_listeners: set[socket.socket] = set()
_listeners_lock = threading.RLock()  # reentrant: werkzeug's constructor closes a socket while we hold it
_FORK_LOCK_WAIT_S = 1.0  # a fork from a signal handler that interrupted a registration must not hang


def _open_listener(family: int) -> socket.socket:
    with _listeners_lock:
        sock = socket.socket(family, socket.SOCK_STREAM)
        _listeners.add(sock)
    return sock


def _close_listener(sock: socket.socket) -> None:
    with _listeners_lock:
        _listeners.discard(sock)
        sock.close()


_fork_held = threading.local()


def _before_fork() -> None:
    _fork_held.locked = _listeners_lock.acquire(timeout=_FORK_LOCK_WAIT_S)


def _after_fork_in_parent() -> None:
    if getattr(_fork_held, "locked", False):
        _fork_held.locked = False
        _listeners_lock.release()


def _close_listeners_in_child() -> None:
    global _listeners_lock
    for sock in _listeners:
        # detach() marks the object closed without closing, so its finalizer can never close a number the
        # child reuses; os.close drops the child's copy only (no shutdown: the parent keeps listening).
        with contextlib.suppress(OSError):
            os.close(sock.detach())
    _listeners.clear()
    _listeners_lock = threading.RLock()
    _fork_held.locked = False


class _BoundedServer(ThreadedWSGIServer):
    """werkzeug's threaded server with a bound on connections and on how long each may last.

    Every connection costs the rank a thread and a descriptor, so at most MAX_CONNECTIONS are served at once;
    one more is answered 503 and closed right away by the accepting thread.  A per-read timeout alone would
    let a client that sends a byte now and then hold its thread for ever, so each connection also gets a
    deadline, _REQUEST_TIMEOUT_S after it was accepted, past which the serving loop shuts its socket down.
    Connection threads are ours (named, tracked) so that stop() can join them: nothing of ours serves, and
    no scrape reaps, once stop() returns.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._connections: dict[socket.socket, float] = {}  # -> deadline (monotonic s)
        self._workers: set[threading.Thread] = set()
        self._connections_lock = threading.Lock()
        self._stopping = threading.Event()
        self._accept_backoff_s = 0.0
        self._refusal_logged = False
        self.serve_thread: threading.Thread | None = None
        super().__init__(*args, **kwargs)  # (which already calls server_close once)

    def get_request(self) -> tuple[socket.socket, Any]:
        """accept(), backing off while the process or system is out of descriptors (or buffers).

        socketserver swallows accept's error and the pending connection keeps the listener readable, so
        without a pause the serving thread would spin at 100% CPU for as long as the shortage lasts,
        taking the CPU from the rank it lives in.
        """
        try:
            conn = super().get_request()
        except OSError as exc:
            if exc.errno in SCARCE:
                _warner.warn(("accept", self.server_address, exc.errno),
                             "the telemetry endpoint on %s cannot accept connections (%s); it retries with a "
                             "growing pause (at most %.0f s) until the process has descriptors again",
                             _format_address(self.server_address), os.strerror(exc.errno), _ACCEPT_BACKOFF_MAX_S)
                self._accept_backoff_s = min(max(2 * self._accept_backoff_s, _ACCEPT_BACKOFF_MIN_S),
                                             _ACCEPT_BACKOFF_MAX_S)
                self._stopping.wait(self._accept_backoff_s)
            raise
        self._accept_backoff_s = 0.0
        return conn

    def process_request(self, request: Any, client_address: Any) -> None:
        worker = threading.Thread(target=self._serve_connection, args=(request, client_address),
                                  name=f"nixl-metrics-{self.server_address[1]}-conn", daemon=True)
        with self._connections_lock:
            full = len(self._connections) >= MAX_CONNECTIONS
            if not full:
                self._connections[request] = time.monotonic() + _REQUEST_TIMEOUT_S
                self._workers.add(worker)
        if not full:
            try:
                worker.start()
                return
            except RuntimeError:  # the process is at its thread limit: refuse this one, keep serving
                with self._connections_lock:
                    self._workers.discard(worker)
                _warner.warn(("thread", self.server_address),
                             "the telemetry endpoint on %s cannot start a thread for a connection (the process "
                             "is at its thread limit); connections are answered 503 until threads free up",
                             _format_address(self.server_address))
        elif not self._refusal_logged:
            self._refusal_logged = True
            log.warning("the telemetry endpoint has %d connections open; further ones are answered 503 until "
                        "some finish (each is cut %.0f s after it was accepted)", MAX_CONNECTIONS,
                        _REQUEST_TIMEOUT_S)
        with contextlib.suppress(OSError):
            request.setblocking(False)
            request.send(_BUSY)
        self.shutdown_request(request)

    def _serve_connection(self, request: Any, client_address: Any) -> None:
        try:
            self.process_request_thread(request, client_address)
        finally:
            with self._connections_lock:
                self._workers.discard(threading.current_thread())

    def handle_error(self, request: Any, client_address: Any) -> None:
        # socketserver prints a traceback to the rank's stderr; a client's misbehaviour is not the rank's news.
        log.debug("telemetry endpoint: error serving %s", client_address, exc_info=True)

    def shutdown_request(self, request: Any) -> None:
        # Under the lock: service_actions must never shut down a descriptor that was closed (and reused).
        with self._connections_lock:
            self._connections.pop(request, None)
            super().shutdown_request(request)

    def service_actions(self) -> None:
        """Called by serve_forever at every poll: cut the connections past their deadline."""
        super().service_actions()
        now = time.monotonic()
        with self._connections_lock:
            for sock, deadline in self._connections.items():
                if now > deadline:
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_RDWR)

    def server_close(self) -> None:
        """Close the listener and cut every open connection: nothing serves after close()."""
        _close_listener(self.socket)
        with self._connections_lock:
            for sock in self._connections:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def stop(self, timeout_s: float = _STOP_JOIN_S) -> None:
        """Stop the serving loop, close the listener, cut the connections and join their threads (bounded).

        Safe from any thread, including the serving thread itself and a connection thread (a garbage
        collection can run an Exporter's finalizer there): neither is waited for by itself.
        """
        self._stopping.set()
        me = threading.current_thread()
        if me is self.serve_thread:
            self._BaseServer__shutdown_request = True  # serve_forever's own flag: shutdown() would wait for us
        elif self.serve_thread is not None and self.serve_thread.is_alive():
            self.shutdown()
        self.server_close()
        deadline = time.monotonic() + timeout_s
        with self._connections_lock:
            threads = [self.serve_thread, *self._workers]
        for thread in threads:
            if thread is not None and thread is not me:
                thread.join(max(0.0, deadline - time.monotonic()))


def _format_address(address: Any) -> str:
    host, port = address[:2]
    return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"


def bind_listener(host: str, port: int) -> socket.socket:
    """Bind and listen ourselves, so a failure is ours to report.

    (werkzeug's own bind prints to stderr and calls sys.exit on failure,
    which must never happen inside a rank.)  SO_REUSEADDR lets a new owner
    bind while the dead owner's connections sit in TIME_WAIT; it does not
    let two processes listen on one port.
    """
    sock = _open_listener(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except BaseException:
        _close_listener(sock)
        raise
    return sock


def serve_in_thread(sock: socket.socket, app: Any, name: str) -> tuple[_BoundedServer, threading.Thread]:
    """A threaded werkzeug server on an already-bound socket, on a daemon thread.

    Takes ``sock`` over: on failure (no descriptor for werkzeug's duplicate, no thread) every listener is
    closed before the error propagates.
    """
    try:
        host, port = sock.getsockname()[:2]
        with _listeners_lock:  # werkzeug duplicates the descriptor: register the copy the instant it exists
            server = _BoundedServer(host, port, app, handler=_QuietHandler, fd=sock.fileno())
            _listeners.add(server.socket)
    finally:
        _close_listener(sock)  # the server holds its own duplicate (or failed)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": _POLL_S}, name=name,
                              daemon=True)
    server.serve_thread = thread
    try:
        thread.start()
    except BaseException:
        server.server_close()
        raise
    return server, thread


_endpoints: weakref.WeakSet[ScrapeEndpoint] = weakref.WeakSet()


class ScrapeEndpoint:
    """This process's claim on one scrape address.

    ``_lock`` is reentrant because close() must work from a signal handler that interrupted this very
    thread inside claim(): close() then undoes what is published and marks the endpoint closed, and the
    interrupted claim, on resuming, undoes what it made since (see _take_over).
    """

    def __init__(self, election: OwnerElection, host: str, port: int, app: MetricsApp) -> None:
        self.election = election
        self.host, self.port = host, port
        self.app = app
        self.serving_since: float | None = None
        self.replaced_at: float | None = None  # when the directory was found replaced while we served
        self._server: _BoundedServer | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.RLock()
        self._bind_warned = False
        self._lost_logged = False
        self._shortage_logged = False
        self._closed = False
        _endpoints.add(self)

    @property
    def address(self) -> str:
        return self.election.address

    @property
    def serving(self) -> bool:
        return self._server is not None

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
            if self._server is not None:
                self._check_lock_file()
                return now_ns + WATCH_NS
            return self._take_over(now_ns)
        finally:
            self._lock.release()

    def watch(self) -> None:
        """While serving: notice a replaced directory (from scrapes, which an idle owner still gets)."""
        if self._server is not None and self._lock.acquire(blocking=False):
            try:
                if self._server is not None and not self._closed:
                    self._check_lock_file()
            finally:
                self._lock.release()

    def _take_over(self, now_ns: int) -> int:
        outcome = self.election.try_win()
        if outcome is Outcome.LOST:
            if self.election.shortage is not None:
                self._log_shortage(self.election.shortage)
            elif not self._lost_logged:
                self._lost_logged = True
                log.info("another process of the run serves %s; this one records its telemetry for it",
                         self.address)
            return now_ns + RETRY_NS
        try:
            server, thread = serve_in_thread(bind_listener(self.host, self.port), self.app,
                                             f"nixl-metrics-{self.port}")
        except (OSError, RuntimeError, MemoryError) as exc:
            # Whatever failed (the bind, werkzeug's descriptor, the thread), nothing serves: give the
            # election back at once, so that any other rank can take the address over meanwhile.
            self.election.release()
            if isinstance(exc, OSError) and exc.errno in SCARCE:
                self._log_shortage(os.strerror(exc.errno))
            elif isinstance(exc, OSError) and exc.errno is not None:
                self._concede(exc)
            else:
                self._log_shortage(f"{type(exc).__name__}: {exc}")
            return now_ns + BACKOFF_NS
        self._server, self._thread = server, thread
        self.serving_since = time.time()
        if self._closed:  # close() ran in a signal handler while we were taking over: undo it all
            self._stop()
            return NEVER
        if self._bind_warned or self._lost_logged or self._shortage_logged:
            log.info("took over %s: this process now serves the run's telemetry", self.address)
        self._bind_warned = self._lost_logged = self._shortage_logged = False
        return NEVER

    def _log_shortage(self, reason: str) -> None:
        if not self._shortage_logged:
            self._shortage_logged = True
            log.warning("cannot serve %s right now (%s): the election is left for another rank to win. This "
                        "process retries every %d s and serves once it can; recording is not affected.",
                        self.address, reason, BACKOFF_NS // 1_000_000_000)

    def _concede(self, exc: OSError) -> None:
        reason = os.strerror(exc.errno or 0)
        if self.election.problem:
            # Without a usable lock every rank counts itself elected and the
            # bind decides: losing it most likely means a sibling serves.
            log.info("cannot bind %s (%s); with the owner lock unusable, another rank of the run probably "
                     "serves it", self.address, reason)
            return
        if self._bind_warned:
            return
        self._bind_warned = True
        if exc.errno == errno.EADDRINUSE:
            sibling = [a for a in held_addresses_except(self.election.directory, self.address)
                       if a.rpartition(":")[2] == str(self.port)]
            if sibling:
                log.warning(
                    "cannot serve %s: %s of this run already serves port %d, and one port cannot be bound on "
                    "both addresses. The ranks disagree on NIXL_TELEMETRY_PROMETHEUS_LOCAL: set it the same "
                    "for every rank of the run (scrape %s meanwhile; it aggregates every rank). Retrying "
                    "every %d s.", self.address, " and ".join(sibling), self.port, sibling[0],
                    BACKOFF_NS // 1_000_000_000)
                return
            cause = "the port is in use by another program"
        else:
            cause = reason
        log.warning(
            "won the election for %s but cannot bind it: %s. No rank of this run can be serving it, so "
            "nothing aggregates %s on that address (a foreign service, a rank using another "
            "NIXL_TELEMETRY_MULTIPROC_DIR, or the same port on another address?). Retrying every %d s; the "
            "first rank to win once the port is free takes the address over.",
            self.address, cause, self.election.directory, BACKOFF_NS // 1_000_000_000)

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
        if not moved:
            log.warning("another process holds the new owner lock of %s; this process stops serving it",
                        self.address)
            self._stop()

    def warnings(self) -> list[WarningDoc]:
        """The endpoint's own /healthz warnings."""
        if self.replaced_at is None or self._server is None:
            return []
        return [{"kind": "directory-replaced",
                 "message": f"{self.election.directory} was removed or replaced while this process served it; "
                            "ranks that started before are missing until they record again",
                 "details": {"directory": str(self.election.directory),
                             "detected_at": datetime.datetime.fromtimestamp(
                                 self.replaced_at, datetime.timezone.utc).isoformat()}}]

    def owner_info(self, agent_name: str | None, mode: str) -> dict[str, Any]:
        return owner_doc(pid=os.getpid(), agent_name=agent_name, address=self.address, mode=mode,
                         flock=not self.election.problem, since=self.serving_since)

    def close(self) -> None:
        """Stop serving and free the port, THEN release the election.

        The other order would let a sibling win the election and fail to
        bind the port we still hold, then back off for seconds.  Safe from a
        signal handler and from atexit at any moment (see the class doc).
        """
        self._closed = True  # first: an interrupted claim sees it when it resumes
        if not self._lock.acquire(timeout=CLOSE_WAIT_S):
            log.warning("closing %s: another thread is stuck taking the address over; it gives it back when "
                        "it returns", self.address)
            return
        try:
            self._stop()
        finally:
            self._lock.release()

    def _stop(self) -> None:
        server, self._server, self._thread = self._server, None, None
        self.serving_since = self.replaced_at = None
        if server is not None:
            server.stop()
        self.election.release()

    def _after_fork_in_child(self) -> None:
        """A forked child never serves the parent's socket nor holds its election.

        (The listeners themselves were closed by _close_listeners_in_child.)
        """
        self._lock = threading.RLock()
        self._server = self._thread = None
        self.serving_since = self.replaced_at = None
        self.election.forget_after_fork()


def _after_fork_in_child() -> None:
    _close_listeners_in_child()
    for endpoint in list(_endpoints):
        endpoint._after_fork_in_child()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                    after_in_child=_after_fork_in_child)
