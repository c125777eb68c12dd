"""HTTP abuse against a serving rank: parallel scrapes, slow and trickling clients, malformed requests, huge
headers and bodies, connection floods.  The rank keeps answering, its threads, descriptors and memory stay
bounded, and nothing it logs grows with what a client sends."""

from __future__ import annotations

import contextlib
import http.client
import re
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from support import (
    Reaper,
    free_port,
    healthz,
    http_request,
    metrics_url,
    parse_exposition,
    start_exporter_rank,
    wait_until,
)
from support_reliability import vm_status

from app.server import MAX_CONNECTIONS

pytestmark = pytest.mark.reliability


class Server:
    def __init__(self, pid: int, port: int, rank) -> None:  # pid: the serving process
        self.pid, self.port, self.rank = pid, port, rank

    def url(self, path: str = "/metrics") -> str:
        return metrics_url(self.port, path)

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=10)

    def raw(self, data: bytes, timeout: float = 10) -> bytes:
        """Send raw bytes and nothing more, read until the server closes; what it answered (b"" if it reset).

        (Nothing more: the client shuts its side down, so that a server keeping the connection for a next request
        closes it once it has answered this one.)
        """
        with self.connect() as sock:
            sock.settimeout(timeout)
            with contextlib.suppress(OSError):
                sock.sendall(data)
                sock.shutdown(socket.SHUT_WR)
            chunks = []
            with contextlib.suppress(ConnectionResetError, BrokenPipeError):
                while chunk := sock.recv(65536):
                    chunks.append(chunk)
            return b"".join(chunks)

    def ok(self) -> bool:
        response = http_request(self.url(), timeout=5)
        return response.status == 200 and bool(parse_exposition(response.text))


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    directory = tmp_path_factory.mktemp("http") / "mp"
    directory.mkdir(mode=0o700)
    port = free_port()
    with Reaper() as reaper:
        rank = start_exporter_rank(reaper, directory, port, agent="served", tick_hz=20)
        assert rank.serving_at_start
        # The process that answers (the address server, or the rank itself in thread mode) is the one whose
        # threads, descriptors and memory must stay bounded.
        serving = wait_until(lambda: healthz(port)["owner"]["server_pid"], message="the serving process")
        yield Server(serving, port, rank)
        assert "Traceback" not in rank.stderr(), rank.stderr()[-3000:]


def settle(server: Server, baseline: dict[str, int], slack: int = 3) -> dict[str, int]:
    """Wait (bounded) until the server's threads and descriptors are back near ``baseline``."""
    return wait_until(lambda: (s := vm_status(server.pid))["Threads"] <= baseline["Threads"] + slack
                      and s["fds"] <= baseline["fds"] + slack and s, timeout=15,
                      message="the server's threads and descriptors back to their baseline")


def test_fifty_parallel_scrapes_all_answered(server):
    """From five peers (127.0.0.1 to .5: several Prometheus servers and their operators' curls), ten each at once.
    (One peer holds at most half the server's connections: past that, its scrapes still in flight make the
    server answer its next ones 503, by design: test_hostile_clients.py.)"""
    barrier = threading.Barrier(50)
    results: list[object] = []

    def one(peer: str) -> None:
        barrier.wait(timeout=10)
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=15, source_address=(peer, 0))
        try:
            connection.request("GET", "/metrics")
            response = connection.getresponse()
            text = response.read().decode()
            results.append(response.status if response.status != 200 or parse_exposition(text) else "empty")
        except Exception as exc:
            results.append(repr(exc))
        finally:
            connection.close()

    threads = [threading.Thread(target=one, args=(f"127.0.0.{1 + n % 5}",)) for n in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert results == [200] * 50, results


def test_slow_and_trickling_clients_do_not_block_others_and_are_cut(server):
    baseline = vm_status(server.pid)
    held = []
    for _ in range(20):  # half a request line, then silence
        sock = server.connect()
        sock.sendall(b"GET /metr")
        held.append(sock)
    trickler = server.connect()  # one byte per second: never idle long enough for a per-read timeout
    trickler.sendall(b"GET /metrics HTTP/1.1\r\nX-Slow: ")
    http09 = server.connect()  # an HTTP/0.9 request line: answered 400 at once (http.server alone waited for headers)
    http09.sendall(b"GET /metrics\r\n")
    started = time.monotonic()
    try:
        # Each scrape answered within ok()'s 5 s timeout: a server that the held clients blocked would keep the
        # scraper waiting for their 10 s deadline (REQUEST_TIMEOUT_S), so the timeout tells the two apart.
        for _ in range(10):
            assert server.ok()
        cut = None
        while time.monotonic() - started < 20:
            try:
                trickler.sendall(b"a")
            except OSError:
                cut = time.monotonic() - started
                break
            time.sleep(1.0)
        assert cut is not None and cut < 15, f"a trickling client held a server thread for {cut} s"
        for sock in held:  # the silent ones were cut too: EOF (or a reset), maybe after a 408
            sock.settimeout(5)
            with contextlib.suppress(ConnectionResetError):
                answer = sock.recv(100)
                assert answer == b"" or answer.startswith(b"HTTP/1.1 408"), answer
        http09.settimeout(5)
        with contextlib.suppress(ConnectionResetError):
            answer = http09.recv(100)
            assert answer.startswith(b"HTTP/1.1 400 "), answer
        settle(server, baseline)
        assert server.ok()
    finally:
        for sock in [*held, trickler, http09]:
            sock.close()


def status_of(answer: bytes) -> int | None:  # (every answer has a status line: tests/test_hostile_clients.py)
    """The status of a raw answer; http.server answers a request line it reads as HTTP/0.9 without a status
    line, with only the error page (which names the code)."""
    if answer.startswith(b"HTTP/"):
        return int(answer.split(b" ", 2)[1])
    match = re.search(rb"Error code: (\d{3})", answer)
    return int(match.group(1)) if match else None


@pytest.mark.parametrize(("request_bytes", "statuses"), [
    (b"\x00\xff\xfe garbage \x01\r\n\r\n", {400}),
    (b"GET\r\n\r\n", {400}),
    (b"GET /metrics HTTP/1.1 extra\r\n\r\n", {400}),
    (b"GET /metrics HTTP/9.9\r\n\r\n", {505}),
    (b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999999999999\r\n\r\n", {200, 400, 413}),
    (b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n", {400}),
    (b"GET /metrics HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", {200, 400}),
    (b"GET /metrics HTTP/1.1\r\n" + b"X-Many: 1\r\n" * 200 + b"\r\n", {431}),
    (b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n", {414}),
    (b"GET /metrics HTTP/1.1\r\nBad Header Without Colon\r\n\r\n", {200, 400}),
    (b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello", {405}),
    (b"FOO /metrics HTTP/1.1\r\nHost: x\r\n\r\n", {405}),
    (b"GET /../../etc/passwd HTTP/1.1\r\nHost: x\r\n\r\n", {404}),
    (b"GET http://evil.example/metrics HTTP/1.1\r\nHost: x\r\n\r\n", {200, 400, 404}),
])
def test_malformed_requests_get_a_client_error_and_the_server_stays_up(server, request_bytes, statuses):
    answer = server.raw(request_bytes)
    assert status_of(answer) in statuses, answer[:300]
    assert server.ok()


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "CONNECT"])
@pytest.mark.parametrize("path", ["/metrics", "/healthz"])
def test_unsupported_methods_are_405(server, method, path):
    response = http_request(server.url(path), method=method, timeout=5)
    assert response.status == 405, (response.status, response.body[:200])
    assert set(response.headers["allow"].replace(" ", "").split(",")) == {"GET", "HEAD"}


@pytest.mark.parametrize("path", ["/metrics/", "/metricsx", "/healthz/x", "/favicon.ico", "/%00", "/%ff"])
def test_unknown_paths_are_404(server, path):
    assert http_request(server.url(path), timeout=5).status == 404


def test_head_and_query_strings(server):
    head = http_request(server.url(), method="HEAD", timeout=5)
    assert head.status == 200 and head.body == b""
    assert http_request(server.url("/metrics?x=1&x=2"), timeout=5).status == 200
    assert http_request(server.url("/healthz?verbose"), timeout=5).status == 200


def test_huge_header_line_is_refused_without_memory_blowup(server):
    before = vm_status(server.pid)
    for _ in range(5):
        answer = server.raw(b"GET /metrics HTTP/1.1\r\nX-Huge: " + b"a" * (1 << 20) + b"\r\n\r\n")
        assert answer == b"" or answer.startswith((b"HTTP/1.1 431", b"HTTP/1.0 431", b"HTTP/1.1 400")), answer[:80]
    assert vm_status(server.pid)["VmRSS"] - before["VmRSS"] < 20_000
    assert server.ok()


def test_streamed_request_bodies_do_not_grow_memory(server):
    """Clients that keep sending after their request: the server reads (and drops) a bounded amount."""
    before = vm_status(server.pid)
    payload = b"x" * (1 << 20)

    def stream() -> None:
        with contextlib.suppress(OSError), server.connect() as sock:
            sock.sendall(b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000\r\n\r\n")
            for _ in range(30):
                sock.sendall(payload)

    threads = [threading.Thread(target=stream) for _ in range(16)]
    for t in threads:
        t.start()
    peak = 0
    while any(t.is_alive() for t in threads):
        peak = max(peak, vm_status(server.pid)["VmRSS"])
        time.sleep(0.01)
    for t in threads:
        t.join(timeout=30)
    assert peak - before["VmRSS"] < 40_000, f"RSS grew by {peak - before['VmRSS']} kB while clients streamed"
    assert server.ok()


def test_connection_flood_is_capped_and_recovers(server):
    baseline = vm_status(server.pid)
    flood = []
    try:
        for _ in range(MAX_CONNECTIONS * 3):
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            flood.append(sock)
        time.sleep(0.5)
        during = vm_status(server.pid)
        assert during["Threads"] <= baseline["Threads"] + MAX_CONNECTIONS + 2, during
        assert during["fds"] <= baseline["fds"] + MAX_CONNECTIONS + 8, during
        # Refused connections were told so (503) or closed at once, not left queued.
        refused = 0
        for sock in flood[MAX_CONNECTIONS + 8:]:
            sock.settimeout(5)
            with contextlib.suppress(ConnectionResetError):
                answer = sock.recv(200)
                refused += answer == b"" or answer.startswith(b"HTTP/1.1 503")
        assert refused >= MAX_CONNECTIONS, refused
    finally:
        for sock in flood:
            sock.close()
    settle(server, baseline)
    assert server.ok()


def test_memory_and_threads_bounded_across_2000_requests(server):
    requests = [
        ("GET", "/metrics", {}), ("GET", "/metrics", {"Accept-Encoding": "gzip"}),
        ("GET", "/metrics", {"Accept": "application/openmetrics-text; version=1.0.0"}),
        ("GET", "/healthz", {}), ("HEAD", "/metrics", {}), ("GET", "/nope", {}), ("POST", "/metrics", {}),
    ]
    raw = [b"garbage\r\n\r\n", b"GET /metrics HTTP/1.1\r\nX-Huge: " + b"b" * 70000 + b"\r\n\r\n"]

    def burst(n: int) -> None:
        for i in range(n):
            if i % 10 == 9:
                server.raw(raw[i % 2])
            else:
                method, path, headers = requests[i % len(requests)]
                assert http_request(server.url(path), method=method, headers=headers, timeout=10).status in (
                    200, 404, 405)

    burst(200)  # warm-up: caches, allocator arenas, the first thread stacks
    baseline = vm_status(server.pid)
    log_size = len(server.rank.stderr())
    workers = [threading.Thread(target=burst, args=(500,)) for _ in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
    assert not any(w.is_alive() for w in workers)
    after = settle(server, baseline)
    assert after["VmRSS"] - baseline["VmRSS"] < 10_000, (baseline, after)
    assert server.ok()
    # 200 malformed requests later, the rank's log (WARNING and up on stderr) has not grown by a line.
    assert server.rank.stderr()[log_size:] == ""
