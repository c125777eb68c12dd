"""The serving helper: an elected rank serves its address from a child process, never from the host's GIL.

Real rank processes, real scrapes from this (another) process: the helper answers while its rank holds its
GIL in a long C call or is SIGSTOPped, exits with its rank however the rank dies (whichever thread started it),
is restarted when it dies alone (recording or not, SIGCHLD ignored or handled by the host), is stopped and
reaped by close(), and is not used where it cannot run or NIXL_PROMETHEUS_MP_SERVE=thread says so.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from support import (
    DEADLINE_S,
    START_DEADLINE_S,
    ExporterRank,
    can_bind,
    exporter_env,
    free_port,
    healthz,
    http_get,
    make_exporter_fixture,  # noqa: F401  (pytest fixture)
    metrics_url,
    parse_exposition,
    pids_in,
    reaper_fixture,  # noqa: F401  (pytest fixture)
    scrape,
    start_exporter_rank,
    start_rank,
    wait_until,
)

from app import ConfigError, Exporter
from election import address_is_held


def owner(port: int, timeout: float = 2.0) -> dict[str, Any]:
    return healthz(port, timeout=timeout)["owner"]


def wait_for_helper(port: int, rank_pid: int | None = None, timeout: float = START_DEADLINE_S) -> int:
    """Wait (bounded) until the address is answered by a serving helper (of ``rank_pid``); its pid."""
    def served_by_helper() -> int | None:
        doc = owner(port)
        if doc["serving"] == "helper" and (rank_pid is None or doc["pid"] == rank_pid):
            return int(doc["server_pid"])
        return None
    return wait_until(served_by_helper, timeout, message=f"a serving helper answering on port {port}")


def stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat after the command name: the state letter first, ppid at 1, utime and stime at 11 and 12."""
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()


def process_state(pid: int) -> str | None:
    """The process's state letter (R, S, T, Z, ...), or None once it is gone (reaped)."""
    try:
        return stat_fields(pid)[0]
    except OSError:
        return None


def gone(pid: int) -> bool:
    return process_state(pid) in (None, "Z", "X")


def command_line(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


def children_of(pid: int) -> list[int]:
    """The pids of ``pid``'s live child processes."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = stat_fields(int(entry))
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
                found.append(int(entry))
    return found


def rank(reaper, tmp_dir: Path, port: int, **kwargs: Any) -> ExporterRank:
    return start_exporter_rank(reaper, tmp_dir, port, extra_env={"NIXL_PROMETHEUS_MP_SERVE": "helper"}, **kwargs)


# -- who serves, and what /healthz and ps say of it -------------------------------------------------------------


def test_the_elected_rank_serves_from_a_helper_that_says_whom_it_serves(tmp_dir: Path, reaper) -> None:
    port = free_port()
    owner_rank = rank(reaper, tmp_dir, port, agent="agent-0")
    assert owner_rank.serving_at_start
    helper = wait_for_helper(port, owner_rank.pid)
    assert helper != owner_rank.pid
    doc = owner(port)
    # The election holder is the rank (the demo's "kill the serving rank" uses this pid); the helper answers.
    assert doc["pid"] == owner_rank.pid and doc["agent_name"] == "agent-0" and doc["mode"] == "in-process"
    assert doc["election"] == "flock" and doc["serving_since"] is not None
    # Not the rank's child (a host waiting for all its children never waits for it), and ps says only whom it
    # serves for: nothing of the agent, the directory or the state (test_helper_guest.py says more).
    assert children_of(owner_rank.pid) == [] and _parent(helper) != owner_rank.pid
    argv = command_line(helper)
    assert argv[-3:] == ["serving-helper", "--for-pid", str(owner_rank.pid)], argv
    assert not any("agent-0" in arg or str(tmp_dir) in arg or str(port) in arg for arg in argv), argv
    # The helper records nothing: the exposition holds the rank's store only.
    owner_rank.events([(0, 5)])
    assert pids_in(parse_exposition(http_get(metrics_url(port)).text)) == {owner_rank.pid}
    assert sorted(p.name.split(".")[1] for p in tmp_dir.glob("nixl.*.mmap")) == [str(owner_rank.pid)]


def test_thread_mode_serves_from_the_rank_itself(tmp_dir: Path, reaper) -> None:
    port = free_port()
    owner_rank = start_exporter_rank(reaper, tmp_dir, port, extra_env={"NIXL_PROMETHEUS_MP_SERVE": "thread"})
    time.sleep(1.0)  # a helper, were one started, would be answering by now
    doc = owner(port)
    assert doc["serving"] == "thread" and doc["server_pid"] == doc["pid"] == owner_rank.pid
    assert children_of(owner_rank.pid) == []


@pytest.mark.parametrize("value", ["threads", "HELPER", " helper", "process", "0"])
def test_a_bad_serving_mode_is_a_config_error_naming_it(tmp_dir: Path, value: str) -> None:
    with pytest.raises(ConfigError, match=rf"NIXL_PROMETHEUS_MP_SERVE={value!r}.*helper.*thread"):
        Exporter("a", exporter_env(tmp_dir, free_port(), NIXL_PROMETHEUS_MP_SERVE=value))
    assert list(tmp_dir.glob("nixl.*.mmap")) == []  # refused before anything was created


NO_EXECUTABLE = textwrap.dedent("""
    import json, logging, os, sys, time
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    sys.executable = sys.argv[1]  # as an embedded interpreter may leave it
    from app import Exporter
    exp = Exporter("embedded")
    time.sleep(1.0)
    print(json.dumps({"serving": exp.serving, "children": os.listdir(f"/proc/{os.getpid()}/task")}), flush=True)
    sys.stdin.readline()
    exp.close()
""")


@pytest.mark.parametrize("executable", ["", "/usr/sbin/uwsgi", "/nonexistent/python3"])
def test_without_a_usable_interpreter_the_rank_serves_from_a_thread_with_one_warning(
        tmp_dir: Path, reaper, executable: str) -> None:
    port = free_port()
    embedded = start_rank(reaper, NO_EXECUTABLE, exporter_env(tmp_dir, port, NIXL_PROMETHEUS_MP_SERVE="helper"),
                          args=(executable,))
    assert json.loads(embedded.readline(START_DEADLINE_S))["serving"] is True
    doc = owner(port)
    assert doc["serving"] == "thread" and doc["server_pid"] == embedded.pid
    assert children_of(embedded.pid) == []
    warnings = [line for line in embedded.stderr_text().splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1, warnings
    assert "cannot be served from a helper process" in warnings[0] and "NIXL_PROMETHEUS_MP_SERVE=thread" in warnings[0]
    assert (executable or "sys.executable is empty") in warnings[0], warnings


# -- the helper never depends on the rank's interpreter ---------------------------------------------------------


def test_the_endpoint_answers_while_the_rank_holds_its_gil(tmp_dir: Path, reaper) -> None:
    port = free_port()
    owner_rank = rank(reaper, tmp_dir, port)
    owner_rank.events([(0, 42)])
    wait_for_helper(port, owner_rank.pid)
    owner_rank.process.send(json.dumps({"op": "hold_gil", "us": 4_000_000}))
    assert json.loads(owner_rank.process.readline())["holding"]
    answered = []
    for _ in range(3):  # within the 4 s the rank's only thread that could serve has no GIL to serve with
        response = http_get(metrics_url(port), timeout=1.0)
        assert response.status == 200
        answered.append(parse_exposition(response.text)[("agent_tx_bytes_total", frozenset({
            ("hostname", os.uname().nodename), ("agent_name", "agent"), ("pid", str(owner_rank.pid)),
            ("agent_instance", "0")}))])
        time.sleep(0.3)
    assert answered == [42.0] * 3
    assert "held" in json.loads(owner_rank.process.readline(DEADLINE_S))  # (the call did last)


def test_the_endpoint_answers_while_the_rank_is_stopped(tmp_dir: Path, reaper) -> None:
    port = free_port()
    owner_rank = rank(reaper, tmp_dir, port)
    wait_for_helper(port, owner_rank.pid)
    os.kill(owner_rank.pid, signal.SIGSTOP)
    try:
        wait_until(lambda: process_state(owner_rank.pid) == "T", message="the rank stopped")
        for _ in range(3):
            assert http_get(metrics_url(port), timeout=1.0).status == 200
            assert owner(port, timeout=1.0)["pid"] == owner_rank.pid
            time.sleep(0.2)
    finally:
        os.kill(owner_rank.pid, signal.SIGCONT)
    assert owner_rank.serving()



def cpu_s(pid: int) -> float:
    fields = stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime, all threads


def test_a_helper_out_of_descriptors_backs_off_and_answers_again(tmp_dir: Path, reaper) -> None:
    """accept() failing with EMFILE in the helper (its own descriptor limit) pauses instead of spinning, is said
    once, and the helper answers the waiting connection as soon as it has descriptors again: it never exits."""
    port = free_port()
    owner_rank = rank(reaper, tmp_dir, port)
    helper = wait_for_helper(port, owner_rank.pid)
    owner_rank.events([(0, 7)])
    limits = resource.prlimit(helper, resource.RLIMIT_NOFILE)

    def descriptors() -> set[int]:
        return {int(fd) for fd in os.listdir(f"/proc/{helper}/fd")}

    def limited_to_the_next_descriptor() -> bool:
        """Lower the limit to the lowest free descriptor, kept only if no descriptor closed meanwhile (a
        connection of the scrapes above still closing, on a loaded machine, would free a lower one)."""
        open_fds = descriptors()
        lowest_free = next(fd for fd in range(len(open_fds) + 1) if fd not in open_fds)
        resource.prlimit(helper, resource.RLIMIT_NOFILE, (lowest_free, limits[1]))  # the next descriptor: EMFILE
        time.sleep(0.2)
        return descriptors() == open_fds

    wait_until(limited_to_the_next_descriptor, message="the helper's descriptors to settle")
    client = socket.create_connection(("127.0.0.1", port), timeout=15)  # pending: accept() fails meanwhile
    try:
        before, started = cpu_s(helper), time.monotonic()
        time.sleep(2.0)
        used, window = cpu_s(helper) - before, time.monotonic() - started
        resource.prlimit(helper, resource.RLIMIT_NOFILE, limits)
        client.sendall(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        reply = b""
        while chunk := client.recv(65536):
            reply += chunk
    finally:
        client.close()
    # A spinning accept loop burns the whole window of CPU; backing off costs a few ticks.
    assert used < 0.25 * window, (used, window)
    assert reply.split(b"\r\n", 1)[0].endswith(b" 200 OK") and b"agent_tx_bytes_total" in reply, reply[:200]
    assert owner(port)["server_pid"] == helper  # the same helper, still serving

    def said() -> list[str]:
        return [line for line in owner_rank.stderr().splitlines() if "cannot accept connections" in line]

    # The warning may land after the reply on a loaded machine: wait for it (bounded), then it is said once.
    wait_until(said, message="the helper's warning in the rank's stderr")
    assert len(said()) == 1 and "serving helper" in said()[0], owner_rank.stderr()


# -- the helper never outlives its rank ------------------------------------------------------------------------

SHORT_LIVED_THREAD_TAKEOVER = textwrap.dedent("""
    import json, os, sys, threading, time
    from app import Exporter
    exp = Exporter("takeover")
    print(json.dumps({"pid": os.getpid(), "serving": exp.serving}), flush=True)
    sys.stdin.readline()  # the owner is dead now
    def take_over():  # the takeover happens on a thread that ends right after
        deadline = time.monotonic() + 10
        while not exp.serving and time.monotonic() < deadline:  # (the dead owner's helper exits first)
            exp.export_event(0, 1)
            time.sleep(0.05)
    t = threading.Thread(target=take_over)
    t.start(); t.join()
    print(json.dumps({"serving": exp.serving}), flush=True)
    sys.stdin.readline()
""")


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM, signal.SIGSEGV])
def test_the_helper_exits_with_its_rank_whichever_thread_started_it(tmp_dir: Path, reaper, signum: int) -> None:
    port = free_port()
    first = rank(reaper, tmp_dir, port)
    wait_for_helper(port, first.pid)
    env = exporter_env(tmp_dir, port, NIXL_PROMETHEUS_MP_SERVE="helper")
    second = start_rank(reaper, SHORT_LIVED_THREAD_TAKEOVER, env)
    second_pid = json.loads(second.readline(START_DEADLINE_S))["pid"]
    first.kill()
    second.send("go")
    assert json.loads(second.readline())["serving"] is True
    helper = wait_for_helper(port, second_pid)  # it outlived the thread that started it
    time.sleep(0.5)
    assert not gone(helper) and owner(port)["server_pid"] == helper
    os.kill(second_pid, signum)
    second.proc.wait(DEADLINE_S)
    # No writer is left: the helper serves the departed ranks' last values once, then goes (app.linger).
    wait_until(lambda: (owner(port)["lingering"] or {}).get("departed") == 2, 2.0, message="lingering for both")
    scrape(port)
    wait_until(lambda: gone(helper), 2.0, message=f"helper gone after its rank's {signal.Signals(signum).name}")
    wait_until(lambda: not address_is_held(tmp_dir, f"127.0.0.1:{port}") and can_bind(port), 2.0,
               message="the election and the port released")


FORKING_RANK = textwrap.dedent("""
    import json, os, sys, time
    from app import Exporter
    exp = Exporter("parent")
    print(json.dumps({"pid": os.getpid()}), flush=True)
    sys.stdin.readline()  # the helper serves
    pid = os.fork()
    if pid == 0:  # a child that records, and closes its Exporter: never the parent's helper's business
        exp.export_event(0, 1)
        exp.close()
        os._exit(0)
    os.waitpid(pid, 0)
    print(json.dumps({"child": pid}), flush=True)
    sys.stdin.readline()
""")


def test_a_forked_child_never_inherits_the_helper(tmp_dir: Path, reaper) -> None:
    port = free_port()
    parent = start_rank(reaper, FORKING_RANK, exporter_env(tmp_dir, port, NIXL_PROMETHEUS_MP_SERVE="helper"))
    parent_pid = json.loads(parent.readline(START_DEADLINE_S))["pid"]
    helper = wait_for_helper(port, parent_pid)
    parent.send("fork")
    json.loads(parent.readline())
    time.sleep(0.3)
    assert not gone(helper) and owner(port)["server_pid"] == helper  # the child's close did not touch it
    assert command_line(helper)[command_line(helper).index("--for-pid") + 1] == str(parent_pid)
    parent.kill()
    served_then_gone(port, helper)  # it serves the departed stores' last values once (app.rank.linger), then goes


# -- the rank restarts a helper that died ----------------------------------------------------------------------

SIGCHLD_HOST = textwrap.dedent("""
    import json, os, signal, sys
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
            print(json.dumps({"closed": True}), flush=True)
""")


@pytest.mark.parametrize("sigchld", ["default", "ignore", "reap-all"])
def test_a_helper_killed_alone_is_replaced_and_close_reaps_it(tmp_dir: Path, reaper, sigchld: str) -> None:
    port = free_port()
    host = start_rank(reaper, SIGCHLD_HOST, exporter_env(tmp_dir, port, NIXL_PROMETHEUS_MP_SERVE="helper"),
                      args=(sigchld,))
    host_pid = json.loads(host.readline(START_DEADLINE_S))["pid"]
    first = wait_for_helper(port, host_pid)
    for _ in range(2):  # the rank records nothing: its supervisor, not its export path, notices
        helper = wait_for_helper(port, host_pid)
        os.kill(helper, signal.SIGKILL)
        wait_until(lambda h=helper: gone(h), message="the killed helper gone")
        # Served again at once (from the rank's thread while the next helper starts), then by a new helper.
        wait_until(lambda: http_get(metrics_url(port), timeout=1.0).status == 200, message="served again")
        wait_until(lambda h=helper: owner(port)["server_pid"] not in (h, host_pid), START_DEADLINE_S,
                   message="a new helper")
    last = wait_for_helper(port, host_pid)
    assert last != first and children_of(host_pid) == []  # (its launcher was reaped: the helper is nobody's child)
    host.send("close")
    assert json.loads(host.readline())["closed"]
    served_then_gone(port, last)  # left the address: it serves the closed rank's last values once, then goes
    # (a helper whose main thread is a zombie may still have threads exiting, holding its descriptors a moment)
    wait_until(lambda: can_bind(port) and not address_is_held(tmp_dir, f"127.0.0.1:{port}"), 2.0,
               message="the port and the election free")
    # Only its own child was reaped, and no zombie is left behind.
    assert [p for p in os.listdir("/proc") if p.isdigit() and process_state(int(p)) == "Z"
            and _parent(int(p)) == host_pid] == []


def served_then_gone(port: int, helper: int) -> None:
    """A helper left the address (its rank closed or died): it lingers for the departed ranks, one scrape serves
    their last values (app.rank.linger), then it goes."""
    wait_until(lambda: (owner(port)["lingering"] or {}).get("departed", 0) >= 1, 2.0,
               message="the helper lingering for the departed ranks")
    scrape(port)
    wait_until(lambda: gone(helper), 3.0, message=f"helper {helper} gone once the last values were served")
    wait_until(lambda: can_bind(port), 2.0, message="the port free")


def _parent(pid: int) -> int | None:
    try:
        return int(stat_fields(pid)[1])
    except OSError:
        return None


# -- hand-over: no connection is refused or cut -----------------------------------------------------------------


def test_no_scrape_fails_while_the_thread_hands_over_to_the_helper(tmp_dir: Path, make_exporter) -> None:
    port = free_port()
    failures: list[str] = []
    served: list[str] = []
    stop, bound = threading.Event(), threading.Event()

    def scrape() -> None:
        while not stop.is_set():
            after_bind = bound.is_set()  # (a connection tried before the Exporter existed is refused, rightly)
            try:
                response = http_get(metrics_url(port, "/healthz"), timeout=DEADLINE_S)
                if response.status != 200:
                    failures.append(f"status {response.status}")
                else:
                    served.append(response.json()["owner"]["serving"])
            except OSError as exc:
                if after_bind:
                    failures.append(repr(exc))
                time.sleep(0.001)

    scrapers = [threading.Thread(target=scrape, daemon=True) for _ in range(6)]
    for thread in scrapers:
        thread.start()
    try:
        exp = make_exporter("owner", exporter_env(tmp_dir, port, NIXL_PROMETHEUS_MP_SERVE="helper"))
        assert exp.serving
        bound.set()
        wait_until(lambda: served.count("helper") > 20, START_DEADLINE_S, message="the helper serving")
    finally:
        stop.set()
        for thread in scrapers:
            thread.join(DEADLINE_S)
    assert failures == []
    assert served[0] == "thread" and served[-1] == "helper"
    first_helper = served.index("helper")
    assert "thread" not in served[first_helper + 12:]  # (in-flight thread answers may finish just after)
    helper = wait_for_helper(port, os.getpid())
    exp.close()
    served_then_gone(port, helper)
    assert can_bind(port)


def test_close_leaves_the_last_values_to_the_helper_which_then_goes_reaped(tmp_dir: Path, make_exporter) -> None:
    port = free_port()
    exp = make_exporter("owner", exporter_env(tmp_dir, port, NIXL_PROMETHEUS_MP_SERVE="helper"))
    helper = wait_for_helper(port, os.getpid())
    exp.close()  # it leaves the address to the helper, which serves this rank's last values once, then goes
    served_then_gone(port, helper)
    # (a helper whose main thread is a zombie may still have threads exiting, holding its descriptors a moment)
    wait_until(lambda: can_bind(port) and not address_is_held(tmp_dir, f"127.0.0.1:{port}"), 2.0,
               message="the port and the election free")
    exp.close()  # idempotent
    assert not exp.serving and sys.modules["app.rank.supervisor"] is not None
