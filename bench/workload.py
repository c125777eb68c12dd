"""The recorded data, identical for ours and the reference.

A NIXL transfer is recorded as four events: post time, transfer time (both
µs, histogrammed), bytes (counter + last-value gauge) and one request.  The
reference does the same updates with prometheus_client metrics: 4 counters
inc, 3 gauges set, 2 histograms observe.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from store.metrics import (
    COUNTER_FAMILIES,
    DEFAULT_BUCKETS_US,
    ERROR_EVENTS,
    GAUGE_FAMILIES,
    HISTOGRAM_FAMILIES,
    error_status,
)
from store.metrics import EventType as E

Transfer = tuple[int, int, int, bool]  # xfer_time_us, post_time_us, nbytes, is_write


def transfers(seed: int, count: int) -> list[Transfer]:
    """Realistic transfers: log-uniform 5 µs..200 ms, posts 1..200 µs, 4 KiB..64 MiB."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        xfer = int(math.exp(rng.uniform(math.log(5), math.log(200_000))))
        post = rng.randint(1, 200)
        nbytes = 1 << rng.randint(12, 26)
        out.append((xfer, post, nbytes, rng.random() < 0.5))
    return out


def rank_history(seed: int, transfers_per_rank: int = 100) -> tuple[list[Transfer], list[tuple[int, int]]]:
    """What one rank recorded before the scrape: transfers, plus (event, value) extras."""
    rng = random.Random(seed * 7919 + 1)
    extras = [(int(E.AGENT_MEMORY_REGISTERED), 1 << rng.randint(20, 32)) for _ in range(3)]
    extras.append((int(E.AGENT_MEMORY_DEREGISTERED), 1 << 20))
    extras += [(int(ev), 1) for ev in ERROR_EVENTS if rng.random() < 0.3]
    return transfers(seed, transfers_per_rank), extras


# -- the reference: prometheus_client metrics with the same families and samples -----------------------------

LABELS = ("hostname", "agent_name", "pid", "agent_instance", "local_rank")
# Gauges in multiprocess mode "all" get the pid label from the file name.
GAUGE_LABELS = ("hostname", "agent_name", "agent_instance", "local_rank")
# prometheus_client keys a family by its name without _total, so the counter
# agent_xfer_time_total and the gauge agent_xfer_time would be merged into one
# (wrong) family by MultiProcessCollector: the reference renames those gauges.
_GAUGE_RENAMES = {"agent_xfer_time": "agent_xfer_time_last", "agent_xfer_post_time": "agent_xfer_post_time_last"}


@dataclass
class ReferenceRank:
    """One process's bound prometheus_client children, by event."""

    counters: dict[int, Any]
    gauges: dict[int, Any]
    histograms: dict[int, Any]
    errors: dict[int, Any]

    def transfer_recorder(self) -> Callable[[int, int, int, bool], None]:
        """The nine updates of one transfer, with every child pre-bound (the fastest fair use)."""
        tx_c, rx_c = self.counters[E.AGENT_TX_BYTES], self.counters[E.AGENT_RX_BYTES]
        txr_c, rxr_c = self.counters[E.AGENT_TX_REQUESTS_NUM], self.counters[E.AGENT_RX_REQUESTS_NUM]
        tx_g, rx_g = self.gauges[E.AGENT_TX_BYTES], self.gauges[E.AGENT_RX_BYTES]
        post_c, xfer_c = self.counters[E.AGENT_XFER_POST_TIME], self.counters[E.AGENT_XFER_TIME]
        post_g, xfer_g = self.gauges[E.AGENT_XFER_POST_TIME], self.gauges[E.AGENT_XFER_TIME]
        post_h, xfer_h = self.histograms[E.AGENT_XFER_POST_TIME], self.histograms[E.AGENT_XFER_TIME]

        def record(xfer: int, post: int, nbytes: int, is_write: bool) -> None:
            if is_write:
                tx_c.inc(nbytes)
                tx_g.set(nbytes)
                txr_c.inc(1)
            else:
                rx_c.inc(nbytes)
                rx_g.set(nbytes)
                rxr_c.inc(1)
            post_c.inc(post)
            post_g.set(post)
            post_h.observe(post)
            xfer_c.inc(xfer)
            xfer_g.set(xfer)
            xfer_h.observe(xfer)

        return record

    def extra(self, event: int, value: int) -> None:
        if event in self.errors:
            self.errors[event].inc(value)
            return
        self.counters[event].inc(value)
        if event in self.gauges:
            self.gauges[event].set(value)


def reference_rank(hostname: str, agent_name: str, pid: int, instance: int, local_rank: str) -> ReferenceRank:
    """Create one process's metrics in the current prometheus_client value class (registry=None)."""
    from prometheus_client import Counter, Gauge, Histogram

    labels = (hostname, agent_name, str(pid), str(instance), local_rank)
    gauge_labels = (hostname, agent_name, str(instance), local_rank)
    counters: dict[int, Any] = {}
    errors: dict[int, Any] = {}
    for fam in COUNTER_FAMILIES:
        if len(fam.events) > 1:
            metric = Counter(fam.name, fam.help, (*LABELS, "status"), registry=None)
            for ev in fam.events:
                errors[int(ev)] = metric.labels(*labels, error_status(ev))
        else:
            counters[int(fam.events[0])] = Counter(fam.name, fam.help, LABELS, registry=None).labels(*labels)
    gauges = {int(fam.events[0]): Gauge(_GAUGE_RENAMES.get(fam.name, fam.name), fam.help, GAUGE_LABELS,
                                        registry=None, multiprocess_mode="all").labels(*gauge_labels)
              for fam in GAUGE_FAMILIES}
    histograms = {int(fam.events[0]): Histogram(fam.name, fam.help, LABELS, registry=None,
                                                buckets=DEFAULT_BUCKETS_US).labels(*labels)
                  for fam in HISTOGRAM_FAMILIES}
    return ReferenceRank(counters, gauges, histograms, errors)
