"""The writer library: NIXL prometheus_mp per-process stores.

``layout`` is the on-disk contract, ``metrics`` the descriptor (event types,
families, buckets), ``recorders`` the hot path (one recorder per event type,
and the validators), ``writer`` the per-agent ``StoreWriter`` (the store
file's life), ``reader`` the snapshot reader and liveness probe.  Nothing here knows about elections or
HTTP.
"""

from store.layout import STORE_SIZE
from store.metrics import DEFAULT_BUCKETS_US, EventType, parse_buckets
from store.reader import InvalidStore, Snapshot, Unreadable, read_snapshot, writer_alive
from store.writer import StoreIdentity, StoreWriter

__all__ = [
    "DEFAULT_BUCKETS_US",
    "STORE_SIZE",
    "EventType",
    "InvalidStore",
    "Snapshot",
    "StoreIdentity",
    "StoreWriter",
    "Unreadable",
    "parse_buckets",
    "read_snapshot",
    "writer_alive",
]
