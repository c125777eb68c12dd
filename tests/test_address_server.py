"""The address belongs to the job: one address server per address, which a rank's death or close() never
moves, which publishes every rank's final values to every scraper until the TTL, and which goes once nothing
is left to publish (docs/architecture.md).

Real rank processes, real signals, real sockets; every wait is on the state it checks, bounded by a deadline
only a hang reaches.  The figures (how fast, how much CPU) are bench's (``python -m bench --scenarios
standby``); here, what happens and in what order.
"""

from __future__ import annotations

import json
import os
import signal
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import (
    DEADLINE_S,
    START_DEADLINE_S,
    RankProcess,
    Reaper,
    can_bind,
    free_port,
    healthz,
    parse_exposition,
    proc_cpu_s,
    reaper_fixture,  # noqa: F401  (the "reaper" fixture)
    start_rank,
    try_scrape,
    wait_until,
)

from app import Exporter
from store import EventType, Snapshot, StoreIdentity, StoreWriter, read_snapshot

pytestmark = pytest.mark.usefixtures("helper_mode")

TTL_S = 6.0
COUNTER = "agent_rx_requests_num_total"

# A rank recording RANK_RATE events/s until SIGTERM (its handler closes the Exporter, as a NIXL job's does) or
# SIGKILL; on stdin: "threads" (the names of our threads), "close".
RANK_SCRIPT = textwrap.dedent("""
    import json, os, signal, sys, threading
    from app import Exporter
    exp = Exporter(os.environ.get("RANK_AGENT", "agent"))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    rate = float(os.environ.get("RANK_RATE", "50"))

    def record():
        while not stop.wait(1.0 / rate):
            exp.export_event(3, 1)
        exp.close()
        os._exit(0)

    if rate > 0:
        threading.Thread(target=record, daemon=True).start()
    print(json.dumps({"pid": os.getpid(), "store": str(exp.store_path)}), flush=True)
    for line in sys.stdin:
        if line.strip() == "threads":
            print(json.dumps(sorted(t.name for t in threading.enumerate() if t.name.startswith("nixl"))), flush=True)
        elif line.strip() == "close":
            exp.close()
            print(json.dumps("closed"), flush=True)
    stop.wait()
""")


@pytest.fixture
def helper_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """The address server is the default mode's; thread mode keeps the C++ plug-in's shape (tested elsewhere)."""
    monkeypatch.setenv("NIXL_PROMETHEUS_MP_SERVE", "helper")


def _env(directory: Path, port: int, **extra: str) -> dict[str, str]:
    return {"NIXL_TELEMETRY_MULTIPROC_DIR": str(directory), "NIXL_TELEMETRY_PROMETHEUS_PORT": str(port),
            "NIXL_TELEMETRY_PROMETHEUS_LOCAL": "y", "NIXL_TELEMETRY_MP_STALE_TTL": str(TTL_S),
            "NIXL_PROMETHEUS_MP_SERVE": "helper", **extra}


def _start(reaper: Reaper, directory: Path, port: int, rate: float = 50, **extra: str) -> RankProcess:
    rank = start_rank(reaper, RANK_SCRIPT, _env(directory, port, RANK_RATE=str(rate), **extra))
    json.loads(rank.readline(START_DEADLINE_S))
    return rank


def _owner(port: int) -> dict[str, object]:
    return healthz(port)["owner"]


def _server(port: int) -> int:
    """The pid of the address server answering ``port`` (waited for)."""
    return wait_until(lambda: _owner(port)["server_pid"], message="an address server answering")


def _counts(text: str | None) -> dict[int, float]:
    if text is None:
        return {}
    return {int(dict(key[1])["pid"]): value for key, value in parse_exposition(text).items() if key[0] == COUNTER}


def _final_values(directory: Path) -> dict[int, int]:
    """What each rank's store holds once every rank is gone: the truth the scrapers must see."""
    snaps = [read_snapshot(path) for path in directory.glob("nixl.*.mmap")]
    return {s.pid: s.counters[EventType.AGENT_RX_REQUESTS_NUM] for s in snaps if isinstance(s, Snapshot)}


class Scraper:
    """A Prometheus of an HA pair: scrapes every ``interval_s`` from a thread; keeps what each scrape saw."""

    def __init__(self, port: int, interval_s: float, offset_s: float = 0.0) -> None:
        self.port, self.interval_s = port, interval_s
        self.scrapes: list[tuple[float, dict[int, float] | None]] = []  # (monotonic, counts or None: failed)
        self._stop = threading.Event()
        self._offset_s = offset_s
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self._stop.wait(self._offset_s)
        while not self._stop.is_set():
            text = try_scrape(self.port, timeout=5.0)
            self.scrapes.append((time.monotonic(), None if text is None else _counts(text)))
            self._stop.wait(self.interval_s)

    def saw_since(self, since: float, truth: dict[int, int]) -> bool:
        return any(counts is not None and all(counts.get(pid) == value for pid, value in truth.items())
                   for at, counts in self.scrapes if at > since)

    def failures(self) -> int:
        return sum(counts is None for _, counts in self.scrapes)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(DEADLINE_S)


@pytest.fixture
def scrapers() -> Iterator[list[Scraper]]:
    made: list[Scraper] = []
    yield made
    for scraper in made:
        scraper.close()


ENDINGS = {  # how the job ends: (signal, seconds between ranks, the starting rank first)
    "sigterm-at-once": (signal.SIGTERM, 0.0, True),
    "sigterm-50ms-starter-first": (signal.SIGTERM, 0.05, True),
    "sigterm-150ms-starter-first": (signal.SIGTERM, 0.15, True),
    "sigterm-50ms-starter-last": (signal.SIGTERM, 0.05, False),
    "sigkill-at-once": (signal.SIGKILL, 0.0, True),
}


@pytest.mark.parametrize("ending", list(ENDINGS))
def test_a_jobs_final_values_reach_both_scrapers_of_an_ha_pair(tmp_dir: Path, reaper: Reaper,
                                                              scrapers: list[Scraper], ending: str) -> None:
    signum, spacing_s, starter_first = ENDINGS[ending]
    port = free_port()
    ranks = [_start(reaper, tmp_dir, port) for _ in range(3)]
    starter = wait_until(lambda: _owner(port)["started_by"], message="the server naming the rank that started it")
    order = sorted(ranks, key=lambda r: (r.pid == starter) != starter_first)
    assert (order[0].pid == starter) == starter_first
    scrapers += [Scraper(port, 1.0), Scraper(port, 1.0, offset_s=0.5)]
    wait_until(lambda: all(len(s.scrapes) >= 1 for s in scrapers), message="both scrapers scraping")
    for rank in order:
        os.kill(rank.pid, signum)
        if spacing_s:
            time.sleep(spacing_s)  # the ending being tested, not a wait
    for rank in order:
        rank.proc.wait(DEADLINE_S)
    ended = time.monotonic()
    curl = try_scrape(port)  # an operator's curl right after the end takes nothing from anyone
    truth = _final_values(tmp_dir)
    assert set(truth) == {r.pid for r in ranks} and all(truth.values()), truth
    assert _counts(curl) == truth
    for scraper in scrapers:
        wait_until(lambda s=scraper: s.saw_since(ended, truth), timeout=TTL_S,
                   message="a scraper seeing every rank's final value before the TTL")
    assert [s.failures() for s in scrapers] == [0, 0]


def test_no_request_fails_when_ranks_die_or_close_the_starting_rank_first(tmp_dir: Path,
                                                                          reaper: Reaper) -> None:
    port = free_port()
    ranks = [_start(reaper, tmp_dir, port) for _ in range(4)]
    server = _server(port)
    starter = _owner(port)["started_by"]
    failed, answered, stop = [], [0], threading.Event()

    def poll() -> None:
        while not stop.is_set():
            if try_scrape(port, timeout=5.0) is None:
                failed.append(time.monotonic())
            else:
                answered[0] += 1
            stop.wait(0.005)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        by_pid = {r.pid: r for r in ranks}
        first = by_pid.pop(starter)  # type: ignore[arg-type]
        first.kill()  # the starting rank, SIGKILLed
        second, third, last = by_pid.values()
        os.kill(second.pid, signal.SIGTERM)  # closes its Exporter
        second.proc.wait(DEADLINE_S)
        third.kill()
        before = answered[0]
        wait_until(lambda: answered[0] >= before + 20, message="scrapes after the deaths")
        assert _counts(try_scrape(port)).keys() == set(_final_values(tmp_dir)) | {last.pid}
    finally:
        stop.set()
        poller.join(DEADLINE_S)
    assert failed == []
    assert _owner(port)["server_pid"] == server  # nothing moved


def test_a_killed_server_is_replaced_by_a_standby_and_a_stopped_one_too(tmp_dir: Path,
                                                                        reaper: Reaper) -> None:
    port = free_port()
    ranks = [_start(reaper, tmp_dir, port, rate=0) for _ in range(3)]  # idle: nothing re-elects as it records
    first = _server(port)
    os.kill(first, signal.SIGKILL)
    second = wait_until(lambda: (pid := _owner(port)["server_pid"]) != first and pid,
                        message="a new server after SIGKILL")
    assert _owner(port)["started_by"] in {r.pid for r in ranks}
    # Stopped (a debugger): the rank that started it kills it once it has not answered for 2 s.
    os.kill(second, signal.SIGSTOP)
    try:
        # The kill first (no request waits on it), then the new server: until then each look waits out its 5 s
        # timeout in the stopped server's backlog, and a standby starts a fresh interpreter (one CI run under
        # load, on the pure-Python twins, took more than 15 s for both): a failure says which did not come.
        wait_until(lambda: _zombie(second), timeout=DEADLINE_S + 5, message="the stopped server killed")
        wait_until(lambda: _owner(port)["server_pid"] not in (first, second), timeout=START_DEADLINE_S + DEADLINE_S,
                   message="a new server after SIGSTOP")
    finally:
        os.kill(second, signal.SIGCONT)  # (a zombie by now, unless the test failed)
    assert sorted(_counts(try_scrape(port))) == sorted(r.pid for r in ranks)


def test_a_server_killed_as_it_starts_is_started_again(tmp_dir: Path, reaper: Reaper) -> None:
    port = free_port()
    rank = _start(reaper, tmp_dir, port, rate=0)
    # SIGKILL every server of this address as soon as it appears, three times; then leave the next one be.
    killed: set[int] = set()
    deadline = time.monotonic() + DEADLINE_S * 2
    while len(killed) < 3 and time.monotonic() < deadline:
        for pid in _servers_of(port) - killed:
            os.kill(pid, signal.SIGKILL)
            killed.add(pid)
    assert len(killed) == 3
    wait_until(lambda: _owner(port)["server_pid"] not in killed, timeout=DEADLINE_S * 2,
               message="a server that was left alone serving")
    assert _owner(port)["started_by"] == rank.pid


def _servers_of(port: int) -> set[int]:
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if len(argv) >= 3 and argv[-3] == b"serving-helper" and argv[-2].endswith(f":{port}".encode()):
                found.add(int(entry))
    return found


def test_an_idle_server_polls_nothing_and_gives_the_address_up_after_the_ttl(tmp_dir: Path,
                                                                             reaper: Reaper) -> None:
    for instance in range(200):  # 200 departed stores, as a long job's churn leaves behind
        StoreWriter(tmp_dir, StoreIdentity("departed", "host", "", instance, (10.0, 100.0))).close()
    port = free_port()
    rank = _start(reaper, tmp_dir, port, rate=0, NIXL_TELEMETRY_MP_STALE_TTL="8")
    server = _server(port)
    assert rank.send("close") is None and json.loads(rank.readline()) == "closed"
    # Unscraped from here on.  Its CPU over 2 s, per thread (/proc/PID/task): none of them wakes to look.
    before = proc_cpu_s(server)
    time.sleep(2.0)  # the interval measured, not a wait for a state
    used = proc_cpu_s(server) - before
    assert used < 0.2, f"an idle address server used {used:.2f} CPU s in 2 s"
    wait_until(lambda: can_bind(port), timeout=8 + DEADLINE_S, message="the port free after the TTL")
    wait_until(lambda: not Path(f"/proc/{server}").exists() or _zombie(server), message="the server gone")


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except OSError:
        return True


def test_a_new_run_in_the_same_directory_is_served_without_a_failed_scrape(tmp_dir: Path, reaper: Reaper,
                                                                           scrapers: list[Scraper]) -> None:
    port = free_port()
    old = _start(reaper, tmp_dir, port, rate=0)
    server = _server(port)
    old.send("close")
    old.readline()
    scrapers.append(Scraper(port, 0.02))
    new = _start(reaper, tmp_dir, port, rate=0)
    wait_until(lambda: new.pid in _counts(try_scrape(port)), message="the new run's rank published")
    assert _owner(port)["server_pid"] == server
    assert scrapers[0].failures() == 0 and scrapers[0].scrapes


def test_a_new_run_of_another_directory_gets_the_port_from_a_server_of_departed_ranks(
        tmp_dir: Path, tmp_path: Path, reaper: Reaper) -> None:
    port = free_port()
    old = _start(reaper, tmp_dir, port, rate=0, NIXL_TELEMETRY_MP_STALE_TTL="60")
    old_server = _server(port)
    other = tmp_path / "other"
    other.mkdir(mode=0o700)
    # While a rank of the old run lives, its server keeps the port, and the newcomer says who holds it.
    held = _start(reaper, other, port, rate=0, RANK_LOG_LEVEL="WARNING")
    wait_until(lambda: "in use" in held.stderr_text(), message="the newcomer's warning")
    assert healthz(port)["directory"] == str(tmp_dir)
    held.kill()
    old.send("close")
    old.readline()
    new = _start(reaper, other, port, rate=0)
    wait_until(lambda: healthz(port)["directory"] == str(other), message="the new run's server")
    assert _owner(port)["started_by"] == new.pid and _owner(port)["server_pid"] != old_server


def test_threads_of_ours_one_standby_plus_the_starters_log_carrier_none_running_after_close(
        tmp_dir: Path, reaper: Reaper) -> None:
    port = free_port()
    ranks = [_start(reaper, tmp_dir, port, rate=0) for _ in range(2)]
    starter = wait_until(lambda: _owner(port)["started_by"], message="the server naming its starter")
    for rank in ranks:
        rank.send("threads")
        names = json.loads(rank.readline())
        expected = [f"nixl-standby-nixl-owner.127.0.0.1:{port}.lock"]
        if rank.pid == starter:
            expected.append(f"nixl-server-log-127.0.0.1:{port}")
        assert sorted(names) == sorted(expected), (rank.pid == starter, names)
    for rank in ranks:
        rank.send("close")
        assert json.loads(rank.readline()) == "closed"
        rank.send("threads")
        # The standby detached by close() stays parked in the kernel's flock() until the lock is next released
        # (docs/guarantees.md, "Not guaranteed"): it holds nothing and runs no code of ours.
        assert json.loads(rank.readline()) in ([], [f"nixl-standby-nixl-owner.127.0.0.1:{port}.lock"])
    assert sorted(_counts(try_scrape(port))) == sorted(r.pid for r in ranks)  # the server serves on


def test_the_servers_records_go_to_the_starting_rank_then_to_a_file_healthz_names(
        tmp_dir: Path, reaper: Reaper) -> None:
    port = free_port()
    rank = start_rank(reaper, RANK_SCRIPT.replace("from app import Exporter", "import logging\nlogging.basicConfig("
                                                  "level=logging.INFO)\nfrom app import Exporter"),
                      _env(tmp_dir, port, RANK_RATE="0", NIXL_TELEMETRY_MP_STALE_TTL="1"))
    json.loads(rank.readline(START_DEADLINE_S))
    server = _server(port)
    assert _owner(port)["log_file"] is None
    StoreWriter(tmp_dir, StoreIdentity("gone", "host", "", 0, (10.0,))).close()  # reaped (and said) after the TTL
    wait_until(lambda: "reaped" in rank.stderr_text() and f"address server (pid {server})" in rank.stderr_text(),
               message="the server's record in the rank's log")
    rank.send("close")
    rank.readline()
    log_file = Path(wait_until(lambda: _owner(port)["log_file"], message="/healthz naming the log file"))
    assert log_file.parent == tmp_dir
    wait_until(lambda: log_file.exists() and "reaped" in log_file.read_text(), timeout=DEADLINE_S,
               message="the rank's own store reaped, said in the file")


def test_an_exporter_in_this_process_leaves_the_server_serving_after_close(tmp_dir: Path) -> None:
    port = free_port()
    exporter = Exporter("in-process", _env(tmp_dir, port))
    try:
        exporter.export_event(EventType.AGENT_RX_REQUESTS_NUM, 7)
        wait_until(lambda: exporter.serving, message="the server it started ready")
    finally:
        exporter.close()
    assert not exporter.serving
    assert _counts(try_scrape(port)) == {os.getpid(): 7.0}


@pytest.mark.skipif(os.geteuid() != 0, reason="a root rank's server")
def test_a_root_ranks_server_keeps_no_capability_it_does_not_need(tmp_dir: Path, reaper: Reaper) -> None:
    port = free_port()
    _start(reaper, tmp_dir, port, rate=0)
    server = _server(port)
    status = dict(line.split(":\t", 1) for line in Path(f"/proc/{server}/status").read_text().splitlines()
                  if ":\t" in line)
    assert status["Uid"].split()[0] == "0"  # the stores are root's: a reader skips another owner's
    assert int(status["CapEff"], 16) == 0 and int(status["CapPrm"], 16) == 0, status  # the directory is root's
    assert _counts(try_scrape(port)) != {}  # and it serves all the same (the port below 1024 or not)
