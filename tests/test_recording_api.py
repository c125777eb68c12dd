"""What the recording API refuses, and that telemetry-off (NullExporter) refuses exactly the same."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from support import (  # noqa: F401  (pytest fixtures)
    exporter_env,
    free_port,
    make_exporter_fixture,
    reaper_fixture,
)

from app import Exporter
from app.rank.exporter import NullExporter, create_exporter
from store import EventType

pytestmark = pytest.mark.usefixtures("recording_path")

E = EventType

# (method, args, kwargs, exception, text in the message)
REFUSED: list[tuple[str, tuple[Any, ...], dict[str, Any], type[Exception], str]] = [
    ("export_event", (1.0, 5), {}, ValueError, "unknown event type 1.0"),
    ("export_event", (True, 5), {}, ValueError, "unknown event type True"),
    ("export_event", (False, 5), {}, ValueError, "unknown event type False"),
    ("export_event", ("AGENT_TX_BYTES", 5), {}, ValueError, "unknown event type"),
    ("export_event", (21, 5), {}, ValueError, "unknown event type 21"),
    ("export_event", (-1, 5), {}, ValueError, "unknown event type -1"),
    ("export_event", (E.AGENT_TX_BYTES, -1), {}, ValueError, "outside 0..2**64-1"),
    ("export_event", (E.AGENT_TX_BYTES, 2**64), {}, ValueError, "outside 0..2**64-1"),
    ("export_event", (E.AGENT_TX_BYTES, 1.0), {}, TypeError, "event value must be"),
    ("export_event", (E.AGENT_TX_BYTES, True), {}, TypeError, "event value must be"),
    ("export_event", (E.AGENT_TX_BYTES,), {}, TypeError, "value"),
    ("record_transfer", (10, 1, 100, "no"), {}, TypeError, "is_write must be a bool, got str 'no'"),
    ("record_transfer", (10, 1, 100, 1), {}, TypeError, "is_write must be a bool, got int 1"),
    ("record_transfer", (10, 1, 100), {"is_write": None}, TypeError, "is_write must be a bool"),
    ("record_transfer", (10, -1, 100, True), {}, ValueError, "outside 0..2**64-1"),
    ("record_transfer", (10, 1, 1.5, False), {}, TypeError, "event value must be"),
    ("record_error", ("bogus",), {}, ValueError, "unknown error status 'bogus'"),
    ("record_error", (E.AGENT_TX_BYTES,), {}, ValueError, "AGENT_TX_BYTES is not an error event"),
    ("record_error", (True,), {}, ValueError, "unknown event type True"),
    ("record_memory_registered", (-5,), {}, ValueError, "outside 0..2**64-1"),
    ("record_memory_deregistered", ("5",), {}, TypeError, "event value must be"),
]


@pytest.mark.parametrize(("method", "args", "kwargs", "error", "text"), REFUSED)
def test_exporter_refuses_and_changes_nothing(tmp_dir: Path, make_exporter, method, args, kwargs, error,
                                             text) -> None:
    exp = make_exporter("a", exporter_env(tmp_dir, free_port()))
    exp.record_transfer(10, 1, 100, True)
    before = exp.store_path.read_bytes()
    with pytest.raises(error) as info:
        getattr(exp, method)(*args, **kwargs)
    assert text in str(info.value)
    assert exp.store_path.read_bytes() == before


@pytest.mark.parametrize(("method", "args", "kwargs", "error", "text"), REFUSED)
def test_null_exporter_refuses_exactly_what_the_exporter_refuses(tmp_dir: Path, make_exporter, method, args,
                                                                  kwargs, error, text) -> None:
    exp = make_exporter("a", exporter_env(tmp_dir, free_port()))
    null = create_exporter("a", {"NIXL_TELEMETRY_ENABLE": "n"})
    assert isinstance(null, NullExporter)
    with pytest.raises(error) as real:
        getattr(exp, method)(*args, **kwargs)
    with pytest.raises(error) as off:
        getattr(null, method)(*args, **kwargs)
    assert str(off.value) == str(real.value)


def test_valid_calls_are_accepted_by_both(tmp_dir: Path, make_exporter) -> None:
    exp: Exporter = make_exporter("a", exporter_env(tmp_dir, free_port()))
    null = NullExporter("a")
    for sink in (exp, null):
        sink.export_event(E.AGENT_RX_BYTES, 2**64 - 1)
        sink.export_event(1, 7)
        sink.record_transfer(10, 1, 100, is_write=False)
        sink.record_transfer(xfer_time_us=10, post_time_us=1, nbytes=100, is_write=True)
        sink.record_error("backend")
        sink.record_memory_registered(4096)
        sink.record_memory_deregistered(4096)
    null.close()
    assert null.store_path is None and not null.serving
