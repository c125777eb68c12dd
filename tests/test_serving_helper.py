"""Who serves an elected rank's address: the address server it starts, never the rank's own interpreter.

Real rank processes, real scrapes from this (another) process: the winning rank hands the address to a server
that names it and keeps no copy of the port or the lock; the endpoint answers while that rank holds its GIL in
a long C call or is SIGSTOPped; a forked child never inherits the server's channel; a host that ignores or
reaps SIGCHLD gets its killed server replaced and keeps no zombie; no scrape fails while the server starts; a
server out of descriptors backs off; and the rank serves from a thread where no server can run or
NIXL_PROMETHEUS_MP_SERVE=thread says so.  (What happens at job end, at rank and server deaths, to an idle
server and at new runs: test_address_server.py.)
"""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from support import (  # noqa: F401  (pytest fixtures)
    DEADLINE_S,
    HELD_DESCRIPTORS,
    START_DEADLINE_S,
    ExporterRank,
    Reaper,
    children_of,
    exporter_env,
    free_port,
    healthz,
    http_get,
    make_exporter_fixture,
    metrics_url,
    parent_of,
    parse_exposition,
    pids_in,
    proc_cpu_s,
    process_state,
    reaper_fixture,
    scrape,
    series,
    start_exporter_rank,
    start_rank,
    try_scrape,
    wait_for_spare,
    wait_until,
)

from app import ConfigError, Exporter
from app.probe import port_holders

HELPER = {"NIXL_PROMETHEUS_MP_SERVE": "helper"}


def owner(port: int, timeout: float = 5.0) -> dict[str, Any]:
    return healthz(port, timeout=timeout)["owner"]


def wait_for_server(port: int, started_by: int | None = None, not_in: tuple[int, ...] = ()) -> int:
    """Wait (bounded) until an address server (started by ``started_by``, none of ``not_in``) answers; its pid."""
    def server() -> int | None:
        doc = owner(port)
        if doc["serving"] != "helper" or doc["server_pid"] in not_in:
            return None
        return int(doc["server_pid"]) if started_by is None or doc["started_by"] == started_by else None
    return wait_until(server, START_DEADLINE_S, message=f"an address server answering on port {port}")


def flocked_files(pid: int) -> set[str]:
    """The files on which one of ``pid``'s open descriptors holds a flock (/proc/PID/fdinfo's ``lock:`` lines)."""
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if "FLOCK" in Path(f"/proc/{pid}/fdinfo/{fd}").read_text():
                found.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue
    return found


def rank(reaper: Reaper, tmp_dir: Path, port: int, **kwargs: Any) -> ExporterRank:
    return start_exporter_rank(reaper, tmp_dir, port, extra_env=HELPER, **kwargs)


def tx_bytes(text: str, pid: int) -> float:
    return parse_exposition(text)[series("agent_tx_bytes_total", hostname=os.uname().nodename, agent_name="agent",
                                         pid=pid, agent_instance=0)]


# -- who serves, and what /healthz says of it ---------------------------------------------------------------------


def test_the_winning_rank_hands_the_address_to_a_server_that_names_it(tmp_dir: Path, reaper: Reaper) -> None:
    port = free_port()
    owner_rank = rank(reaper, tmp_dir, port, agent="agent-0")
    assert owner_rank.serving_at_start  # handed over in the constructor: connections wait in the backlog meanwhile
    server = wait_for_server(port, owner_rank.pid)
    assert server != owner_rank.pid
    doc = owner(port)
    assert doc["pid"] == server and doc["started_by"] == owner_rank.pid and doc["agent_name"] == "agent-0"
    assert doc["mode"] == "in-process" and doc["election"] == "flock" and doc["serving_since"] is not None
    assert doc["log_file"] == str(tmp_dir / f"nixl-server.127.0.0.1:{port}.log")  # its records go to its file
    # The server (and its spare) alone hold the port and the lock: the rank kept no copy of either.  The spare's
    # launcher holds a copy for the moment it forks the spare and exits: wait for it to be gone.
    holders = wait_until(lambda: held if len(held := port_holders(port).split(", ")) == 2
                         and any("(nixl-spare)" in h for h in held) else None, message="the spare waiting alone")
    assert f"pid {server} (nixl-server)" in holders, holders
    lock = str(next(tmp_dir.glob("nixl-owner.*.lock")))
    assert lock in flocked_files(server) and lock not in flocked_files(owner_rank.pid)
    # Not the rank's child (its launcher, which forks it and exits, is reaped at the rank's next export): a host
    # waiting for all its children never waits for it.
    wait_until(lambda: owner_rank.events([(0, 0)]) and children_of(owner_rank.pid) == [],
               message="the launcher reaped")
    assert parent_of(server) != owner_rank.pid
    # The server records nothing: the exposition holds the rank's store only.
    owner_rank.events([(0, 5)])
    assert pids_in(parse_exposition(scrape(port))) == {owner_rank.pid}
    assert sorted(p.name.split(".")[1] for p in tmp_dir.glob("nixl.*.mmap")) == [str(owner_rank.pid)]


THREAD_NAMES = textwrap.dedent("""
    import json, os, sys, threading
    from app import Exporter
    exp = Exporter("threaded")
    names = sorted(t.name for t in threading.enumerate() if t.name.startswith("nixl"))
    print(json.dumps({"pid": os.getpid(), "serving": exp.serving, "threads": names}), flush=True)
    sys.stdin.read()
""")


def test_thread_mode_serves_from_the_rank_itself(tmp_dir: Path, reaper: Reaper) -> None:
    port = free_port()
    process = start_rank(reaper, THREAD_NAMES, exporter_env(tmp_dir, port, NIXL_PROMETHEUS_MP_SERVE="thread"))
    started = json.loads(process.readline(START_DEADLINE_S))
    pid = started["pid"]
    # Served from the constructor on, by a thread of its own; no server started.
    assert started["serving"] is True
    assert f"nixl-metrics-{port}" in started["threads"], started
    doc = owner(port)
    assert doc["serving"] == "thread" and doc["server_pid"] == doc["pid"] == doc["started_by"] == pid
    assert port_holders(port).startswith(f"pid {pid} (")
    assert str(next(tmp_dir.glob("nixl-owner.*.lock"))) in flocked_files(pid)
    assert children_of(pid) == []


@pytest.mark.parametrize("value", ["threads", "HELPER", " helper", "process", "0"])
def test_a_bad_serving_mode_is_a_config_error_naming_it(tmp_dir: Path, value: str) -> None:
    with pytest.raises(ConfigError, match=rf"NIXL_PROMETHEUS_MP_SERVE={value!r}.*helper.*thread"):
        Exporter("a", exporter_env(tmp_dir, free_port(), NIXL_PROMETHEUS_MP_SERVE=value))
    assert list(tmp_dir.glob("nixl.*.mmap")) == []  # refused before anything was created


NO_EXECUTABLE = textwrap.dedent("""
    import json, logging, os, sys, threading
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    sys.executable = sys.argv[1]  # as an embedded interpreter may leave it
    from app import Exporter
    exp = Exporter("embedded")
    def reply():
        names = sorted(t.name for t in threading.enumerate() if t.name.startswith("nixl"))
        print(json.dumps({"pid": os.getpid(), "serving": exp.serving, "threads": names}), flush=True)
    reply()
    for line in sys.stdin:  # "record": a burst of events (each may re-run the election), then the state
        for _ in range(100):
            exp.export_event(0, 1)
        reply()
""")


@pytest.mark.parametrize("executable", ["", "/usr/sbin/uwsgi", "/nonexistent/python3"])
def test_without_a_usable_interpreter_the_rank_serves_from_a_thread_with_one_warning(
        tmp_dir: Path, reaper: Reaper, executable: str) -> None:
    port = free_port()
    embedded = start_rank(reaper, NO_EXECUTABLE, exporter_env(tmp_dir, port, NIXL_PROMETHEUS_MP_SERVE="helper"),
                          args=(executable,))
    started = json.loads(embedded.readline(START_DEADLINE_S))
    assert started["serving"] is True and f"nixl-metrics-{port}" in started["threads"], started
    doc = owner(port)
    assert doc["serving"] == "thread" and doc["server_pid"] == doc["started_by"] == embedded.pid
    assert port_holders(port).startswith(f"pid {embedded.pid} (")
    assert children_of(embedded.pid) == []
    for _ in range(3):  # it records and is scraped: nothing is said again
        embedded.send("record")
        assert json.loads(embedded.readline())["serving"] is True
        assert embedded.pid in pids_in(parse_exposition(scrape(port)))
    warnings = [line for line in embedded.stderr_text().splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1, warnings
    assert "cannot be served from an address server" in warnings[0] and "NIXL_PROMETHEUS_MP_SERVE=thread" in warnings[0]
    assert (executable or "sys.executable is empty") in warnings[0], warnings


# -- the server never depends on the rank's interpreter -----------------------------------------------------------

HOLD_GIL_US = 60_000_000  # longer than any test waits: the rank is killed in its call, at the test's end


def test_the_endpoint_answers_while_the_rank_holds_its_gil(tmp_dir: Path, reaper: Reaper) -> None:
    port = free_port()
    owner_rank = rank(reaper, tmp_dir, port)
    owner_rank.events([(0, 42)])
    server = wait_for_server(port, owner_rank.pid)
    owner_rank.process.send(json.dumps({"op": "hold_gil", "us": HOLD_GIL_US}))
    assert json.loads(owner_rank.process.readline())["holding"]
    # The rank's only thread that could serve has no GIL to serve with: every answer is the server's.
    answered = [tx_bytes(scrape(port), owner_rank.pid) for _ in range(3)]
    assert answered == [42.0] * 3
    assert owner(port)["server_pid"] == server
    with pytest.raises(AssertionError, match="no output"):  # it has not said "held": still in its call
        owner_rank.process.readline(timeout=0.0)


def test_the_endpoint_answers_while_the_rank_is_stopped(tmp_dir: Path, reaper: Reaper) -> None:
    port = free_port()
    owner_rank = rank(reaper, tmp_dir, port)
    owner_rank.events([(0, 42)])
    server = wait_for_server(port, owner_rank.pid)
    os.kill(owner_rank.pid, signal.SIGSTOP)
    try:
        wait_until(lambda: process_state(owner_rank.pid) == "T", message="the rank stopped")
        for _ in range(3):
            assert tx_bytes(scrape(port), owner_rank.pid) == 42.0
            doc = owner(port)
            assert doc["server_pid"] == server and doc["started_by"] == owner_rank.pid
        assert process_state(owner_rank.pid) == "T"  # answered while it was stopped throughout
    finally:
        os.kill(owner_rank.pid, signal.SIGCONT)
    # Resumed, the rank still has its server: nothing was replaced.
    assert owner_rank.serving()
    assert owner(port)["server_pid"] == server


def test_a_server_out_of_descriptors_backs_off_and_answers_again(tmp_dir: Path, reaper: Reaper) -> None:
    """accept() failing with EMFILE in the server (its own descriptor limit) pauses instead of spinning, is said
    once in its log file, and the server answers the waiting connection as soon as it has descriptors again:
    it never exits."""
    port = free_port()
    owner_rank = rank(reaper, tmp_dir, port)
    server = wait_for_server(port, owner_rank.pid)
    wait_for_spare(port)  # (the spare's start opens and closes descriptors in the server: settled first)
    owner_rank.events([(0, 7)])
    limits = resource.prlimit(server, resource.RLIMIT_NOFILE)

    def descriptors() -> set[int]:
        return {int(fd) for fd in os.listdir(f"/proc/{server}/fd")}

    def limited_to_the_next_descriptor() -> bool:
        """Lower the limit to the lowest free descriptor, kept only if no descriptor closed meanwhile (a
        connection of the requests above still closing, on a loaded machine, would free a lower one)."""
        open_fds = descriptors()
        lowest_free = next(fd for fd in range(len(open_fds) + 1) if fd not in open_fds)
        resource.prlimit(server, resource.RLIMIT_NOFILE, (lowest_free, limits[1]))  # the next descriptor: EMFILE
        time.sleep(0.2)
        return descriptors() == open_fds

    wait_until(limited_to_the_next_descriptor, message="the server's descriptors to settle")
    client = socket.create_connection(("127.0.0.1", port), timeout=15)  # pending: accept() fails meanwhile
    try:
        before, started = proc_cpu_s(server), time.monotonic()
        time.sleep(2.0)  # the interval measured, not a wait for a state
        used, window = proc_cpu_s(server) - before, time.monotonic() - started
        resource.prlimit(server, resource.RLIMIT_NOFILE, limits)
        client.sendall(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        reply = b""
        while chunk := client.recv(65536):
            reply += chunk
    finally:
        client.close()
    # A spinning accept loop burns the whole window of CPU; backing off costs a few ticks.
    assert used < 0.25 * window, (used, window)
    assert reply.split(b"\r\n", 1)[0].endswith(b" 200 OK") and b"agent_tx_bytes_total" in reply, reply[:200]
    assert owner(port)["server_pid"] == server  # the same server, still serving

    log_file = Path(owner(port)["log_file"])

    def said() -> list[str]:
        return [line for line in log_file.read_text().splitlines() if "cannot accept connections" in line]

    wait_until(said, message="the server's warning in its log file")
    assert len(said()) == 1 and f"pid {server} WARNING" in said()[0], log_file.read_text()


# -- a fork, a host's SIGCHLD --------------------------------------------------------------------------------------

FORKING_RANK = textwrap.dedent("""
    import json, logging, os, sys
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    from app import Exporter
    exp = Exporter("parent")

    HELD_DESCRIPTORS

    print(json.dumps({"pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        if line.strip() == "held":
            print(json.dumps(held()), flush=True)
            continue
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # a child that records, and closes its Exporter: never the parent's server's business
            os.close(read_end)
            inherited = held()
            exp.export_event(0, 1)
            exp.close()
            os.write(write_end, json.dumps({"inherited": inherited, "after_close": held()}).encode())
            os._exit(0)
        os.close(write_end)
        child = json.loads(os.fdopen(read_end).read())
        os.waitpid(pid, 0)
        print(json.dumps({"child": pid, **child}), flush=True)
""").replace("HELD_DESCRIPTORS\n", HELD_DESCRIPTORS)


def test_a_forked_child_never_inherits_the_server(tmp_dir: Path, reaper: Reaper) -> None:
    port = free_port()
    parent = start_rank(reaper, FORKING_RANK, exporter_env(tmp_dir, port, **HELPER))
    parent_pid = json.loads(parent.readline(START_DEADLINE_S))["pid"]
    server = wait_for_server(port, parent_pid)
    nothing = {"listeners": 0, "locks": 0}
    parent.send("held")
    assert json.loads(parent.readline()) == nothing  # the parent itself holds neither: the server does
    parent.send("fork")
    report = json.loads(parent.readline())
    assert report["inherited"] == nothing and report["after_close"] == nothing, report
    # The child's close left the server serving both.
    assert pids_in(parse_exposition(scrape(port))) == {parent_pid, report["child"]}
    assert owner(port)["server_pid"] == server


SIGCHLD_HOST = textwrap.dedent("""
    import json, logging, os, signal, sys
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    mode = sys.argv[1]
    if mode == "ignore":
        signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    elif mode == "reap-all":  # a host that reaps every child in its own handler
        def reap(signo, frame):
            try:
                while os.waitpid(-1, os.WNOHANG)[0] > 0:
                    pass
            except ChildProcessError:
                pass
        signal.signal(signal.SIGCHLD, reap)
    from app import Exporter
    exp = Exporter("host")
    print(json.dumps({"pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        if line.strip() == "close":
            exp.close()
            print(json.dumps({"closed": True, "serving": exp.serving}), flush=True)
""")


@pytest.mark.parametrize("sigchld", ["default", "ignore", "reap-all"])
def test_a_host_ignoring_or_reaping_sigchld_gets_its_killed_server_replaced_and_no_zombie(
        tmp_dir: Path, reaper: Reaper, sigchld: str) -> None:
    port = free_port()
    host = start_rank(reaper, SIGCHLD_HOST, exporter_env(tmp_dir, port, **HELPER), args=(sigchld,))
    host_pid = json.loads(host.readline(START_DEADLINE_S))["pid"]
    killed: tuple[int, ...] = ()
    for _ in range(2):  # each server's spare takes its place, and starts a spare of its own
        server = wait_for_server(port, host_pid, not_in=killed)
        wait_for_spare(port)
        os.kill(server, signal.SIGKILL)
        killed += (server,)
    last = wait_for_server(port, host_pid, not_in=killed)
    host.send("close")  # (the host recorded nothing since: its close reaps its launcher, if nothing else did)
    assert json.loads(host.readline()) == {"closed": True, "serving": False}
    # The launcher was reaped (by us, by the kernel, or by the host's handler), and no server is the host's child.
    wait_until(lambda: children_of(host_pid) == [], message="no child of the host left, not even a zombie")
    # The server is the job's: it serves on.
    assert owner(port)["server_pid"] == last and host_pid in pids_in(parse_exposition(scrape(port)))


# -- the hand-over: no connection is refused or cut ---------------------------------------------------------------


def test_no_scrape_fails_while_the_server_starts(tmp_dir: Path, make_exporter) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    failures: list[str] = []
    served: list[str] = []
    stop, bound = threading.Event(), threading.Event()

    def poll() -> None:
        while not stop.is_set():
            after_bind = bound.is_set()  # (a connection tried before the Exporter existed is refused, rightly)
            try:
                response = http_get(metrics_url(port, "/healthz"), timeout=START_DEADLINE_S)
                if response.status != 200:
                    failures.append(f"status {response.status}")
                else:
                    served.append(response.json()["owner"]["serving"])
            except OSError as exc:
                if after_bind:
                    failures.append(repr(exc))
                time.sleep(0.001)

    pollers = [threading.Thread(target=poll, daemon=True) for _ in range(6)]
    for thread in pollers:
        thread.start()
    try:
        exp = make_exporter("owner", exporter_env(tmp_dir, port, **HELPER))
        assert exp.serving  # handed over: the connections made from now on wait in the backlog for the server
        bound.set()
        wait_until(lambda: len(served) > 20, START_DEADLINE_S, message="the server answering")
    finally:
        stop.set()
        for thread in pollers:
            thread.join(DEADLINE_S)
    assert failures == []
    assert set(served) == {"helper"}  # nothing of the rank's ever answered
    server = wait_for_server(port, os.getpid())
    exp.close()
    assert not exp.serving
    assert owner(port)["server_pid"] == server and try_scrape(port) is not None  # the job's: it serves on
