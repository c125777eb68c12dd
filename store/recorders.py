"""The hot path: one recorder per event type, and the validators both implementations raise through.

The hot path has two implementations with the same behaviour, byte for byte:
the C extension ``store._recorder`` (relaxed 8-byte atomics, no Python frame
per event) where it was built (``NATIVE``), else one Python closure per event
type with every slot offset bound at creation (one lock acquisition, a
handful of aligned 8-byte stores through a ``memoryview`` cast to ``Q``:
``python_recorders``).  One completed transfer (NIXL's four events) is fused
in both: every value validated first, then all four applied with one
heartbeat.  Errors are always raised by the Python validators below, so both
paths say the same thing.  ``NullSink`` records nowhere through the same
recorders.  The store file the recorders write into is store.writer's.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Collection
from types import ModuleType
from typing import Any, Final

from store import layout as L
from store import native
from store.metrics import GAUGE_EVENTS, HISTOGRAM_EVENTS, EventType

log = logging.getLogger("nixl_prometheus_mp.store")

U64_MAX: Final = (1 << 64) - 1
W_LAST_UPDATE: Final = L.word_index(L.LAST_UPDATE_FIELD)
_W_COUNTERS, _W_GAUGES, _W_BUCKETS, _W_SUMS = L.W_COUNTERS, L.W_GAUGES, L.W_BUCKETS, L.W_SUMS

Recorder = Callable[[int], int]
# (xfer_time_us, post_time_us, nbytes) -> the heartbeat stamped
TransferRecorder = Callable[[int, int, int], int]
DetachedRecorder = Callable[[Any, Any], int]
DetachedTransfer = Callable[[Any, Any, Any, Any], int]
_TRANSFER_EVENTS: Final = {
    True: (EventType.AGENT_TX_BYTES, EventType.AGENT_TX_REQUESTS_NUM),
    False: (EventType.AGENT_RX_BYTES, EventType.AGENT_RX_REQUESTS_NUM),
}
# What an event slot feeds, as store._recorder numbers it.
_OFF, _COUNTER, _GAUGE, _HISTOGRAM = range(4)


def event_value(value: object) -> int:
    """Validate one event value: an unsigned 64-bit integer, else raise.

    The hot path only calls this when ``type(value) is not int`` or the value
    is out of range, so the common case costs one type check.
    """
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"event value must be an unsigned 64-bit integer, got {type(value).__name__} {value!r}")
    number = value.__index__()  # type: ignore[attr-defined]
    if not 0 <= number <= U64_MAX:
        raise ValueError(f"event value {number} is outside 0..2**64-1")
    return number


def event_type(value: Any) -> EventType:
    """Validate an event type: an EventType or a plain int, never a bool or float (ValueError naming it)."""
    valid = f"EventType members or ints 0..{len(EventType) - 1}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"unknown event type {value!r}: event types are {valid}, not {type(value).__name__}")
    try:
        return EventType(value)
    except ValueError:
        raise ValueError(f"unknown event type {value!r} (valid: {valid})") from None


def transfer_direction(is_write: Any) -> bool:
    """Validate record_transfer's is_write: a real bool (a string like "no" would read as a write)."""
    if is_write is True or is_write is False:
        return is_write
    raise TypeError(f"is_write must be a bool, got {type(is_write).__name__} {is_write!r}")


def _load_native() -> ModuleType | None:
    module = native.load("_recorder")
    if module is None:
        return None
    expected = (L.SLOT_COUNT, L.MAX_BUCKETS, L.STORE_SIZE, W_LAST_UPDATE, _W_COUNTERS, _W_GAUGES, _W_BUCKETS,
                _W_SUMS)
    if tuple(module.LAYOUT) != expected:
        log.warning("store._recorder was built for another store layout (%s, expected %s); using the "
                    "pure-Python path. Rebuild the package (pip install .) to get the C path back.",
                    module.LAYOUT, expected)
        native.refuse("_recorder")
        return None
    module.install(event_type, event_value, transfer_direction)
    return module


# The C hot path, or None for the Python twin.  Read when a writer is created
# (tests set it to None to run the Python path in the same process).
NATIVE: ModuleType | None = _load_native()


def kinds(enabled: Collection[EventType]) -> bytes:
    """What each slot feeds (store._recorder's table): off, counter, +gauge, +histogram."""
    return bytes(_OFF if ev not in enabled else _HISTOGRAM if ev in HISTOGRAM_EVENTS
                 else _GAUGE if ev in GAUGE_EVENTS else _COUNTER for ev in EventType)


def int_bounds(bounds: tuple[float, ...]) -> tuple[int, ...]:
    """Values are ints, so "value <= bound" equals "value <= floor(bound)"; both paths compare ints."""
    return tuple(math.floor(b) for b in bounds)


def recorder_for(recorders: dict[int, Recorder], event: Any) -> Recorder:
    """The recorder of ``event``; raises as an unknown event type must, changing nothing.

    Only an int or an EventType is an event type: a bool or a float would
    otherwise hash like an int and be taken for one.
    """
    if event.__class__ is not int and event.__class__ is not EventType:
        event = event_type(event)
    try:
        return recorders[event]
    except KeyError:
        event_type(event)
        raise



def python_recorders(words: memoryview, lock: threading.Lock, live: list[bool], bounds: tuple[int, ...],
                     enabled: Collection[EventType], detached: DetachedRecorder,
                     detached_transfer: DetachedTransfer) -> tuple[dict[int, Recorder], dict[bool, TransferRecorder]]:
    """The pure-Python twin of store._recorder.Store: one closure per event type, one per transfer direction.

    ``bounds`` are int floors (int_bounds).  An event that finds ``live``
    cleared (the store closed, or being recreated) goes to ``detached``, which
    drops it or replays it into the store that replaced this one.
    """
    mask, hb, now = U64_MAX, W_LAST_UPDATE, time.monotonic_ns

    # Under the lock there is no call at all: the clock is read before it
    # is taken, and ``with`` calls the lock's __enter__ from C.  CPython
    # only switches threads at calls and loop jumps, so a thread is never
    # descheduled while it holds the lock, and threads recording at once
    # never queue on it (a lock convoy costs several times the update).
    # The heartbeat is the instant the event was taken; a thread switch
    # between the two may leave it a few ms behind another thread's.
    #
    # A histogram event's counter and sum both accumulate the value, mod
    # 2**64, under this one lock, in a store only this process writes: they
    # are always equal, so the sum is the counter's new value.
    def make(ev: EventType) -> Recorder:
        c, g, s = _W_COUNTERS + ev, _W_GAUGES + ev, _W_SUMS + ev
        base = _W_BUCKETS + ev * L.BUCKET_SLOTS
        if ev not in enabled:
            def record(value: int) -> int:
                if type(value) is not int or not 0 <= value <= mask:
                    event_value(value)
                return now()
        elif ev in HISTOGRAM_EVENTS:
            def record(value: int) -> int:
                if type(value) is not int or not 0 <= value <= mask:
                    value = event_value(value)
                b = base + bisect_left(bounds, value)
                t = now()
                with lock:
                    if live[0]:
                        words[c] = words[s] = (words[c] + value) & mask
                        words[g] = value
                        words[b] = (words[b] + 1) & mask
                        words[hb] = t
                        return t
                return detached(ev, value)
        elif ev in GAUGE_EVENTS:
            def record(value: int) -> int:
                if type(value) is not int or not 0 <= value <= mask:
                    value = event_value(value)
                t = now()
                with lock:
                    if live[0]:
                        words[c] = (words[c] + value) & mask
                        words[g] = value
                        words[hb] = t
                        return t
                return detached(ev, value)
        else:
            def record(value: int) -> int:
                if type(value) is not int or not 0 <= value <= mask:
                    value = event_value(value)
                t = now()
                with lock:
                    if live[0]:
                        words[c] = (words[c] + value) & mask
                        words[hb] = t
                        return t
                return detached(ev, value)
        return record

    recorders = {int(ev): make(ev) for ev in EventType}
    xt, pt = EventType.AGENT_XFER_TIME, EventType.AGENT_XFER_POST_TIME

    def make_transfer(is_write: bool) -> TransferRecorder:
        bytes_ev, requests_ev = _TRANSFER_EVENTS[is_write]
        if not {bytes_ev, requests_ev, xt, pt} <= set(enabled):
            # Some of the four are filtered out: apply each through its own
            # recorder (a disabled one records nothing), after validating all.
            rec_bytes, rec_requests = recorders[bytes_ev], recorders[requests_ev]
            rec_post, rec_xfer = recorders[pt], recorders[xt]

            def partial_transfer(xfer: int, post: int, nbytes: int) -> int:
                for value in (xfer, post, nbytes):
                    if type(value) is not int or not 0 <= value <= mask:
                        event_value(value)
                rec_bytes(nbytes)
                rec_requests(1)
                rec_post(post)
                return rec_xfer(xfer)
            return partial_transfer

        bc, bg, rc = _W_COUNTERS + bytes_ev, _W_GAUGES + bytes_ev, _W_COUNTERS + requests_ev
        xc, xg, xs, xb = _W_COUNTERS + xt, _W_GAUGES + xt, _W_SUMS + xt, _W_BUCKETS + xt * L.BUCKET_SLOTS
        pc, pg, ps, pb = _W_COUNTERS + pt, _W_GAUGES + pt, _W_SUMS + pt, _W_BUCKETS + pt * L.BUCKET_SLOTS

        def transfer(xfer: int, post: int, nbytes: int) -> int:
            if type(xfer) is not int or not 0 <= xfer <= mask:
                xfer = event_value(xfer)
            if type(post) is not int or not 0 <= post <= mask:
                post = event_value(post)
            if type(nbytes) is not int or not 0 <= nbytes <= mask:
                nbytes = event_value(nbytes)
            b_post = pb + bisect_left(bounds, post)
            b_xfer = xb + bisect_left(bounds, xfer)
            t = now()
            with lock:
                if live[0]:
                    words[bc] = (words[bc] + nbytes) & mask
                    words[bg] = nbytes
                    words[rc] = (words[rc] + 1) & mask
                    words[pc] = words[ps] = (words[pc] + post) & mask
                    words[pg] = post
                    words[b_post] = (words[b_post] + 1) & mask
                    words[xc] = words[xs] = (words[xc] + xfer) & mask
                    words[xg] = xfer
                    words[b_xfer] = (words[b_xfer] + 1) & mask
                    words[hb] = t
                    return t
            return detached_transfer(xfer, post, nbytes, is_write)
        return transfer

    return recorders, {True: make_transfer(True), False: make_transfer(False)}


class NullSink:
    """Validates events exactly as a store does and records them nowhere (telemetry off).

    The same recorders as a StoreWriter's, over a private buffer with every
    event disabled: no duplicated validation, one cheap check per event.
    """

    def __init__(self) -> None:
        buffer = bytearray(L.STORE_SIZE)  # never written: nothing is enabled
        self.native: Any = None
        if NATIVE is not None:
            self.native = NATIVE.Store((), kinds(()), _never_detached, _never_detached)
            self.native.attach(buffer)
        self.recorders, self.transfer_recorders = python_recorders(
            memoryview(buffer).cast("Q"), threading.Lock(), [True], (), (), _never_detached, _never_detached)


def _never_detached(*args: Any) -> int:
    raise AssertionError("a NullSink never detaches")

