"""Hostile clients: the endpoint listens on 0.0.0.0 in someone else's program (issue 31).

Bounded memory per request (MAX_HEADER_BYTES, MAX_HEADER_FIELDS, MAX_REQUEST_LINE: 431 or 414 beyond), fair
connection slots per peer address (PEER_SHARE), and an HTTP/1.1 status line for every bad request: in both
serving modes (the address server, the rank's thread), measured on the process that answers, from another
process; and the gunicorn aggregator's own limits set to the same bounds.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from support import (  # noqa: F401  (pytest fixture)
    DEADLINE_S,
    Reaper,
    free_port,
    healthz,
    reaper_fixture,
    start_exporter_rank,
    try_scrape,
    wait_until,
)
from support_e2e import procfile_web_command, rank_env
from support_reliability import vm_status

from app.connections import PEER_SHARE
from app.http import MAX_HEADER_BYTES, MAX_HEADER_FIELDS, MAX_REQUEST_LINE
from app.server import MAX_CONNECTIONS

pytestmark = pytest.mark.reliability


@dataclass
class Served:
    port: int
    pid: int  # the process that answers: the address server, or the rank in thread mode


@pytest.fixture
def served(tmp_dir: Path, reaper: Reaper, serve_mode: str) -> Served:  # (both serving modes)
    port = free_port()
    start_exporter_rank(reaper, tmp_dir, port, tick_hz=20)
    pid = wait_until(lambda: healthz(port)["owner"]["server_pid"], message="the serving process")
    wait_until(lambda: try_scrape(port), message="a first scrape")
    return Served(port, pid)


def _connect(port: int, source: str = "127.0.0.1", timeout: float = 10.0) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    return sock


def _answer(port: int, request: bytes) -> bytes:
    """Send ``request`` and nothing more; what the server answered before it closed."""
    with _connect(port) as sock:
        with contextlib.suppress(OSError):
            sock.sendall(request)
            sock.shutdown(socket.SHUT_WR)
        chunks = []
        with contextlib.suppress(OSError):
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks)


MALFORMED = {
    "garbage": (b"GARBAGE\r\n\r\n", 400),
    "binary": (b"\x00\xff\xfe garbage \x01\r\n\r\n", 400),
    "http-0.9": (b"GET /metrics\r\n\r\n", 400),
    "version-9.9": (b"GET /metrics HTTP/9.9\r\n\r\n", 505),
    "version-2.0": (b"GET /metrics HTTP/2.0\r\n\r\n", 505),
    "not-a-version": (b"GET /metrics HTTX/1.1\r\n\r\n", 400),
    "content-length-superscript": (b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: \xb2\r\n\r\n", 400),
    "content-length-negative": (b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n", 400),
    "content-length-plus": (b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: +3\r\n\r\nabc", 400),
    "content-lengths-conflicting": (b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nContent-Length: 4\r\n"
                                    b"\r\nabcd", 400),
    "too-many-fields": (b"GET /metrics HTTP/1.1\r\n" + b"X-A: 1\r\n" * (MAX_HEADER_FIELDS + 1) + b"\r\n", 431),
    "fields-too-long": (b"GET /metrics HTTP/1.1\r\nX-Big: " + b"a" * MAX_HEADER_BYTES + b"\r\n\r\n", 431),
    "request-line-too-long": (b"GET /" + b"a" * MAX_REQUEST_LINE + b" HTTP/1.1\r\n\r\n", 414),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_every_malformed_request_gets_an_http_1_1_status_line(served: Served, case: str) -> None:
    request, status = MALFORMED[case]
    answer = _answer(served.port, request)
    assert answer.startswith(f"HTTP/1.1 {status} ".encode()), answer[:200]
    assert try_scrape(served.port) is not None  # and the endpoint stays up


def test_what_real_scrapers_send_is_within_the_bounds(served: Served) -> None:
    fields = b"".join(f"X-Field-{i}: {'v' * 100}\r\n".encode() for i in range(MAX_HEADER_FIELDS - 2))
    answer = _answer(served.port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + fields + b"Connection: close\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]


def test_many_large_headers_from_stalled_connections_cost_bounded_memory(served: Served) -> None:
    """64 connections, each sending 99 header fields of 64 KB and then stalling (not closing)."""
    baseline = vm_status(served.pid)["VmRSS"]
    field = b"X-Huge: " + b"a" * 64000 + b"\r\n"  # (64 KB: under http.server's 64 KiB a line)
    held: list[socket.socket] = []
    peak = baseline
    try:
        for _ in range(MAX_CONNECTIONS):
            sock = _connect(served.port, timeout=2.0)
            held.append(sock)
            with contextlib.suppress(OSError):  # refused with its 431 once past the bound, or a full buffer
                sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
                for _ in range(99):
                    sock.sendall(field)
            peak = max(peak, vm_status(served.pid)["VmRSS"])
        assert try_scrape(served.port) is not None
        peak = max(peak, vm_status(served.pid)["VmRSS"])
    finally:
        for sock in held:
            sock.close()
    assert peak - baseline <= 32 << 10, f"grew by {(peak - baseline) >> 10} MiB"
    wait_until(lambda: vm_status(served.pid)["VmRSS"] - baseline <= 8 << 10, timeout=DEADLINE_S * 2,
               message="the serving process back within 8 MiB of where it started")


class SlowPeer:
    """A client at another address (127.0.0.2) holding ``count`` slow partial requests, re-opening each one the
    server cuts or refuses, until stopped."""

    def __init__(self, port: int, count: int) -> None:
        self.port, self.count = port, count
        self.opened = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _open(self) -> socket.socket | None:
        with contextlib.suppress(OSError):
            sock = _connect(self.port, source="127.0.0.2", timeout=2.0)
            sock.sendall(b"GET /metr")  # and no more: a slow request
            self.opened += 1
            return sock
        return None

    def _run(self) -> None:
        socks = [s for s in (self._open() for _ in range(self.count)) if s is not None]
        while not self._stop.is_set():
            readable, _, _ = select.select(socks, [], [], 0.05) if socks else ([], [], [])
            for sock in readable:  # a 503, or the server's EOF: it was refused or cut
                socks.remove(sock)
                sock.close()
            while len(socks) < self.count and not self._stop.is_set():
                sock = self._open()
                if sock is None:
                    break
                socks.append(sock)
        for sock in socks:
            sock.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(DEADLINE_S)


@pytest.fixture
def slow_peer(served: Served) -> Iterator[SlowPeer]:
    peer = SlowPeer(served.port, count=80)
    yield peer
    peer.close()


def test_one_peer_holding_slow_requests_cannot_starve_a_scraper_at_another_address(
        served: Served, slow_peer: SlowPeer) -> None:
    wait_until(lambda: slow_peer.opened >= 80, message="the slow peer's 80 connections")
    answered = 0
    for _ in range(30):  # a scraper every 0.25 s (Prometheus scrapes every 15 s or so: this is 60x that)
        answered += try_scrape(served.port, timeout=5.0) is not None
        time.sleep(0.25)  # the scraper's interval, not a wait for a state
    assert answered >= 29, f"{answered} of 30 scrapes answered while one peer held {slow_peer.count} slow requests"
    assert MAX_CONNECTIONS // PEER_SHARE < slow_peer.count  # (the peer asked for more than its share)


def test_the_gunicorn_aggregator_has_the_same_request_bounds(tmp_path: Path) -> None:
    directory, port = tmp_path / "mp", free_port()
    with Reaper() as r:
        r.spawn(procfile_web_command(), rank_env(directory, port, GUNICORN_WORKERS="1", GUNICORN_THREADS="2"),
                cwd=tmp_path)
        wait_until(lambda: healthz(port)["owner"]["serving"] == "gunicorn", timeout=DEADLINE_S * 2,
                   message="the aggregator answering")
        too_many = _answer(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + b"X-A: 1\r\n" * (MAX_HEADER_FIELDS + 1)
                           + b"\r\n")
        assert too_many.startswith(b"HTTP/1.1 4"), too_many[:200]
        long_line = _answer(port, b"GET /" + b"a" * MAX_REQUEST_LINE + b" HTTP/1.1\r\n\r\n")
        assert long_line.startswith(b"HTTP/1.1 4"), long_line[:200]
        within = b"".join(f"X-Field-{i}: v\r\n".encode() for i in range(MAX_HEADER_FIELDS - 2))
        fine = _answer(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + within + b"Connection: close\r\n\r\n")
        assert fine.startswith(b"HTTP/1.1 200 "), fine[:200]
