"""The writer's fused transfer recorder and the integer bucket search of every histogram recorder.

``record_transfer`` applies NIXL's four events of one transfer under one lock
with one heartbeat; it must leave the store exactly as the four separate
events would, validate everything before writing anything, and keep the
recorders' other guarantees (wrap, filtering, close, fork, threads).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from bisect import bisect_left

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from store import EventType, Snapshot, StoreIdentity, StoreWriter, read_snapshot
from store import layout as L

# Every test here runs on the C recording path and on its pure-Python twin.
pytestmark = pytest.mark.usefixtures("recording_path")

E = EventType
U64_MAX = 2**64 - 1
LOGGER = "nixl_prometheus_mp.store"


def snap(path) -> Snapshot:
    result = read_snapshot(path)
    assert isinstance(result, Snapshot), result
    return result


def four_events(writer, xfer: int, post: int, nbytes: int, is_write: bool) -> None:
    writer.record(E.AGENT_TX_BYTES if is_write else E.AGENT_RX_BYTES, nbytes)
    writer.record(E.AGENT_TX_REQUESTS_NUM if is_write else E.AGENT_RX_REQUESTS_NUM, 1)
    writer.record(E.AGENT_XFER_POST_TIME, post)
    writer.record(E.AGENT_XFER_TIME, xfer)


u64 = st.one_of(st.sampled_from([0, 1, 9, 10, 11, 2, 3, 999_999, 2**53 + 1, U64_MAX - 1, U64_MAX]),
                st.integers(0, U64_MAX), st.integers(0, 20_000_000))
transfer = st.tuples(u64, u64, u64, st.booleans())


@settings(max_examples=60, deadline=None)
@given(st.lists(transfer, max_size=12),
       st.sampled_from([(), (10.0, 25.0, 50.0), (0.5, 2.5, 1e6 + 0.5), (2.5e-3, 1.0), (5e-324, 1e300)]))
def test_fused_transfer_equals_the_four_events(tmp_path_factory, transfers, bounds) -> None:
    directory = tmp_path_factory.mktemp("fused")
    fused = StoreWriter(directory, StoreIdentity("fused", "host", "", 0, bounds))
    apart = StoreWriter(directory, StoreIdentity("fused", "host", "", 1, bounds))
    try:
        for xfer, post, nbytes, is_write in transfers:
            stamp = fused.record_transfer(xfer, post, nbytes, is_write)
            assert isinstance(stamp, int)
            four_events(apart, xfer, post, nbytes, is_write)
        a, b = fused.path.read_bytes(), apart.path.read_bytes()
        assert a[:L.LAST_UPDATE_FIELD[0]] == b[:L.LAST_UPDATE_FIELD[0]]
        assert a[L.BUCKET_COUNT_FIELD[0]:] == b[L.BUCKET_COUNT_FIELD[0]:]  # names, bounds and every value
    finally:
        fused.close()
        apart.close()


@pytest.mark.parametrize("bounds", [(10.0, 25.0, 50.0), (0.5, 2.5, 7.25), (2.5e-3, 1e6 + 0.5, 1.5e300), ()])
def test_histogram_buckets_match_float_bisect(make_writer, bounds) -> None:
    """The recorders bisect integer-floored bounds; that must equal value <= le over the float bounds."""
    writer = make_writer(bounds=bounds)
    values = [0, 1, 2, 3, 7, 8, 9, 10, 11, 24, 25, 26, 50, 51, 10**6, 10**6 + 1, 2**63, U64_MAX]
    expected = [0] * (len(bounds) + 1)
    for value in values:
        writer.record(E.AGENT_XFER_TIME, value)
        writer.record_transfer(value, value, 1, True)
        expected[bisect_left(bounds, value)] += 1
    s = snap(writer.path)
    assert list(s.histogram(E.AGENT_XFER_TIME)) == [2 * n for n in expected]
    assert list(s.histogram(E.AGENT_XFER_POST_TIME)) == expected


def test_record_transfer_stamps_one_heartbeat(make_writer) -> None:
    writer = make_writer()
    before = time.monotonic_ns()
    stamp = writer.record_transfer(850, 12, 1 << 20, True)
    assert before <= stamp <= time.monotonic_ns()
    assert snap(writer.path).last_update_ns == stamp


@pytest.mark.parametrize(("xfer", "post", "nbytes", "error"), [
    (-1, 1, 1, ValueError), (1, 2**64, 1, ValueError), (1, 1, -5, ValueError), (1, 1, 1.5, TypeError),
    (None, 1, 1, TypeError), (1, True, 1, TypeError), (1, 1, "3", TypeError)])
@pytest.mark.parametrize("enabled", [None, {E.AGENT_TX_BYTES, E.AGENT_XFER_TIME}], ids=["all", "filtered"])
def test_bad_transfer_raises_and_changes_nothing(make_writer, xfer, post, nbytes, error, enabled) -> None:
    writer = make_writer(enabled=enabled)
    writer.record_transfer(10, 1, 100, True)
    before = writer.path.read_bytes()
    for is_write in (True, False):
        with pytest.raises(error):
            writer.record_transfer(xfer, post, nbytes, is_write)
    assert writer.path.read_bytes() == before


def test_filtered_events_are_left_out_of_a_transfer(make_writer) -> None:
    writer = make_writer(enabled={E.AGENT_TX_BYTES, E.AGENT_XFER_TIME}, bounds=(100.0,))
    writer.record_transfer(50, 7, 4096, True)
    writer.record_transfer(500, 7, 10, False)
    s = snap(writer.path)
    assert s.counters[E.AGENT_TX_BYTES] == 4096 and s.gauges[E.AGENT_TX_BYTES] == 4096
    assert s.counters[E.AGENT_XFER_TIME] == 550 and s.histogram(E.AGENT_XFER_TIME) == (1, 1)
    for ev in (E.AGENT_RX_BYTES, E.AGENT_TX_REQUESTS_NUM, E.AGENT_RX_REQUESTS_NUM, E.AGENT_XFER_POST_TIME):
        assert s.counters[ev] == 0 and s.gauges[ev] == 0 and s.sums[ev] == 0


def test_transfer_counters_wrap_modulo_2_64(make_writer) -> None:
    writer = make_writer(bounds=(10.0,))
    writer.record_transfer(U64_MAX, U64_MAX, U64_MAX, True)
    writer.record_transfer(3, 2, 5, True)
    s = snap(writer.path)
    assert s.counters[E.AGENT_TX_BYTES] == 4 and s.gauges[E.AGENT_TX_BYTES] == 5
    assert s.counters[E.AGENT_XFER_TIME] == s.sums[E.AGENT_XFER_TIME] == 2
    assert s.counters[E.AGENT_XFER_POST_TIME] == s.sums[E.AGENT_XFER_POST_TIME] == 1
    assert s.histogram(E.AGENT_XFER_TIME) == (1, 1) and s.counters[E.AGENT_TX_REQUESTS_NUM] == 2


def test_transfer_after_close_dropped_with_warning(make_writer, caplog) -> None:
    writer = make_writer()
    writer.record_transfer(1, 1, 1, True)
    writer.close()
    contents = writer.path.read_bytes()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert isinstance(writer.record_transfer(1, 1, 1, False), int)
    assert any("closed" in r.getMessage() and "dropped" in r.getMessage() for r in caplog.records)
    assert writer.path.read_bytes() == contents


def test_threads_lose_no_transfer(make_writer) -> None:
    threads_n, per_thread = 6, 20_000
    writer = make_writer(bounds=(10.0, 100.0))
    start = threading.Barrier(threads_n)

    def work(write: bool) -> None:
        start.wait(timeout=30)
        for i in range(per_thread):
            writer.record_transfer(5 if i % 2 else 500, 50, 3, write)
            writer.record(E.AGENT_XFER_TIME, 50)  # interleaved with the per-event recorders

    workers = [threading.Thread(target=work, args=(n % 2 == 0,)) for n in range(threads_n)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(timeout=120)
    s = snap(writer.path)
    n = threads_n * per_thread
    assert s.counters[E.AGENT_TX_BYTES] + s.counters[E.AGENT_RX_BYTES] == 3 * n
    assert s.counters[E.AGENT_TX_REQUESTS_NUM] == s.counters[E.AGENT_RX_REQUESTS_NUM] == n // 2
    assert s.histogram(E.AGENT_XFER_POST_TIME) == (0, n, 0)
    assert s.histogram(E.AGENT_XFER_TIME) == (n // 2, n, n // 2)
    assert s.counters[E.AGENT_XFER_TIME] == s.sums[E.AGENT_XFER_TIME] == n // 2 * 505 + n * 50


def test_forked_child_records_transfers_into_its_own_store(make_writer, tmp_dir) -> None:
    writer = make_writer(agent_name="forky")
    writer.record_transfer(100, 10, 7, True)
    parent_before = writer.path.read_bytes()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        code = 0
        try:
            os.close(r)
            writer.record_transfer(200, 20, 9, False)
            out = {"path": str(writer.path), "pid": writer.pid}
            os.write(w, json.dumps(out).encode())
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as pipe:
        out = json.loads(pipe.read() or "{}")
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert out["pid"] == pid and out["path"] != str(writer.path)
    assert writer.path.read_bytes() == parent_before
    kid = snap(out["path"])
    assert kid.counters[E.AGENT_RX_BYTES] == 9 and kid.counters[E.AGENT_TX_BYTES] == 0
    assert kid.counters[E.AGENT_XFER_TIME] == 200 and kid.counters[E.AGENT_RX_REQUESTS_NUM] == 1
    writer.record_transfer(1, 1, 1, True)
    assert snap(writer.path).counters[E.AGENT_TX_BYTES] == 8
