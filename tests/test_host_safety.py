"""The library never hurts its host: fork storms, descriptor and thread limits, signals, exit, garbage
collection, a replaced directory.  Each test runs the hostile condition for real (resource.setrlimit, os.fork,
pthread_kill, rmtree) in a child process where it would harm the suite, with bounded waits: a hang fails.
"""

from __future__ import annotations

import contextlib
import gc
import http.client
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support import (
    DEADLINE_S,
    PROJECT_ROOT,
    START_DEADLINE_S,
    can_bind,
    child_env,
    exporter_env,
    free_port,
    healthz,
    hold_flock,
    http_request,
    kill_server_and_spare,
    listening_socket,
    lock_is_free,
    metrics_url,
    open_fds,
    server_log,
    start_exporter_rank,
    start_rank,
    wait_for_metrics,
    wait_until,
    wait_until_settled,
)
from support import reaper_fixture as reaper  # noqa: F401  (pytest fixture)

from app import Exporter
from app.address.server import CHECK_S
from election import lock_file_name
from store import EventType

pytestmark = [pytest.mark.reliability, pytest.mark.usefixtures("serve_mode")]  # both ways of serving

# Imported by every child script: logging on stderr, one JSON answer per line on stdout, commands on stdin, and
# the two real limits the tests impose.
CHILD_PRELUDE = textwrap.dedent("""
    import faulthandler, json, logging, os, random, resource, signal, socket, sys, threading, time
    faulthandler.register(signal.SIGUSR2, all_threads=True)  # a hung child tells where (run_child)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    from app import Exporter
    from store import EventType as E

    def say(**doc):
        sys.stdout.write(json.dumps(doc) + "\\n")
        sys.stdout.flush()

    def command():
        return sys.stdin.readline().strip()

    def exhaust_descriptors(leave):
        # A low RLIMIT_NOFILE, then every descriptor but `leave` taken: what a rank that leaks files hits.
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 16, hard))
        fillers = []
        while True:
            try:
                fillers.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                break
        for _ in range(leave):
            os.close(fillers.pop())
        return lambda: ([os.close(fd) for fd in fillers], resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard)))

    def limit_threads():
        # RLIMIT_AS just above what is mapped: no room for a new thread's stack.  And new stacks larger than any
        # thread of ours has: a thread of ours that ends (a standby that handed its win over) leaves its stack to
        # glibc's cache, which a new thread of the same size would reuse without mapping anything.
        threading.stack_size(64 << 20)
        with open("/proc/self/status") as f:
            vm = next(int(line.split()[1]) for line in f if line.startswith("VmSize:")) * 1024
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (vm + (2 << 20), hard))
        try:
            threading.Thread(target=lambda: None).start()
        except RuntimeError:
            pass
        else:
            raise AssertionError("RLIMIT_AS did not stop a thread from starting")
        return lambda: (resource.setrlimit(resource.RLIMIT_AS, (soft, hard)), threading.stack_size(0))
""")


def run_child(script: str, env: dict[str, str], timeout: float, args: tuple[str, ...] = ()) -> tuple[Any, str]:
    """Run CHILD_PRELUDE + script to completion (killed after ``timeout`` s: a hang fails, with every thread's
    stack); (last answer, stderr)."""
    with subprocess.Popen([sys.executable, "-c", CHILD_PRELUDE + textwrap.dedent(script), *args],
                          cwd=PROJECT_ROOT, env=child_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, stdin=subprocess.DEVNULL) as child:
        try:
            stdout, stderr = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            child.send_signal(signal.SIGUSR2)  # faulthandler writes every thread's stack to stderr
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(5)
            child.kill()
            stdout, stderr = child.communicate()
            raise AssertionError(f"the child hung (killed after {timeout} s); stderr:\n{stderr[-6000:]}") from None
    assert child.returncode == 0, f"rc={child.returncode}\nstdout:\n{stdout}\nstderr:\n{stderr}"
    lines = stdout.strip().splitlines()
    assert lines, stderr
    return json.loads(lines[-1]), stderr


def rank_env(directory: Path, port: int, **extra: str) -> dict[str, str]:
    return exporter_env(directory, port, **extra)


def address_given_up(directory: Path, port: int) -> None:
    """Wait (bounded) until the port and the election are free: at once once a rank serving from a thread is
    gone; an address server (the job's) goes once nothing of the directory is live nor within the TTL."""
    lock = directory / lock_file_name(f"127.0.0.1:{port}")
    # (No lock file: no election ever ran, a rank that exited while its first Exporter was being made.)
    wait_until(lambda: can_bind(port) and (not lock.exists() or lock_is_free(lock)),
               message=f"port {port} and its election free")


# -- item: a forked child never holds the parent's listener ---------------------------------------------------

FORK_STORM = """
    port, forks_wanted, seconds = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    stop = threading.Event()
    cycles = [0]

    def churn():  # back-to-back takeovers and closes: the listener is always being created or closed
        while not stop.is_set():
            e = Exporter("churn")
            e.export_event(E.AGENT_TX_BYTES, 1)
            e.close()
            cycles[0] += 1

    def holds_listener():
        for name in os.listdir("/proc/self/fd"):
            try:
                s = socket.socket(fileno=int(name))
            except OSError:
                continue  # not a socket
            try:
                if s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) and s.getsockname()[1] == port:
                    return True
            except OSError:
                pass
            finally:
                s.detach()
        return False

    churner = threading.Thread(target=churn)
    churner.start()
    forks = leaks = 0
    rng = random.Random(7)
    deadline = time.monotonic() + seconds
    while forks < forks_wanted and time.monotonic() < deadline:
        pid = os.fork()
        if pid == 0:
            os._exit(3 if holds_listener() else 0)
        _, status = os.waitpid(pid, 0)
        forks += 1
        leaks += os.waitstatus_to_exitcode(status) == 3
        time.sleep(rng.uniform(0, 0.004))
    stop.set()
    churner.join()
    say(forks=forks, leaks=leaks, cycles=cycles[0])
"""


@pytest.mark.timeout(120)
def test_fork_storm_during_takeovers_and_closes_never_leaks_the_listener(tmp_dir):
    port = free_port()
    # TTL 0: an address server gives the address up as soon as it finds nothing live (between two churns), and
    # the next Exporter takes it over again.
    env = rank_env(tmp_dir, port, NIXL_TELEMETRY_MP_STALE_TTL="0")
    result, stderr = run_child(FORK_STORM, env, timeout=90, args=(str(port), "400", "20"))
    assert result["forks"] >= 100 and result["cycles"] >= 10, result  # the storm really ran
    assert result["leaks"] == 0, f"{result['leaks']} of {result['forks']} children held the listener"
    assert "Traceback" not in stderr, stderr
    address_given_up(tmp_dir, port)


# -- items: a takeover that cannot start serving gives the election back; exports never raise for it ----------

STARVED_TAKEOVER = """
    limit = sys.argv[1]
    exp = Exporter("starved")
    say(serving=exp.serving)
    assert command() == "limit"
    lift = limit_threads() if limit == "threads" else exhaust_descriptors(int(limit.split("-")[1]))
    say(limited=True)
    assert command() == "record"  # the owner is dead now: every export below may try to take over
    errors, n = [], 0
    end = time.monotonic() + 1.5
    while time.monotonic() < end:
        try:
            exp.record_transfer(10, 1, 64, True)
            exp.export_event(E.AGENT_TX_BYTES, 5)
            exp.record_error("backend")
        except Exception as exc:
            errors.append(repr(exc))
        n += 1
        time.sleep(0.002)
    say(serving=exp.serving, errors=errors[:5], n=n)
    if command() == "exit":
        exp.close()
        sys.exit(0)
    lift()
    deadline = time.monotonic() + 20

    def answered():  # (a server started before the lift may still fail: it is said serving until it does)
        import http.client
        connection = http.client.HTTPConnection("127.0.0.1", int(os.environ["NIXL_TELEMETRY_PROMETHEUS_PORT"]),
                                                timeout=2)
        try:
            connection.request("GET", "/healthz")
            return connection.getresponse().status == 200
        except OSError:
            return False
        finally:
            connection.close()

    while not (exp.serving and answered()) and time.monotonic() < deadline:
        exp.export_event(E.AGENT_TX_BYTES, 1)
        time.sleep(0.05)
    say(serving=exp.serving)
    assert command() == "exit"
    exp.close()
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("limit", ["descriptors-0", "descriptors-1", "threads"])
def test_takeover_without_resources_releases_the_election_and_exports_never_raise(tmp_dir, reaper, limit,  # noqa: F811
                                                                                   serve_mode):
    """descriptors-0: no descriptor for the socket; descriptors-1: bound, but none for the next one (werkzeug's
    copy of it, or the channel to an address server); threads: bound, but no thread.  Each time no export raises.
    A rank that cannot serve says so in one warning and leaves the election free for another rank (which takes
    over), and once the limit lifts it serves, elected by flock (no fallback).  Out of threads in helper mode, the
    rank's server (which inherits its RLIMIT_AS) is what cannot start: said once, with its cause, all the same."""
    port = free_port()
    lock = tmp_dir / lock_file_name(f"127.0.0.1:{port}")
    os.close(os.open(lock, os.O_CREAT | os.O_WRONLY, 0o600))
    holder = hold_flock(reaper, lock)  # the owner, for now
    child = start_rank(reaper, CHILD_PRELUDE + textwrap.dedent(STARVED_TAKEOVER), rank_env(tmp_dir, port),
                       args=(limit,))

    def ask(cmd: str | None = None, timeout: float = 30) -> dict[str, Any]:
        if cmd is not None:
            child.send(cmd)
        return json.loads(child.readline(timeout))

    def warnings() -> list[str]:
        return [line for line in child.stderr_text().splitlines() if line.startswith("WARNING")]

    assert ask()["serving"] is False
    assert ask("limit")["limited"]
    holder.kill()  # the owner dies while the rank cannot serve (or can only start a server)
    starved = ask("record")
    assert starved["errors"] == [] and starved["n"] > 0, starved
    if not (serve_mode == "helper" and limit == "threads"):  # (there, a server start fails, again and again)
        assert starved["serving"] is False
        assert lock_is_free(lock), "the starved rank kept the election"
    other = start_exporter_rank(reaper, tmp_dir, port, agent="other", tick_hz=20)  # so another rank takes over
    wait_until(other.serving, timeout=START_DEADLINE_S, message="another rank to take the address over")
    owner = healthz(port)["owner"]
    assert owner["started_by"] == other.pid, owner
    other.kill()
    if serve_mode == "helper":
        kill_server_and_spare(port)  # (the rank's death moved nothing: its server's and its spare's do)
    assert ask("lift", timeout=40)["serving"] is True, child.stderr_text()  # the limit gone, the starved rank serves
    doc = healthz(port)
    assert doc["owner"]["started_by"] == child.pid and doc["owner"]["election"] == "flock", doc["owner"]
    assert not [w for w in doc["warnings"] if w["kind"] == "unusable-lock"], doc["warnings"]
    child.send("exit")
    child.proc.wait(timeout=30)
    log = child.stderr_text()
    # Said once: the rank's own shortage, or (out of threads in helper mode) its server's, which inherits the
    # rank's RLIMIT_AS and cannot start its serving thread either, or even load its code.
    if serve_mode == "helper" and limit == "threads":  # each way its server failed, once (it may also die unheard)
        assert warnings() and all("could not start" in line for line in warnings()), log
        # (Loading its code in that address space fails too, with whatever the first import short of memory
        # raises: a MemoryError, hashlib's ImportError, ...)
        assert any("can't start new thread" in line or "(as it loaded its code)" in line for line in warnings()), log
    else:
        assert len(warnings()) == 1 and "cannot serve" in warnings()[0], log
        assert ("can't start new thread" if limit == "threads" else "Too many open files") in warnings()[0], log
    assert "the port Too many" not in log and "unusable" not in log and "Traceback" not in log, log


# -- item: close() from a signal handler and at exit ----------------------------------------------------------

PELTER = """
import os, random, signal, sys, time
target, rng = int(sys.argv[1]), random.Random(3)
while os.getppid() == target:
    os.kill(target, signal.SIGTERM)
    time.sleep(rng.uniform(0, 0.0002))
"""

SIGNALLED_TAKEOVERS = """
    iterations, seconds = int(sys.argv[1]), float(sys.argv[2])
    current = [None]
    handled = [0]

    def on_term(signo, frame):  # what a rank's SIGTERM handler does: close the exporter
        exp, current[0] = current[0], None
        if exp is not None:
            exp.close()
            handled[0] += 1

    signal.signal(signal.SIGTERM, on_term)
    helper = os.environ.get("NIXL_PROMETHEUS_MP_SERVE", "helper") == "helper"
    killed = [0]

    def kill_the_server():
        # An address server outlives the ranks' closes: its death (an OOM kill, say) is what a standby takes over.
        import http.client
        conn = http.client.HTTPConnection("127.0.0.1", int(os.environ["NIXL_TELEMETRY_PROMETHEUS_PORT"]), timeout=10)
        try:
            conn.request("GET", "/healthz")
            pid = json.loads(conn.getresponse().read())["owner"]["server_pid"]
        except OSError:
            return  # none serves right now (a start that failed): the next round's Exporters start one
        finally:
            conn.close()
        if pid != os.getpid():
            os.kill(pid, signal.SIGKILL)
            killed[0] += 1

    # SIGTERMs from another process (a thread of ours would wait for the GIL and always land between calls),
    # every few tens of microseconds; it exits when we do.
    import subprocess
    pelter = subprocess.Popen([sys.executable, "-c", PELTER, str(os.getpid())])
    done = 0
    deadline = time.monotonic() + seconds
    while min(done, handled[0]) < iterations and time.monotonic() < deadline:  # until covered, or a hang's bound
        owner = Exporter("owner")
        writers = [Exporter(f"writer-{i}") for i in range(10)]  # each loses to the owner
        time.sleep(0.25)  # past the writers' re-election period: their next export re-runs the election
        owner.close()
        if helper:
            kill_the_server()
        for writer in writers:  # each takes the address over in turn ...
            current[0] = writer  # ... while SIGTERMs land
            end = time.monotonic() + 2
            while current[0] is not None and time.monotonic() < end:
                writer.export_event(E.AGENT_TX_BYTES, 1)
            current[0] = None
            writer.close()
            done += 1
    pelter.kill()
    pelter.wait()
    # Every Exporter is closed: no thread of ours serves (from this process) nor carries an address server's
    # records any more.
    end = time.monotonic() + 10
    while time.monotonic() < end:
        serving = [t.name for t in threading.enumerate() if t.name.startswith(("nixl-metrics", "nixl-server-log"))]
        if not serving:
            break
        time.sleep(0.05)
    say(iterations=done, handled=handled[0], threads=serving, servers_killed=killed[0])
"""


@pytest.mark.timeout(120)
def test_close_from_a_signal_handler_during_takeovers_never_hangs(tmp_dir, serve_mode):
    port = free_port()
    # With address servers: each round's server is SIGKILLed once its owner closed, and the writers' standby starts
    # the next one while the SIGTERMs land.  TTL 0: the last one goes once nothing is live.
    env = rank_env(tmp_dir, port, NIXL_TELEMETRY_MP_STALE_TTL="0")
    # Coverage, not speed: the child stops once this many takeovers ran and as many closes came from the handler
    # (each round with address servers starts interpreters: CI saw two rounds of ten in 15 s), or after 60 s,
    # a bound only a hang reaches.  What must hold in every round: the handler's close() returns, nothing hangs.
    rounds = 100 if serve_mode == "thread" else 10
    result, stderr = run_child(SIGNALLED_TAKEOVERS.replace("PELTER", repr(PELTER)), env, timeout=90,
                               args=(str(rounds), "60"))
    assert result["iterations"] >= rounds and result["handled"] >= rounds, result
    assert serve_mode == "thread" or result["servers_killed"] >= 1, result  # (each one started by a takeover)
    assert result["threads"] == [], result
    assert "Traceback" not in stderr, stderr
    address_given_up(tmp_dir, port)


EXIT_DURING_TAKEOVERS = """
    delay = float(sys.argv[1])

    def churn():
        while True:
            owner = Exporter("owner")
            writer = Exporter("writer")
            owner.close()
            writer.export_event(E.AGENT_TX_BYTES, 1)  # takes over
            # writer is dropped without close(): the garbage collector or atexit releases it

    threading.Thread(target=churn, daemon=True).start()
    time.sleep(delay)
    say(exiting=True)
    sys.exit(0)  # atexit (the Exporters' finalizers) runs while the thread is anywhere in a takeover
"""


@pytest.mark.timeout(120)
def test_exit_while_another_thread_takes_over_is_prompt(tmp_dir):
    port = free_port()
    env = rank_env(tmp_dir, port, NIXL_TELEMETRY_MP_STALE_TTL="0")  # (an address server goes with the last store)
    for delay in ("0.05", "0.2", "0.35", "0.5", "0.8"):
        result, stderr = run_child(EXIT_DURING_TAKEOVERS, env, timeout=20, args=(delay,))
        assert result == {"exiting": True}
        assert "Traceback" not in stderr, stderr
        address_given_up(tmp_dir, port)


# -- item: EMFILE on accept backs off, and the endpoint answers again once descriptors return ----------------

ACCEPT_STARVED = """
    port = int(sys.argv[1])
    exp = Exporter("busy")
    assert exp.serving
    exp.export_event(E.AGENT_TX_BYTES, 7)
    serving = next(t for t in threading.enumerate() if t.name == f"nixl-metrics-{port}")
    stat = os.open(f"/proc/self/task/{serving.native_id}/stat", os.O_RDONLY)  # opened while we still can
    tick = os.sysconf("SC_CLK_TCK")

    def cpu_s():
        fields = os.pread(stat, 4096, 0).decode().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / tick  # utime + stime

    client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lift = exhaust_descriptors(0)
    client.connect(("127.0.0.1", port))  # pending: accept() fails with EMFILE for as long as this lasts
    before, started = cpu_s(), time.monotonic()
    for _ in range(200):  # the rank keeps recording meanwhile
        exp.record_transfer(10, 1, 64, True)
        time.sleep(0.01)
    used, window = cpu_s() - before, time.monotonic() - started
    lift()
    client.settimeout(15)
    client.sendall(b"GET /metrics HTTP/1.0\\r\\nHost: x\\r\\n\\r\\n")
    reply = b""
    while chunk := client.recv(65536):
        reply += chunk
    say(cpu_s=used, window_s=window, status=reply.split(b"\\r\\n", 1)[0].decode(),
        has_metrics=b"agent_tx_bytes_total" in reply)
    exp.close()
"""


@pytest.mark.timeout(120)
def test_accept_without_descriptors_backs_off_and_recovers(tmp_dir, serve_mode):
    if serve_mode == "helper":
        pytest.skip("a thread of the rank accepts here; an address server out of descriptors: test_serving_helper.py")
    port = free_port()
    result, stderr = run_child(ACCEPT_STARVED, rank_env(tmp_dir, port), timeout=60, args=(str(port),))
    # A spinning accept loop burns the whole window (about 2 s) of CPU; backing off costs a few ticks.
    assert result["cpu_s"] < 0.25 * result["window_s"], result
    assert result["status"].endswith("200 OK") and result["has_metrics"], result
    assert sum("cannot accept connections" in line for line in stderr.splitlines()) == 1, stderr


THREADLESS_CONNECTION = """
    port = int(sys.argv[1])
    exp = Exporter("threadless")
    assert exp.serving

    def get():
        client = socket.create_connection(("127.0.0.1", port), timeout=15)
        client.sendall(b"GET /metrics HTTP/1.0\\r\\nHost: x\\r\\n\\r\\n")
        reply = b""
        while chunk := client.recv(65536):
            reply += chunk
        client.close()
        return reply.split(b"\\r\\n", 1)[0].decode()

    lift = limit_threads()
    starved = [get(), get()]
    lift()
    say(starved=starved, after=get())
    exp.close()
"""


@pytest.mark.timeout(60)
def test_connection_without_a_thread_is_refused_and_the_endpoint_stays_up(tmp_dir, serve_mode):
    if serve_mode == "helper":
        pytest.skip("the rank's own threads serve here; an address server's connections are its own process's")
    port = free_port()
    result, stderr = run_child(THREADLESS_CONNECTION, rank_env(tmp_dir, port), timeout=45, args=(str(port),))
    assert [line.split(" ", 1)[1] for line in result["starved"]] == ["503 Service Unavailable"] * 2, result
    assert result["after"].endswith("200 OK"), result
    assert sum("cannot start a thread" in line for line in stderr.splitlines()) == 1, stderr
    assert "Traceback" not in stderr, stderr


# -- item: an Exporter dropped without close() is released by the garbage collector --------------------------


@pytest.mark.timeout(60)
def test_dropped_exporter_is_released_like_close(tmp_dir, tmp_path, lock_probe):
    port, solo_port = free_port(), free_port()
    env = exporter_env(tmp_dir, port, NIXL_TELEMETRY_MP_STALE_TTL="0")
    with Exporter("owner", env) as owner:
        assert owner.serving
        wait_until_settled(port, env)
        baseline_fds, baseline_threads = open_fds(), set(threading.enumerate())  # threads, not reusable idents

        writer = Exporter("dropped-writer", env)
        writer.export_event(EventType.AGENT_TX_BYTES, 1)
        writer_store = writer.store_path
        del writer
        gc.collect()
        # (TTL 0: the owner's server may reap the released store before the probe has started.)
        assert lock_probe(writer_store, reaped_ok=True), "the dropped writer's store is still locked"
        assert "dropped-writer" not in [r["agent_name"] for r in healthz(port)["live"]]

        class Agent:  # the usual case: the exporter is owned by an object caught in a reference cycle
            pass

        # Alone in its directory, TTL 0: once its rank let go, nothing there is live, so even an address server (the
        # job's, which outlives a close()) gives the address up at once.
        solo_dir = tmp_path / "solo"
        agent = Agent()
        agent.me = agent  # type: ignore[attr-defined]
        agent.exporter = Exporter("dropped-owner", exporter_env(solo_dir, solo_port,  # type: ignore[attr-defined]
                                                                NIXL_TELEMETRY_MP_STALE_TTL="0"))
        assert agent.exporter.serving  # type: ignore[attr-defined]
        solo_store = agent.exporter.store_path  # type: ignore[attr-defined]
        wait_for_metrics(solo_port)
        del agent
        gc.collect()
        address_given_up(solo_dir, solo_port)  # ... its port and its election
        assert lock_probe(solo_store, reaped_ok=True), "... and its store"  # (or reaped: not held)
        # Nothing of theirs stays (thread mode: the dropped owner's serving threads end).
        def ours_left() -> list[str]:
            return [t.name for t in threading.enumerate() if t not in baseline_threads]

        wait_until(lambda: ours_left() == [], message="the dropped owner's threads to end")
        # A wait, not a look: a descriptor another thread of the test's process has open for a moment (an HTTP
        # client's socket not yet collected) is not one the dropped exporters left (one CI run).
        try:
            wait_until(lambda: len(open_fds()) <= len(baseline_fds),
                       message="the dropped exporters' descriptors to be closed")
        except AssertionError:
            left = {fd: target for fd, target in open_fds().items() if baseline_fds.get(fd) != target}
            raise AssertionError(f"descriptors left open: {left}") from None
        assert owner.serving
    address_given_up(tmp_dir, port)


# -- item: close() joins the scrape threads ------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_close_returns_only_once_no_scrape_thread_of_ours_runs(tmp_dir, serve_mode):
    if serve_mode == "helper":
        pytest.skip("the rank's own threads serve here; an address server's connections are its own process's")
    port = free_port()
    before = set(threading.enumerate())  # the threads themselves: the OS reuses a dead thread's ident
    exp = Exporter("closing", exporter_env(tmp_dir, port))
    assert exp.serving
    stop = threading.Event()

    def scraping() -> None:
        while not stop.is_set():
            try:
                http_request(metrics_url(port, "/healthz"), timeout=2)
            except (OSError, http.client.HTTPException):  # refused, or cut mid-answer by close(): expected
                pass

    scrapers = [threading.Thread(target=scraping) for _ in range(4)]
    for t in scrapers:
        t.start()
    slow = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(3)]
    for s in slow:
        s.sendall(b"GET /metr")  # each holds a connection thread of ours, blocked reading
    wait_until(lambda: sum(t not in before for t in threading.enumerate()) >= 1 + 4 + 3,
               message="the slow connections' threads")
    exp.close()
    left = [t.name for t in threading.enumerate() if t not in before and t not in scrapers]
    stop.set()
    for t in scrapers:
        t.join(timeout=10)
    for s in slow:
        s.close()
    assert left == [], f"threads of ours still running after close(): {left}"


# -- item: the owner notices its directory was removed and recreated ----------------------------------------


@contextlib.contextmanager
def recording(exp: Exporter, serve_mode: str) -> Iterator[Callable[[bool], None]]:
    """With an address server, ``exp`` records at 20 Hz meanwhile, as a job's ranks do (its store, gone with the
    directory, is back at its next export); ``pause(True)`` stops it (no export in flight once it returns) until
    ``pause(False)``."""
    stop, paused, busy = threading.Event(), threading.Event(), threading.Lock()

    def tick() -> None:
        while not stop.wait(0.05):
            with busy:
                if not paused.is_set():
                    exp.export_event(EventType.AGENT_TX_BYTES, 1)

    def pause(on: bool) -> None:
        with busy:
            (paused.set if on else paused.clear)()

    ticker = threading.Thread(target=tick, daemon=True)
    if serve_mode == "helper":
        ticker.start()
    try:
        yield pause
    finally:
        stop.set()
        if ticker.is_alive():
            ticker.join(DEADLINE_S)


@pytest.mark.timeout(90)
def test_replaced_directory_is_reported_and_reelected(tmp_dir, reaper, serve_mode, caplog):  # noqa: F811
    """Serving from a thread, the owner notices at its next scrape, says so in /healthz and its log, and re-elects
    itself on the new lock file: a rank started in the new directory loses.  An address server serves the
    directory at its path (the rank's store is back there at its next export) until a rank of the new directory,
    elected on the new lock file, asks it for the port: it then gives the port up to that rank, saying why."""
    port = free_port()
    lock = tmp_dir / lock_file_name(f"127.0.0.1:{port}")
    caplog.set_level(logging.INFO, logger="nixl_prometheus_mp")  # (an address server logs at its rank's level)
    with Exporter("first", exporter_env(tmp_dir, port)) as owner, recording(owner, serve_mode):
        assert owner.serving
        doc = healthz(port)
        assert doc["warnings"] == []
        first_server = doc["owner"]["server_pid"]
        shutil.rmtree(tmp_dir)
        tmp_dir.mkdir(mode=0o700)
        if serve_mode == "thread":
            doc = wait_until(lambda: (d := healthz(port))["warnings"] and d, message="the replaced warning")
            assert [w["kind"] for w in doc["warnings"]] == ["directory-replaced"], doc["warnings"]
            assert str(tmp_dir) in doc["warnings"][0]["message"]
            assert not lock_is_free(lock), "the owner did not elect itself on the new lock file"
            late = start_exporter_rank(reaper, tmp_dir, port, agent="late", tick_hz=20, log_level="INFO")
            assert not late.serving_at_start and not late.serving()
            assert "cannot bind" not in late.stderr()  # it lost the new election: no contradictory warning
            assert owner.serving and healthz(port)["owner"]["pid"] == os.getpid()
            return
        wait_until(lambda: owner.store_path.exists(), message="the owner's store back at its next export")
        assert [r["pid"] for r in healthz(port)["live"]] == [os.getpid()]  # the same server, the new directory
        assert healthz(port)["owner"]["server_pid"] == first_server and owner.serving
        late = start_exporter_rank(reaper, tmp_dir, port, agent="late", tick_hz=20, log_level="INFO")
        # A rank elected on the new lock file (the late one, or the owner, recording there again) asks for the
        # port: the old server gives it up, and that rank starts the new directory's server.
        doc = wait_until(lambda: (d := healthz(port))["owner"]["server_pid"] != first_server and d,
                         message="a server of the new directory")
        assert doc["owner"]["started_by"] in (late.pid, os.getpid()), doc["owner"]
        assert not lock_is_free(lock)
        wait_until(lambda: not Path(f"/proc/{first_server}/cmdline").exists() or not
                   Path(f"/proc/{first_server}/cmdline").read_bytes(), message="the old server gone")
        assert "cannot bind" not in late.stderr()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("new_lock_file", [False, True], ids=["empty", "with-a-lock-file"])
def test_an_address_server_keeps_the_address_while_the_replaced_directorys_ranks_record_again(
        tmp_dir, serve_mode, caplog, new_lock_file):
    """An address server that looks at its recreated directory before its rank has recorded there again finds
    nothing, though the rank lives: it keeps the address for the TTL, and serves the rank's store once it is
    back.  (It once gave the address up at that look: scrapes refused until a standby started another server.)
    The rank pauses across the server's look, which a real rank's export pace makes rare but possible.

    A lock file in the new directory changes nothing: whoever elected there and gave it back (a C++ rank of
    the run re-electing as it exports) did not ask for the port.  (The server once took that file for a new
    run's and gave the address up unasked.)"""
    if serve_mode == "thread":
        pytest.skip("no address server: the serving rank re-elects itself (the test above)")
    port = free_port()
    caplog.set_level(logging.INFO, logger="nixl_prometheus_mp")  # (an address server logs at its rank's level)
    with Exporter("first", exporter_env(tmp_dir, port)) as owner, recording(owner, serve_mode) as pause:
        server = healthz(port)["owner"]["server_pid"]
        pause(True)
        shutil.rmtree(tmp_dir)
        tmp_dir.mkdir(mode=0o700)
        if new_lock_file:
            lock = tmp_dir / lock_file_name(f"127.0.0.1:{port}")
            lock.touch(mode=0o600)
            assert lock_is_free(lock)  # made, and nobody holds it
        # Its next look (within 10 s: a rank was live) finds the directory empty and says so (in its log file,
        # gone with the directory: read through the server's descriptor).
        wait_until(lambda: "was removed and recreated: its ranks are missing" in server_log(server),
                   timeout=CHECK_S + DEADLINE_S, message="the server's look at the empty directory")
        assert not can_bind(port) and f"giving 127.0.0.1:{port} up" not in server_log(server), server_log(server)
        pause(False)
        wait_until(lambda: owner.store_path.exists(), message="the owner's store back at its next export")
        # Served again: by the same server, or (the rank, recording there again, won the new lock file and asked
        # for the port) by the one this rank started for the new directory.
        doc = wait_until(lambda: (d := healthz(port))["live"] and d, message="the store served again")
        assert [r["pid"] for r in doc["live"]] == [os.getpid()], doc
        assert doc["owner"]["server_pid"] == server or doc["owner"]["started_by"] == os.getpid(), doc


@pytest.mark.timeout(90)
def test_rank_started_in_the_replaced_directory_never_makes_a_second_owner(tmp_dir, reaper, serve_mode):  # noqa: F811
    """Serving from a thread: the new rank wins the new lock file before the owner checks, cannot bind, and gives
    it back; the owner re-elects itself on it at its next scrape; the new rank, retrying, loses.  With an address
    server: the new rank, elected on the new lock file, gets the port from the old directory's server and starts
    the new directory's; the owner's claims lose to it.  One owner throughout."""
    port = free_port()
    lock = tmp_dir / lock_file_name(f"127.0.0.1:{port}")
    with Exporter("first", exporter_env(tmp_dir, port)) as owner, recording(owner, serve_mode):
        assert owner.serving
        first_server = healthz(port)["owner"]["server_pid"]
        shutil.rmtree(tmp_dir)
        tmp_dir.mkdir(mode=0o700)
        late = start_exporter_rank(reaper, tmp_dir, port, agent="late", tick_hz=20)
        if serve_mode == "thread":
            assert not late.serving_at_start
            assert healthz(port)["owner"]["pid"] == os.getpid()
            # Serving from a thread, the owner re-elects at that scrape.
            wait_until(lambda: not lock_is_free(lock), message="the owner holding the new lock file")
            server, starter = os.getpid(), os.getpid()

            def one_owner() -> bool:
                return owner.serving and not late.serving()
        else:
            # A recording rank elected on the new lock file (the late one, or the owner, whose store is back in the
            # new directory at its next export) asks the old directory's server for the port, and a later claim
            # of the same rank gets it.
            doc = wait_until(lambda: (d := healthz(port)["owner"])["server_pid"] != first_server and d,
                             message="a server of the new directory")
            server, starter = doc["server_pid"], doc["started_by"]
            assert starter in (late.pid, os.getpid()), doc

            def one_owner() -> bool:
                return (owner.serving, late.serving()) == (starter == os.getpid(), starter == late.pid)

            wait_until(one_owner, message="the one starter serving")
        deadline = time.monotonic() + 7  # past a retry after a failed bind (5 s)
        while time.monotonic() < deadline:
            assert one_owner()
            doc = healthz(port)["owner"]
            assert (doc["server_pid"], doc["started_by"]) == (server, starter), doc
            time.sleep(0.2)


# -- the bind warnings say what is true -----------------------------------------------------------------------


def test_bind_warning_names_a_foreign_program(tmp_dir, caplog):
    port = free_port()
    caplog.set_level(logging.WARNING, logger="nixl_prometheus_mp")
    foreign = listening_socket(port)
    try:
        with Exporter("blocked", exporter_env(tmp_dir, port)) as exp:
            assert not exp.serving
    finally:
        foreign.close()
    messages = [r.getMessage() for r in caplog.records if "cannot bind" in r.getMessage()]
    assert len(messages) == 1 and "cannot bind it: the port is in use by another program." in messages[0], messages


@contextlib.contextmanager
def port_held_by_no_process(port: int) -> Iterator[Callable[[], None]]:
    """127.0.0.1:``port`` listening, its socket's only reference in flight on a Unix socket: in no process's
    descriptor table, as when its last holder is ending.  Yields what frees it."""
    listener = listening_socket(port)
    sender, receiver = socket.socketpair()
    with sender, receiver:
        with listener:
            socket.send_fds(sender, [b"x"], [listener.fileno()])

        def free() -> None:
            _, fds, _, _ = socket.recv_fds(receiver, 1, 1)
            for fd in fds:
                os.close(fd)
        yield free


def test_a_port_no_process_holds_is_said_only_when_it_stays_held(tmp_dir, caplog):
    """A won election whose port no process holds: its last holder is ending (a server and its spare killed
    together free the lock a few milliseconds before the spare's copy of the port).  Given back without a word;
    the next claim binds once the port is free.  Still held at the next claim, it is a program this rank cannot
    see (another user's): said as any foreign one."""
    caplog.set_level(logging.WARNING, logger="nixl_prometheus_mp")

    def bind_warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if "cannot bind" in r.getMessage()]

    def recording(exp: Exporter, until: Callable[[], Any]) -> Callable[[], Any]:
        return lambda: exp.record_error("backend") or until()  # (each export may claim, every 200 ms at most)

    port = free_port()
    with port_held_by_no_process(port) as free, Exporter("ending", exporter_env(tmp_dir, port)) as exp:
        assert not exp.serving and bind_warnings() == []
        free()
        wait_until(recording(exp, lambda: exp.serving), message="the rank serving once the port is free")
    assert bind_warnings() == [], caplog.text
    port = free_port()
    with port_held_by_no_process(port), Exporter("unseen", exporter_env(tmp_dir / "unseen", port)) as exp:
        messages = wait_until(recording(exp, bind_warnings), message="the port said in use")
        assert not exp.serving
    assert len(messages) == 1 and "cannot bind it: the port is in use by another program." in messages[0], messages


def test_ranks_disagreeing_on_bind_scope_are_told_the_truth(tmp_dir, caplog):
    port = free_port()
    caplog.set_level(logging.WARNING, logger="nixl_prometheus_mp")
    with Exporter("local", exporter_env(tmp_dir, port)) as local:
        assert local.serving
        with Exporter("wide", exporter_env(tmp_dir, port, NIXL_TELEMETRY_PROMETHEUS_LOCAL="n")) as wide:
            assert not wide.serving
    messages = [r.getMessage() for r in caplog.records if f"0.0.0.0:{port}" in r.getMessage()
                and "serve" in r.getMessage()]
    assert len(messages) == 1, messages
    assert f"127.0.0.1:{port} of this run already serves port {port}" in messages[0], messages
    assert "NIXL_TELEMETRY_PROMETHEUS_LOCAL" in messages[0] and "No rank of this run" not in messages[0]
    # ... and no warning claims the directory is served twice: the 0.0.0.0 address is not served at all
    assert not [r for r in caplog.records if "sees each series twice" in r.getMessage()], caplog.text
