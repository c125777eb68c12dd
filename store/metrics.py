"""The metric descriptor: NIXL's event types and what each one feeds.

Shared with NIXL's single-process prometheus exporter: the same event
numbering (which is also the slot index in the store), the same metric names,
types and HELP strings.  Names are never stored on disk; a slot's meaning
comes from this table alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum
from typing import Final

from store.layout import MAX_BUCKETS, SLOT_COUNT


class EventType(IntEnum):
    """NIXL telemetry event types; the value is the store slot."""

    AGENT_TX_BYTES = 0
    AGENT_RX_BYTES = 1
    AGENT_TX_REQUESTS_NUM = 2
    AGENT_RX_REQUESTS_NUM = 3
    AGENT_MEMORY_REGISTERED = 4
    AGENT_MEMORY_DEREGISTERED = 5
    AGENT_XFER_TIME = 6
    AGENT_XFER_POST_TIME = 7
    AGENT_ERR_NOT_POSTED = 8
    AGENT_ERR_INVALID_PARAM = 9
    AGENT_ERR_BACKEND = 10
    AGENT_ERR_NOT_FOUND = 11
    AGENT_ERR_MISMATCH = 12
    AGENT_ERR_NOT_ALLOWED = 13
    AGENT_ERR_REPOST_ACTIVE = 14
    AGENT_ERR_UNKNOWN = 15
    AGENT_ERR_NOT_SUPPORTED = 16
    AGENT_ERR_REMOTE_DISCONNECT = 17
    AGENT_ERR_CANCELED = 18
    AGENT_ERR_NO_TELEMETRY = 19
    AGENT_TELEMETRY_EVENTS_DROPPED = 20


@dataclass(frozen=True)
class Family:
    """One exposed metric family and the event slots that feed it."""

    name: str  # as exposed in the text format (counters keep their _total)
    kind: str  # "counter", "gauge" or "histogram"
    help: str
    events: tuple[EventType, ...]  # one, except agent_errors_total (one per status)


_E = EventType

ERROR_EVENTS: Final = tuple(e for e in EventType if e.name.startswith("AGENT_ERR_"))
ERROR_FAMILY_NAME: Final = "agent_errors_total"


def error_status(event: EventType) -> str:
    """The ``status`` label of an error event: AGENT_ERR_NOT_POSTED -> not_posted."""
    return event.name.removeprefix("AGENT_ERR_").lower()


COUNTER_FAMILIES: Final = (
    Family("agent_tx_bytes_total", "counter", "Number of bytes sent by the agent", (_E.AGENT_TX_BYTES,)),
    Family("agent_rx_bytes_total", "counter", "Number of bytes received by the agent", (_E.AGENT_RX_BYTES,)),
    Family("agent_tx_requests_num_total", "counter", "Number of requests sent by the agent",
           (_E.AGENT_TX_REQUESTS_NUM,)),
    Family("agent_rx_requests_num_total", "counter", "Number of requests received by the agent",
           (_E.AGENT_RX_REQUESTS_NUM,)),
    Family("agent_memory_registered_total", "counter", "Cumulative memory registered",
           (_E.AGENT_MEMORY_REGISTERED,)),
    Family("agent_memory_deregistered_total", "counter", "Cumulative memory deregistered",
           (_E.AGENT_MEMORY_DEREGISTERED,)),
    Family("agent_xfer_time_total", "counter", "Cumulative sum of transfer time from start to completion",
           (_E.AGENT_XFER_TIME,)),
    Family("agent_xfer_post_time_total", "counter",
           "Cumulative sum of time from start to posting to the back-end", (_E.AGENT_XFER_POST_TIME,)),
    Family(ERROR_FAMILY_NAME, "counter", "Cumulative error count by status", ERROR_EVENTS),
    Family("agent_telemetry_events_dropped_total", "counter",
           "Cumulative telemetry events dropped at the producer-side staging queue",
           (_E.AGENT_TELEMETRY_EVENTS_DROPPED,)),
)
GAUGE_FAMILIES: Final = (
    Family("agent_tx_last_bytes", "gauge", "Bytes sent by the last request", (_E.AGENT_TX_BYTES,)),
    Family("agent_rx_last_bytes", "gauge", "Bytes received by the last request", (_E.AGENT_RX_BYTES,)),
    Family("agent_memory_registered_last_bytes", "gauge", "Memory registered by the last operation",
           (_E.AGENT_MEMORY_REGISTERED,)),
    Family("agent_memory_deregistered_last_bytes", "gauge", "Memory deregistered by the last operation",
           (_E.AGENT_MEMORY_DEREGISTERED,)),
    Family("agent_xfer_time", "gauge", "Transfer time of the last request", (_E.AGENT_XFER_TIME,)),
    Family("agent_xfer_post_time", "gauge", "Post time of the last request", (_E.AGENT_XFER_POST_TIME,)),
)
HISTOGRAM_FAMILIES: Final = (
    Family("agent_xfer_time_us", "histogram",
           "Distribution of transfer time from start to completion, in microseconds", (_E.AGENT_XFER_TIME,)),
    Family("agent_xfer_post_time_us", "histogram",
           "Distribution of time from start to posting to the back-end, in microseconds",
           (_E.AGENT_XFER_POST_TIME,)),
)
FAMILIES: Final = COUNTER_FAMILIES + GAUGE_FAMILIES + HISTOGRAM_FAMILIES

GAUGE_EVENTS: Final = frozenset(f.events[0] for f in GAUGE_FAMILIES)
HISTOGRAM_EVENTS: Final = frozenset(f.events[0] for f in HISTOGRAM_FAMILIES)

DEFAULT_BUCKETS_US: Final = (
    10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0, 5000.0, 10000.0, 25000.0,
    50000.0, 100000.0, 250000.0, 500000.0, 1000000.0, 5000000.0, 10000000.0,
)
BUCKETS_ENV: Final = "NIXL_TELEMETRY_HISTOGRAM_BUCKETS_US"


def parse_buckets(text: str | None) -> tuple[float, ...]:
    """Parse NIXL_TELEMETRY_HISTOGRAM_BUCKETS_US; unset or blank means the defaults.

    Raises ValueError naming the variable and the value for anything the
    fixed-layout store cannot hold faithfully: more than 32 bounds (never
    silently truncated), a bound that is not a positive finite number, or
    bounds that are not strictly increasing.
    """
    if text is None or not text.strip():
        return DEFAULT_BUCKETS_US
    bounds: list[float] = []
    for item in text.split(","):
        try:
            bound = float(item)
        except ValueError:
            raise ValueError(f"{BUCKETS_ENV}={text!r}: {item.strip()!r} is not a number") from None
        if not math.isfinite(bound) or bound <= 0:
            raise ValueError(f"{BUCKETS_ENV}={text!r}: {item.strip()!r} is not a positive finite bound")
        if bounds and bound <= bounds[-1]:
            raise ValueError(f"{BUCKETS_ENV}={text!r}: bounds must be strictly increasing "
                             f"({item.strip()} follows {bounds[-1]:g})")
        bounds.append(bound)
    if len(bounds) > MAX_BUCKETS:
        raise ValueError(f"{BUCKETS_ENV}={text!r}: {len(bounds)} bounds, the store holds at most {MAX_BUCKETS}")
    return tuple(bounds)


def _check_descriptor() -> None:
    if len(EventType) != SLOT_COUNT or [int(e) for e in EventType] != list(range(SLOT_COUNT)):
        raise AssertionError("EventType must number the store's slots 0..SLOT_COUNT-1")
    if len(ERROR_EVENTS) != 12:
        raise AssertionError("NIXL has twelve AGENT_ERR_* statuses")
    if len(DEFAULT_BUCKETS_US) > MAX_BUCKETS:
        raise AssertionError("default buckets do not fit the store")


_check_descriptor()
