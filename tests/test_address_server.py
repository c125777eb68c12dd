"""The address belongs to the job: one address server per address, which a rank's death or close() never
moves, which publishes every rank's final values to every scraper until the TTL, and which goes once nothing
is left to publish (docs/architecture.md).

Real rank processes, real signals, real sockets; every wait is on the state it checks, bounded by a deadline
only a hang reaches.  The figures (how fast, how much CPU) are bench's (``python -m bench --scenarios
succession``); here, what happens and in what order.
"""

from __future__ import annotations

import http.client
import json
import os
import re
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
    Scraper,
    can_bind,
    free_port,
    healthz,
    kill_server_and_spare,
    parse_exposition,
    proc_cpu_s,
    reaper_fixture,  # noqa: F401  (the "reaper" fixture)
    start_rank,
    try_scrape,
    wait_until,
)

from app import Exporter
from app.probe import SPARE_COMM, flock_entries, is_address_server, listening_pids
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


class Poller:
    """GET /metrics every 5 ms on a fresh connection, from a thread: how many were answered, and when each
    failed one was sent (CLOCK_MONOTONIC)."""

    def __init__(self, port: int) -> None:
        self.port, self.answered = port, 0
        self.failed: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            sent = time.monotonic()
            if try_scrape(self.port, timeout=5.0) is None:
                self.failed.append(sent)
            else:
                self.answered += 1
            self._stop.wait(0.005)

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
    scrapers += [Scraper(port, 1.0, read=_counts), Scraper(port, 1.0, offset_s=0.5, read=_counts)]
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
    poller = Poller(port)
    try:
        by_pid = {r.pid: r for r in ranks}
        first = by_pid.pop(starter)  # type: ignore[arg-type]
        first.kill()  # the starting rank, SIGKILLed
        second, third, last = by_pid.values()
        os.kill(second.pid, signal.SIGTERM)  # closes its Exporter
        second.proc.wait(DEADLINE_S)
        third.kill()
        before = poller.answered
        wait_until(lambda: poller.answered >= before + 20, message="scrapes after the deaths")
        assert _counts(try_scrape(port)).keys() == set(_final_values(tmp_dir)) | {last.pid}
    finally:
        poller.close()
    assert poller.failed == []
    assert _owner(port)["server_pid"] == server  # nothing moved


def _roles(port: int) -> tuple[list[int], list[int]]:
    """The address server and the spare holding 127.0.0.1:``port``, from /proc (never a request: a stopped
    server would hold it in its backlog)."""
    address = f"127.0.0.1:{port}"
    holders = listening_pids(port)
    return ([pid for pid in holders if is_address_server(pid, address)],
            [pid for pid in holders if is_address_server(pid, address, (SPARE_COMM,))])


def _server_and_spare(port: int, not_server: int = 0) -> tuple[int, int]:
    """(server, spare), once there are exactly one of each and the server is not ``not_server`` (waited for)."""
    def found() -> tuple[int, int] | None:
        servers, spares = _roles(port)
        return (servers[0], spares[0]) if len(servers) == 1 == len(spares) and servers[0] != not_server else None
    return wait_until(found, timeout=START_DEADLINE_S, message="one address server and one spare")


@pytest.mark.parametrize("ranks_do", ["idle", "record"])
def test_a_killed_server_costs_no_request_its_spare_answers_then_starts_a_spare(tmp_dir: Path, reaper: Reaper,
                                                                              ranks_do: str) -> None:
    port = free_port()
    ranks = [_start(reaper, tmp_dir, port, rate=0 if ranks_do == "idle" else 50) for _ in range(3)]
    server, _ = _server_and_spare(port)
    killed: list[float] = []
    poller = Poller(port)
    try:
        for _ in range(3):  # three deaths in a row, each once the new spare waits for the lock
            wait_for_spare_waiting(port)
            killed.append(time.monotonic())
            os.kill(server, signal.SIGKILL)
            server = _server_and_spare(port, not_server=server)[0]
            before = poller.answered
            wait_until(lambda before=before: poller.answered >= before + 5, message="scrapes answered after the death")
    finally:
        poller.close()
    # A request the dying server had itself accepted cannot be saved: only those sent once it was dead count.
    late = [at for at in poller.failed if not any(kill - 5.0 < at <= kill for kill in killed)]
    assert late == [], (poller.failed, killed)
    assert sorted(_counts(try_scrape(port))) == sorted(r.pid for r in ranks)
    assert _owner(port)["server_pid"] == server


def wait_for_spare_waiting(port: int) -> None:
    """Wait (bounded) until the spare of 127.0.0.1:``port`` waits in flock(LOCK_EX) (it holds the listener from its
    start, and waits for the lock once its imports are done): /proc/locks lists it blocked on the lock file."""
    lock = next(p for p in Path(healthz(port)["directory"]).glob(f"nixl-owner.127.0.0.1:{port}.lock"))
    wait_until(lambda: any(blocked for blocked, _ in flock_entries(os.stat(lock))), message="the spare waiting")


def test_a_stopped_server_is_replaced_by_its_spare_and_sigcont_makes_no_second_server(tmp_dir: Path,
                                                                                       reaper: Reaper) -> None:
    port = free_port()
    ranks = [_start(reaper, tmp_dir, port, rate=0) for _ in range(2)]
    server, spare = _server_and_spare(port)
    os.kill(server, signal.SIGSTOP)  # a debugger, an operator's kill -STOP
    try:
        new_server, _ = _server_and_spare(port, not_server=server)
        assert new_server == spare
        wait_until(lambda: _zombie(server), message="the stopped server killed")
    finally:
        os.kill(server, signal.SIGCONT)
    assert _roles(port)[0] == [spare]
    assert sorted(_counts(try_scrape(port))) == sorted(r.pid for r in ranks)


def test_a_server_and_its_spare_both_killed_are_replaced_by_the_next_rank_that_records(tmp_dir: Path,
                                                                                       reaper: Reaper) -> None:
    port = free_port()
    idle = _start(reaper, tmp_dir, port, rate=0)
    server, spare = _server_and_spare(port)
    recording = _start(reaper, tmp_dir, port, rate=50)
    assert sorted(kill_server_and_spare(port)) == sorted([server, spare])
    wait_until(lambda: _owner(port)["server_pid"] not in (None, server, spare), timeout=START_DEADLINE_S,
               message="a new server")
    assert _owner(port)["started_by"] == recording.pid  # (the idle rank records nothing: it claims nothing)
    assert sorted(_counts(try_scrape(port))) == sorted([idle.pid, recording.pid])


def test_a_server_killed_as_it_starts_is_started_again(tmp_dir: Path, reaper: Reaper) -> None:
    port = free_port()
    rank = _start(reaper, tmp_dir, port)
    # SIGKILL every process of ours for this address (server, spare, launcher) as soon as it appears, three
    # times; then leave the next ones be: the recording rank's claim starts another server.
    killed: set[int] = set()
    deadline = time.monotonic() + DEADLINE_S * 2
    while len(killed) < 3 and time.monotonic() < deadline:
        for pid in _servers_of(port) - killed:
            os.kill(pid, signal.SIGKILL)
            killed.add(pid)
    assert len(killed) >= 3
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
    scrapers.append(Scraper(port, 0.02, read=_counts))
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
    # While a rank of the old run lives, its server keeps the port, and the newcomer (recording: it claims as it
    # records) says who holds it.
    held = _start(reaper, other, port, rate=50, RANK_LOG_LEVEL="WARNING")
    wait_until(lambda: "in use" in held.stderr_text(), message="the newcomer's warning")
    assert healthz(port)["directory"] == str(tmp_dir)
    held.kill()
    old.send("close")
    old.readline()
    new = _start(reaper, other, port, rate=50)
    wait_until(lambda: healthz(port)["directory"] == str(other), message="the new run's server")
    assert _owner(port)["started_by"] == new.pid and _owner(port)["server_pid"] != old_server


def test_no_thread_of_ours_in_a_rank_that_started_the_server_or_lost_nor_after_close(tmp_dir: Path,
                                                                                    reaper: Reaper) -> None:
    port = free_port()
    ranks = [_start(reaper, tmp_dir, port, rate=0) for _ in range(2)]
    _server_and_spare(port)
    assert _owner(port)["started_by"] in {r.pid for r in ranks}
    for rank in ranks:
        rank.send("threads")
        assert json.loads(rank.readline()) == []
    for rank in ranks:
        rank.send("close")
        assert json.loads(rank.readline()) == "closed"
        rank.send("threads")
        assert json.loads(rank.readline()) == []
    assert sorted(_counts(try_scrape(port))) == sorted(r.pid for r in ranks)  # the server serves on


def _inventory() -> dict[str, tuple[set[str], set[str]]]:
    """docs/architecture.md's table of our processes and threads: for each row (its "where"), the kernel's
    thread names (`ps -T`) and Python's, as written (``<address>``, ``<port>`` left as such)."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text()
    table = text.split("## Processes and threads of ours", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:-1] for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    header = [cell.strip() for cell in rows[0]]
    kernel, python = header.index("threads (`ps -T`)"), header.index("Python's names")
    return {row[0].strip(): (set(re.findall(r"`([^`]+)`", row[kernel])), set(re.findall(r"`([^`]+)`", row[python])))
            for row in rows[1:]}


def _kernel_thread_names(pid: int) -> set[str]:
    return {(task / "comm").read_text().strip() for task in Path(f"/proc/{pid}/task").iterdir()}


def _keep_alive_scrape(port: int) -> http.client.HTTPConnection:
    """A scrape on a connection left open: its connection thread stays while it is."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=DEADLINE_S)
    connection.request("GET", "/metrics")
    assert connection.getresponse().read()
    return connection


def test_a_running_jobs_processes_and_threads_are_the_architecture_documents(tmp_dir: Path,
                                                                              reaper: Reaper) -> None:
    inventory = _inventory()
    port = free_port()
    ranks = [_start(reaper, tmp_dir, port, rate=20) for _ in range(2)]
    server, spare = _server_and_spare(port)
    scrape = _keep_alive_scrape(port)
    try:
        # The server: its main thread, the accepting thread, one thread per open connection; a log emitter
        # only while the serving threads have records to write.
        documented = inventory["nobody's child (init or the nearest subreaper)"][0] | inventory["the address server"][0]
        seen = wait_until(lambda: names if {"nixl-server", "nixl-accept", "nixl-conn"} <= (
            names := _kernel_thread_names(server)) else None, message="the server's threads")
        assert seen <= documented, (seen, documented)
    finally:
        scrape.close()
    assert _kernel_thread_names(spare) == inventory["nobody's child"][0] | inventory["the spare"][0]
    assert Path(f"/proc/{server}/comm").read_text().strip() == "nixl-server"
    assert Path(f"/proc/{spare}/comm").read_text().strip() == "nixl-spare"
    # The ranks: no thread of ours, by either name (the script's own recording thread is the host's).
    assert inventory["a rank"] == (set(), set())  # what the document says of a rank: nothing of ours runs there
    for rank in ranks:
        rank.send("threads")
        assert json.loads(rank.readline()) == []
        assert not any(name.startswith("nixl") for name in _kernel_thread_names(rank.pid))


def test_a_thread_mode_ranks_threads_of_ours_are_the_architecture_documents(tmp_dir: Path, reaper: Reaper) -> None:
    kernel, python = _inventory()["thread mode only, in the rank that serves"]
    port = free_port()
    rank = _start(reaper, tmp_dir, port, rate=20, NIXL_PROMETHEUS_MP_SERVE="thread")
    scrape = _keep_alive_scrape(port)
    try:
        ours = wait_until(lambda: found if {"nixl-accept", "nixl-conn"} <= (
            found := {n for n in _kernel_thread_names(rank.pid) if n.startswith("nixl")}) else None,
            message="the rank's serving threads")
        assert ours <= kernel, (ours, kernel)
        rank.send("threads")
        names = {name.replace(str(port), "<port>") for name in json.loads(rank.readline())}
        assert {"nixl-metrics-<port>", "nixl-metrics-<port>-conn"} <= names <= python, (names, python)
    finally:
        scrape.close()


def test_the_servers_records_go_to_its_file_from_the_start_which_healthz_names(tmp_dir: Path,
                                                                              reaper: Reaper) -> None:
    port = free_port()
    rank = start_rank(reaper, RANK_SCRIPT.replace("from app import Exporter", "import logging\nlogging.basicConfig("
                                                  "level=logging.INFO)\nfrom app import Exporter"),
                      _env(tmp_dir, port, RANK_RATE="0", NIXL_TELEMETRY_MP_STALE_TTL="1"))
    json.loads(rank.readline(START_DEADLINE_S))
    _server(port)
    log_file = Path(_owner(port)["log_file"])
    assert log_file.parent == tmp_dir and log_file.name == f"nixl-server.127.0.0.1:{port}.log"
    assert (log_file.stat().st_mode & 0o777) == 0o600
    StoreWriter(tmp_dir, StoreIdentity("gone", "host", "", 0, (10.0,))).close()  # reaped (and said) after the TTL
    wait_until(lambda: log_file.exists() and "reaped" in log_file.read_text(), timeout=DEADLINE_S,
               message="the store's reaping, said in the file")
    assert "reaped" not in rank.stderr_text()  # the rank's logging carries nothing of the server's


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


DIRECTORIES = {  # who owns the run's directory, its mode, and whether a capless root server can list it
    "root's (0700)": (0, 0, 0o700, True),
    "a group's (2770)": (12345, 12345, 0o2770, True),
    "another user's, private (0700)": (12345, 12345, 0o700, False),
}


@pytest.mark.skipif(os.geteuid() != 0, reason="a root rank's server")
@pytest.mark.parametrize("directory", list(DIRECTORIES))
def test_a_root_ranks_server_keeps_no_capability(tmp_dir: Path, reaper: Reaper, directory: str) -> None:
    uid, gid, mode, listable = DIRECTORIES[directory]
    os.chown(tmp_dir, uid, gid)
    os.chmod(tmp_dir, mode)
    port = free_port()
    rank = _start(reaper, tmp_dir, port, rate=20, RANK_LOG_LEVEL="WARNING")
    server = _server(port) if listable else wait_until(
        lambda: next((p for p in listening_pids(port) if is_address_server(p, f"127.0.0.1:{port}")), None),
        message="the address server listening")
    status = dict(line.split(":\t", 1) for line in Path(f"/proc/{server}/status").read_text().splitlines()
                  if ":\t" in line)
    assert status["Uid"].split()[0] == "0"  # the stores are root's: a reader skips another owner's
    assert int(status["CapEff"], 16) == 0 and int(status["CapPrm"], 16) == 0, status
    assert int(status["NoNewPrivs"]) == 1, status
    if listable:
        assert _counts(try_scrape(port)) != {}  # and it serves all the same
    else:  # said, once, by the rank that started it; /healthz says why nothing is served
        wait_until(lambda: "cannot list" in rank.stderr_text(), message="the rank saying why")
        assert rank.stderr_text().count("cannot list") == 1, rank.stderr_text()


def test_a_slow_server_is_never_replaced(tmp_dir: Path, reaper: Reaper) -> None:
    """A directory of many departed stores of the run's own and many foreign store-named files makes every scan
    and scrape slow; nothing decides from slowness that the server is dead: the same server answers every scrape
    of four clients throughout."""
    for instance in range(10_000):
        StoreWriter(tmp_dir, StoreIdentity("departed", "host", "", instance, (10.0, 100.0))).close()
    for n in range(20_000):  # a co-tenant's: skipped (and warned about), never read nor reaped
        planted = tmp_dir / f"nixl.{n + 1}.7.0.mmap"
        planted.touch()
        os.chown(planted, 12345, 12345)
    port = free_port()
    _start(reaper, tmp_dir, port, rate=10, NIXL_TELEMETRY_MP_STALE_TTL="3600")
    server, _ = _server_and_spare(port)
    answers: list[bool] = []

    def scrape_for(seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            answers.append(try_scrape(port, timeout=60.0) is not None)

    clients = [threading.Thread(target=scrape_for, args=(8.0,), daemon=True) for _ in range(4)]
    for client in clients:
        client.start()
    for client in clients:
        client.join(60.0 + DEADLINE_S)
    assert answers and all(answers), f"{answers.count(False)} of {len(answers)} scrapes failed"
    assert _roles(port)[0] == [server] and _owner(port)["server_pid"] == server
