"""Who serves when the owner is gone: standbys waiting in the kernel, and a job's last values served.

Real rank processes (support.EXPORTER_RANK_SCRIPT), real flock, real signals, scraped over 127.0.0.1.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
from support import (  # noqa: F401  (pytest fixtures)
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
TAKEOVER_BOUND_S = 5.0  # a bound for a loaded machine: bench measures the figure (0.5 s target, 50 ms goal)


def owner_pid(port: int) -> int | None:
    try:
        return int(healthz(port, timeout=2.0)["owner"]["pid"])
    except (OSError, ValueError, KeyError):
        return None


def wait_for_new_owner(port: int, among: dict[int, ExporterRank], gone: int) -> int:
    """The pid of the rank that serves ``port`` once ``gone`` is dead, with /metrics answering again."""
    def served() -> int | None:
        pid = owner_pid(port)
        return pid if pid in among and pid != gone and try_scrape(port, timeout=2.0) is not None else None

    return wait_until(served, timeout=TAKEOVER_BOUND_S)


@pytest.mark.usefixtures("serve_mode")
def test_idle_standbys_take_over_from_each_killed_owner_without_recording(tmp_dir: Path, reaper: Reaper) -> None:
    port = free_port()
    ranks = {r.pid: r for r in (start_exporter_rank(reaper, tmp_dir, port, agent=f"r{i}") for i in range(4))}
    owner = wait_until(lambda: owner_pid(port), timeout=TAKEOVER_BOUND_S)
    for _ in range(3):  # three successive owners die; nobody records a thing
        ranks.pop(owner).kill()
        wait_for_new_owner(port, ranks, owner)
        # The rank /healthz names says it serves.  Asked a moment later, through its own channel: CI saw, once in
        # some hundred runs on a loaded machine, the named rank no longer serving at that moment, so the check
        # is that the owner /healthz names and the rank that says it serves agree within the bound.
        owner = wait_until(lambda: (pid := owner_pid(port)) in ranks and ranks[pid].serving() and pid,
                           timeout=TAKEOVER_BOUND_S, message="the rank /healthz names to say it serves")


@pytest.mark.usefixtures("serve_mode", "nixl_required")
def test_idle_python_standbys_take_over_from_a_killed_cpp_owner(tmp_dir: Path, reaper: Reaper) -> None:
    """NIXL's C++ plug-in re-elects only as it exports; a Python standby waits in the kernel, even for it."""
    port = free_port()
    (cpp,) = start_cpp_ranks(reaper, tmp_dir, port, ["cpp-owner"])
    wait_for_owner(port, cpp.pid)
    standbys = {r.pid: r for r in (start_exporter_rank(reaper, tmp_dir, port, agent=f"py{i}") for i in range(2))}
    assert not any(r.serving_at_start for r in standbys.values())
    cpp.kill()
    assert wait_for_new_owner(port, standbys, cpp.pid) in standbys


@pytest.mark.usefixtures("serve_mode")
def test_a_waiting_standby_uses_no_cpu(tmp_dir: Path, reaper: Reaper) -> None:
    port = free_port()
    first = start_exporter_rank(reaper, tmp_dir, port, agent="owner")
    standby = start_exporter_rank(reaper, tmp_dir, port, agent="standby")
    wait_until(lambda: owner_pid(port) == first.pid, timeout=TAKEOVER_BOUND_S)
    before = proc_cpu_s(standby.pid)
    time.sleep(5.0)
    used = proc_cpu_s(standby.pid) - before
    assert used < 0.05, f"an idle standby used {used:.3f} s of CPU in 5 s"


@pytest.mark.usefixtures("serve_mode")
def test_a_closed_exporter_no_longer_stands_by(tmp_dir: Path, reaper: Reaper) -> None:
    port = free_port()
    owner = start_exporter_rank(reaper, tmp_dir, port, agent="owner")
    wait_until(lambda: owner_pid(port) == owner.pid, timeout=TAKEOVER_BOUND_S)
    closed = start_exporter_rank(reaper, tmp_dir, port, agent="closed")
    started = time.monotonic()
    closed.command("close")
    assert time.monotonic() - started < 3.0  # bounded: close() does not wait for the owner to die
    other = start_exporter_rank(reaper, tmp_dir, port, agent="other")
    owner.kill()
    assert wait_for_new_owner(port, {other.pid: other, closed.pid: closed}, owner.pid) == other.pid
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
    port = free_port()
    ranks = [start_exporter_rank(reaper, tmp_dir, port, agent=f"r{i}") for i in range(3)]
    wait_until(lambda: healthz(port)["owner"]["serving"] == "helper", timeout=TAKEOVER_BOUND_S)
    for i, rank in enumerate(ranks):
        rank.events(_final_values(i))
    if ending == "close":
        for rank in ranks:
            rank.process.send('{"op": "exit"}')  # every rank closes its Exporter and exits, all at once
        for rank in ranks:
            rank.process.proc.wait(timeout=10)
    else:
        for rank in ranks:
            os.kill(rank.pid, signal.SIGKILL)
        for rank in ranks:
            rank.process.proc.wait(timeout=10)
    time.sleep(2.0)
    doc = healthz(port, timeout=3.0)
    assert doc["owner"]["lingering"]["until"], doc["owner"]
    _assert_final_values_served(port, ranks)


def test_a_lingering_helper_yields_to_a_new_run(tmp_dir: Path, reaper: Reaper) -> None:
    port = free_port()
    old = start_exporter_rank(reaper, tmp_dir, port, agent="r0", extra_env={"NIXL_TELEMETRY_MP_STALE_TTL": "120"},
                              log_level="INFO")
    wait_until(lambda: healthz(port)["owner"]["serving"] == "helper", timeout=TAKEOVER_BOUND_S)
    old.events(_final_values(0))
    old.kill()
    lingering = _await_lingering(port, old)
    assert lingering["departed"] == 1
    helper_pid = healthz(port)["owner"]["server_pid"]
    new = start_exporter_rank(reaper, tmp_dir, port, agent="new")
    assert wait_for_new_owner(port, {new.pid: new}, old.pid) == new.pid
    wait_until(lambda: not os.path.exists(f"/proc/{helper_pid}") or _zombie(helper_pid), timeout=TAKEOVER_BOUND_S)


def _await_lingering(port: int, rank: ExporterRank) -> dict[str, object]:
    try:
        return wait_until(lambda: healthz(port, timeout=2.0)["owner"].get("lingering"), timeout=TAKEOVER_BOUND_S)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; the rank's (and its helper's) stderr:\n{rank.stderr()}") from None


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"
    except OSError:
        return True


def test_a_lingering_helper_ends_once_each_departed_store_was_served(tmp_dir: Path, reaper: Reaper) -> None:
    port = free_port()
    rank = start_exporter_rank(reaper, tmp_dir, port, agent="r0", extra_env={"NIXL_TELEMETRY_MP_STALE_TTL": "120"},
                               log_level="INFO")
    wait_until(lambda: healthz(port)["owner"]["serving"] == "helper", timeout=TAKEOVER_BOUND_S)
    helper_pid = healthz(port)["owner"]["server_pid"]
    rank.events(_final_values(0))
    rank.kill()
    _await_lingering(port, rank)
    assert Path(f"/proc/{helper_pid}").exists()  # /healthz does not count as serving the values
    _assert_final_values_served(port, [rank])
    wait_until(lambda: _zombie(helper_pid), timeout=TAKEOVER_BOUND_S)
    assert try_scrape(port, timeout=1.0) is None  # the address is free again


@pytest.mark.usefixtures("serve_mode")
def test_exporters_that_come_and_go_keep_one_standby_thread(tmp_dir: Path, reaper: Reaper, make_exporter) -> None:
    """A blocked flock cannot be woken, so a closed Exporter's standby parks; the next one reuses it."""
    port = free_port()
    owner = start_exporter_rank(reaper, tmp_dir, port, agent="owner")
    wait_until(lambda: owner_pid(port) == owner.pid, timeout=TAKEOVER_BOUND_S)
    for i in range(20):
        exporter = make_exporter(f"short-lived-{i}", exporter_env(tmp_dir, port))
        assert not exporter.serving
        exporter.close()
    standbys = [t for t in threading.enumerate() if t.name.startswith("nixl-standby-")]
    assert len(standbys) <= 1, [t.name for t in standbys]
    last = make_exporter("last", exporter_env(tmp_dir, port))
    owner.kill()
    wait_until(lambda: last.serving, timeout=TAKEOVER_BOUND_S)  # the reused thread still takes over
