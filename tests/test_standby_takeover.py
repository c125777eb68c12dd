"""Who serves when the address server (thread mode: the serving rank) is gone: standbys waiting in the kernel,
and a job's last values served after its ranks ended.

Real rank processes (support.EXPORTER_RANK_SCRIPT), real flock, real signals, scraped over 127.0.0.1.  In helper
mode (the default) the address is held by the address server a rank started, and only that server's death
moves it; in thread mode by the serving rank itself.
"""

from __future__ import annotations

import os
import signal
import threading
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
    make_exporter_fixture,
    parse_exposition,
    proc_cpu_s,
    reaper_fixture,
    select_pid,
    start_exporter_rank,
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


@pytest.mark.usefixtures("serve_mode")
def test_idle_standbys_take_over_from_each_killed_owner_without_recording(tmp_dir: Path, reaper: Reaper,
                                                                          serve_mode: str) -> None:
    """Helper mode: the address server is SIGKILLed three times, the ranks all live; thread mode: the serving
    rank is, three times."""
    port = free_port()
    ranks = {r.pid: r for r in (start_exporter_rank(reaper, tmp_dir, port, agent=f"r{i}") for i in range(4))}
    holder = wait_until(lambda: holder_pid(port), timeout=TAKEOVER_BOUND_S, message="an owner")
    for _ in range(3):  # three successive holders die; nobody records a thing
        if serve_mode == "thread":
            ranks.pop(holder).kill()
        else:
            assert holder not in ranks  # the address server, a process of its own
            os.kill(holder, signal.SIGKILL)
        wait_for_new_holder(port, ranks, holder)
        # The rank /healthz names says it serves.  Asked a moment later, through its own channel: CI saw, once in
        # some hundred runs on a loaded machine, the named rank no longer serving at that moment, so the check
        # is that the rank /healthz names and the rank that says it serves agree within the bound.
        starter = wait_until(lambda: (pid := started_by(port)) in ranks and ranks[pid].serving() and pid,
                             timeout=TAKEOVER_BOUND_S, message="the rank /healthz names to say it serves")
        holder = holder_pid(port)  # type: ignore[assignment]
        assert holder is not None
        if serve_mode == "thread":
            assert holder == starter


@pytest.mark.usefixtures("serve_mode", "nixl_required")
def test_idle_python_standbys_take_over_from_a_killed_cpp_owner(tmp_dir: Path, reaper: Reaper,
                                                                serve_mode: str) -> None:
    """NIXL's C++ plug-in re-elects only as it exports; a Python standby waits in the kernel, even for it."""
    port = free_port()
    (cpp,) = start_cpp_ranks(reaper, tmp_dir, port, ["cpp-owner"])
    wait_for_owner(port, cpp.pid)
    standbys = {r.pid: r for r in (start_exporter_rank(reaper, tmp_dir, port, agent=f"py{i}") for i in range(2))}
    assert not any(r.serving_at_start for r in standbys.values())
    cpp.kill()
    assert wait_for_new_holder(port, standbys, cpp.pid) in standbys
    doc = owner(port)
    assert doc is not None and doc["serving"] == serve_mode
    if serve_mode == "helper":
        assert doc["server_pid"] not in standbys  # a server of its own, started by the winning standby


@pytest.mark.usefixtures("serve_mode")
def test_a_waiting_standby_uses_no_cpu(tmp_dir: Path, reaper: Reaper) -> None:
    port = free_port()
    first = start_exporter_rank(reaper, tmp_dir, port, agent="owner")
    standby = start_exporter_rank(reaper, tmp_dir, port, agent="standby")
    wait_until(lambda: started_by(port) == first.pid, timeout=TAKEOVER_BOUND_S, message="the first rank serving")
    before = proc_cpu_s(standby.pid)
    time.sleep(5.0)  # the interval measured, not a wait for a state
    used = proc_cpu_s(standby.pid) - before
    assert used < 0.05, f"an idle standby used {used:.3f} s of CPU in 5 s"


@pytest.mark.usefixtures("serve_mode")
def test_a_closed_exporter_no_longer_stands_by(tmp_dir: Path, reaper: Reaper, serve_mode: str) -> None:
    port = free_port()
    first = start_exporter_rank(reaper, tmp_dir, port, agent="owner")
    wait_until(lambda: started_by(port) == first.pid, timeout=TAKEOVER_BOUND_S, message="the first rank serving")
    holder = holder_pid(port)
    assert holder is not None
    closed = start_exporter_rank(reaper, tmp_dir, port, agent="closed")
    started = time.monotonic()
    closed.command("close")
    assert time.monotonic() - started < 5.0  # bounded: close() does not wait for the holder to die
    other = start_exporter_rank(reaper, tmp_dir, port, agent="other")
    first.kill()  # thread mode: the holder; helper mode: the rank that started it (the server serves on) ...
    if serve_mode == "helper":
        assert holder_pid(port) == holder
        os.kill(holder, signal.SIGKILL)  # ... and then the server: the closed rank and `other` remain
    assert wait_for_new_holder(port, {other.pid: other, closed.pid: closed}, holder) == other.pid
    assert not closed.serving()


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
    # No rank carries its records any more: /healthz names the file they go to.
    wait_until(lambda: (doc := owner(port)) and doc["log_file"], message="/healthz naming the server's log file")


@pytest.mark.usefixtures("serve_mode")
def test_exporters_that_come_and_go_keep_one_standby_thread(tmp_dir: Path, reaper: Reaper, make_exporter,
                                                            serve_mode: str) -> None:
    """A blocked flock cannot be woken, so a closed Exporter's standby parks; the next one reuses it."""
    port = free_port()
    first = start_exporter_rank(reaper, tmp_dir, port, agent="owner")
    wait_until(lambda: started_by(port) == first.pid, timeout=TAKEOVER_BOUND_S, message="the first rank serving")
    holder = holder_pid(port)
    assert holder is not None
    for i in range(20):
        exporter = make_exporter(f"short-lived-{i}", exporter_env(tmp_dir, port))
        assert not exporter.serving
        exporter.close()
    # (per address: an earlier test's parked standby, for its own port, may still wait in this process)
    standbys = [t for t in threading.enumerate() if t.name == f"nixl-standby-nixl-owner.127.0.0.1:{port}.lock"]
    assert len(standbys) <= 1, [t.name for t in standbys]
    last = make_exporter("last", exporter_env(tmp_dir, port))
    first.kill()  # thread mode: the holder; helper mode: the rank that started it, then its server
    if serve_mode == "helper":
        os.kill(holder, signal.SIGKILL)
    wait_until(lambda: last.serving, timeout=TAKEOVER_BOUND_S, message="the reused thread taking over")
    assert wait_for_new_holder(port, {os.getpid()}, holder) == os.getpid()
