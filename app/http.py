"""The request path of our HTTP server (app.server): persistent connections, one write per response, pooled threads.

http.server parses each request (its request line and headers, with its limits and error answers), werkzeug's
WSGIRequestHandler builds the WSGI environ; what is ours is what happens around them, which werkzeug's own
``run_wsgi`` does not do for a scraper:

* **Persistent HTTP/1.1 connections.**  werkzeug answers every request with ``Connection: close``; Prometheus keeps
  one connection per target.  A connection here serves up to MAX_REQUESTS requests, waits at most IDLE_S for the
  next one, and is closed at once (rather than a new one refused) when the server is full; each request still
  has REQUEST_TIMEOUT_S from its first byte until our app computes, then REQUEST_TIMEOUT_S from its answer's start
  plus what its bytes take at MIN_SEND_RATE, so a client trickling its request or not reading its answer is cut,
  and one reading a large answer steadily is not (app.connections keeps the deadlines).
* **No linger after the answer.**  werkzeug waits (10 ms) for more of the request to arrive after each answer,
  holding the connection, its thread and the client's EOF for that long; here a request's body is read exactly as
  far as it was declared, and only a body we stopped reading is drained, after the client was told EOF.
* **One write per answer**: the status line, the headers and the body in one ``sendmsg`` (no copy of the body).
* **Pooled threads**: a connection is served by an idle thread of the server's when there is one; a few stay
  idle between connections (app.connections), and every one ends when the server stops or is
  abandoned.
* **Bounded requests** (the endpoint listens on 0.0.0.0 in someone else's program): a request line of at most
  MAX_REQUEST_LINE bytes (414 beyond), at most MAX_HEADER_FIELDS header fields and MAX_HEADER_BYTES of them
  in all (431 beyond); http.server alone allows 64 KiB per line and 100 lines, 6.4 MB a request.  Real
  scrapers send a few hundred bytes.
* **A status line for every bad request**: http.server answers a request line it cannot read the HTTP/0.9 way
  (a bare HTML body), and takes ``Content-Length: ²`` for a number; here a malformed request line is a 400, an
  unknown version a 505, an invalid Content-Length a 400 (RFC 9112), each an HTTP/1.1 answer.
* **Fair slots**: no peer address holds more than a PEER_SHARE-th of the connections, and when the server is
  full the busiest peer's longest idle connection goes first (app.connections.Connections.admit): one host
  re-opening slow requests cannot starve a Prometheus scraping from another.
"""

from __future__ import annotations

import contextlib
import email.utils
import http.client
import io
import re
import socket
import time
from collections.abc import Callable, Iterable
from typing import Any, cast

from werkzeug.exceptions import InternalServerError
from werkzeug.serving import WSGIRequestHandler

from app.connections import REQUEST_TIMEOUT_S, Connections

MAX_REQUESTS = 1000  # answered on one connection, the last with Connection: close
MAX_DRAIN_BYTES = 1 << 20  # what we read of a request body nobody needs: past it the connection is closed
_DRAIN_CHUNK = 64 << 10
_DRAIN_WAIT_S = 0.01  # a body we stopped reading is drained while more of it arrives within this
_FLUSH_BYTES = 4 << 20  # an answer given in many pieces is sent once this much of it is waiting
_NO_BODY_STATUS = (204, 304)
MAX_REQUEST_LINE = 8190  # bytes, CRLF included (gunicorn's limit_request_line is 4094; Go's whole head 1 MiB)
MAX_HEADER_FIELDS = 64
MAX_HEADER_BYTES = 16 << 10  # every header line, the blank one included, not the request line
_HTTP_VERSION = re.compile(r"HTTP/([0-9])\.([0-9])")
_DIGITS = re.compile(r"[0-9]+")
_MAX_IOV = 512  # buffers per sendmsg (the kernel takes at most IOV_MAX, 1024 on Linux)


class _BodyReader:
    """wsgi.input: the request's body, of which at most ``limit`` bytes are ever read, one chunk at a time.

    ``limit`` is the declared Content-Length (so that nothing reads into the next request of the connection), or
    MAX_DRAIN_BYTES where the body has no length we keep the connection for.
    """

    def __init__(self, stream: Any, limit: int) -> None:
        self._stream = stream
        self.left = limit

    def read(self, size: int | None = -1) -> bytes:
        if self.left <= 0:
            return b""
        want = self.left if size is None or size < 0 else min(size, self.left)
        data = self._stream.read1(min(want, _DRAIN_CHUNK))
        self.left = self.left - len(data) if data else 0  # (EOF: nothing more will come)
        return data

    def readline(self, size: int | None = -1) -> bytes:
        if self.left <= 0:
            return b""
        want = self.left if size is None or size < 0 else min(size, self.left)
        data = self._stream.readline(min(want, _DRAIN_CHUNK))
        self.left = self.left - len(data) if data else 0
        return data

    def drain(self) -> bool:
        """Read the rest of the body; whether it was read whole (False: the client closed, or it timed out)."""
        with contextlib.suppress(OSError, ValueError):
            while self.left > 0 and self.read():
                pass
        return self.left <= 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class _HeaderBudget:
    """The request's stream while http.server parses its header fields: it raises (and http.server answers 431)
    once they pass MAX_HEADER_BYTES or MAX_HEADER_FIELDS, having read no more than that."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._left = MAX_HEADER_BYTES
        self._fields = 0

    def readline(self, size: int | None = -1) -> bytes:
        want = self._left + 1 if size is None or size < 0 else min(size, self._left + 1)
        line: bytes = self._stream.readline(want)
        self._left -= len(line)
        if self._left < 0:
            raise http.client.LineTooLong(f"header fields longer than {MAX_HEADER_BYTES} bytes in all")
        if line not in (b"\r\n", b"\n", b""):
            self._fields += 1
            if self._fields > MAX_HEADER_FIELDS:
                raise http.client.HTTPException(f"more than {MAX_HEADER_FIELDS} header fields")
        return line

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _body_length(headers: Any) -> int | None:
    """The request body's declared length, 0 for none; None where the connection cannot be kept after it
    (chunked, or longer than we would read).  ValueError for an invalid length (RFC 9112: answered 400)."""
    lengths = headers.get_all("Content-Length") or []
    if any(not _DIGITS.fullmatch(value.strip()) for value in lengths):  # (str.isdigit would take "²")
        raise ValueError(f"invalid Content-Length {lengths[0]!r}")
    if len({int(value) for value in lengths}) > 1:
        raise ValueError(f"conflicting Content-Length values {lengths!r}")
    if headers.get("Transfer-Encoding") is not None:
        return None
    if not lengths:
        return 0
    length = int(lengths[0])
    return length if length <= MAX_DRAIN_BYTES else None


_date_cache: tuple[int, str] = (0, "")


def _http_date() -> str:
    global _date_cache
    now = int(time.time())
    if _date_cache[0] != now:
        _date_cache = (now, email.utils.formatdate(now, usegmt=True))
    return _date_cache[1]


def send_all(sock: socket.socket, buffers: list[bytes],
             progress: Callable[[int], None] = lambda sent: None) -> None:
    """Send every buffer, in order, with as few system calls as the kernel allows (one, for an answer that fits
    its send buffer); ``progress`` hears how many bytes each call sent."""
    views = [memoryview(b) for b in buffers if b]
    while views:
        sent = sock.sendmsg(views[:_MAX_IOV])
        progress(sent)
        while views and sent >= len(views[0]):
            sent -= len(views.pop(0))
        if sent:
            views[0] = views[0][sent:]


class PersistentHandler(WSGIRequestHandler):
    """werkzeug's handler, serving requests on one connection until it closes, each answer in one write.

    The server must have a ``connections`` attribute (a Connections) that tracks this one.
    """

    protocol_version = "HTTP/1.1"
    # http.server's errors before the request's version is read go out as this version's (with a status line),
    # not as HTTP/0.9's bare body.
    default_request_version = "HTTP/1.1"
    timeout = REQUEST_TIMEOUT_S  # per read and write; the whole request's bound is the Connections' deadline
    disable_nagle_algorithm = True  # an answer is one write: nothing to coalesce, and no wait for an ACK

    def parse_request(self) -> bool:
        """http.server's parse, within our bounds: 414, 400 or 505 for the request line, 431 for the fields.

        After an error answer the rest of what the client sent is read and dropped (a bounded amount): closing
        with it unread would reset the connection, and the client would lose the answer.
        """
        if self._parse_request():
            return True
        self._drain_after_error()
        return False

    def _drain_after_error(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.connection.shutdown(socket.SHUT_WR)
            self.connection.settimeout(_DRAIN_WAIT_S)
            left = MAX_DRAIN_BYTES
            while left > 0 and (chunk := cast(io.BufferedReader, self.rfile).read1(min(left, _DRAIN_CHUNK))):
                left -= len(chunk)

    def _parse_request(self) -> bool:
        self.command = None  # type: ignore[assignment]  # (send_error reads it; http.server sets it so too)
        self.request_version = self.default_request_version
        self.requestline = self.raw_requestline.decode("iso-8859-1").rstrip("\r\n")
        if len(self.raw_requestline) > MAX_REQUEST_LINE:
            self.send_error(414, f"request line longer than {MAX_REQUEST_LINE} bytes")
            return False
        words = self.requestline.split()
        if len(words) != 3:  # (two words would be HTTP/0.9, which no scraper speaks)
            self.send_error(400, "bad request line")
            return False
        version = _HTTP_VERSION.fullmatch(words[2])
        if version is None:
            self.send_error(400, "bad HTTP version")
            return False
        if version.group(1) != "1":
            self.send_error(505)
            return False
        stream, self.rfile = self.rfile, _HeaderBudget(self.rfile)  # type: ignore[assignment]
        try:
            return bool(super().parse_request())
        finally:
            self.rfile = stream

    def handle(self) -> None:
        self.close_connection = True
        self._answered = 0
        try:
            self.handle_one_request()
            while not self.close_connection and self._next_request():
                self.handle_one_request()
        except (ConnectionError, TimeoutError) as exc:
            self.connection_dropped(exc)

    def _next_request(self) -> bool:
        """Wait (at most IDLE_S) for the next request's first byte; False: the connection is to close."""
        connections: Connections = self.server.connections  # type: ignore[attr-defined]
        if not connections.await_request(self.connection):
            return False
        try:
            self.connection.settimeout(connections.idle_s)
            # What the client pipelined, or else the next bytes it sends; b"" once it closed or we cut it.
            arrived = cast(io.BufferedReader, self.rfile).peek(1)
            self.connection.settimeout(self.timeout)
        except (OSError, ValueError):  # timed out, reset, or cut while idle
            return False
        return bool(arrived) and connections.request_begins(self.connection)

    def run_wsgi(self) -> None:
        connections: Connections = self.server.connections  # type: ignore[attr-defined]
        if not connections.in_time(self.connection):
            self.close_connection = True  # cut at its deadline: what was read of it ended there, unanswerable
            return
        self._answered += 1
        try:
            length = _body_length(self.headers)
        except ValueError as exc:
            self.close_connection = True  # (what follows has no known start: the connection ends here)
            self.send_error(400, "bad Content-Length", str(exc))
            return
        body = _BodyReader(self.rfile, MAX_DRAIN_BYTES if length is None else length)
        if length is None or self._answered >= MAX_REQUESTS or not connections.keep_alive:
            self.close_connection = True
        stream, self.rfile = self.rfile, body  # type: ignore[assignment]  # (make_environ's wsgi.input)
        try:
            self.environ = environ = self.make_environ()
        finally:
            self.rfile = stream
        head_only = self.command == "HEAD"
        answer = _Answer()
        app_iter: Iterable[bytes] = ()
        connections.answering(self.connection)
        try:
            app_iter = self.server.app(environ, answer.start_response)  # type: ignore[attr-defined]
            for data in app_iter:
                answer.add(data)
                if answer.waiting >= _FLUSH_BYTES:
                    self._send(answer, head_only, final=False)
            self._send(answer, head_only, final=True)
            if self.close_connection and body.left <= 0:  # (a body still to drain first: after that)
                with contextlib.suppress(OSError):
                    self.connection.shutdown(socket.SHUT_WR)  # the client's EOF, right behind the body
        except (ConnectionError, TimeoutError) as exc:
            self.close_connection = True
            self.connection_dropped(exc, environ)
        except Exception:
            self.close_connection = True
            if answer.sent_head:
                raise  # the client sees the answer cut short (the server logs it at DEBUG)
            failed = _Answer()
            for data in InternalServerError()(environ, failed.start_response):
                failed.add(data)
            self._send(failed, head_only, final=True)
            raise
        finally:
            close = getattr(app_iter, "close", None)
            if close is not None:
                close()
        if answer.sent_head:
            self.log_request(answer.code, answer.length if answer.length is not None else "-")
        if length is None:
            self._drain_after_eof(body)
        elif not body.drain():
            self.close_connection = True  # the body's declared end never came

    def _send(self, answer: _Answer, head_only: bool, final: bool) -> None:
        buffers = [] if head_only or answer.code < 200 or answer.code in _NO_BODY_STATUS else answer.chunks
        if not answer.sent_head:
            if final and answer.length is None and not head_only and answer.code not in _NO_BODY_STATUS:
                answer.headers.append(("Content-Length", str(answer.waiting)))
                answer.length = answer.waiting
            if answer.length is None and not head_only and answer.code not in _NO_BODY_STATUS:
                self.close_connection = True  # an answer of unknown length ends with the connection
            head = [f"{self.protocol_version} {answer.status}\r\nServer: {self.version_string()}\r\n"
                    f"Date: {_http_date()}\r\n"]
            head += [f"{name}: {value}\r\n" for name, value in answer.headers]
            if self.close_connection:
                head.append("Connection: close\r\n\r\n")
            elif self.request_version == "HTTP/1.0":
                head.append("Connection: keep-alive\r\n\r\n")
            else:
                head.append("\r\n")
            buffers = ["".join(head).encode("latin-1"), *buffers]
        connections: Connections = self.server.connections  # type: ignore[attr-defined]
        first, answer.sent_head = not answer.sent_head, True

        def progress(sent: int) -> None:
            nonlocal first
            connections.sent(self.connection, sent, first)
            first = False
        progress(0)  # (the answer's deadline starts as it begins, whatever the first call sends)
        send_all(self.connection, buffers, progress)
        answer.chunks, answer.waiting = [], 0

    def _drain_after_eof(self, body: _BodyReader) -> None:
        """The client may still be sending a body we will not read: tell it EOF now, then read (and drop) what
        arrives, a bounded amount, so that closing does not reset the connection before it has read the answer."""
        with contextlib.suppress(OSError, ValueError):
            self.connection.shutdown(socket.SHUT_WR)
            self.connection.settimeout(_DRAIN_WAIT_S)
            while body.left > 0 and body.read():
                pass


class _Answer:
    """One WSGI answer, collected until it is sent."""

    def __init__(self) -> None:
        self.status = ""
        self.code = 0
        self.headers: list[tuple[str, str]] = []
        self.length: int | None = None  # the declared Content-Length
        self.chunks: list[bytes] = []
        self.waiting = 0  # bytes in chunks
        self.sent_head = False

    def start_response(self, status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Callable[
            [bytes], None]:
        if exc_info is not None and self.sent_head:
            raise exc_info[1].with_traceback(exc_info[2])
        self.status, self.code, self.headers = status, int(status.split(None, 1)[0]), list(headers)
        self.length = next((int(value) for name, value in headers if name.lower() == "content-length"), None)
        return self.add

    def add(self, data: bytes) -> None:
        if data:
            self.chunks.append(data)
            self.waiting += len(data)
