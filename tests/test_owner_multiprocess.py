"""Owner election, aggregation and the in-process endpoint across real rank processes.

Every rank is a subprocess running one Exporter (support.EXPORTER_RANK_SCRIPT) on 127.0.0.1 and a free port;
the test process scrapes it over a real socket. Every process is reaped by the ``reaper`` fixture.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import pytest
from support import (  # noqa: F401  (pytest fixtures)
    DEADLINE_S,
    START_DEADLINE_S,
    ExporterRank,
    Reaper,
    free_port,
    healthz,
    hold_flock,
    listening_socket,
    parse_exposition,
    pids_in,
    reaper_fixture,
    scrape,
    select_pid,
    series,
    start_exporter_rank,
    start_rank,
    try_scrape,
    wait_for_metrics,
    wait_until,
)

from election import held_addresses_except, lock_file_name
from store import EventType

pytestmark = pytest.mark.usefixtures("serve_mode")  # each test served by an address server, then from a thread

E = EventType
BUCKETS = "10,100,1000"
LES = ("10", "100", "1000", "+Inf")  # as the C++ plug-in spells them
BOUNDS = (10, 100, 1000)

# The exposition's names, spelled out here rather than taken from the descriptor under test.
COUNTER_NAMES = {
    E.AGENT_TX_BYTES: "agent_tx_bytes_total",
    E.AGENT_RX_BYTES: "agent_rx_bytes_total",
    E.AGENT_TX_REQUESTS_NUM: "agent_tx_requests_num_total",
    E.AGENT_RX_REQUESTS_NUM: "agent_rx_requests_num_total",
    E.AGENT_MEMORY_REGISTERED: "agent_memory_registered_total",
    E.AGENT_MEMORY_DEREGISTERED: "agent_memory_deregistered_total",
    E.AGENT_XFER_TIME: "agent_xfer_time_total",
    E.AGENT_XFER_POST_TIME: "agent_xfer_post_time_total",
    E.AGENT_TELEMETRY_EVENTS_DROPPED: "agent_telemetry_events_dropped_total",
}
GAUGE_NAMES = {
    E.AGENT_TX_BYTES: "agent_tx_last_bytes",
    E.AGENT_RX_BYTES: "agent_rx_last_bytes",
    E.AGENT_MEMORY_REGISTERED: "agent_memory_registered_last_bytes",
    E.AGENT_MEMORY_DEREGISTERED: "agent_memory_deregistered_last_bytes",
    E.AGENT_XFER_TIME: "agent_xfer_time",
    E.AGENT_XFER_POST_TIME: "agent_xfer_post_time",
}
HISTOGRAM_NAMES = {E.AGENT_XFER_TIME: "agent_xfer_time_us", E.AGENT_XFER_POST_TIME: "agent_xfer_post_time_us"}
ERROR_STATUSES = {
    E.AGENT_ERR_NOT_POSTED: "not_posted", E.AGENT_ERR_INVALID_PARAM: "invalid_param",
    E.AGENT_ERR_BACKEND: "backend", E.AGENT_ERR_NOT_FOUND: "not_found", E.AGENT_ERR_MISMATCH: "mismatch",
    E.AGENT_ERR_NOT_ALLOWED: "not_allowed", E.AGENT_ERR_REPOST_ACTIVE: "repost_active",
    E.AGENT_ERR_UNKNOWN: "unknown", E.AGENT_ERR_NOT_SUPPORTED: "not_supported",
    E.AGENT_ERR_REMOTE_DISCONNECT: "remote_disconnect", E.AGENT_ERR_CANCELED: "canceled",
    E.AGENT_ERR_NO_TELEMETRY: "no_telemetry",
}


def rank_events(i: int) -> list[tuple[EventType, int]]:
    """What rank i records: different values per rank, on every bucket boundary and past the last bound."""
    xfer = [5, 10, 11, 100, 999 + i, 1000, 1001, 10**6 * (i + 1)][: 5 + i]
    return [
        (E.AGENT_TX_BYTES, 100 * (i + 1)), (E.AGENT_TX_BYTES, 7 + i),
        (E.AGENT_RX_BYTES, 3 * i + 1),
        *[(E.AGENT_TX_REQUESTS_NUM, 1)] * (i + 1),
        (E.AGENT_RX_REQUESTS_NUM, 2 * i),
        (E.AGENT_MEMORY_REGISTERED, 4096 * (i + 1)),
        (E.AGENT_MEMORY_DEREGISTERED, 2048 * i),
        *[(E.AGENT_XFER_TIME, v) for v in xfer],
        (E.AGENT_XFER_POST_TIME, i + 1), (E.AGENT_XFER_POST_TIME, 20 * (i + 1)),
        *[(E.AGENT_ERR_BACKEND, 1)] * i,
        (E.AGENT_ERR_CANCELED, 1),
        (E.AGENT_TELEMETRY_EVENTS_DROPPED, i),
    ]


def expected_exposition(events: list[tuple[EventType, int]], labels: dict[str, object]) -> dict:
    """The series one rank must show after recording ``events`` (every family, zeros included)."""
    counters = dict.fromkeys(E, 0)
    gauges = dict.fromkeys(E, 0)
    observed: dict[EventType, list[int]] = {ev: [] for ev in HISTOGRAM_NAMES}
    for ev, value in events:
        counters[ev] += value
        gauges[ev] = value
        if ev in observed:
            observed[ev].append(value)
    out = {}
    for ev, name in COUNTER_NAMES.items():
        out[series(name, **labels)] = counters[ev]
    for ev, status in ERROR_STATUSES.items():
        out[series("agent_errors_total", status=status, **labels)] = counters[ev]
    for ev, name in GAUGE_NAMES.items():
        out[series(name, **labels)] = gauges[ev]
    for ev, name in HISTOGRAM_NAMES.items():
        values = observed[ev]
        for le, bound in zip(LES, (*BOUNDS, float("inf")), strict=True):
            out[series(f"{name}_bucket", le=le, **labels)] = sum(1 for v in values if v <= bound)
        out[series(f"{name}_count", **labels)] = len(values)
        out[series(f"{name}_sum", **labels)] = sum(values)
    return out


def serving_rank(port: int) -> int:
    """The rank that serves ``port``: the one that started its address server, or serves from its thread."""
    return healthz(port)["owner"]["started_by"]


def holder_pid(port: int) -> int:
    """The process that holds ``port``: the address server (helper mode), the serving rank (thread mode)."""
    return healthz(port)["owner"]["server_pid"]


def test_four_ranks_behind_one_endpoint_with_exact_values(tmp_dir: Path, reaper) -> None:
    port = free_port()
    env = {"NIXL_TELEMETRY_HISTOGRAM_BUCKETS_US": BUCKETS}
    ranks = [start_exporter_rank(reaper, tmp_dir, port, agent=f"agent-{i}", extra_env={**env, "LOCAL_RANK": str(i)})
             for i in range(4)]
    assert [r.serving_at_start for r in ranks] == [True, False, False, False]
    for i, rank in enumerate(ranks):
        rank.events(rank_events(i))
    assert [r.serving() for r in ranks] == [True, False, False, False]

    samples = parse_exposition(scrape(port))
    host = socket.gethostname()
    expected = {}
    for i, rank in enumerate(ranks):
        labels = {"hostname": host, "agent_name": f"agent-{i}", "pid": rank.pid, "agent_instance": 0,
                  "local_rank": i}
        expected.update(expected_exposition(rank_events(i), labels))
    assert samples == expected

    doc = healthz(port)
    assert doc["owner"]["started_by"] == ranks[0].pid
    assert sorted(r["pid"] for r in doc["live"]) == sorted(r.pid for r in ranks)
    assert doc["stale"] == [] and doc["warnings"] == []


def test_killed_writer_is_dropped_and_unlinked_on_the_next_scrape_with_ttl_0(tmp_dir: Path, reaper) -> None:
    port = free_port()
    ttl0 = {"NIXL_TELEMETRY_MP_STALE_TTL": "0"}
    owner = start_exporter_rank(reaper, tmp_dir, port, agent="owner", extra_env=ttl0)
    writer = start_exporter_rank(reaper, tmp_dir, port, agent="writer", extra_env=ttl0)
    writer.events([(E.AGENT_TX_BYTES, 4096)])
    assert pids_in(parse_exposition(scrape(port))) == {owner.pid, writer.pid}
    assert writer.store.exists()

    writer.kill()
    time.sleep(0.001)  # the monotonic clock moves past its last update
    samples = parse_exposition(scrape(port))
    assert pids_in(samples) == {owner.pid}
    assert not writer.store.exists()
    doc = healthz(port)
    assert [r["pid"] for r in doc["live"]] == [owner.pid] and doc["stale"] == []


def test_killed_writer_is_published_again_with_the_default_ttl(tmp_dir: Path, reaper) -> None:
    port = free_port()
    owner = start_exporter_rank(reaper, tmp_dir, port, agent="owner")
    writer = start_exporter_rank(reaper, tmp_dir, port, agent="writer", extra_env={"LOCAL_RANK": "1"})
    writer.events([(E.AGENT_TX_BYTES, 4096), (E.AGENT_XFER_TIME, 250), (E.AGENT_ERR_BACKEND, 1)])
    before = select_pid(parse_exposition(scrape(port)), writer.pid)
    assert before[series("agent_tx_bytes_total", hostname=socket.gethostname(), agent_name="writer",
                         pid=writer.pid, agent_instance=0, local_rank=1)] == 4096

    writer.kill()
    for _ in range(2):  # published once more, and again: values kept until the 30 s TTL
        after = parse_exposition(scrape(port))
        assert select_pid(after, writer.pid) == before
        assert pids_in(after) == {owner.pid, writer.pid}
    assert writer.store.exists()
    doc = healthz(port)
    assert [r["pid"] for r in doc["live"]] == [owner.pid]
    (stale,) = doc["stale"]
    assert stale["pid"] == writer.pid and stale["agent_name"] == "writer"
    assert 0 < stale["seconds_until_reaped"] <= 30


def test_writer_behind_a_sibling_owner_is_quiet(tmp_dir: Path, reaper) -> None:
    port = free_port()
    owner = start_exporter_rank(reaper, tmp_dir, port, agent="owner")
    quiet = start_exporter_rank(reaper, tmp_dir, port, agent="quiet", log_level="WARNING", tick_hz=20)
    chatty = start_exporter_rank(reaper, tmp_dir, port, agent="chatty", log_level="INFO", tick_hz=20)

    def exported(rank: ExporterRank, n: int) -> bool:  # >= 0.5 s of exports: several election attempts
        samples = select_pid(parse_exposition(scrape(port)), rank.pid)
        return any(key[0] == "agent_rx_requests_num_total" and value >= n for key, value in samples.items())

    wait_until(lambda: exported(quiet, 10) and exported(chatty, 10), message="both writers exporting")
    for rank in (quiet, chatty):
        assert rank.command("close")["serving"] is False
    assert owner.serving()

    assert quiet.stderr() == ""  # logging at WARNING: nothing at all
    lines = chatty.stderr().splitlines()
    assert not [line for line in lines if not line.startswith("INFO ")], lines
    lost = [line for line in lines if "another process serves" in line]
    assert len(lost) == 1 and f"127.0.0.1:{port}" in lost[0]  # said once, at INFO


def test_the_address_is_served_again_after_its_holder_is_sigkilled(tmp_dir: Path, reaper,
                                                                    serve_mode: str) -> None:
    """Helper mode: the address server is SIGKILLed (both ranks live, and both stand by: either starts the next
    one); thread mode: the serving rank is, and the other rank serves.  Nobody's values are lost."""
    port = free_port()
    owner = start_exporter_rank(reaper, tmp_dir, port, agent="owner")
    owner.events([(E.AGENT_TX_BYTES, 1234)])
    writer = start_exporter_rank(reaper, tmp_dir, port, agent="writer", tick_hz=10)
    assert not writer.serving_at_start
    assert serving_rank(port) == owner.pid
    holder = holder_pid(port)
    if serve_mode == "thread":
        assert holder == owner.pid
        owner.kill()
        successors = {writer.pid}
    else:
        assert holder not in (owner.pid, writer.pid)  # a process of its own
        os.kill(holder, signal.SIGKILL)
        successors = {owner.pid, writer.pid}

    # A fresh interpreter starting the new server on a loaded machine: a bound only a hang reaches (bench
    # measures how fast).
    wait_until(lambda: holder_pid(port) != holder and serving_rank(port) in successors, timeout=START_DEADLINE_S,
               message="a standby serving the address again")
    samples = parse_exposition(scrape(port))
    assert pids_in(samples) == {owner.pid, writer.pid}  # the owner's store is still published (thread mode: stale)
    owner_tx = [v for key, v in select_pid(samples, owner.pid).items() if key[0] == "agent_tx_bytes_total"]
    assert owner_tx == [1234]


def test_port_held_by_a_foreign_socket_warns_then_a_rank_takes_over(tmp_dir: Path, reaper) -> None:
    port = free_port()
    address = f"127.0.0.1:{port}"
    foreign = listening_socket(port)
    try:
        ranks = [start_exporter_rank(reaper, tmp_dir, port, agent=f"rank-{i}", tick_hz=20) for i in range(2)]
        for rank in ranks:
            assert not rank.serving_at_start

            def warned(rank: ExporterRank = rank) -> bool:
                # Each rank, once it wins the election and its bind fails (at construction, or later: a ticking
                # sibling holds the election while it asks the port's holder for /healthz).
                return any(line.startswith("WARNING") and address in line and "cannot bind" in line
                           for line in rank.stderr().splitlines())

            wait_until(warned, message=f"pid {rank.pid} warning that it cannot bind {address}")
        assert not any(r.serving() for r in ranks)
        # The election was conceded: each failed bind released it (a rank holds it again for a moment each time
        # it retries, every 5 s, asking the port's holder for /healthz).
        wait_until(lambda: held_addresses_except(tmp_dir, "127.0.0.1:1") == [], message="the election released")
    finally:
        foreign.close()
    # the first rank to retry once the port is free serves (helper mode: through the server it starts)
    wait_for_metrics(port, timeout=START_DEADLINE_S)
    assert serving_rank(port) in {r.pid for r in ranks}
    wait_until(lambda: [r.serving() for r in ranks].count(True) == 1, message="exactly one serving rank")


def test_ranks_on_two_ports_both_serve_and_report_each_other(tmp_dir: Path, reaper) -> None:
    port_a, port_b = free_port(), free_port()
    addr_a, addr_b = f"127.0.0.1:{port_a}", f"127.0.0.1:{port_b}"
    a = start_exporter_rank(reaper, tmp_dir, port_a, agent="a")
    b = start_exporter_rank(reaper, tmp_dir, port_b, agent="b")
    assert a.serving_at_start and b.serving_at_start
    construction = [line for line in b.stderr().splitlines() if line.startswith("WARNING")]
    assert any(addr_a in line for line in construction), b.stderr()  # said at construction, naming the other
    for port in (port_a, port_b):
        assert pids_in(parse_exposition(scrape(port))) == {a.pid, b.pid}  # each exports every rank
        dups = [w for w in healthz(port)["warnings"] if w["kind"] == "duplicate-owners"]
        assert len(dups) == 1, dups
        assert sorted(dups[0]["details"]["addresses"]) == sorted([addr_a, addr_b])
        other = addr_b if port == port_a else addr_a
        assert other in dups[0]["message"]


def test_first_owner_learns_of_a_later_second_owner(tmp_dir: Path, reaper) -> None:
    """The rank that elected first warns too, once a second owner appears (checked from its scrapes)."""
    port_a, port_b = free_port(), free_port()
    a = start_exporter_rank(reaper, tmp_dir, port_a, agent="a", extra_env={"RANK_OWNER_WATCH_NS": "0"})
    assert a.serving_at_start and a.stderr() == ""  # alone so far: nothing to say
    b = start_exporter_rank(reaper, tmp_dir, port_b, agent="b")
    assert b.serving_at_start
    scrape(port_a)  # the owner's periodic check runs from its scrapes
    addr_b = f"127.0.0.1:{port_b}"
    log_file = healthz(port_a)["owner"]["log_file"]  # an address server's log (None: the rank's own, thread mode)

    def said() -> list[str]:
        text = a.stderr() if log_file is None else Path(log_file).read_text()
        return [line for line in text.splitlines() if "WARNING" in line and addr_b in line]

    wait_until(said, message=f"the first owner warning about {addr_b}")
    scrape(port_a)
    assert any(w["kind"] == "duplicate-owners" for w in healthz(port_a)["warnings"])
    assert len(said()) == 1  # once per other address and owner


def test_leftover_lock_file_is_not_a_second_owner(tmp_dir: Path, reaper) -> None:
    port, old_port = free_port(), free_port()
    leftover = tmp_dir / lock_file_name(f"127.0.0.1:{old_port}")
    leftover.touch(mode=0o600)  # an earlier run's lock file: present, held by nobody
    rank = start_exporter_rank(reaper, tmp_dir, port, agent="a")
    assert rank.serving_at_start
    assert rank.stderr() == ""
    assert [w for w in healthz(port)["warnings"] if w["kind"] == "duplicate-owners"] == []
    assert held_addresses_except(tmp_dir, f"127.0.0.1:{port}") == []
    assert held_addresses_except(tmp_dir, f"127.0.0.1:{old_port}") == [f"127.0.0.1:{port}"]
    assert leftover.exists()


def test_foreign_owned_lock_held_elsewhere_cannot_leave_the_run_unscrapeable(tmp_dir: Path, reaper) -> None:
    port = free_port()
    lock = tmp_dir / lock_file_name(f"127.0.0.1:{port}")
    lock.touch(mode=0o600)
    os.chown(lock, 12345, 12345)
    hold_flock(reaper, lock)  # a co-tenant holding a planted lock on the address
    rank = start_exporter_rank(reaper, tmp_dir, port, agent="a")
    assert rank.serving_at_start  # the bind decided
    warnings = [line for line in rank.stderr().splitlines() if line.startswith("WARNING")]
    assert any(str(lock) in line and "unusable" in line for line in warnings), rank.stderr()
    doc = healthz(port)
    assert doc["owner"]["started_by"] == rank.pid
    assert doc["owner"]["election"] == "bind-fallback"
    unusable = [w for w in doc["warnings"] if w["kind"] == "unusable-lock"]
    assert len(unusable) == 1 and unusable[0]["details"] == {"lock_file": str(lock)}
    assert pids_in(parse_exposition(scrape(port))) == {rank.pid}


def test_reaper_kills_and_waits_for_every_process_it_started(tmp_dir: Path) -> None:
    with Reaper() as reaper:
        sleepers = [start_rank(reaper, "import sys, time; print('up', flush=True); time.sleep(600)")
                    for _ in range(2)]
        assert [s.readline() for s in sleepers] == ["up", "up"]
        exited = start_rank(reaper, "pass")
        exited.proc.wait(timeout=DEADLINE_S)
    for proc in (*[s.proc for s in sleepers], exited.proc):
        assert proc.returncode is not None  # reaped: no zombie, no survivor
    assert [s.proc.returncode for s in sleepers] == [-9, -9]
