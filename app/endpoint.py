"""The scrape endpoint: claim the address, serve it, give it back.

The election decides who may bind; the bind can still fail when something
outside the run holds the port.  Then nothing aggregates the directory on
that address, so the winner warns and concedes the election: once the port
frees, whichever rank wins next takes the address over.
"""

from __future__ import annotations

import contextlib
import errno
import importlib.metadata
import logging
import os
import socket
import threading
import time
import weakref
from typing import Any

from werkzeug.serving import BaseWSGIServer, ThreadedWSGIServer, WSGIRequestHandler

from app.web import MetricsApp, owner_doc
from election import Outcome, OwnerElection

log = logging.getLogger("nixl_prometheus_mp.endpoint")

# werkzeug's server constructor looks its own version up with
# importlib.metadata.  Done for the first time in a takeover, importing that
# module and filling its path caches would cost milliseconds between the old
# owner's death and the first scrape served; done here, it costs them once, at
# import, and a takeover only pays the (cached) lookup itself.
with contextlib.suppress(Exception):
    importlib.metadata.version("werkzeug")

RETRY_NS = 200_000_000  # a writer re-runs the election at most every 200 ms
BACKOFF_NS = 5_000_000_000  # ... but every 5 s once a won election failed to bind
NEVER = 1 << 63
_POLL_S = 0.1  # serve_forever's shutdown poll: bounds close() latency
_REQUEST_TIMEOUT_S = 10.0  # a connection is cut this long after it was accepted, whatever the client does
MAX_CONNECTIONS = 64  # connections served at once (one thread each); more are refused with a 503
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


class _BoundedServer(ThreadedWSGIServer):
    """werkzeug's threaded server with a bound on connections and on how long each may last.

    Every connection costs the rank a thread and a descriptor, so at most MAX_CONNECTIONS are served at once;
    one more is answered 503 and closed right away by the accepting thread.  A per-read timeout alone would
    let a client that sends a byte now and then hold its thread for ever, so each connection also gets a
    deadline, _REQUEST_TIMEOUT_S after it was accepted, past which the serving loop shuts its socket down.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._connections: dict[socket.socket, float] = {}  # -> deadline (monotonic s)
        self._connections_lock = threading.Lock()
        self._refusal_logged = False
        super().__init__(*args, **kwargs)  # (which already calls server_close once)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._connections_lock:
            full = len(self._connections) >= MAX_CONNECTIONS
            if not full:
                self._connections[request] = time.monotonic() + _REQUEST_TIMEOUT_S
        if not full:
            super().process_request(request, client_address)  # a thread per connection
            return
        if not self._refusal_logged:
            self._refusal_logged = True
            log.warning("the telemetry endpoint has %d connections open; further ones are answered 503 until "
                        "some finish (each is cut %.0f s after it was accepted)", MAX_CONNECTIONS,
                        _REQUEST_TIMEOUT_S)
        with contextlib.suppress(OSError):
            request.setblocking(False)
            request.send(_BUSY)
        self.shutdown_request(request)

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
        super().server_close()
        with self._connections_lock:
            for sock in self._connections:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


def bind_listener(host: str, port: int) -> socket.socket:
    """Bind and listen ourselves, so a failure is ours to report.

    (werkzeug's own bind prints to stderr and calls sys.exit on failure,
    which must never happen inside a rank.)  SO_REUSEADDR lets a new owner
    bind while the dead owner's connections sit in TIME_WAIT; it does not
    let two processes listen on one port.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    return sock


def serve_in_thread(sock: socket.socket, app: Any, name: str) -> tuple[BaseWSGIServer, threading.Thread]:
    """A threaded werkzeug server on an already-bound socket, on a daemon thread."""
    host, port = sock.getsockname()[:2]
    server = _BoundedServer(host, port, app, handler=_QuietHandler, fd=sock.fileno())
    sock.close()  # the server holds its own duplicate
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": _POLL_S}, name=name,
                              daemon=True)
    thread.start()
    return server, thread


_endpoints: weakref.WeakSet[ScrapeEndpoint] = weakref.WeakSet()


class ScrapeEndpoint:
    """This process's claim on one scrape address."""

    def __init__(self, election: OwnerElection, host: str, port: int, app: MetricsApp) -> None:
        self.election = election
        self.host, self.port = host, port
        self.app = app
        self.serving_since: float | None = None
        self._server: BaseWSGIServer | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._bind_warned = False
        self._lost_logged = False
        self._closed = False
        _endpoints.add(self)

    @property
    def address(self) -> str:
        return self.election.address

    @property
    def serving(self) -> bool:
        return self._server is not None

    def claim(self, now_ns: int | None = None) -> int:
        """Run the election (and bind if won); returns when to try again (ns)."""
        now_ns = time.monotonic_ns() if now_ns is None else now_ns
        if not self._lock.acquire(blocking=False):
            return now_ns + RETRY_NS  # another thread of ours is claiming right now
        try:
            if self._closed or self._server is not None:
                return NEVER
            outcome = self.election.try_win()
            if outcome is Outcome.LOST:
                if not self._lost_logged:
                    self._lost_logged = True
                    log.info("another process of the run serves %s; this one records its telemetry for it",
                             self.address)
                return now_ns + RETRY_NS
            try:
                sock = bind_listener(self.host, self.port)
            except OSError as exc:
                self._concede(exc)
                return now_ns + BACKOFF_NS
            self._server, self._thread = serve_in_thread(sock, self.app, f"nixl-metrics-{self.port}")
            self.serving_since = time.time()
            if self._bind_warned or self._lost_logged:
                log.info("took over %s: this process now serves the run's telemetry", self.address)
            self._bind_warned = self._lost_logged = False
            return NEVER
        finally:
            self._lock.release()

    def _concede(self, exc: OSError) -> None:
        self.election.release()
        if self.election.problem:
            # Without a usable lock every rank counts itself elected and the
            # bind decides: losing it most likely means a sibling serves.
            log.info("cannot bind %s (%s); with the owner lock unusable, another rank of the run probably "
                     "serves it", self.address, os.strerror(exc.errno or 0))
            return
        if not self._bind_warned:
            self._bind_warned = True
            cause = "is in use by another program" if exc.errno == errno.EADDRINUSE else os.strerror(exc.errno or 0)
            log.warning(
                "won the election for %s but cannot bind it: the port %s. No rank of this run can be serving it, "
                "so nothing aggregates %s on that address (a foreign service, a rank using another "
                "NIXL_TELEMETRY_MULTIPROC_DIR, or the same port on another address?). Retrying every %d s; the "
                "first rank to win once the port is free takes the address over.",
                self.address, cause, self.election.directory, BACKOFF_NS // 1_000_000_000)

    def owner_info(self, agent_name: str | None, mode: str) -> dict[str, Any]:
        return owner_doc(pid=os.getpid(), agent_name=agent_name, address=self.address, mode=mode,
                         flock=not self.election.problem, since=self.serving_since)

    def close(self) -> None:
        """Stop serving and free the port, THEN release the election.

        The other order would let a sibling win the election and fail to
        bind the port we still hold, then back off for seconds.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            server, thread = self._server, self._thread
            self._server = self._thread = None
            if server is not None:
                server.shutdown()  # serve_forever returns and closes the listening socket
                server.server_close()
                if thread is not None:
                    thread.join(timeout=5)
            self.election.release()

    def _after_fork_in_child(self) -> None:
        """A forked child never serves the parent's socket nor holds its election."""
        self._lock = threading.Lock()
        if self._server is not None:
            self._server.socket.close()  # our copy only; the parent keeps listening
        self._server = self._thread = None
        self.serving_since = None
        self.election.forget_after_fork()


def _after_fork_in_child() -> None:
    for endpoint in list(_endpoints):
        endpoint._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
