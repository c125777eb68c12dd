"""The HTTP server of an address: werkzeug's threaded server on a socket we bound, made safe for a host.

Used wherever this project serves: the address server (app.address.server), a rank serving from a thread
(app.rank.endpoint), the demo's aggregator and the benchmarks.  What it adds to werkzeug: the request path of
app.http (persistent connections, one write per answer, pooled threads), a bound on connections and on how long
each request may last, accept() backing off while descriptors run out, no traceback on a client's error, no log
line per scrape.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import os
import socket
import threading
import time
from typing import Any

from werkzeug.serving import ThreadedWSGIServer

from app.connections import REQUEST_TIMEOUT_S, Connections
from app.http import PersistentHandler
from app.logsink import never_block_on_logs
from app.threads import new_thread
from election.lock import SCARCE
from store.fds import stdio_occupied
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

_POLL_S = 0.1  # serve_forever's shutdown poll: bounds close() latency, and how late a deadline is enforced
MAX_CONNECTIONS = 64  # connections open at once (one thread each); more are refused with a 503
_STOP_JOIN_S = 5.0  # close() waits at most this long for the serving and connection threads to end
_ACCEPT_BACKOFF_MIN_S, _ACCEPT_BACKOFF_MAX_S = 0.01, 1.0  # accept() pauses while descriptors run out
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: 33\r\n"
         b"Retry-After: 1\r\nConnection: close\r\n\r\ntoo many concurrent connections\r\n")


class _QuietHandler(PersistentHandler):
    """One log line per scrape would drown the rank's own logs.

    So would one per malformed or timed-out request, which a client controls: those go to DEBUG.
    """

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        pass

    def log(self, type: str, message: str, *args: Any) -> None:
        log.debug("telemetry endpoint, client %s: " + message, self.address_string(), *args)


class BoundedServer(ThreadedWSGIServer):
    """werkzeug's threaded server with a bound on connections and on how long each may last.

    Every connection costs a thread and a descriptor, so at most MAX_CONNECTIONS are open at once, and a peer
    address at most a share of them; when the server is full the busiest peer's connection idle the longest
    (waiting for a next request, app.http) is closed for a new one, and failing that the new one is answered 503
    and closed right away by the accepting thread (app.connections.Connections.admit).  A
    per-read timeout alone would let a client that sends a byte now and then hold its thread for ever, so each
    request also gets a deadline, REQUEST_TIMEOUT_S after its first byte (after the accept, for a connection's
    first), past which the serving loop shuts its socket down.  Connections are served by a pool of our threads
    (app.connections.Connections), named and tracked so that stop() can join them: nothing of ours serves, and no
    scrape reaps, once stop() returns.
    """

    connections: Connections

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._stopping = threading.Event()
        self._stopped = threading.Event()  # stop() was called
        self._accept_backoff_s = 0.0
        self._refusal_logged = False
        self.serve_thread: threading.Thread | None = None
        super().__init__(*args, **kwargs)  # (which already calls server_close once)
        self.connections = Connections(f"nixl-metrics-{self.server_address[1]}", self._serve_connection,
                                       MAX_CONNECTIONS)

    def get_request(self) -> tuple[socket.socket, Any]:
        """accept(), backing off while the process or system is out of descriptors (or buffers).

        socketserver swallows accept's error and the pending connection keeps the listener readable, so
        without a pause the serving thread would spin at 100% CPU for as long as the shortage lasts,
        taking the CPU from the rank it lives in.
        """
        try:
            with stdio_occupied():  # (the listener is non-blocking: held for one accept() at most)
                conn, address = super().get_request()
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
        return conn, address

    def process_request(self, request: Any, client_address: Any) -> None:
        if self.connections.admit(request, str(client_address[0]) if client_address else ""):
            if self.connections.dispatch(request, client_address):
                return
            _warner.warn(("thread", self.server_address),
                         "the telemetry endpoint on %s cannot start a thread for a connection (the process "
                         "is at its thread limit); connections are answered 503 until threads free up",
                         _format_address(self.server_address))
        elif not self._refusal_logged:
            self._refusal_logged = True
            log.warning("the telemetry endpoint has %d connections open; further ones are answered 503 until "
                        "some finish (each request is cut %.0f s after it began)", MAX_CONNECTIONS,
                        REQUEST_TIMEOUT_S)
        with contextlib.suppress(OSError):
            request.setblocking(False)
            request.send(_BUSY)
        self.shutdown_request(request)

    def _serve_connection(self, request: socket.socket, client_address: Any) -> None:
        never_block_on_logs()  # a scrape never waits for the host's log sink (app.logsink)
        self.process_request_thread(request, client_address)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # socketserver prints a traceback to the rank's stderr; a client's misbehaviour is not the rank's news.
        log.debug("telemetry endpoint: error serving %s", client_address, exc_info=True)

    def shutdown_request(self, request: Any) -> None:
        # Under the connections' lock: nothing must ever shut down a descriptor that was closed (and reused).
        self.connections.forget(request, super().shutdown_request)

    def service_actions(self) -> None:
        """Called by serve_forever at every poll: cut the connections past their deadline."""
        super().service_actions()
        self.connections.cut_overdue()

    def server_close(self) -> None:
        """Close the listener and cut every open connection: nothing serves after close().

        (werkzeug's serve_forever calls this as it returns.)
        """
        self.socket.close()
        if getattr(self, "connections", None) is None:
            return
        self.connections.cut_all()

    def abandon(self) -> None:
        """For a process about to exit: stop accepting at once, and keep no connection for another request.

        It does not wait for the serving loop to notice (up to _POLL_S): an address server giving the address up
        frees the port now (whoever wins the lock next must find it free), and exits once the answers
        being written are.
        """
        self._stopping.set()
        # Shut down before closing: the serving thread polls this socket, and a descriptor closed under a poll
        # leaves the socket listening until the poll returns (the port would still be bound when the lock goes).
        with contextlib.suppress(OSError):
            self.socket.shutdown(socket.SHUT_RDWR)
        self.socket.close()
        self.connections.close_all(idle_only=True)

    def busy(self) -> bool:
        """Whether a connection thread of this server still runs (after abandon(): a connection is still open)."""
        return self.connections.busy()

    def stop(self, timeout_s: float = _STOP_JOIN_S) -> None:
        """Stop the serving loop, close the listener, cut the connections and join their threads (bounded).

        Safe from any thread, including the serving thread itself and a connection thread (a garbage
        collection can run an Exporter's finalizer there): neither is waited for by itself.
        """
        self._stopping.set()
        self._stopped.set()
        self.connections.close_all()
        me = threading.current_thread()
        if me is self.serve_thread:
            self._BaseServer__shutdown_request = True  # serve_forever's own flag: shutdown() would wait for us
        elif self.serve_thread is not None and self.serve_thread.is_alive():
            self.shutdown()
        self.server_close()
        deadline = time.monotonic() + timeout_s
        threads = [self.serve_thread, *self.connections.threads()]
        for thread in threads:
            if thread is not None and thread is not me:
                thread.join(max(0.0, deadline - time.monotonic()))


def _format_address(address: Any) -> str:
    host, port = address[:2]
    return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"


def _serve_forever(server: BoundedServer) -> None:
    never_block_on_logs()  # the serving loop never waits for the host's log sink (app.logsink)
    server.serve_forever(poll_interval=_POLL_S)


def serve_in_thread(sock: socket.socket, app: Any, name: str) -> tuple[BoundedServer, threading.Thread]:
    """A threaded werkzeug server on a duplicate of the bound socket ``sock``, on a daemon thread.

    The caller keeps ``sock`` (and closes it once the server is stopped).  On failure (no descriptor for
    werkzeug's duplicate, no thread) the duplicate is closed before the error propagates.
    """
    host, port = sock.getsockname()[:2]
    with stdio_occupied():
        server = BoundedServer(host, port, app, handler=_QuietHandler, fd=sock.fileno())
    thread = new_thread(_serve_forever, name, "nixl-accept", (server,))
    server.serve_thread = thread
    try:
        thread.start()
    except BaseException:
        server.server_close()
        raise
    return server, thread

