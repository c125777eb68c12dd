"""Resource hygiene: no descriptor or thread leak across many Exporter lifetimes and scrapes; close() is
idempotent, safe from several threads at once, and leaves nothing running, bound or locked.  Both ways of serving:
from a thread of the rank, and through an address server, which is the job's (it goes by itself once nothing in
the directory is live: at once here, where the TTL is 0)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import threading
import time
from pathlib import Path

import pytest
from support import (
    DEADLINE_S,
    can_bind,
    exporter_env,
    free_port,
    http_request,
    lock_is_free,
    metrics_url,
    open_fds,
    wait_until,
    wait_until_settled,
)

from app import Exporter
from election import lock_file_name
from store import EventType

pytestmark = pytest.mark.reliability


def settled(fds: int, threads: int) -> None:
    """Wait (bounded) until this process is back to ``fds`` descriptors and ``threads`` threads; if it never
    is, say what is open and running at the end of the wait (not at its start)."""
    try:
        wait_until(lambda: len(open_fds()) <= fds and threading.active_count() <= threads, timeout=20,
                   message=f"descriptors back to {fds} and threads to {threads}")
    except AssertionError as exc:
        open_now = open_fds()
        raise AssertionError(f"{exc}: now {len(open_now)} descriptors {open_now} and threads "
                             f"{[t.name for t in threading.enumerate()]}") from None


def scrape_ok(port: int) -> bool:
    response = http_request(metrics_url(port), headers={"Connection": "close"}, timeout=5)
    return response.status == 200 and b"agent_tx_bytes_total" in response.body


def ours() -> list[str]:
    """The threads of ours in this process (their names start with "nixl")."""
    return [t.name for t in threading.enumerate() if t.name.startswith("nixl")]


def address_given_up(port: int, lock: Path) -> None:
    """Wait (bounded) until nothing holds the address: at once in thread mode once its rank closed; with an address
    server (TTL 0 here), once the server saw nothing live in the directory (it looks every second)."""
    wait_until(lambda: can_bind(port) and lock_is_free(lock), message=f"port {port} and its election free")


@pytest.mark.timeout(180)
def test_many_exporter_lifetimes_leak_no_descriptor_nor_thread(tmp_dir, serve_mode):
    port = free_port()
    lock = tmp_dir / lock_file_name(f"127.0.0.1:{port}")
    env = exporter_env(tmp_dir, port, NIXL_TELEMETRY_MP_STALE_TTL="0")
    with Exporter("warm-up", env) as exp:  # imports, caches and the first thread stacks
        exp.export_event(EventType.AGENT_TX_BYTES, 1)
        assert scrape_ok(port)
    address_given_up(port, lock)
    # The warm-up's serving threads end with it (thread mode's server thread).
    wait_until(lambda: ours() == [], timeout=DEADLINE_S * 2, message="the warm-up's serving threads to end")
    fds0, threads0 = len(open_fds()), threading.active_count()

    # Each one wins the election, binds, serves (from a thread, or starts its address server) and gives it all
    # back (an address server goes by itself once nothing is live: a second or so per lifetime).
    for cycle in range(100 if serve_mode == "thread" else 20):
        exp = Exporter(f"cycle-{cycle}", env)
        try:
            assert exp.serving, cycle
            exp.record_transfer(100, 5, 4096, is_write=cycle % 2 == 0)
            if cycle % 4 == 0:
                assert scrape_ok(port)
        finally:
            exp.close()
        address_given_up(port, lock)
    settled(fds0, threads0)

    with Exporter("holder", env) as holder:  # now 200 writer-only lifetimes beside a serving owner
        assert holder.serving
        wait_until_settled(port, env)
        fds, threads = len(open_fds()), threading.active_count()
        for cycle in range(200):
            with Exporter(f"writer-{cycle}", env) as exp:
                assert not exp.serving
                exp.export_event(EventType.AGENT_RX_BYTES, cycle)
        for _ in range(300):
            assert scrape_ok(port)
        settled(fds, threads)  # nothing of the writers stays
    address_given_up(port, lock)
    settled(fds0, threads0)
    assert len(list(tmp_dir.glob("nixl.*.mmap"))) <= 2  # departed stores reaped as they go (TTL 0)


@pytest.mark.timeout(60)
def test_concurrent_close_is_idempotent_and_leaves_nothing_running(tmp_dir, serve_mode):
    port = free_port()
    baseline_threads = set(threading.enumerate())  # the threads themselves: the OS reuses a dead thread's ident
    fds = len(open_fds())
    exp = Exporter("closing", exporter_env(tmp_dir, port, NIXL_TELEMETRY_MP_STALE_TTL="0"))
    assert exp.serving
    lock = tmp_dir / lock_file_name(exp.address)
    # The store opened now: an address server (TTL 0) may reap it as soon as its writer has let it go.
    store = os.open(exp.store_path, os.O_RDONLY | os.O_CLOEXEC)
    # A client holding a connection open: close() must not wait for it (nor, serving from a thread, leave its
    # thread serving; an address server's connection is the server's, cut when it goes).
    slow = socket.create_connection(("127.0.0.1", port), timeout=10)
    slow.sendall(b"GET /metr")
    stop = threading.Event()
    errors: list[BaseException] = []

    def exporting() -> None:
        try:
            while not stop.is_set():
                exp.record_transfer(10, 1, 64, is_write=True)
        except BaseException as exc:
            errors.append(exc)

    def closing(barrier: threading.Barrier) -> None:
        try:
            barrier.wait(timeout=10)
            exp.close()
        except BaseException as exc:
            errors.append(exc)

    exporters = [threading.Thread(target=exporting) for _ in range(2)]
    for t in exporters:
        t.start()
    time.sleep(0.05)  # the exporting threads under way (not a wait for a state)
    barrier = threading.Barrier(8)
    closers = [threading.Thread(target=closing, args=(barrier,)) for _ in range(8)]
    started = time.monotonic()
    for t in closers:
        t.start()
    for t in closers:
        t.join(timeout=10)
    took = time.monotonic() - started
    stop.set()
    for t in exporters:
        t.join(timeout=10)
    assert not errors, errors
    assert took < 5, f"close() took {took:.1f} s"  # (the slow client's request would hold it 10 s)
    exp.close()  # once more: a no-op
    assert not exp.serving
    def writer_let_go() -> bool:  # (a moment's exclusive lock is the address server's reaper probing it)
        try:
            fcntl.flock(store, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    try:
        wait_until(writer_let_go, timeout=10, message="the closed Exporter's writer to let its store go")
    finally:
        os.close(store)
    # Serving from a thread, close() freed the port, then the election; an address server (the job's) gives them
    # up itself once nothing of the directory is live (TTL 0): the rank kept no copy of either.
    address_given_up(port, lock)
    slow.settimeout(5)  # cut by close() or the server's exit, never left to its 10 s timeout: a timeout fails
    with contextlib.suppress(ConnectionResetError):
        assert not slow.recv(100).startswith(b"HTTP/1.1 200")
    slow.close()
    wait_until(lambda: set(threading.enumerate()) <= baseline_threads, timeout=10,
               message="every thread the exporter started to end")
    assert len(open_fds()) <= fds
    assert not [t for t in threading.enumerate() if not t.daemon and t is not threading.main_thread()]
