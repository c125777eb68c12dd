"""Memory bounded under slow readers (issue 44): what the address server holds for answers in flight.

A body is held until its answer is sent, which a client that never reads stretches to the request's deadline;
concurrent /metrics requests share one collection and its bytes (app.web.SharedScrapes), so clients that never
read hold references to a few bodies, not one body each.  A real address server, real sockets, measured in
/proc.
"""

from __future__ import annotations

import contextlib
import http.client
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
    HttpResponse,
    Reaper,
    free_port,
    healthz,
    http_get,
    kill_server_and_spare,
    metrics_url,
    reaper_fixture,
    start_exporter_rank,
    try_scrape,
    wait_until,
)
from support_forge import store_bytes

from store import DEFAULT_BUCKETS_US
from store import layout as L

pytestmark = pytest.mark.reliability

MIB = 1 << 20
SLOW_STORES = 950  # departed stores of the default buckets: a body of about 7 MB
NEVER_READING = 60
LARGE_STORES = 50_000  # a body of about 360 MB


def _status_kib(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0])
    return out


def _populate(directory: Path, count: int, first_pid: int = 100_000) -> None:
    """``count`` departed stores of distinct pids (so none is dropped as a duplicate), stamped now: one image,
    its pid patched per file, which writes 50 000 of them in a couple of seconds."""
    slots = L.SLOT_COUNT
    image = bytearray(store_bytes(1, 0, "agent", "host-f", "", tuple(DEFAULT_BUCKETS_US), [7] * slots, [7] * slots,
                                  [7] * (slots * L.BUCKET_SLOTS), [7] * slots, time.monotonic_ns()))
    start, size = L.PID_FIELD
    for pid in range(first_pid, first_pid + count):
        image[start:start + size] = pid.to_bytes(size, "little")
        (directory / L.store_file_name(pid, 1, 0)).write_bytes(image)


def _scrape(port: int) -> HttpResponse | None:
    with contextlib.suppress(OSError):
        response = http_get(metrics_url(port), timeout=DEADLINE_S * 3)
        return response if response.status == 200 else None
    return None


@dataclass
class Server:
    port: int
    pid: int  # the address server's


@pytest.fixture
def server(tmp_dir: Path, reaper: Reaper) -> Iterator[Server]:
    """An address server over ``tmp_dir`` (departed stores are published for an hour), before any store of ours;
    killed with its spare at the end (it would serve the departed stores for that hour)."""
    port = free_port()
    start_exporter_rank(reaper, tmp_dir, port, extra_env={"NIXL_TELEMETRY_MP_STALE_TTL": "3600"})
    pid = wait_until(lambda: healthz(port)["owner"]["server_pid"], message="the address server")
    yield Server(port, pid)
    kill_server_and_spare(port)


@contextlib.contextmanager
def _never_reading(port: int, count: int) -> Iterator[list[socket.socket]]:
    """``count`` clients, from two peer addresses (each within its share of connections), that send
    ``GET /metrics`` and never read; their receive buffers as small as the kernel allows."""
    socks: list[socket.socket] = []
    try:
        for i in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.bind((f"127.0.0.{2 + i % 2}", 0))
            sock.settimeout(DEADLINE_S)
            sock.connect(("127.0.0.1", port))
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        yield socks
    finally:
        for sock in socks:
            sock.close()


def test_clients_that_never_read_hold_a_few_bodies_not_one_each(tmp_dir: Path, server: Server) -> None:
    _populate(tmp_dir, SLOW_STORES)
    body = wait_until(lambda: try_scrape(server.port), message="a scrape of the stores")
    assert len(body) >= 7_000_000
    alone_kib = _status_kib(server.pid)["VmHWM"]  # the server's peak with one collection, one body, behind it
    with _never_reading(server.port, NEVER_READING) as socks:
        # Readable: its answer began, so its body was rendered and is being sent (and held until the deadline).
        wait_until(lambda: len(select.select(socks, [], [], 0)[0]) == len(socks), timeout=DEADLINE_S,
                   message=f"every one of the {NEVER_READING} answers begun")
        # A scraper at a third address is answered whole meanwhile, with a body of its own collection.
        third = try_scrape(server.port, timeout=DEADLINE_S)
        assert third is not None and len(third) >= 7_000_000
        peak_kib = _status_kib(server.pid)["VmHWM"]  # (the high-water mark: nothing between samples is missed)
    # One body each would be 60 bodies more (718 MiB measured before the bodies were shared); shared, and at most
    # MAX_HELD flights' bodies held by answers in flight, the peak is a few bodies and a collection above one
    # scrape's: 117-124 MiB (55 MiB after one scrape), beside a CPU burner too (docs/operations.md, "HTTP").
    bodies = (peak_kib - alone_kib) / (len(body) / 1024)
    assert bodies < 20, f"the server peaked at {peak_kib >> 10} MiB, {bodies:.0f} bodies above one scrape's"


def _count_body(port: int) -> int:
    """GET /metrics, reading the body as it comes and keeping none of it: its length."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=DEADLINE_S * 3)
    try:
        connection.request("GET", "/metrics")
        response = connection.getresponse()
        assert response.status == 200, response.status
        length = 0
        while chunk := response.read(1 << 20):
            length += len(chunk)
        assert length == int(response.getheader("Content-Length", "-1"))
        return length
    finally:
        connection.close()


def test_concurrent_scrapes_of_a_large_directory_hold_at_most_two_bodies(tmp_dir: Path, server: Server) -> None:
    """50 000 departed stores: four clients scraping at once, twice each.  A scrape reads its stores a batch at a
    time and its body is never copied whole; a body being sent while the next collection renders is the most
    the server holds: at most two bodies and 100 MiB (before: 4.4 GB for a 205 MB body)."""
    _populate(tmp_dir, LARGE_STORES)
    size = _count_body(server.port)
    assert size > 300 * MIB
    sizes: list[int] = []
    failures: list[BaseException] = []

    def client() -> None:
        try:
            for _ in range(2):
                sizes.append(_count_body(server.port))
        except BaseException as exc:  # (said by the assertion below)
            failures.append(exc)

    clients = [threading.Thread(target=client) for _ in range(4)]
    for thread in clients:
        thread.start()
    for thread in clients:
        thread.join(timeout=DEADLINE_S * 20)
    assert not failures and sizes == [size] * 8, (failures, sizes)
    peak = _status_kib(server.pid)["VmHWM"] * 1024
    assert peak <= 2 * size + 100 * MIB, f"the server peaked at {peak / MIB:.0f} MiB for a {size / MIB:.0f} MiB body"
    # Sent (the server lets a body go just after its last byte), the bodies' memory goes back to the system
    # (app.malloc): 721 MiB stayed when glibc kept it.
    wait_until(lambda: _status_kib(server.pid)["VmRSS"] * 1024 < size,
               message="the server's memory back under one body once the bodies are sent")
