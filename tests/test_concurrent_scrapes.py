"""Concurrent scrapes of one endpoint never fail because of each other (they share the renderer's template cache).

Ranks come and go, so that every scrape adds templates to the cache and some trim it, while several threads scrape
at once with a tiny thread switch interval: through HTTP against a served directory that churns, and directly
against one Renderer (where the race, when there was one, showed within a few hundred renders).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from support import DEADLINE_S, exporter_env, free_port, http_get, make_exporter_fixture, metrics_url  # noqa: F401
from support_forge import cpp_reference, forge_store, raw_samples, store_bytes

from app.exposition import Renderer
from store import layout as L
from store.reader import Snapshot, decode

pytestmark = pytest.mark.reliability

SCRAPERS = 8
SCRAPES_EACH = 20
RANKS_PER_ROUND = 60


def test_concurrent_scrapes_never_fail_because_of_each_other(tmp_dir: Path, make_exporter) -> None:
    port = free_port()
    # Served from a thread of this process: the tiny switch interval below is this process's (an address server's
    # threads would switch at their own pace).
    exp = make_exporter("owner", exporter_env(tmp_dir, port, NIXL_TELEMETRY_MP_STALE_TTL="3600",
                                              NIXL_PROMETHEUS_MP_SERVE="thread"))
    assert exp.serving
    stop = threading.Event()
    failures: list[str] = []
    served = [0] * SCRAPERS

    def churn() -> None:
        """Replace every forged rank by new ones (new pids, so new templates), round after round."""
        pid, previous = 100_000, []
        while not stop.is_set():
            current = [forge_store(tmp_dir, pid=pid + i, value=pid + i) for i in range(RANKS_PER_ROUND)]
            for path in previous:
                path.unlink()
            previous, pid = current, pid + RANKS_PER_ROUND

    def scrape() -> None:
        index = int(threading.current_thread().name.rpartition("-")[2])
        for _ in range(SCRAPES_EACH):
            try:
                response = http_get(metrics_url(port), timeout=DEADLINE_S * 3)
                if response.status != 200:
                    failures.append(f"status {response.status}: {response.text[:300]}")
                    continue
                raw_samples(response.text)  # parses, and no series twice
                served[index] += 1
            except Exception as exc:  # a refused or dropped connection is a failure too
                failures.append(repr(exc))

    with tiny_switch_interval():
        run_bounded([scrape] * SCRAPERS, background=churn, stop=stop)
    assert failures == []
    assert served == [SCRAPES_EACH] * SCRAPERS


def test_one_renderer_shared_by_many_threads() -> None:
    slots = L.SLOT_COUNT

    def snapshot(pid: int) -> Snapshot:
        data = store_bytes(pid, 0, "agent", "host", "", (10.0,), [pid] * slots, [1] * slots,
                           [1] * (slots * L.BUCKET_SLOTS), [1] * slots)
        snap = decode(data, Path(f"/nowhere/nixl.{pid}.1.0.mmap"))
        assert isinstance(snap, Snapshot)
        return snap

    # 12 disjoint sets of 40 ranks: each render brings in new identities and every few renders trim the cache
    sets = [[snapshot(1000 * g + i) for i in range(40)] for g in range(12)]
    expected = [cpp_reference(ranks) for ranks in sets]
    renderer = Renderer()
    failures: list[str] = []

    def render(worker: int) -> Callable[[], None]:
        def run() -> None:
            for j in range(150):
                g = (worker * 5 + j) % len(sets)
                try:
                    if renderer.render(sets[g]) != expected[g]:
                        failures.append(f"set {g}: wrong bytes")
                except Exception as exc:
                    failures.append(repr(exc))
        return run

    with tiny_switch_interval():
        run_bounded([render(w) for w in range(6)])
    assert failures == []


@contextmanager
def tiny_switch_interval() -> Iterator[None]:
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch after (almost) every bytecode: races show
    try:
        yield
    finally:
        sys.setswitchinterval(interval)


def run_bounded(workers: list[Callable[[], None]], background: Callable[[], None] | None = None,
                stop: threading.Event | None = None, timeout: float = 120) -> None:
    """Run ``workers`` in threads to completion (``background`` beside them until they finish); bounded."""
    helper = threading.Thread(target=background, name="background") if background else None
    threads = [threading.Thread(target=w, name=f"worker-{i}") for i, w in enumerate(workers)]
    try:
        if helper:
            helper.start()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=timeout)
    finally:
        if stop is not None:
            stop.set()
        if helper:
            helper.join(timeout=DEADLINE_S)
    assert not any(t.is_alive() for t in [*threads, *([helper] if helper else [])]), "a thread did not finish"
