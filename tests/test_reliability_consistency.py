"""Consistency under concurrent scrapes: writers at full speed, several scrapers at once.

What the design guarantees (every word is one aligned 8-byte store, a reader copies the store with one pread,
the exposition derives _count and the cumulative buckets from the per-bucket words):

- per series, counters, buckets, _count and _sum never go backwards between two scrapes;
- in every scrape, a histogram's _count equals its +Inf bucket and its buckets are monotonic in le.

What it does not guarantee, and is therefore not asserted: that _sum agrees with the buckets (or with the
matching *_total counter) in one scrape -- a scrape can copy the store between a writer's bucket and its sum.
"""

from __future__ import annotations

import math
import threading
import time
from collections import defaultdict

import pytest
from support import (
    free_port,
    http_get,
    metrics_url,
    parse_exposition,
    reaper_fixture,  # noqa: F401  (a fixture)
)
from support_reliability import start_workload_ranks

from store import read_snapshot
from store.reader import Snapshot

pytestmark = pytest.mark.reliability

SCRAPERS = 4
DURATION_S = 4.0
CUMULATIVE_SUFFIXES = ("_total", "_bucket", "_count", "_sum")


def check_scrape(samples: dict) -> list[str]:
    """Histogram invariants inside one scrape."""
    problems = []
    buckets: dict[tuple[str, frozenset], list[tuple[float, float]]] = defaultdict(list)
    counts = {}
    for (name, labels), value in samples.items():
        if name.endswith("_bucket"):
            le = dict(labels)["le"]
            base = frozenset((k, v) for k, v in labels if k != "le")
            buckets[(name.removesuffix("_bucket"), base)].append((math.inf if le == "+Inf" else float(le), value))
        elif name.endswith("_count"):
            counts[(name.removesuffix("_count"), labels)] = value
    for key, series in buckets.items():
        series.sort()
        values = [v for _, v in series]
        if values != sorted(values):
            problems.append(f"{key}: buckets not monotonic in le: {series}")
        if series[-1][0] != math.inf or counts.get(key) != series[-1][1]:
            problems.append(f"{key}: _count {counts.get(key)} != +Inf bucket {series[-1]}")
    return problems


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("serve_mode")  # read by an address server, or by a rank recording at full speed itself
def test_concurrent_scrapes_see_monotonic_counters_and_consistent_histograms(tmp_dir, reaper):
    port = free_port()
    ranks = start_workload_ranks(reaper, 2, tmp_dir, port)
    assert sum(r.serving_at_start for r in ranks) == 1
    for rank in ranks:  # the owner records at full speed too (serving from a thread: beside its server threads)
        assert rank.command("spin", threads=2)["spinning"]

    stop = threading.Event()
    problems: list[str] = []
    scrapes = [0] * SCRAPERS

    def scraper(n: int) -> None:
        previous: dict = {}
        while not stop.is_set():
            try:
                response = http_get(metrics_url(port), timeout=10)
                assert response.status == 200, response.status
                samples = parse_exposition(response.text)
            except Exception as exc:
                problems.append(f"scraper {n}: {exc!r}")
                return
            scrapes[n] += 1
            problems.extend(check_scrape(samples))
            for key, value in samples.items():
                if key[0].endswith(CUMULATIVE_SUFFIXES) and key in previous and value < previous[key]:
                    problems.append(f"scraper {n}: {key} went back from {previous[key]} to {value}")
            previous = samples
            if len(problems) > 20:
                return

    threads = [threading.Thread(target=scraper, args=(n,), daemon=True) for n in range(SCRAPERS)]
    for t in threads:
        t.start()
    time.sleep(DURATION_S)
    stop.set()
    for t in threads:
        t.join(timeout=30)
    for rank in ranks:
        assert rank.command("unspin")["stopped"]
    assert not problems, problems[:10]
    assert min(scrapes) >= 5, scrapes


def _words(snap: Snapshot) -> tuple[int, ...]:
    return snap.counters + snap.buckets + snap.sums


@pytest.mark.timeout(60)
def test_raw_reads_never_see_a_torn_word(tmp_dir, reaper):
    """The reader's single pread against two processes writing at full speed: per store, every counter,
    bucket and sum word only grows from one read to the next (a torn 8-byte word would show as a jump back)."""
    ranks = start_workload_ranks(reaper, 2, tmp_dir, free_port())
    for rank in ranks:
        assert rank.command("spin", threads=2)["spinning"]
    previous: dict = {}
    reads = 0
    deadline = time.monotonic() + 2.5
    try:
        while time.monotonic() < deadline:
            for rank in ranks:
                snap = read_snapshot(rank.store)
                assert isinstance(snap, Snapshot), snap
                words = _words(snap)
                old = previous.get(rank.pid)
                if old is not None:
                    back = [i for i, (a, b) in enumerate(zip(old, words, strict=True)) if b < a]
                    assert not back, f"pid {rank.pid}: words {back[:5]} went backwards"
                previous[rank.pid] = words
                reads += 1
    finally:
        for rank in ranks:
            rank.command("unspin")
    assert reads > 1000, reads
