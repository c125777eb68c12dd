"""The recording entry points every Exporter (and NullExporter) has.

``Recording`` is the C type ``store._recorder.Recording`` where the extension
was built: ``export_event`` and ``record_transfer`` are then C methods that
record through the writer's C Store with no Python frame per event.
``PyRecording`` is their pure-Python twin, used where the extension is not
built, when NIXL_PROMETHEUS_MP_PURE_PYTHON=1, and whenever the bound sink has
no C Store.  Both validate through store.recorders' validators, so they raise
the same errors, and both call ``self._on_deadline()`` only once an event's
heartbeat reaches ``self._next_claim_ns``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from store.metrics import ERROR_EVENTS, EventType, error_status
from store.recorders import NATIVE, Recorder, TransferRecorder, event_type, recorder_for, transfer_direction

_STATUS_EVENTS = {error_status(ev): ev for ev in ERROR_EVENTS}


class Sink(Protocol):
    """What recording binds to: a StoreWriter, or store.recorders.NullSink."""

    native: Any
    recorders: dict[int, Recorder]
    transfer_recorders: dict[bool, TransferRecorder]


class PyRecording:
    """The Python twin of store._recorder.Recording, and the helpers both share."""

    _next_claim_ns: int
    _recorders: dict[int, Recorder]
    _transfers: dict[bool, TransferRecorder]

    def _bind_recording(self, sink: Sink) -> None:
        """Record into ``sink`` (its recorder dicts are updated in place on fork and close)."""
        self._recorders, self._transfers = sink.recorders, sink.transfer_recorders
        if sink.native is not None and NATIVE is not None and isinstance(self, NATIVE.Recording):
            self._store = sink.native

    def export_event(self, event: EventType | int, value: int) -> None:
        """Record one event; a writer may take over the endpoint from here.

        Raises ValueError/TypeError, changing nothing, for an unknown event
        type (only EventType or int; not bool or float) or a value that is
        not an unsigned 64-bit integer.
        """
        if recorder_for(self._recorders, event)(value) >= self._next_claim_ns:
            self._on_deadline()

    def record_transfer(self, xfer_time_us: int, post_time_us: int, nbytes: int, is_write: bool) -> None:
        """The four events NIXL records for one completed transfer.

        TX_BYTES and TX_REQUESTS_NUM (1) for a write, RX_* otherwise, then
        XFER_POST_TIME and XFER_TIME, with one heartbeat.  Raises TypeError
        unless is_write is a bool, and ValueError/TypeError, changing
        nothing, unless all three values are unsigned 64-bit integers.
        """
        if is_write is not True and is_write is not False:
            transfer_direction(is_write)
        if self._transfers[is_write](xfer_time_us, post_time_us, nbytes) >= self._next_claim_ns:
            self._on_deadline()

    # What the C type falls back to when no Store is bound.
    _export_event_py = export_event
    _record_transfer_py = record_transfer

    def _on_deadline(self) -> None:
        """Called by an event once CLOCK_MONOTONIC reaches _next_claim_ns."""

    def record_error(self, status: EventType | str) -> None:
        """Count one error: an AGENT_ERR_* event type or its status label ("backend")."""
        if isinstance(status, str):
            key = status.lower().removeprefix("agent_err_").removeprefix("nixl_err_")
            if key not in _STATUS_EVENTS:
                raise ValueError(f"unknown error status {status!r} (valid: {', '.join(_STATUS_EVENTS)})")
            event = _STATUS_EVENTS[key]
        else:
            event = event_type(status)
            if event not in ERROR_EVENTS:
                raise ValueError(f"{event.name} is not an error event")
        self.export_event(event, 1)

    def record_memory_registered(self, nbytes: int) -> None:
        self.export_event(EventType.AGENT_MEMORY_REGISTERED, nbytes)

    def record_memory_deregistered(self, nbytes: int) -> None:
        self.export_event(EventType.AGENT_MEMORY_DEREGISTERED, nbytes)


if TYPE_CHECKING or NATIVE is None:
    Recording = PyRecording
else:
    class Recording(NATIVE.Recording, PyRecording):
        """export_event and record_transfer from store._recorder; the rest from PyRecording."""
