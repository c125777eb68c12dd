"""StoreWriter: recording semantics, validation, names, buckets, creation paths, close."""

from __future__ import annotations

import logging
import os
import stat
import threading
import time

import pytest

import store
import store.writer
from store import EventType, Snapshot, parse_buckets, read_snapshot, writer_alive
from store import layout as L

# Every test here runs on the C recording path and on its pure-Python twin.
pytestmark = pytest.mark.usefixtures("recording_path")

LOGGER = "nixl_prometheus_mp.store"
E = EventType

# docs/format.md, the metric table: which of counter / gauge / histogram each event feeds.
FEEDS = {
    E.AGENT_TX_BYTES: {"counter", "gauge"},
    E.AGENT_RX_BYTES: {"counter", "gauge"},
    E.AGENT_TX_REQUESTS_NUM: {"counter"},
    E.AGENT_RX_REQUESTS_NUM: {"counter"},
    E.AGENT_MEMORY_REGISTERED: {"counter", "gauge"},
    E.AGENT_MEMORY_DEREGISTERED: {"counter", "gauge"},
    E.AGENT_XFER_TIME: {"counter", "gauge", "histogram"},
    E.AGENT_XFER_POST_TIME: {"counter", "gauge", "histogram"},
    **{e: {"counter"} for e in EventType if e.name.startswith("AGENT_ERR_")},
    E.AGENT_TELEMETRY_EVENTS_DROPPED: {"counter"},
}
# EventType keeps NIXL's numbering.
NUMBERING = [
    "AGENT_TX_BYTES", "AGENT_RX_BYTES", "AGENT_TX_REQUESTS_NUM", "AGENT_RX_REQUESTS_NUM",
    "AGENT_MEMORY_REGISTERED", "AGENT_MEMORY_DEREGISTERED", "AGENT_XFER_TIME", "AGENT_XFER_POST_TIME",
    "AGENT_ERR_NOT_POSTED", "AGENT_ERR_INVALID_PARAM", "AGENT_ERR_BACKEND", "AGENT_ERR_NOT_FOUND",
    "AGENT_ERR_MISMATCH", "AGENT_ERR_NOT_ALLOWED", "AGENT_ERR_REPOST_ACTIVE", "AGENT_ERR_UNKNOWN",
    "AGENT_ERR_NOT_SUPPORTED", "AGENT_ERR_REMOTE_DISCONNECT", "AGENT_ERR_CANCELED", "AGENT_ERR_NO_TELEMETRY",
    "AGENT_TELEMETRY_EVENTS_DROPPED",
]
DEFAULTS = (10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0, 5000.0, 10000.0, 25000.0,
            50000.0, 100000.0, 250000.0, 500000.0, 1000000.0, 5000000.0, 10000000.0)
U64_MAX = 2**64 - 1


def snap(path) -> Snapshot:
    result = read_snapshot(path)
    assert isinstance(result, Snapshot), result
    return result


def hist(s: Snapshot, ev: int) -> list[int]:
    """All 33 bucket words of a slot (not just the used ones)."""
    return list(s.buckets[ev * 33:(ev + 1) * 33])


def test_event_numbering():
    assert [e.name for e in EventType] == NUMBERING
    assert [int(e) for e in EventType] == list(range(21))


# -- semantics -------------------------------------------------------------------


@pytest.mark.parametrize("ev", list(EventType), ids=lambda e: e.name)
def test_event_feeds_exactly_its_metrics(make_writer, ev):
    writer = make_writer(bounds=(10.0, 100.0))
    writer.record(ev, 50)
    writer.record(ev, 7)
    s = snap(writer.path)
    feeds = FEEDS[ev]
    assert s.counters == tuple(57 if i == ev else 0 for i in range(21))
    assert s.gauges == tuple(7 if i == ev and "gauge" in feeds else 0 for i in range(21))
    if "histogram" in feeds:
        assert hist(s, ev) == [1, 1] + [0] * 31
        assert s.sums[ev] == 57
    all_buckets = [0] * (21 * 33)
    if "histogram" in feeds:
        all_buckets[ev * 33] = all_buckets[ev * 33 + 1] = 1
    assert list(s.buckets) == all_buckets
    assert s.sums == tuple(57 if i == ev and "histogram" in feeds else 0 for i in range(21))


def test_histogram_bucket_boundaries(make_writer):
    bounds = (10.0, 25.0, 50.0)
    writer = make_writer(bounds=bounds)
    ev = E.AGENT_XFER_POST_TIME
    # value -> expected bucket index: bounds are inclusive (value <= le), overflow is index 3.
    cases = {0: 0, 1: 0, 9: 0, 10: 0, 11: 1, 25: 1, 26: 2, 49: 2, 50: 2, 51: 3, 10**9: 3, U64_MAX: 3}
    expected = [0] * 33
    total = 0
    for value, bucket in cases.items():
        writer.record(ev, value)
        expected[bucket] += 1
        total += value
        s = snap(writer.path)
        assert hist(s, ev) == expected, value
        assert s.gauges[ev] == value
    s = snap(writer.path)
    assert s.histogram(ev) == (4, 2, 3, 3)  # non-cumulative, overflow last
    assert s.sums[ev] == total % 2**64
    assert s.counters[ev] == total % 2**64
    assert s.bounds == bounds


def test_histogram_with_default_bounds_and_overflow_index(make_writer):
    writer = make_writer()  # 18 default bounds: overflow at index 18
    ev = E.AGENT_XFER_TIME
    writer.record(ev, 10_000_000)  # == last bound
    writer.record(ev, 10_000_001)
    writer.record(ev, 100)
    s = snap(writer.path)
    expected = [0] * 33
    expected[3] = 1  # 100 -> bound index 3 (100.0)
    expected[17] = 1
    expected[18] = 1
    assert hist(s, ev) == expected
    assert s.bounds == DEFAULTS


def test_histogram_without_bounds_counts_everything_in_overflow(make_writer):
    writer = make_writer(bounds=())
    writer.record(E.AGENT_XFER_TIME, 0)
    writer.record(E.AGENT_XFER_TIME, 12345)
    s = snap(writer.path)
    assert s.bounds == ()
    assert s.histogram(E.AGENT_XFER_TIME) == (2,)
    assert hist(s, E.AGENT_XFER_TIME) == [2] + [0] * 32
    assert s.sums[E.AGENT_XFER_TIME] == 12345


def test_gauge_keeps_last_counter_accumulates(make_writer):
    writer = make_writer()
    for value in (300, 5, 0, 42):
        writer.record(E.AGENT_RX_BYTES, value)
    s = snap(writer.path)
    assert s.gauges[E.AGENT_RX_BYTES] == 42
    assert s.counters[E.AGENT_RX_BYTES] == 347
    writer.record(E.AGENT_RX_BYTES, 0)
    assert snap(writer.path).gauges[E.AGENT_RX_BYTES] == 0


def test_record_returns_and_stamps_last_update(make_writer):
    writer = make_writer()
    created = snap(writer.path).last_update_ns
    before = time.monotonic_ns()
    stamp = writer.record(E.AGENT_TX_REQUESTS_NUM, 1)
    after = time.monotonic_ns()
    assert created <= before <= stamp <= after
    assert snap(writer.path).last_update_ns == stamp
    writer.heartbeat()
    beat = snap(writer.path).last_update_ns
    assert stamp <= beat <= time.monotonic_ns()


def test_record_accepts_index_ints(make_writer):
    class Index:
        def __index__(self):
            return 21

    writer = make_writer()
    writer.record(E.AGENT_TX_BYTES, Index())
    writer.record(int(E.AGENT_TX_BYTES), 1)
    assert snap(writer.path).counters[0] == 22


def test_disabled_events_validate_but_record_nothing(make_writer):
    writer = make_writer(enabled={E.AGENT_XFER_TIME})
    before = writer.path.read_bytes()
    writer.record(E.AGENT_TX_BYTES, 10)
    assert writer.path.read_bytes() == before
    with pytest.raises(ValueError):
        writer.record(E.AGENT_TX_BYTES, -1)
    writer.record(E.AGENT_XFER_TIME, 10)
    s = snap(writer.path)
    assert s.counters == tuple(10 if i == E.AGENT_XFER_TIME else 0 for i in range(21))


# -- wrap-around -------------------------------------------------------------------


def test_counters_and_sums_wrap_modulo_2_64(make_writer):
    writer = make_writer(bounds=(10.0,))
    ev = E.AGENT_XFER_TIME
    writer.record(ev, U64_MAX)
    s = snap(writer.path)
    assert s.counters[ev] == U64_MAX and s.sums[ev] == U64_MAX and s.gauges[ev] == U64_MAX
    writer.record(ev, 2)
    s = snap(writer.path)
    assert s.counters[ev] == 1
    assert s.sums[ev] == 1
    assert s.gauges[ev] == 2
    assert s.histogram(ev) == (1, 1)
    writer.record(E.AGENT_TX_REQUESTS_NUM, U64_MAX)
    writer.record(E.AGENT_TX_REQUESTS_NUM, U64_MAX)
    assert snap(writer.path).counters[E.AGENT_TX_REQUESTS_NUM] == U64_MAX - 1


# -- threads -------------------------------------------------------------------------


def test_threads_lose_no_update(make_writer):
    """8 threads x 100k updates, alternating a histogram event and a counter-only event."""
    threads_n, per_thread = 8, 100_000
    bounds = (10.0, 100.0, 1000.0)
    writer = make_writer(bounds=bounds)
    values = (5, 10, 50, 500, 5000)  # buckets 0, 0, 1, 2, 3
    start = threading.Barrier(threads_n)
    errors: list[BaseException] = []

    def work() -> None:
        try:
            record, xfer, requests = writer.record, E.AGENT_XFER_TIME, E.AGENT_TX_REQUESTS_NUM
            start.wait(timeout=30)
            for i in range(per_thread // 2):
                record(xfer, values[i % 5])
                record(requests, 1)
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)

    workers = [threading.Thread(target=work) for _ in range(threads_n)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in workers)
    assert errors == []
    n = threads_n * per_thread // 2  # events of each type
    s = snap(writer.path)
    assert s.counters[E.AGENT_TX_REQUESTS_NUM] == n
    assert s.counters[E.AGENT_XFER_TIME] == n // 5 * sum(values)
    assert s.sums[E.AGENT_XFER_TIME] == n // 5 * sum(values)
    assert s.histogram(E.AGENT_XFER_TIME) == (2 * n // 5, n // 5, n // 5, n // 5)
    assert sum(s.histogram(E.AGENT_XFER_TIME)) == n
    assert s.gauges[E.AGENT_XFER_TIME] in values


# -- bad values ---------------------------------------------------------------------


BAD_VALUES = [
    pytest.param(-1, ValueError, id="negative"),
    pytest.param(-(2**64), ValueError, id="very-negative"),
    pytest.param(2**64, ValueError, id="2**64"),
    pytest.param(1.0, TypeError, id="float"),
    pytest.param(float("nan"), TypeError, id="nan"),
    pytest.param("1", TypeError, id="str"),
    pytest.param(None, TypeError, id="None"),
    pytest.param(True, TypeError, id="True"),
    pytest.param(False, TypeError, id="False"),
    pytest.param(b"\x01", TypeError, id="bytes"),
]


@pytest.mark.parametrize(("value", "error"), BAD_VALUES)
def test_bad_value_raises_and_changes_nothing(make_writer, value, error):
    writer = make_writer(bounds=(10.0,))
    writer.record(E.AGENT_XFER_TIME, 3)  # some state to keep
    before = writer.path.read_bytes()
    for ev in EventType:
        with pytest.raises(error):
            writer.record(ev, value)
        with pytest.raises(error):
            writer.recorders[int(ev)](value)
    assert writer.path.read_bytes() == before


@pytest.mark.parametrize("event", [21, -1, 100, "AGENT_TX_BYTES", None, 1.5])
def test_unknown_event_type_raises_and_changes_nothing(make_writer, event):
    writer = make_writer()
    writer.record(E.AGENT_TX_BYTES, 3)
    before = writer.path.read_bytes()
    with pytest.raises(ValueError, match="unknown event type"):
        writer.record(event, 1)
    assert writer.path.read_bytes() == before


# -- names ---------------------------------------------------------------------------


@pytest.mark.parametrize(("field", "cap"), [("agent_name", 255), ("hostname", 127), ("local_rank", 63)])
@pytest.mark.parametrize("char", ["é", "€", "😀"])
def test_long_names_truncated_on_a_character_boundary(make_writer, caplog, field, cap, char):
    width = len(char.encode())
    for shift in range(width + 1):
        # The multi-byte character starts `shift` bytes before the cap, so it straddles it
        # (shift 1..width-1), ends exactly on it (shift == width), or starts on it (shift 0).
        text = "x" * (cap - shift) + char + "tail"
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            writer = make_writer(instance=shift, **{field: text})
        raw = writer.path.read_bytes()
        offset, size = {"agent_name": L.AGENT_NAME_FIELD, "hostname": L.HOSTNAME_FIELD,
                        "local_rank": L.LOCAL_RANK_FIELD}[field]
        assert size == cap + 1
        stored = raw[offset:offset + size].split(b"\0", 1)[0]
        assert raw[offset + len(stored):offset + size] == bytes(size - len(stored))
        assert len(stored) <= cap
        decoded = stored.decode("utf-8")  # never split mid character
        expected = "x" * (cap - shift) + (char if shift == width else "")
        assert decoded == expected, (shift, decoded)
        assert getattr(snap(writer.path), field) == expected
        warnings = [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]
        assert len(warnings) == 1
        assert "truncated" in warnings[0].getMessage()


@pytest.mark.parametrize(("field", "cap"), [("agent_name", 255), ("hostname", 127), ("local_rank", 63)])
def test_names_that_fit_are_kept_without_warning(make_writer, caplog, field, cap):
    text = "y" * (cap - 2) + "é"  # exactly cap bytes
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        writer = make_writer(**{field: text})
    assert getattr(snap(writer.path), field) == text
    assert [r for r in caplog.records if r.name == LOGGER] == []


def test_empty_local_rank(make_writer):
    writer = make_writer(local_rank="")
    data = writer.path.read_bytes()
    assert data[432:496] == bytes(64)
    assert snap(writer.path).local_rank == ""


# -- parse_buckets -------------------------------------------------------------------


@pytest.mark.parametrize("text", [None, "", "   ", "\t\n"])
def test_parse_buckets_defaults(text):
    assert parse_buckets(text) == DEFAULTS
    assert store.DEFAULT_BUCKETS_US == DEFAULTS


@pytest.mark.parametrize(("text", "expected"), [
    ("10,100,1000", (10.0, 100.0, 1000.0)),
    (" 1.5 , 2 ,3e3 ", (1.5, 2.0, 3000.0)),
    ("0.001", (0.001,)),
    (",".join(str(i) for i in range(1, 33)), tuple(float(i) for i in range(1, 33))),
])
def test_parse_buckets_valid(text, expected):
    assert parse_buckets(text) == expected


@pytest.mark.parametrize("text", [
    pytest.param(",".join(str(i) for i in range(1, 34)), id="33-bounds"),
    pytest.param("10,abc,100", id="not-a-number"),
    pytest.param("10,,100", id="empty-item"),
    pytest.param("0,10", id="zero"),
    pytest.param("-5,10", id="negative"),
    pytest.param("10,inf", id="inf"),
    pytest.param("10,nan", id="nan"),
    pytest.param("10,5,100", id="decreasing"),
    pytest.param("10,10,100", id="duplicate"),
])
def test_parse_buckets_errors_name_variable_and_value(text):
    with pytest.raises(ValueError) as info:
        parse_buckets(text)
    message = str(info.value)
    assert "NIXL_TELEMETRY_HISTOGRAM_BUCKETS_US" in message
    assert text in message


def test_writer_refuses_more_than_32_bounds(tmp_dir, make_identity):
    with pytest.raises(ValueError):
        store.StoreWriter(tmp_dir, make_identity(bounds=tuple(float(i) for i in range(1, 34))))
    assert list(tmp_dir.iterdir()) == []


def test_writer_with_32_bounds(make_writer):
    bounds = tuple(float(i) for i in range(1, 33))
    writer = make_writer(bounds=bounds)
    writer.record(E.AGENT_XFER_TIME, 32)
    writer.record(E.AGENT_XFER_TIME, 33)
    s = snap(writer.path)
    assert s.bounds == bounds
    assert hist(s, E.AGENT_XFER_TIME) == [0] * 31 + [1, 1]


# -- lock, close -------------------------------------------------------------------


def test_lock_held_while_open_released_by_close(make_writer, lock_probe):
    writer = make_writer(bounds=(10.0,))
    writer.record(E.AGENT_XFER_TIME, 7)
    writer.record(E.AGENT_MEMORY_REGISTERED, 1 << 40)
    assert writer.locked is True
    assert lock_probe(writer.path) is False
    assert writer_alive(writer.path) is True
    contents = writer.path.read_bytes()
    writer.close()
    assert writer.closed
    assert writer.path.exists()
    assert writer.path.read_bytes() == contents
    assert lock_probe(writer.path) is True
    assert writer_alive(writer.path) is False
    s = snap(writer.path)
    assert s.counters[E.AGENT_XFER_TIME] == 7
    assert s.counters[E.AGENT_MEMORY_REGISTERED] == 1 << 40
    assert s.histogram(E.AGENT_XFER_TIME) == (1, 0)
    writer.close()  # idempotent
    assert writer.path.read_bytes() == contents


def test_writes_after_close_dropped_with_warning(make_writer, caplog):
    writer = make_writer()
    writer.record(E.AGENT_TX_BYTES, 5)
    writer.close()
    contents = writer.path.read_bytes()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        stamp = writer.record(E.AGENT_TX_BYTES, 5)
        writer.recorders[int(E.AGENT_XFER_TIME)](9)
        writer.heartbeat()
    assert isinstance(stamp, int)
    warnings = [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]
    assert len(warnings) == 1  # once per store, however many events follow
    assert "closed" in warnings[0].getMessage() and "dropped" in warnings[0].getMessage()
    assert writer.path.read_bytes() == contents
    assert snap(writer.path).counters[E.AGENT_TX_BYTES] == 5


def test_writer_alive_cases(make_writer, tmp_dir):
    writer = make_writer()
    assert writer_alive(writer.path) is True
    assert writer_alive(str(writer.path)) is True
    assert writer_alive(tmp_dir / "nixl.1.2.3.mmap") is True  # missing: conservative
    writer.close()
    assert writer_alive(writer.path) is False


# -- creation paths ------------------------------------------------------------------


def staging_path(tmp_dir, instance: int):
    return tmp_dir / (L.store_file_name(os.getpid(), store.writer._run_marker, instance) + ".staging")


def test_staging_fallback_renamed_into_place(monkeypatch, make_writer, tmp_dir, lock_probe):
    monkeypatch.setattr(store.writer, "USE_O_TMPFILE", False)
    writer = make_writer(agent_name="nfs", instance=3, bounds=(10.0,))
    assert not staging_path(tmp_dir, 3).exists()
    assert sorted(p.name for p in tmp_dir.iterdir()) == [writer.path.name]
    assert writer.path.name == L.store_file_name(os.getpid(), store.writer._run_marker, 3)
    st = os.lstat(writer.path)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == 6800
    assert lock_probe(writer.path) is False
    writer.record(E.AGENT_XFER_TIME, 20)
    s = snap(writer.path)
    assert s.agent_name == "nfs" and s.instance == 3 and s.pid == os.getpid()
    assert s.histogram(E.AGENT_XFER_TIME) == (0, 1)
    writer.close()
    assert lock_probe(writer.path) is True


@pytest.mark.parametrize("dangling", [False, True], ids=["existing-target", "dangling"])
def test_staging_refuses_planted_symlink(monkeypatch, tmp_dir, tmp_path, make_identity, dangling):
    monkeypatch.setattr(store.writer, "USE_O_TMPFILE", False)
    target = tmp_path / "victim"
    if not dangling:
        target.write_bytes(b"precious")
        target.chmod(0o644)
    planted = staging_path(tmp_dir, 0)
    planted.symlink_to(target)
    with pytest.raises(OSError):
        store.StoreWriter(tmp_dir, make_identity(instance=0))
    assert planted.is_symlink() and os.readlink(planted) == str(target)
    if dangling:
        assert not os.path.lexists(target)
    else:
        assert target.read_bytes() == b"precious"
        assert stat.S_IMODE(target.stat().st_mode) == 0o644
    assert sorted(p.name for p in tmp_dir.iterdir()) == [planted.name]


def test_tmpfile_path_ignores_staging_name(tmp_dir, tmp_path, make_writer):
    """With O_TMPFILE the store never has a staging name, so a planted one is irrelevant."""
    try:
        os.close(os.open(tmp_dir, os.O_TMPFILE | os.O_RDWR, 0o600))
    except (AttributeError, OSError):
        pytest.skip("O_TMPFILE unavailable here")
    assert store.writer.USE_O_TMPFILE is True
    target = tmp_path / "victim"
    target.write_bytes(b"precious")
    planted = staging_path(tmp_dir, 0)
    planted.symlink_to(target)
    writer = make_writer(instance=0)
    assert snap(writer.path).instance == 0
    assert target.read_bytes() == b"precious"
    assert planted.is_symlink()


def test_existing_store_name_is_not_overwritten(make_writer, tmp_dir, make_identity):
    writer = make_writer(instance=0)
    writer.record(E.AGENT_TX_BYTES, 77)
    with pytest.raises(FileExistsError):
        store.StoreWriter(tmp_dir, make_identity(instance=0))
    assert snap(writer.path).counters[0] == 77

