"""The address server is a good guest: as harmless to the rank that starts it as a thread, whatever the host does.

Real rank processes, real signals, a real uid: a host that waits for all its children or execs itself, a rank
killed as it starts its server, descriptors 0-2 closed, the rank's interpreter flags and installs (isolated
interpreters, zipapps, site-packages, debug builds), the host's own logging and a stderr nobody reads,
RLIMIT_NPROC, a blocked SIGTERM, forks racing server starts, and what ps shows.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import textwrap
import time
import zipapp
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support import (  # noqa: F401  (pytest fixtures)
    DEADLINE_S,
    HELD_DESCRIPTORS,
    PROJECT_ROOT,
    START_DEADLINE_S,
    Reaper,
    child_env,
    children_of,
    directory_for,
    exporter_env,
    free_port,
    healthz,
    http_get,
    metrics_url,
    parent_of,
    parse_exposition,
    pids_in,
    process_state,
    reaper_fixture,
    scrape,
    start_exporter_rank,
    start_rank,
    wait_for_spare,
    wait_until,
)

from app.probe import HELPER_MARK

HELPER = {"NIXL_PROMETHEUS_MP_SERVE": "helper"}
UNPRIVILEGED = 54321  # a uid (and gid) no other process of the machine uses


@pytest.fixture
def unprivileged_dir() -> Iterator[Path]:
    """A 0700 directory of UNPRIVILEGED's, which that uid can reach."""
    with directory_for("nixl-guest-", 0o700, UNPRIVILEGED) as directory:
        yield directory


# An interpreter every uid can run (the test's may live under root's 0700 home), with this package and the
# test environment's site-packages on its path: what a rank running as a uid of its own needs.
SYSTEM_PYTHON = f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"


def system_python_env(environ: dict[str, str]) -> dict[str, str]:
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        pytest.skip(f"needs {SYSTEM_PYTHON}, which any uid can run")
    env = child_env(environ)
    env["PYTHONPATH"] = os.pathsep.join([str(PROJECT_ROOT), sysconfig.get_paths()["purelib"]])
    return env


class OtherRank:
    """A rank run by SYSTEM_PYTHON as ``user``, speaking lines; stderr to a file."""

    def __init__(self, script: str, env: dict[str, str], stderr: Path, user: int) -> None:
        with open(stderr, "wb") as err:
            self.proc = subprocess.Popen([SYSTEM_PYTHON, "-c", script], cwd="/", env=env, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=err, text=True, user=user, group=user,
                                         extra_groups=[])
        self._stderr = stderr

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def readline(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"the rank exited; stderr:\n{self.stderr_text()}"
        return dict(json.loads(line))

    def stderr_text(self) -> str:
        return self._stderr.read_text(errors="replace")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(DEADLINE_S)


def owner(port: int, timeout: float = 5.0) -> dict[str, Any]:
    return healthz(port, timeout=timeout)["owner"]


def served_by_server_of(port: int, rank_pid: int, not_in: tuple[int, ...] = (),
                        timeout: float = START_DEADLINE_S) -> int:
    """Wait (bounded) until an address server started by ``rank_pid`` (none of ``not_in``) answers; its pid."""
    def server() -> int | None:
        doc = owner(port)
        ok = doc["serving"] == "helper" and doc["started_by"] == rank_pid and doc["server_pid"] not in not_in
        return int(doc["server_pid"]) if ok else None
    return wait_until(server, timeout, message=f"an address server started by {rank_pid} answering on port {port}")


def gone(pid: int) -> bool:
    return process_state(pid) in (None, "Z", "X")


def server_processes(port: int) -> list[int]:
    """Live processes whose command line says they serve 127.0.0.1:``port`` (a launcher, a server, a spare)."""
    return sorted(int(p) for p in filter(str.isdigit, os.listdir("/proc"))
                  if _command_tail(int(p)) == [HELPER_MARK, f"127.0.0.1:{port}"] and not gone(int(p)))


def _command_tail(pid: int) -> list[str]:
    try:
        return [arg.decode() for arg in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[-3:-1]]
    except OSError:
        return []


RANK = textwrap.dedent("""
    import json, logging, os, sys
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    from app import Exporter
    exp = Exporter("guest")
    exp.export_event(0, 7)
    def reply(**doc):
        print(json.dumps({"pid": os.getpid(), **doc}), flush=True)
    reply(serving=exp.serving)
    for line in sys.stdin:
        op = line.strip()
        if op == "wait-all":  # a simple launcher's loop: wait for every child until there is none
            reaped = []
            while True:
                try:
                    reaped.append(os.wait()[0])
                except ChildProcessError:
                    break
            reply(reaped=reaped)
        elif op == "exec":  # the rank execs another program (its Exporter's descriptors close on exec)
            os.execv(sys.executable, [sys.executable, "-c", "import sys; print('execd', flush=True); sys.stdin.read()"])
""")


def guest_rank(reaper: Reaper, tmp_dir: Path, port: int, **extra: str):  # type: ignore[no-untyped-def]
    process = start_rank(reaper, RANK, exporter_env(tmp_dir, port, **HELPER, **extra))
    pid = json.loads(process.readline(START_DEADLINE_S))["pid"]
    return process, pid


# -- 1. nobody's child: a host's wait loop, an exec; a rank killed as it starts its server -----------------------


# A rank that records, then says which of the serving core's heavy modules it has loaded.
LOADED_SCRIPT = textwrap.dedent("""
    import json, sys
    from app import Exporter

    exp = Exporter("loaded")
    exp.record_transfer(10, 1, 64, True)
    heavy = ("werkzeug", "prometheus_client", "http.client")
    print(json.dumps({"serving": exp.serving, "loaded": [m for m in heavy if m in sys.modules]}), flush=True)
    sys.stdin.readline()
    exp.close()
""")


@pytest.mark.parametrize("mode", ["helper", "thread"])
def test_a_rank_loads_an_http_server_only_to_serve_from_a_thread(tmp_dir: Path, reaper: Reaper, mode: str) -> None:
    """A rank that starts an address server (or loses to one) loads none of werkzeug, prometheus_client and
    http.client: they took 12 of the 19 MiB and 100 of the 185 ms an Exporter added to a rank.  In thread mode
    every rank loads them as its Exporter is made: a takeover must not wait for werkzeug's import."""
    port = free_port()
    ranks = [start_rank(reaper, LOADED_SCRIPT, exporter_env(tmp_dir, port, NIXL_PROMETHEUS_MP_SERVE=mode))
             for _ in range(2)]
    reports = [json.loads(rank.readline(START_DEADLINE_S)) for rank in ranks]
    for rank in ranks:
        rank.send("exit")
        rank.proc.wait(timeout=DEADLINE_S)
    assert sorted(report["serving"] for report in reports) == [False, True], reports
    for report in reports:
        if mode == "helper":
            assert report["loaded"] == [], reports
        else:
            assert {"werkzeug", "prometheus_client"} <= set(report["loaded"]), reports


def test_a_host_waiting_for_all_its_children_never_waits_for_its_server(tmp_dir: Path, reaper: Reaper) -> None:
    port = free_port()
    process, pid = guest_rank(reaper, tmp_dir, port)
    server = served_by_server_of(port, pid)
    process.send("wait-all")
    # It returns (the server, which serves on, would never exit): at most the launcher was reaped.
    answer = json.loads(process.readline(DEADLINE_S))
    assert server not in answer["reaped"], answer
    assert owner(port)["server_pid"] == server and not gone(server)
    assert pid in pids_in(parse_exposition(scrape(port)))


def test_a_rank_that_execs_leaves_no_zombie(tmp_dir: Path, reaper: Reaper) -> None:
    port = free_port()
    process, pid = guest_rank(reaper, tmp_dir, port)
    server = served_by_server_of(port, pid)
    wait_until(lambda: children_of(pid) == [], message="the server's launcher reaped")  # (it exits at once)
    process.send("exec")
    assert process.readline(DEADLINE_S) == "execd"
    # The store's lock closed with the exec: the server serves the departed store, and the exec'd program has no
    # child of ours, zombie or not.
    wait_until(lambda: [r["pid"] for r in healthz(port)["stale"]] == [pid], message="the server seeing its rank gone")
    assert owner(port)["server_pid"] == server
    assert pid in pids_in(parse_exposition(scrape(port)))
    assert children_of(pid) == []


def test_a_rank_killed_as_it_starts_its_server_has_handed_the_address_over(tmp_dir: Path, reaper: Reaper) -> None:
    port = free_port()
    process = start_rank(reaper, RANK, exporter_env(tmp_dir, port, **HELPER))
    # SIGKILLed the moment its launcher exists: the launcher holds the lock and the listener already.
    starting = wait_until(lambda: server_processes(port), START_DEADLINE_S, interval=0.001,
                          message="a server starting")
    process.kill()
    server = served_by_server_of(port, process.pid)
    assert process.pid in pids_in(parse_exposition(scrape(port)))  # the dead rank's store, departed
    # (A launcher orphaned by the kill was adopted by this test's process, a subreaper: reaped here.)
    for pid in starting:
        if pid != server and parent_of(pid) == os.getpid():
            wait_until(lambda p=pid: os.waitpid(p, os.WNOHANG)[0] == p, message="the orphaned launcher reaped")


# -- 2. descriptors 0-2 closed in the rank -----------------------------------------------------------------------

# The host writes to the streams it closed all the time, from a thread of its own, as a host's print or log line
# would: those writes fail, and must never land in a descriptor of ours that sits on 0-2 for a moment.
CLOSED_STDIO = textwrap.dedent("""
    import json, logging, os, sys, threading
    closed = [int(c) for c in sys.argv[1]]
    reply_fd, command_fd = os.dup(1), os.dup(0)  # the test's channel, above 2
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    for fd in closed:
        os.close(fd)
    def scribble():
        while True:
            for fd in closed:
                try:
                    os.write(fd, b"the host's output\\n")
                except OSError:
                    pass
    threading.Thread(target=scribble, daemon=True).start()
    from app import Exporter
    exp = Exporter("daemon")
    commands = os.fdopen(command_fd)
    def reply(**doc):
        os.write(reply_fd, (json.dumps({"pid": os.getpid(), **doc}) + "\\n").encode())
    reply(serving=exp.serving)
    for line in commands:
        reply(open={fd: os.readlink(f"/proc/self/fd/{fd}") for fd in range(3)  # (opens no descriptor)
                    if os.path.exists(f"/proc/self/fd/{fd}")})
""")


@pytest.mark.usefixtures("serve_mode")
@pytest.mark.parametrize("closed", ["0", "1", "2", "012"])
def test_no_descriptor_of_ours_lands_on_0_1_or_2(tmp_dir: Path, reaper: Reaper, closed: str,
                                                  serve_mode: str) -> None:
    port = free_port()
    process = start_rank(reaper, CLOSED_STDIO, exporter_env(tmp_dir, port), args=(closed,))
    pid = json.loads(process.readline(START_DEADLINE_S))["pid"]
    left_open = sorted(set(range(3)) - {int(c) for c in closed})

    def low_fds() -> list[int]:
        process.send("fds")
        found = json.loads(process.readline())["open"]
        assert sorted(int(fd) for fd in found) == left_open, found
        return left_open

    if serve_mode == "helper":
        served_by_server_of(port, pid)
    else:
        wait_until(lambda: owner(port)["serving"] == "thread", message="served")
    assert low_fds() == left_open
    for n in range(20):  # warned about (and reaped) on the next scrape: the rank logs (thread mode)
        (tmp_dir / f"nixl.{n + 1}.9.0.mmap").write_bytes(b"not a store")
    for _ in range(2):  # whole answers: nothing of the host's in them
        assert pid in pids_in(parse_exposition(scrape(port)))
    assert low_fds() == left_open
    lock = next(tmp_dir.glob("nixl-owner.*.lock"))
    assert lock.read_bytes() == b""  # nothing was written into it
    assert [p.stat().st_size for p in tmp_dir.glob("nixl.*.mmap")] == [6800]


# -- 3. the rank's interpreter, flags and sys.path -------------------------------------------------------------

FLAGGED_RANK = textwrap.dedent("""
    import json, os, sys
    if os.environ.get("RANK_ROOT"):  # (the rank finds this package itself: PYTHONPATH may be ignored)
        sys.path.insert(0, os.environ["RANK_ROOT"])
    if os.environ.get("RANK_SITE"):  # an install after the standard library, as site-packages is
        sys.path.append(os.environ["RANK_SITE"])
    if os.environ.get("RANK_EXECUTABLE"):
        sys.executable = os.environ["RANK_EXECUTABLE"]
    import app
    from app import Exporter
    exp = Exporter("isolated")
    print(json.dumps({"pid": os.getpid(), "app": app.__file__}), flush=True)
    sys.stdin.read()
""")


def _shadowing_werkzeug(tmp_path: Path) -> Path:
    shadow = tmp_path / "shadow"
    (shadow / "werkzeug").mkdir(parents=True)
    (shadow / "werkzeug" / "__init__.py").write_text("raise ImportError('the shadow werkzeug')\n")
    return shadow


@pytest.mark.parametrize("flags", [["-I"], ["-E", "-s"], ["-E", "-O"]])
def test_the_server_runs_with_the_ranks_flags_and_ignores_what_the_rank_ignores(
        tmp_dir: Path, tmp_path: Path, reaper: Reaper, flags: list[str]) -> None:
    port = free_port()
    env = child_env(exporter_env(tmp_dir, port, **HELPER))
    env["PYTHONPATH"] = str(_shadowing_werkzeug(tmp_path))
    env["RANK_ROOT"] = str(PROJECT_ROOT)
    process = subprocess.Popen([sys.executable, *flags, "-c", FLAGGED_RANK], env=env,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        pid = json.loads(process.stdout.readline())["pid"]  # type: ignore[union-attr]
        server = served_by_server_of(port, pid)
        argv = Path(f"/proc/{server}/cmdline").read_bytes().decode().split("\0")
        assert all(flag in argv[1:argv.index("-c")] for flag in flags), argv
        assert pid in pids_in(parse_exposition(scrape(port)))  # werkzeug is the real one there too
    finally:
        process.kill()
        process.communicate(timeout=DEADLINE_S)


def _package_copy(into: Path) -> None:
    for package in ("app", "store", "election"):
        shutil.copytree(PROJECT_ROOT / package, into / package, ignore=shutil.ignore_patterns("__pycache__", "*.c"))


@pytest.mark.parametrize("install", ["zipapp", "site-packages", "debug-interpreter", "checkout"])
def test_the_server_starts_from_any_install(tmp_dir: Path, tmp_path: Path, reaper: Reaper, install: str) -> None:
    """A zipapp host; a package installed after the standard library (a module there named like a standard one
    must not shadow it in the server); an interpreter named like a debug build; a rank run from a source tree
    that is not installed (its sys.path[0] is "", the working directory, which the server, in /, drops)."""
    port = free_port()
    env = child_env(exporter_env(tmp_dir, port, **HELPER))
    env.pop("PYTHONPATH")
    command = [sys.executable, "-E", "-c", FLAGGED_RANK]
    where = cwd = tmp_path
    if install == "zipapp":
        source = tmp_path / "source"
        _package_copy(source)
        (source / "__main__.py").write_text(FLAGGED_RANK)
        zipapp.create_archive(source, tmp_path / "rank.pyz")
        command = [sys.executable, "-E", "rank.pyz"]  # (relative: sys.path[0] depends on the working directory)
        where = tmp_path / "rank.pyz"
    elif install == "site-packages":
        site = tmp_path / "site"
        _package_copy(site)
        (site / "selectors.py").write_text("raise ImportError('site-packages ahead of the standard library')\n")
        env["RANK_SITE"] = str(site)
        where = site
    elif install == "debug-interpreter":
        link = tmp_path / "python3.11-dbg"
        link.symlink_to(sys.executable)
        env["RANK_EXECUTABLE"] = str(link)
        env["RANK_ROOT"] = str(PROJECT_ROOT)
        where = PROJECT_ROOT
    elif install == "checkout":
        where = cwd = tmp_path / "checkout"
        _package_copy(where)
        # No site: nothing installed (this project's own editable install) finds the package for the server; the
        # dependencies through PYTHONPATH, where no .pth file runs.
        command = [sys.executable, "-S", "-c", FLAGGED_RANK]
        env["PYTHONPATH"] = sysconfig.get_path("purelib")
    process = subprocess.Popen(command, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()  # type: ignore[union-attr]
        assert line, process.communicate(timeout=DEADLINE_S)[1]
        started = json.loads(line)
        assert started["app"].startswith(str(where)), started  # the rank's own copy of this package
        server = served_by_server_of(port, started["pid"])
        assert started["pid"] in pids_in(parse_exposition(scrape(port)))
        if install == "debug-interpreter":
            assert Path(f"/proc/{server}/cmdline").read_bytes().split(b"\0")[0] == str(env["RANK_EXECUTABLE"]).encode()
    finally:
        process.kill()
        process.communicate(timeout=DEADLINE_S)


# -- 4. logs through the host's logging, never blocking serving ------------------------------------------------

HOST_LOGGING = textwrap.dedent("""
    import json, logging, os, sys
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="STDERR %(name)s: %(message)s")
    mine = logging.getLogger("nixl_prometheus_mp")  # the host routes this package's records to its own file
    handler = logging.FileHandler(sys.argv[1])
    handler.setFormatter(logging.Formatter("HOST %(levelname)s %(name)s: %(message)s"))
    mine.addHandler(handler)
    mine.propagate = False
    from app import Exporter
    exp = Exporter("logging")
    print(json.dumps({"pid": os.getpid()}), flush=True)
    sys.stdin.read()
""")


def _plant_invalid_stores(directory: Path, count: int) -> None:
    for n in range(count):  # ours, held by nobody, not a store: warned about and reaped by the next scrape
        (directory / f"nixl.{n + 1}.9.0.mmap").write_bytes(b"not a store")


def _settled(port: int, pid: int, serve_mode: str) -> None:
    if serve_mode == "helper":
        served_by_server_of(port, pid)
    else:
        wait_until(lambda: owner(port)["serving"] == "thread", message="served")


@pytest.mark.usefixtures("serve_mode")
def test_the_endpoints_logs_go_through_the_hosts_logging(tmp_dir: Path, tmp_path: Path, reaper: Reaper,
                                                          serve_mode: str) -> None:
    port = free_port()
    host_log = tmp_path / "host.log"
    process = start_rank(reaper, HOST_LOGGING, exporter_env(tmp_dir, port), args=(str(host_log),))
    pid = json.loads(process.readline(START_DEADLINE_S))["pid"]
    _settled(port, pid, serve_mode)
    _plant_invalid_stores(tmp_dir, 3)
    scrape(port)
    if serve_mode == "helper":  # the server's records go to its own file in the directory, never to the host
        log_file = Path(owner(port)["log_file"])
        wait_until(lambda: "nixl.1.9.0.mmap" in log_file.read_text(), DEADLINE_S, message="the server's log file")
        assert "nixl.1.9.0.mmap" not in host_log.read_text()
    else:
        wait_until(lambda: host_log.read_text().count("not a valid store") >= 3 or host_log.read_text().count(
            "nixl.1.9.0.mmap") >= 1, DEADLINE_S, message="the warnings in the host's own log")
        logged = host_log.read_text()
        assert "HOST WARNING nixl_prometheus_mp.collector:" in logged, logged
    assert "nixl.1.9.0.mmap" not in process.stderr_text()  # nothing of ours on the stderr the host routed away


@pytest.mark.usefixtures("serve_mode")
def test_a_stderr_nobody_reads_never_blocks_a_scrape(tmp_dir: Path, serve_mode: str) -> None:
    port = free_port()
    read_end, write_end = os.pipe()
    flags = fcntl.fcntl(write_end, fcntl.F_GETFL)
    fcntl.fcntl(write_end, fcntl.F_SETFL, flags | os.O_NONBLOCK)
    try:
        while True:
            os.write(write_end, b"x" * 4096)  # full: the rank's next write to stderr blocks
    except BlockingIOError:
        pass
    fcntl.fcntl(write_end, fcntl.F_SETFL, flags)
    script = textwrap.dedent("""
        import json, logging, os, sys
        logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
        from app import Exporter
        exp = Exporter("stuck-stderr")
        print(json.dumps({"pid": os.getpid()}), flush=True)
        sys.stdin.read()
    """)
    process = subprocess.Popen([sys.executable, "-c", script], cwd=PROJECT_ROOT, env=child_env(exporter_env(
        tmp_dir, port)), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=write_end, text=True)
    try:
        pid = json.loads(process.stdout.readline())["pid"]  # type: ignore[union-attr]
        _settled(port, pid, serve_mode)
        _plant_invalid_stores(tmp_dir, 300)
        for _ in range(3):  # 300 warnings, none of which can be written: every scrape still answers
            started = time.monotonic()
            assert http_get(metrics_url(port), timeout=5.0).status == 200
            assert time.monotonic() - started < 5.0
        assert owner(port, timeout=5.0)["started_by"] == pid
    finally:
        process.kill()
        process.wait(DEADLINE_S)
        os.close(read_end)
        os.close(write_end)


# -- 5. a start that fails for want of processes is retried --------------------------------------------------

NPROC_RANK = textwrap.dedent("""
    import json, logging, os, resource, sys, threading, time
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    import app.rank.endpoint as endpoint
    from app import Exporter
    launches, launch = [0], endpoint.launch
    def counted(*args, **kwargs):  # (only counted: the starts tried, whether the fork fails or not)
        launches[0] += 1
        return launch(*args, **kwargs)
    endpoint.launch = counted
    exporters = []
    def record():  # a rank records as it runs: its export path retries what failed
        while True:
            for exp in exporters:
                exp.export_event(3, 1)
            time.sleep(0.05)
    threading.Thread(target=record, daemon=True).start()
    soft, hard = resource.getrlimit(resource.RLIMIT_NPROC)
    # Not one process or thread more for this uid (this process is its only one): the launcher's fork is EAGAIN.
    resource.setrlimit(resource.RLIMIT_NPROC, (len(os.listdir("/proc/self/task")), hard))
    exp = Exporter("nproc")
    exporters.append(exp)
    def reply():
        print(json.dumps({"pid": os.getpid(), "serving": exp.serving, "launches": launches[0]}), flush=True)
    reply()
    for line in sys.stdin:
        if line.strip() == "lift":
            resource.setrlimit(resource.RLIMIT_NPROC, (soft, hard))
        reply()
""")


def test_a_server_that_cannot_start_for_want_of_processes_is_tried_again(unprivileged_dir: Path,
                                                                        tmp_path: Path) -> None:
    port = free_port()
    process = OtherRank(NPROC_RANK, system_python_env(exporter_env(unprivileged_dir, port, **HELPER)),
                        tmp_path / "stderr", user=UNPRIVILEGED)
    try:
        started = process.readline()
        assert started["launches"] == 1 and not started["serving"], started
        pid = started["pid"]

        def tried(times: int) -> bool:
            process.send("status")
            return process.readline()["launches"] >= times

        # Tried again as it records: a shortage leaves the election to another rank, and this rank retries every
        # 5 s (claims.BACKOFF_NS), never in a tight loop.
        wait_until(lambda: tried(2), 5.0 + DEADLINE_S, interval=0.2, message="the start tried again")
        stderr = process.stderr_text()
        said = [line for line in stderr.splitlines() if "Resource temporarily unavailable" in line]
        assert said and len(said) == len(set(said)), stderr  # said, and each thing once though it failed twice
        assert any(line.startswith("WARNING") and "the address server" in line for line in said), stderr
        process.send("lift")
        process.readline()
        served_by_server_of(port, pid, timeout=5.0 + START_DEADLINE_S)  # the next retry, 5 s at most
        assert process.stderr_text().count("Resource temporarily unavailable") == len(said), process.stderr_text()
    finally:
        process.kill()


# -- 6. a clean signal mask -----------------------------------------------------------------------------------

BLOCKING_RANK = textwrap.dedent("""
    import json, os, signal, sys
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # to sigwait on it, as some hosts do
    from app import Exporter
    exp = Exporter("sigwait")
    print(json.dumps({"pid": os.getpid()}), flush=True)
    sys.stdin.read()
""")


def test_a_host_that_blocks_sigterm_leaves_its_server_a_clean_mask(tmp_dir: Path, reaper: Reaper) -> None:
    port = free_port()
    process = start_rank(reaper, BLOCKING_RANK, exporter_env(tmp_dir, port, **HELPER))
    pid = json.loads(process.readline(START_DEADLINE_S))["pid"]
    server = served_by_server_of(port, pid)
    wait_for_spare(port)  # (while it starts its spare, Popen blocks every signal for the moment of its vfork)
    status = dict(line.split(":", 1) for line in Path(f"/proc/{server}/status").read_text().splitlines())
    assert int(status["SigBlk"], 16) == 0 and int(status["SigIgn"], 16) & (1 << (signal.SIGTERM - 1)) == 0
    os.kill(server, signal.SIGTERM)  # (an operator's: the address is given up, the spare with it)
    wait_until(lambda: gone(server) and server_processes(port) == [], message="the server and its spare gone")


# -- 7. a fork racing server starts --------------------------------------------------------------------------

FORKING_RANK = textwrap.dedent("""
    import json, os, sys, threading
    from app import Exporter
    exp = Exporter("forker")
    print(json.dumps({"pid": os.getpid()}), flush=True)
    stop = threading.Event()

    def record():  # its claims start a server whenever the address is free
        while not stop.wait(0.01):
            exp.export_event(3, 1)

    threading.Thread(target=record, daemon=True).start()
    leaks, forks = [], [0]

    HELD_DESCRIPTORS

    def leaked():  # in a child, any of them is a leak: said on stderr with what each descriptor is, then counted
        found = held()
        if sum(found.values()):
            named = {}
            for fd in os.listdir("/proc/self/fd"):
                try:
                    info = [line for line in open(f"/proc/self/fdinfo/{fd}") if line.startswith("Pid:")]
                    named[fd] = os.readlink(f"/proc/self/fd/{fd}") + "".join(" " + line.strip() for line in info)
                except OSError:
                    pass
            os.write(2, f"child {os.getpid()} leaked {found}: {named}\\n".encode())
        return sum(found.values())

    def fork_loop():
        while not stop.is_set():
            pid = os.fork()
            if pid == 0:
                os._exit(min(leaked(), 100))
            _, status = os.waitpid(pid, 0)
            forks[0] += 1
            if os.waitstatus_to_exitcode(status):
                leaks.append(os.waitstatus_to_exitcode(status))

    thread = threading.Thread(target=fork_loop)
    thread.start()
    for line in sys.stdin:
        if line.strip() == "stop":
            break
        print(json.dumps({"forks": forks[0], **held()}), flush=True)
    stop.set()
    thread.join()
    print(json.dumps({"forks": forks[0], "leaks": leaks}), flush=True)
    sys.stdin.read()
""").replace("HELD_DESCRIPTORS\n", HELD_DESCRIPTORS)


def test_a_fork_racing_server_starts_never_inherits_their_descriptors(tmp_dir: Path, reaper: Reaper) -> None:
    port = free_port()
    process = start_rank(reaper, FORKING_RANK, exporter_env(tmp_dir, port, **HELPER))
    pid = json.loads(process.readline(START_DEADLINE_S))["pid"]
    killed: tuple[int, ...] = ()

    def status() -> dict[str, int]:
        process.send("held")
        return dict(json.loads(process.readline()))

    # Each server is killed with its spare, and the recording rank starts another: at least six starts, and as
    # many more as it takes for hundreds of forks to race them (fewer per start on a loaded machine).
    for _ in range(100):
        server = served_by_server_of(port, pid, not_in=killed)
        if len(killed) >= 6 and status()["forks"] >= 200:
            break
        for process_of_ours in server_processes(port):  # the spare, a launcher, the server
            os.kill(process_of_ours, signal.SIGKILL)
        killed += (server,)

    process.send("stop")
    report = json.loads(process.readline(DEADLINE_S))
    if report["forks"] < 200 or report["leaks"]:  # (pytest.fail: an assertion's message would be cut short)
        said = "\n".join(line for line in process.stderr_text().splitlines() if " leaked " in line)
        pytest.fail(f"{len(killed)} servers killed, {report}:\n{said}")


# -- 8. ps ---------------------------------------------------------------------------------------------------


def test_ps_shows_no_more_of_the_server_than_its_address(tmp_dir: Path, reaper: Reaper) -> None:
    port = free_port()
    secret = "agent-with-a-secret-name"
    rank = start_exporter_rank(reaper, tmp_dir, port, agent=secret, extra_env=HELPER)
    server = served_by_server_of(port, rank.pid)
    shown = subprocess.run(["ps", "-ww", "-o", "args=", "-p", str(server)], capture_output=True, text=True).stdout
    assert shown.rstrip().endswith(f"serving-helper 127.0.0.1:{port}"), shown
    for hidden in (secret, str(tmp_dir), "{"):
        assert hidden not in shown, shown
    named = subprocess.run(["ps", "-o", "comm=", "-p", str(server)], capture_output=True, text=True).stdout
    assert named.strip() == "nixl-server", named


# -- 9. a host that closes every descriptor, a huge sys.path -------------------------------------------------------

CLOSERANGE_RANK = textwrap.dedent("""
    import json, os, sys
    from app import Exporter
    exp = Exporter("daemonized")
    exp.export_event(0, 5)
    print(json.dumps({"pid": os.getpid(), "store": str(exp.store_path)}), flush=True)
    sys.stdin.readline()
    os.closerange(3, 1024)  # as daemonizing code does, behind the library's back (0-2 stay: the test's channel)
    # The host's own descriptors now take the lowest free numbers, where ours were.
    mine = [os.open(os.devnull, os.O_RDONLY) for _ in range(4)]
    pipe_r, pipe_w = os.pipe()
    os.set_blocking(pipe_r, False)
    files = {fd: os.readlink(f"/proc/self/fd/{fd}") for fd in [*mine, pipe_r, pipe_w]}
    print(json.dumps({"files": files}), flush=True)
    for line in sys.stdin:
        for _ in range(int(line)):  # recording goes on; the exports' claims and checks run
            exp.export_event(0, 1)
        if line.strip() == "0":
            exp.close()
        try:
            unread = os.read(pipe_r, 4096)  # nothing of ours ever lands in the host's pipe
        except BlockingIOError:
            unread = b""
        still = {fd: os.readlink(f"/proc/self/fd/{fd}") for fd in files if os.path.exists(f"/proc/self/fd/{fd}")}
        print(json.dumps({"files": still, "unread": unread.decode(errors="replace"), "serving": exp.serving}),
              flush=True)
""")


def test_a_host_that_closes_our_descriptors_keeps_its_own_and_its_telemetry(tmp_dir: Path, reaper: Reaper) -> None:
    port = free_port()
    process = start_rank(reaper, CLOSERANGE_RANK, exporter_env(tmp_dir, port, **HELPER))
    started = json.loads(process.readline(START_DEADLINE_S))
    server = served_by_server_of(port, started["pid"])
    process.send("go")
    files = json.loads(process.readline())["files"]

    def record(n: int) -> dict[str, Any]:
        process.send(str(n))
        return dict(json.loads(process.readline()))

    # The store lost its lock with its descriptor: the next export's check recreates it (live again, values
    # carried); the host's descriptors are left alone throughout, and nothing is written into them.
    def live_again() -> bool:
        answer = record(10)
        assert answer["files"] == files and answer["unread"] == "", answer
        return [r["pid"] for r in healthz(port)["live"]] == [started["pid"]]

    wait_until(live_again, message="the rank's store live again")
    answer = record(0)  # close(): releases what is ours, and nothing else
    assert answer["files"] == files and answer["unread"] == "" and answer["serving"] is False, answer
    values = {key[0]: v for key, v in parse_exposition(scrape(port)).items() if dict(key[1])["pid"] ==
              str(started["pid"])}
    assert values["agent_tx_bytes_total"] >= 5 + 10, values  # nothing recorded was lost
    assert owner(port)["server_pid"] == server  # and the address never moved


BIG_PATH_RANK = textwrap.dedent("""
    import json, os, sys
    sys.path.extend(f"/nonexistent/added-by-the-program/{'x' * 90}/{n}" for n in range(1000))  # ~100 KB more
    from app import Exporter
    exp = Exporter("big-path")
    print(json.dumps({"pid": os.getpid(), "path": len(os.pathsep.join(sys.path))}), flush=True)
    sys.stdin.read()
""")


def test_a_200_kb_sys_path_starts_a_server_all_the_same(tmp_dir: Path, reaper: Reaper) -> None:
    port = free_port()
    env = exporter_env(tmp_dir, port, **HELPER)
    # A 100 KB PYTHONPATH (one environment string holds at most 128 KiB), as Bazel or Spack trees make.
    env["PYTHONPATH"] = os.pathsep.join([str(PROJECT_ROOT), *(f"/nonexistent/spack/{'y' * 90}/{n}"
                                                              for n in range(1000))])
    process = start_rank(reaper, BIG_PATH_RANK, env)
    started = json.loads(process.readline(START_DEADLINE_S))
    assert started["path"] > 200_000, started
    served_by_server_of(port, started["pid"])
    assert started["pid"] in pids_in(parse_exposition(scrape(port)))
