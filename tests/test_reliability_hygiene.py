"""Resource hygiene: no descriptor or thread leak across many Exporter lifetimes and scrapes; close() is
idempotent, safe from several threads at once, and leaves nothing running, bound or locked."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time

import pytest
from support import (
    can_bind,
    exporter_env,
    free_port,
    http_request,
    metrics_url,
    try_scrape,
    wait_until,
    wait_until_settled,
)
from support_reliability import lock_is_free

from app import Exporter
from election import lock_file_name
from store import EventType

pytestmark = pytest.mark.reliability


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def settled(fds: int, threads: int) -> None:
    """Wait (bounded) until this process is back to ``fds`` descriptors and ``threads`` threads."""
    wait_until(lambda: fd_count() <= fds and threading.active_count() <= threads, timeout=10,
               message=f"descriptors back to {fds} (now {fd_count()}) and threads to {threads} "
                       f"(now {threading.active_count()}: {[t.name for t in threading.enumerate()]})")


def scrape_ok(port: int) -> bool:
    response = http_request(metrics_url(port), headers={"Connection": "close"}, timeout=5)
    return response.status == 200 and b"agent_tx_bytes_total" in response.body


@pytest.mark.timeout(120)
def test_many_exporter_lifetimes_leak_no_descriptor_nor_thread(tmp_dir):
    port = free_port()
    env = exporter_env(tmp_dir, port, NIXL_TELEMETRY_MP_STALE_TTL="0")
    with Exporter("warm-up", env) as exp:  # imports, caches and the first thread stacks
        exp.export_event(EventType.AGENT_TX_BYTES, 1)
        assert scrape_ok(port)
    fds, threads = fd_count(), threading.active_count()

    for cycle in range(100):  # each one wins the election, binds, serves, and gives it all back
        exp = Exporter(f"cycle-{cycle}", env)
        try:
            assert exp.serving, cycle
            exp.record_transfer(100, 5, 4096, is_write=cycle % 2 == 0)
            if cycle % 4 == 0:
                assert scrape_ok(port)
        finally:
            exp.close()
    settled(fds, threads)

    with Exporter("holder", env) as holder:  # now 200 writer-only lifetimes beside a serving owner
        assert holder.serving
        wait_until_settled(port, env)
        fds, threads = fd_count(), threading.active_count()
        for cycle in range(200):
            with Exporter(f"writer-{cycle}", env) as exp:
                assert not exp.serving
                exp.export_event(EventType.AGENT_RX_BYTES, cycle)
        for _ in range(300):
            assert scrape_ok(port)
        # One thing stays while the holder serves: the writers' standby, parked in flock() (a blocked flock
        # cannot be woken without a signal handler of ours), one thread and one descriptor for all 200.
        settled(fds + 1, threads + 1)
    settled(fds, threads)  # ... and it ends once the holder is gone
    assert len(list(tmp_dir.glob("nixl.*.mmap"))) <= 2  # departed stores reaped as they go (TTL 0)


@pytest.mark.timeout(60)
def test_concurrent_close_is_idempotent_and_leaves_nothing_running(tmp_dir, lock_probe):
    port = free_port()
    baseline_threads = {t.ident for t in threading.enumerate()}
    fds = fd_count()
    exp = Exporter("closing", exporter_env(tmp_dir, port))
    assert exp.serving
    lock = tmp_dir / lock_file_name(exp.address)
    # A client holding a connection open: close() must not wait for it nor leave its thread serving.
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
    time.sleep(0.05)
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
    assert took < 3, f"close() took {took:.1f} s"
    exp.close()  # once more: a no-op
    assert not exp.serving
    # A helper that was ready when close() came stays on for this rank's last values until they are served
    # (app.rank.linger): take them, as Prometheus's next scrape would; then nothing is left.
    try_scrape(port)
    wait_until(lambda: can_bind(port), 3.0, message="the port free after close() and the last values' scrape")
    wait_until(lambda: lock_is_free(lock), 3.0, message="the election lock free after close()")
    assert lock_probe(exp.store_path), "the store lock is still held after close()"
    slow.settimeout(5)  # cut by close(), not left to its 10 s timeout: a socket.timeout here fails the test
    with contextlib.suppress(ConnectionResetError):
        assert not slow.recv(100).startswith(b"HTTP/1.1 200")
    slow.close()
    wait_until(lambda: {t.ident for t in threading.enumerate()} <= baseline_threads, timeout=10,
               message="every thread the exporter started to end")
    assert fd_count() <= fds
    assert not [t for t in threading.enumerate() if not t.daemon and t is not threading.main_thread()]
