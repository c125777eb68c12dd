"""The Exporter (app/rank/exporter.py): configuration, the directory, recording, life cycle, fork, re-election pace."""

from __future__ import annotations

import itertools
import json
import logging
import os
import signal
import stat
import textwrap
import time
from pathlib import Path

import pytest
from support import (  # noqa: F401  (pytest fixtures)
    DEADLINE_S,
    START_DEADLINE_S,
    can_bind,
    exporter_env,
    free_port,
    healthz,
    make_exporter_fixture,
    parse_exposition,
    reaper_fixture,
    scrape,
    select_pid,
    series,
    start_rank,
    wait_until,
)

from app import ConfigError, Exporter, NullExporter, create_exporter
from store import EventType, read_snapshot
from store.layout import STORE_SIZE

# Every test here runs on the C recording path and on its pure-Python twin.
pytestmark = pytest.mark.usefixtures("recording_path")

E = EventType
RETRY_NS = 200_000_000  # the pace: a writer re-runs the election at most every 200 ms


def snapshot(exp: Exporter):
    snap = read_snapshot(exp.store_path)
    assert snap.__class__.__name__ == "Snapshot", snap
    return snap


# -- configuration --------------------------------------------------------------------------------------------

BAD_VALUES = [
    ("NIXL_TELEMETRY_PROMETHEUS_PORT", "0"),
    ("NIXL_TELEMETRY_PROMETHEUS_PORT", "65536"),
    ("NIXL_TELEMETRY_PROMETHEUS_PORT", "abc"),
    ("NIXL_TELEMETRY_PROMETHEUS_PORT", "-1"),
    ("NIXL_TELEMETRY_PROMETHEUS_PORT", "90.5"),
    ("NIXL_TELEMETRY_PROMETHEUS_LOCAL", "maybe"),
    ("NIXL_TELEMETRY_MP_STALE_TTL", "-1"),
    ("NIXL_TELEMETRY_MP_STALE_TTL", "abc"),
    ("NIXL_TELEMETRY_MP_STALE_TTL", "nan"),
    ("NIXL_TELEMETRY_MP_STALE_TTL", "inf"),
    ("NIXL_TELEMETRY_HISTOGRAM_BUCKETS_US", ",".join(str(i) for i in range(1, 34))),  # 33 bounds
    ("NIXL_TELEMETRY_HISTOGRAM_BUCKETS_US", "100,10,1000"),  # unsorted
    ("NIXL_TELEMETRY_HISTOGRAM_BUCKETS_US", "10,10"),  # not strictly increasing
    ("NIXL_TELEMETRY_HISTOGRAM_BUCKETS_US", "0,10"),
    ("NIXL_TELEMETRY_HISTOGRAM_BUCKETS_US", "10,inf"),
    ("NIXL_TELEMETRY_HISTOGRAM_BUCKETS_US", "10,abc"),
]


@pytest.mark.parametrize(("name", "value"), BAD_VALUES)
def test_bad_value_is_a_config_error_naming_the_variable(tmp_dir: Path, name: str, value: str) -> None:
    env = exporter_env(tmp_dir, free_port())
    env[name] = value
    with pytest.raises(ConfigError) as info:
        Exporter("bad", env)
    assert name in str(info.value)
    assert repr(value) in str(info.value)
    assert isinstance(info.value, ValueError)
    assert os.listdir(tmp_dir) == []  # nothing created: no store, no lock


def test_32_bounds_are_accepted(tmp_dir: Path, make_exporter) -> None:
    bounds = [str(i) for i in range(1, 33)]
    exp = make_exporter("a", exporter_env(tmp_dir, free_port(), NIXL_TELEMETRY_HISTOGRAM_BUCKETS_US=",".join(bounds)))
    assert snapshot(exp).bounds == tuple(float(b) for b in bounds)


@pytest.mark.parametrize("value", [None, "", "  "])
def test_missing_directory_variable_is_a_config_error(value: str | None) -> None:
    env = {"NIXL_TELEMETRY_PROMETHEUS_PORT": str(free_port()), "NIXL_TELEMETRY_PROMETHEUS_LOCAL": "y"}
    if value is not None:
        env["NIXL_TELEMETRY_MULTIPROC_DIR"] = value
    with pytest.raises(ConfigError, match="NIXL_TELEMETRY_MULTIPROC_DIR"):
        Exporter("a", env)


def test_uncreatable_or_non_directory_is_a_config_error(tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for directory in (a_file, a_file / "sub"):
        with pytest.raises(ConfigError, match="NIXL_TELEMETRY_MULTIPROC_DIR") as info:
            Exporter("a", exporter_env(directory, free_port()))
        assert str(directory) in str(info.value)


def test_missing_directory_is_created_0700(tmp_path: Path, make_exporter) -> None:
    directory = tmp_path / "a" / "b" / "run"
    old = os.umask(0o022)
    try:
        exp = make_exporter("a", exporter_env(directory, free_port()))
    finally:
        os.umask(old)
    st = os.stat(directory)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
    assert exp.store_path.parent == directory and exp.store_path.exists()
    assert stat.S_IMODE(os.stat(exp.store_path).st_mode) == 0o600


def test_existing_world_writable_directory_is_warned_about_and_left_alone(tmp_dir: Path, make_exporter,
                                                                          caplog) -> None:
    tmp_dir.chmod(0o777)
    with caplog.at_level(logging.WARNING):
        exp = make_exporter("a", exporter_env(tmp_dir, free_port()))
    assert exp.serving
    assert stat.S_IMODE(os.stat(tmp_dir).st_mode) == 0o777
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(tmp_dir) in m and "world-writable" in m and "0777" in m for m in messages), messages


def test_directory_owned_by_another_uid_is_warned_about(tmp_dir: Path, make_exporter, caplog) -> None:
    os.chown(tmp_dir, 12345, 12345)
    os.chmod(tmp_dir, 0o2770)  # (a project's group directory: a root rank's server, capless, joins its group)
    port = free_port()
    with caplog.at_level(logging.WARNING):
        exp = make_exporter("a", exporter_env(tmp_dir, port))
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(tmp_dir) in m and "uid 12345" in m for m in messages), messages
    assert exp.serving
    kinds = [w["kind"] for w in healthz(port)["warnings"]]
    assert "directory-permissions" in kinds


def test_private_directory_gives_no_warning(tmp_dir: Path, make_exporter, caplog) -> None:
    with caplog.at_level(logging.WARNING):
        make_exporter("a", exporter_env(tmp_dir, free_port()))
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


# -- recording --------------------------------------------------------------------------------------------------

BAD_EVENTS = [
    (99, 1, ValueError),
    (-1, 1, ValueError),
    (len(EventType), 1, ValueError),
    ("AGENT_TX_BYTES", 1, ValueError),
    (None, 1, ValueError),
    (E.AGENT_TX_BYTES, -1, ValueError),
    (E.AGENT_TX_BYTES, 2**64, ValueError),
    (E.AGENT_XFER_TIME, 2**64 + 5, ValueError),
    (E.AGENT_TX_BYTES, 1.0, TypeError),
    (E.AGENT_XFER_TIME, 2.5, TypeError),
    (E.AGENT_TX_REQUESTS_NUM, "5", TypeError),
    (E.AGENT_ERR_BACKEND, None, TypeError),
    (E.AGENT_TX_BYTES, True, TypeError),
]


@pytest.mark.parametrize(("event", "value", "error"), BAD_EVENTS)
def test_bad_event_raises_and_changes_nothing(tmp_dir: Path, make_exporter, event, value, error) -> None:
    exp = make_exporter("a", exporter_env(tmp_dir, free_port()))
    exp.export_event(E.AGENT_TX_BYTES, 3)
    before = exp.store_path.read_bytes()
    with pytest.raises(error):
        exp.export_event(event, value)
    assert exp.store_path.read_bytes() == before
    assert len(before) == STORE_SIZE


def test_largest_value_is_accepted(tmp_dir: Path, make_exporter) -> None:
    exp = make_exporter("a", exporter_env(tmp_dir, free_port()))
    exp.export_event(E.AGENT_TX_BYTES, 2**64 - 1)
    assert snapshot(exp).gauges[E.AGENT_TX_BYTES] == 2**64 - 1


def test_enabled_metrics_glob_records_only_matching_events(tmp_dir: Path, make_exporter, caplog) -> None:
    with caplog.at_level(logging.WARNING):
        exp = make_exporter("a", exporter_env(tmp_dir, free_port(), NIXL_TELEMETRY_ENABLED_METRICS="agent_xfer_*"))
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    exp.export_event(E.AGENT_XFER_TIME, 70)
    exp.export_event(E.AGENT_XFER_POST_TIME, 5)
    exp.export_event(E.AGENT_TX_BYTES, 4096)
    exp.record_error("backend")
    with pytest.raises(ValueError):
        exp.export_event(E.AGENT_TX_BYTES, -1)  # a disabled event's value is still validated
    snap = snapshot(exp)
    assert snap.counters[E.AGENT_XFER_TIME] == 70 and snap.sums[E.AGENT_XFER_TIME] == 70
    assert snap.counters[E.AGENT_XFER_POST_TIME] == 5
    assert snap.counters[E.AGENT_TX_BYTES] == 0 and snap.gauges[E.AGENT_TX_BYTES] == 0
    assert snap.counters[E.AGENT_ERR_BACKEND] == 0


def test_enabled_metrics_entries_are_trimmed_and_case_sensitive(tmp_dir: Path, make_exporter, caplog) -> None:
    with caplog.at_level(logging.WARNING):
        exp = make_exporter("a", exporter_env(tmp_dir, free_port(),
                                              NIXL_TELEMETRY_ENABLED_METRICS=" agent_tx_bytes ,, AGENT_ERR_*,tx_*"))
    exp.export_event(E.AGENT_TX_BYTES, 1)
    exp.export_event(E.AGENT_TX_REQUESTS_NUM, 1)
    exp.record_error("canceled")
    snap = snapshot(exp)
    assert snap.counters[E.AGENT_TX_BYTES] == 1
    assert snap.counters[E.AGENT_TX_REQUESTS_NUM] == 0 and snap.counters[E.AGENT_ERR_CANCELED] == 0
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 2 and "'AGENT_ERR_*'" in warned[0] and "'tx_*'" in warned[1], warned


def test_enabled_metrics_glob_matching_nothing_warns(tmp_dir: Path, make_exporter, caplog) -> None:
    with caplog.at_level(logging.WARNING):
        exp = make_exporter("a", exporter_env(tmp_dir, free_port(),
                                              NIXL_TELEMETRY_ENABLED_METRICS="agent_tx_bytes,no_such_*"))
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("NIXL_TELEMETRY_ENABLED_METRICS" in m and "'no_such_*'" in m and "agent_err_canceled" in m
               for m in messages), messages
    exp.export_event(E.AGENT_TX_BYTES, 2)
    assert snapshot(exp).counters[E.AGENT_TX_BYTES] == 2


def test_enabled_metrics_matching_nothing_records_nothing(tmp_dir: Path, make_exporter) -> None:
    exp = make_exporter("a", exporter_env(tmp_dir, free_port(), NIXL_TELEMETRY_ENABLED_METRICS="AGENT_TX_*"))
    for event in E:
        exp.export_event(event, 1)
    snap = snapshot(exp)
    assert not any(snap.counters) and not any(snap.gauges)


def test_record_helpers_feed_the_right_series(tmp_dir: Path, make_exporter) -> None:
    port = free_port()
    exp = make_exporter("helpers", exporter_env(tmp_dir, port, NIXL_TELEMETRY_HISTOGRAM_BUCKETS_US="10,100,1000",
                                                LOCAL_RANK="1"))
    exp.record_transfer(xfer_time_us=850, post_time_us=12, nbytes=1 << 20, is_write=True)
    exp.record_transfer(xfer_time_us=5, post_time_us=100, nbytes=300, is_write=True)
    exp.record_transfer(xfer_time_us=2000, post_time_us=3, nbytes=77, is_write=False)
    exp.record_error("backend")
    exp.record_error("BACKEND")
    exp.record_error(E.AGENT_ERR_CANCELED)
    exp.record_error("AGENT_ERR_NOT_FOUND")
    exp.record_error("nixl_err_mismatch")
    for bad in ("bogus", E.AGENT_TX_BYTES, 99):
        with pytest.raises(ValueError):
            exp.record_error(bad)
    exp.record_memory_registered(1 << 30)
    exp.record_memory_registered(4096)
    exp.record_memory_deregistered(1 << 20)

    samples = parse_exposition(scrape(port))
    labels = {"hostname": exp._writer.identity.hostname, "agent_name": "helpers", "pid": os.getpid(),
              "agent_instance": exp._writer.identity.instance, "local_rank": "1"}
    mine = select_pid(samples, os.getpid())

    def value(name: str, **extra: object) -> float:
        return mine[series(name, **labels, **extra)]

    assert value("agent_tx_bytes_total") == (1 << 20) + 300 and value("agent_tx_last_bytes") == 300
    assert value("agent_tx_requests_num_total") == 2
    assert value("agent_rx_bytes_total") == 77 and value("agent_rx_last_bytes") == 77
    assert value("agent_rx_requests_num_total") == 1
    assert value("agent_xfer_time_total") == 2855 and value("agent_xfer_time") == 2000
    assert value("agent_xfer_post_time_total") == 115 and value("agent_xfer_post_time") == 3
    assert [value("agent_xfer_time_us_bucket", le=le) for le in ("10", "100", "1000", "+Inf")] == [1, 1, 2, 3]
    assert value("agent_xfer_time_us_count") == 3 and value("agent_xfer_time_us_sum") == 2855
    assert [value("agent_xfer_post_time_us_bucket", le=le) for le in ("10", "100", "1000", "+Inf")] == [
        1, 3, 3, 3]
    assert value("agent_xfer_post_time_us_sum") == 115
    statuses = {"backend": 2, "canceled": 1, "not_found": 1, "mismatch": 1, "not_posted": 0, "no_telemetry": 0}
    for status, count in statuses.items():
        assert value("agent_errors_total", status=status) == count
    assert value("agent_memory_registered_total") == (1 << 30) + 4096
    assert value("agent_memory_registered_last_bytes") == 4096
    assert value("agent_memory_deregistered_total") == 1 << 20
    assert value("agent_memory_deregistered_last_bytes") == 1 << 20
    assert value("agent_telemetry_events_dropped_total") == 0


# -- life cycle ---------------------------------------------------------------------------------------------------


# Thread mode: the rank's own listener.  A rank that handed the address to an address server (the default) holds no
# port to free: its server serves the job's final values until the TTL (test_address_server.py).
THREAD_MODE = {"NIXL_PROMETHEUS_MP_SERVE": "thread"}


def test_close_is_idempotent_frees_the_port_and_leaves_the_store(tmp_dir: Path, make_exporter, lock_probe,
                                                                  caplog) -> None:
    port = free_port()
    exp = make_exporter("a", exporter_env(tmp_dir, port, **THREAD_MODE))
    exp.export_event(E.AGENT_TX_BYTES, 11)
    assert exp.serving and not can_bind(port)
    scrape(port)  # leave a connection behind in TIME_WAIT: the next owner binds anyway
    exp.close()
    assert not exp.serving
    assert can_bind(port)  # right after close
    assert exp.store_path.exists()
    assert lock_probe(exp.store_path)  # the store's lock is released: readers see a departed rank
    assert read_snapshot(exp.store_path).counters[E.AGENT_TX_BYTES] == 11
    exp.close()
    exp.close()
    with caplog.at_level(logging.WARNING):
        exp.export_event(E.AGENT_TX_BYTES, 1)  # dropped with a warning, never an exception
    assert read_snapshot(exp.store_path).counters[E.AGENT_TX_BYTES] == 11
    assert not exp.serving
    # the election is released too: the next exporter on the address serves at once
    successor = make_exporter("b", exporter_env(tmp_dir, port, **THREAD_MODE))
    assert successor.serving


def test_context_manager_closes(tmp_dir: Path, make_exporter) -> None:
    port = free_port()
    env = exporter_env(tmp_dir, port, **THREAD_MODE)
    with Exporter("ctx", env) as exp:
        assert exp.serving
        exp.export_event(E.AGENT_RX_BYTES, 5)
        path = exp.store_path
    assert not exp.serving and path.exists()
    assert can_bind(port, reuse=False)  # no connection was made: even a plain bind succeeds
    assert make_exporter("next", env).serving


def test_second_exporter_in_a_process_is_a_writer_with_the_next_instance(tmp_dir: Path, make_exporter) -> None:
    port = free_port()
    env = exporter_env(tmp_dir, port)
    exps = [make_exporter(f"agent-{i}", env) for i in range(3)]
    assert [e.serving for e in exps] == [True, False, False]
    first = exps[0]._writer.identity.instance
    assert [e._writer.identity.instance for e in exps] == [first, first + 1, first + 2]
    assert len({e.store_path for e in exps}) == 3


SEVERAL_AGENTS = textwrap.dedent("""
    import json, sys
    from app import Exporter
    exps = [Exporter(f"agent-{i}") for i in range(3)]
    for i, exp in enumerate(exps):
        exp.export_event(0, 100 + i)  # AGENT_TX_BYTES
    print(json.dumps({"serving": [e.serving for e in exps], "stores": [str(e.store_path) for e in exps]}), flush=True)
    sys.stdin.read()
""")


def test_several_agents_in_one_process_get_instances_0_1_2(tmp_dir: Path, reaper) -> None:
    port = free_port()
    rank = start_rank(reaper, SEVERAL_AGENTS, exporter_env(tmp_dir, port))
    info = json.loads(rank.readline(START_DEADLINE_S))
    assert info["serving"] == [True, False, False]
    for i, store_path in enumerate(info["stores"]):
        snap = read_snapshot(store_path)
        assert (snap.instance, snap.agent_name, snap.pid) == (i, f"agent-{i}", rank.pid)
        assert Path(store_path).name.endswith(f".{i}.mmap")
    samples = parse_exposition(scrape(port))
    host = read_snapshot(info["stores"][0]).hostname
    for i in range(3):
        key = series("agent_tx_bytes_total", hostname=host, agent_name=f"agent-{i}", pid=rank.pid,
                     agent_instance=i)
        assert samples[key] == 100 + i


def test_create_exporter_selects_only_when_enabled_and_named(tmp_dir: Path) -> None:
    base = exporter_env(tmp_dir, free_port())
    for extra in ({}, {"NIXL_TELEMETRY_ENABLE": "n"}, {"NIXL_TELEMETRY_ENABLE": "y"},
                  {"NIXL_TELEMETRY_ENABLE": "y", "NIXL_TELEMETRY_EXPORTER": "prometheus"},
                  {"NIXL_TELEMETRY_ENABLE": "no", "NIXL_TELEMETRY_EXPORTER": "prometheus_mp"}):
        sink = create_exporter("a", {**base, **extra})
        assert isinstance(sink, NullExporter), extra
        with sink:
            sink.export_event(E.AGENT_TX_BYTES, 1)
            sink.record_transfer(1, 1, 1, True)
            sink.record_error("backend")
            sink.record_memory_registered(1)
            sink.record_memory_deregistered(1)
        assert not sink.serving and sink.store_path is None
    assert os.listdir(tmp_dir) == []
    exp = create_exporter("a", {**base, "NIXL_TELEMETRY_ENABLE": "y", "NIXL_TELEMETRY_EXPORTER": "prometheus_mp"})
    try:
        assert isinstance(exp, Exporter) and exp.serving and exp.store_path.exists()
    finally:
        exp.close()


def test_create_exporter_still_fails_loudly_when_selected(tmp_dir: Path) -> None:
    selected = {"NIXL_TELEMETRY_ENABLE": "yes", "NIXL_TELEMETRY_EXPORTER": "prometheus_mp"}
    with pytest.raises(ConfigError, match="NIXL_TELEMETRY_MULTIPROC_DIR"):
        create_exporter("a", selected)
    with pytest.raises(ConfigError, match="NIXL_TELEMETRY_ENABLE"):
        create_exporter("a", {"NIXL_TELEMETRY_ENABLE": "maybe"})
    with pytest.raises(ConfigError, match="NIXL_TELEMETRY_PROMETHEUS_PORT"):
        create_exporter("a", {**exporter_env(tmp_dir, 1), **selected, "NIXL_TELEMETRY_PROMETHEUS_PORT": "0"})


FORKER = textwrap.dedent("""
    import json, os, sys
    from app import Exporter
    exp = Exporter("forker")
    assert exp.serving
    exp.export_event(0, 10)  # AGENT_TX_BYTES
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        out = {"pid": os.getpid()}
        try:
            out["serving_after_fork"] = exp.serving
            exp.export_event(0, 7)  # the child's first export: its own store, and the election (lost)
            out["serving_after_export"] = exp.serving
            out["store"] = str(exp.store_path)
            fds = os.listdir("/proc/self/fd")
            links = []
            for fd in fds:
                try:
                    links.append(os.readlink(f"/proc/self/fd/{fd}"))
                except OSError:
                    pass
            out["sockets"] = sum(link.startswith("socket:") for link in links)
            exp.close()
        except BaseException as exc:
            out["error"] = repr(exc)
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"parent": os.getpid(), "store": str(exp.store_path), "serving": exp.serving,
                      "child_status": status, "child": json.loads(data)}), flush=True)
    sys.stdin.read()
    exp.close()
""")


def test_forked_child_records_into_its_own_store_and_never_serves(tmp_dir: Path, reaper, serve_mode: str) -> None:
    port = free_port()
    rank = start_rank(reaper, FORKER, exporter_env(tmp_dir, port))
    info = json.loads(rank.readline(START_DEADLINE_S))
    child = info["child"]
    assert "error" not in child, child
    assert info["child_status"] == 0
    assert info["parent"] == rank.pid and child["pid"] != rank.pid
    assert child["serving_after_fork"] is False and child["serving_after_export"] is False
    assert child["sockets"] == 0  # the inherited listening socket was closed in the child
    assert child["store"] != info["store"] and f"nixl.{child['pid']}." in Path(child["store"]).name
    assert info["serving"] is True  # the parent keeps serving
    samples = parse_exposition(scrape(port))
    parent_tx = [v for key, v in select_pid(samples, rank.pid).items() if key[0] == "agent_tx_bytes_total"]
    child_tx = [v for key, v in select_pid(samples, child["pid"]).items() if key[0] == "agent_tx_bytes_total"]
    assert parent_tx == [10] and child_tx == [7]
    owner = healthz(port)["owner"]
    if serve_mode == "helper":  # the address server the parent started answers, never the child
        assert owner["started_by"] == rank.pid and owner["server_pid"] not in (rank.pid, child["pid"]), owner
    else:
        assert owner["pid"] == owner["server_pid"] == rank.pid, owner


# -- re-election pace -----------------------------------------------------------------------------------------


def test_writer_retries_the_election_at_most_every_200ms(tmp_dir: Path, make_exporter) -> None:
    port = free_port()
    env = exporter_env(tmp_dir, port, NIXL_PROMETHEUS_MP_SERVE="helper")  # an address server: SIGTERMed below
    owner = make_exporter("owner", env)
    writer = make_exporter("writer", env)
    assert owner.serving and not writer.serving
    attempts: list[tuple[int, int]] = []  # (entry, exit) of every claim, monotonic ns
    claim = writer._endpoint.claim

    def recording_claim(now_ns: int | None = None) -> int:
        start = time.monotonic_ns()
        try:
            return claim(now_ns)
        finally:
            attempts.append((start, time.monotonic_ns()))

    writer._endpoint.claim = recording_claim
    end = time.monotonic() + 1.0
    exports = 0
    while time.monotonic() < end or len(attempts) < 2:
        writer.export_event(E.AGENT_TX_REQUESTS_NUM, 1)
        exports += 1
        time.sleep(0.001)
        assert time.monotonic() < end + 10, "the writer never re-ran the election"
    assert not writer.serving
    assert exports > len(attempts) * 5  # most exports do not touch the election
    for (a, _), (b, _) in itertools.pairwise(attempts):
        assert b - a >= RETRY_NS, f"two attempts {(b - a) / 1e6:.1f} ms apart"

    # The address server goes (an operator's SIGTERM: its spare goes with it), and the owner closed: the writer's
    # next claims, at its exports, take the address over.
    server = healthz(port)["owner"]["server_pid"]
    owner.close()
    os.kill(server, signal.SIGTERM)
    wait_until(lambda: writer.export_event(E.AGENT_TX_REQUESTS_NUM, 1) or writer.serving, timeout=DEADLINE_S,
               message="the writer's claim to take over")
    assert healthz(port)["owner"]["server_pid"] != server


@pytest.mark.parametrize(("xfer", "post", "nbytes", "error"), [
    (-1, 1, 1, ValueError), (1, 2**64, 1, ValueError), (1, 1, 1.5, TypeError), (None, 1, 1, TypeError)])
def test_record_transfer_with_a_bad_value_raises_and_changes_nothing(tmp_dir: Path, make_exporter, xfer, post,
                                                                      nbytes, error) -> None:
    exp = make_exporter("a", exporter_env(tmp_dir, free_port()))
    exp.record_transfer(10, 1, 100, is_write=True)
    before = exp.store_path.read_bytes()
    for is_write in (True, False):
        with pytest.raises(error):
            exp.record_transfer(xfer, post, nbytes, is_write=is_write)
    assert exp.store_path.read_bytes() == before
