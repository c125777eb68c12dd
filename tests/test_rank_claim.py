"""A rank's claim on the address: a non-blocking election as it records, as the C++ plug-in's ranks do, which
takes the address over once nothing of ours holds it (thread mode's serving rank gone, an address server and
its spare both gone, a C++ owner gone); and a job's last values served after its ranks ended.

Real rank processes (support.EXPORTER_RANK_SCRIPT), real flock, real signals, scraped over 127.0.0.1.  The
server's own succession (its spare) is tests/test_address_server.py's.
"""

from __future__ import annotations

import json
import os
import signal
import textwrap
import time
from pathlib import Path

import pytest
from support import (  # noqa: F401  (pytest fixtures)
    DEADLINE_S,
    START_DEADLINE_S,
    ExporterRank,
    Reaper,
    exporter_env,
    free_port,
    healthz,
    kill_server_and_spare,
    make_exporter_fixture,
    parse_exposition,
    proc_cpu_s,
    reaper_fixture,
    select_pid,
    start_exporter_rank,
    start_rank,
    try_scrape,
    wait_until,
)
from support_nixl import nixl_required_fixture, start_cpp_ranks, wait_for_owner  # noqa: F401  (pytest fixture)

from store import EventType

E = EventType
# A takeover is a bind and, in helper mode, a fresh interpreter starting the new server on a loaded machine: a
# bound only a hang reaches (bench measures the figure).
TAKEOVER_BOUND_S = START_DEADLINE_S


def owner(port: int) -> dict[str, object] | None:
    """/healthz's owner on ``port`` right now (None if nothing answers)."""
    try:
        return healthz(port, timeout=2.0)["owner"]
    except (OSError, ValueError, KeyError, AssertionError):
        return None


def holder_pid(port: int) -> int | None:
    """The process holding the address: the address server (helper mode) or the serving rank (thread mode)."""
    doc = owner(port)
    return None if doc is None else int(doc["server_pid"])  # type: ignore[arg-type]


def started_by(port: int) -> int | None:
    """The rank that started the address server (thread mode: the serving rank itself)."""
    doc = owner(port)
    return None if doc is None else int(doc["started_by"])  # type: ignore[arg-type]


def wait_for_new_holder(port: int, among: dict[int, ExporterRank] | set[int], gone: int) -> int:
    """The rank that serves ``port`` (started its server, or serves from its thread) once ``gone``, the holder,
    is dead, with /metrics answering again."""
    def served() -> int | None:
        doc = owner(port)
        if doc is None or doc["server_pid"] == gone or doc["started_by"] not in among:
            return None
        return int(doc["started_by"]) if try_scrape(port, timeout=2.0) is not None else None  # type: ignore[arg-type]

    return wait_until(served, timeout=TAKEOVER_BOUND_S, message=f"a rank of {sorted(among)} serving after {gone}")


def _kill_holder(port: int, holder: int, ranks: dict[int, ExporterRank], serve_mode: str) -> None:
    """Thread mode: the serving rank dies; helper mode: the address server's spare, then the server."""
    if serve_mode == "thread":
        ranks.pop(holder).kill()
        return
    assert holder not in ranks  # the address server, a process of its own
    assert holder in kill_server_and_spare(port)


@pytest.mark.usefixtures("serve_mode")
def test_recording_ranks_take_over_from_each_killed_owner(tmp_dir: Path, reaper: Reaper, serve_mode: str) -> None:
    """Thread mode: the serving rank is SIGKILLed three times; helper mode: the address server and its spare."""
    port = free_port()
    ranks = {r.pid: r for r in (start_exporter_rank(reaper, tmp_dir, port, agent=f"r{i}", tick_hz=20)
                                for i in range(4))}
    holder = wait_until(lambda: holder_pid(port), timeout=TAKEOVER_BOUND_S, message="an owner")
    for _ in range(3):  # three successive holders die
        _kill_holder(port, holder, ranks, serve_mode)
        wait_for_new_holder(port, ranks, holder)
        starter = wait_until(lambda: (pid := started_by(port)) in ranks and ranks[pid].serving() and pid,
                             timeout=TAKEOVER_BOUND_S, message="the rank /healthz names to say it serves")
        holder = holder_pid(port)  # type: ignore[assignment]
        assert holder is not None
        if serve_mode == "thread":
            assert holder == starter


@pytest.mark.usefixtures("serve_mode")
def test_idle_ranks_take_nothing_over_until_they_record(tmp_dir: Path, reaper: Reaper, serve_mode: str) -> None:
    """What the docs say of idle ranks: they stay writers until they record (the C++ plug-in's ranks' rule)."""
    port = free_port()
    ranks = {r.pid: r for r in (start_exporter_rank(reaper, tmp_dir, port, agent=f"r{i}") for i in range(2))}
    holder = wait_until(lambda: holder_pid(port), timeout=TAKEOVER_BOUND_S, message="an owner")
    _kill_holder(port, holder, ranks, serve_mode)
    wait_until(lambda: holder_pid(port) is None, message="nothing serving")
    idle = next(iter(ranks.values()))
    # It records: one of its next exports (at most every 200 ms) claims the address.
    wait_until(lambda: idle.events([(E.AGENT_TX_BYTES, 1)]) and holder_pid(port), timeout=TAKEOVER_BOUND_S,
               message="the recording rank taking over")
    assert started_by(port) == idle.pid


@pytest.mark.usefixtures("serve_mode", "nixl_required")
def test_recording_python_ranks_take_over_from_a_killed_cpp_owner(tmp_dir: Path, reaper: Reaper,
                                                                  serve_mode: str) -> None:
    """NIXL's C++ plug-in re-elects as it exports; so do Python ranks."""
    port = free_port()
    (cpp,) = start_cpp_ranks(reaper, tmp_dir, port, ["cpp-owner"])
    wait_for_owner(port, cpp.pid)
    ranks = {r.pid: r for r in (start_exporter_rank(reaper, tmp_dir, port, agent=f"py{i}", tick_hz=20)
                                for i in range(2))}
    assert not any(r.serving_at_start for r in ranks.values())
    cpp.kill()
    assert wait_for_new_holder(port, ranks, cpp.pid) in ranks
    doc = owner(port)
    assert doc is not None and doc["serving"] == serve_mode
    if serve_mode == "helper":
        assert doc["server_pid"] not in ranks  # a server of its own, started by the winning rank


@pytest.mark.usefixtures("serve_mode")
def test_a_rank_that_lost_uses_no_cpu(tmp_dir: Path, reaper: Reaper) -> None:
    port = free_port()
    first = start_exporter_rank(reaper, tmp_dir, port, agent="owner")
    other = start_exporter_rank(reaper, tmp_dir, port, agent="other")
    wait_until(lambda: started_by(port) == first.pid, timeout=TAKEOVER_BOUND_S, message="the first rank serving")
    before = proc_cpu_s(other.pid)
    time.sleep(3.0)  # the interval measured, not a wait for a state
    used = proc_cpu_s(other.pid) - before
    assert used < 0.05, f"an idle rank used {used:.3f} s of CPU in 3 s"


# A rank recording flat out for 1.5 s (its claims every 200 ms), counting through the interpreter's audit events
# every listing of its directory: those its constructor made, and those its export path made.
LISTINGS_SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    from app import Exporter
    from app.health import OwnerWatch

    OwnerWatch.WATCH_INTERVAL_NS = 0  # a duplicate-owner check would be due at every claim
    directory = os.path.realpath(os.environ["NIXL_TELEMETRY_MULTIPROC_DIR"])
    listings = []

    def audit(event, args):
        if event in ("os.scandir", "os.listdir") and args and args[0] is not None:
            if os.path.realpath(os.fsdecode(os.fspath(args[0]))) == directory:
                listings.append(event)

    sys.addaudithook(audit)
    exp = Exporter(sys.argv[1])
    constructing = len(listings)
    end = time.monotonic() + 1.5
    while time.monotonic() < end:
        exp.record_transfer(10, 1, 64, True)
        time.sleep(0.001)
    print(json.dumps({"serving": exp.serving, "constructing": constructing,
                      "recording": len(listings) - constructing}), flush=True)
    sys.stdin.readline()  # (serving from a thread, the first keeps the address until the second reported)
    exp.close()
""")


@pytest.mark.usefixtures("serve_mode")
def test_the_export_path_never_lists_the_directory(tmp_dir: Path, reaper: Reaper) -> None:
    """Listing the directory takes 80 ms for 150 000 files: a pause in the host's recording thread.  A rank
    lists it as it starts (the duplicate-owner check, said once); from then on whoever serves checks, from its
    scrapes.  The rank that serves and the one that lost alike."""
    port = free_port()
    ranks = [start_rank(reaper, LISTINGS_SCRIPT, exporter_env(tmp_dir, port), args=(agent,))
             for agent in ("first", "second")]
    reports = [json.loads(rank.readline(START_DEADLINE_S + 5)) for rank in ranks]
    for rank in ranks:
        rank.send("exit")
        rank.proc.wait(timeout=DEADLINE_S)
    assert sorted(report["serving"] for report in reports) == [False, True], reports
    assert all(report["constructing"] >= 1 for report in reports), reports  # (the count sees a listing)
    assert [report["recording"] for report in reports] == [0, 0], reports


def _final_values(i: int) -> list[tuple[EventType, int]]:
    return [(E.AGENT_TX_BYTES, 1000 + i), (E.AGENT_TX_REQUESTS_NUM, 1), (E.AGENT_XFER_TIME, 50 * (i + 1))]


def _assert_final_values_served(port: int, ranks: list[ExporterRank]) -> None:
    text = try_scrape(port, timeout=3.0)
    assert text is not None, "nothing serves the job's last values"
    samples = parse_exposition(text)
    for i, rank in enumerate(ranks):
        mine = {name: value for (name, _), value in select_pid(samples, rank.pid).items()}
        assert mine.get("agent_tx_bytes_total") == 1000 + i, mine
        assert mine["agent_tx_requests_num_total"] == 1
        assert mine["agent_xfer_time_total"] == 50 * (i + 1)


@pytest.mark.parametrize("ending", ["close", "sigkill"])
def test_a_jobs_last_values_are_served_after_its_last_rank_ended(tmp_dir: Path, reaper: Reaper, ending: str) -> None:
    """The default mode: the address server, not a rank, holds the address, and outlives every rank."""
    port = free_port()
    ranks = [start_exporter_rank(reaper, tmp_dir, port, agent=f"r{i}") for i in range(3)]
    server = wait_until(lambda: (doc := owner(port)) and doc["serving"] == "helper" and doc["server_pid"],
                        timeout=TAKEOVER_BOUND_S, message="the address server serving")
    for i, rank in enumerate(ranks):
        rank.events(_final_values(i))
    if ending == "close":
        for rank in ranks:
            rank.process.send('{"op": "exit"}')  # every rank closes its Exporter and exits, all at once
    else:
        for rank in ranks:
            os.kill(rank.pid, signal.SIGKILL)
    for rank in ranks:
        rank.process.proc.wait(timeout=DEADLINE_S)
    _assert_final_values_served(port, ranks)
    doc = owner(port)
    assert doc is not None and doc["server_pid"] == server, doc  # the same server: nothing moved
