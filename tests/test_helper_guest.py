"""The serving helper is a good guest: as harmless to its host as a thread, whatever the host does (issue 24).

Real rank processes, real signals, real uids: a host that waits for all its children or execs itself, a
stopped helper (with and without its rank), a rank that drops root, descriptors 0-2 closed, a helper that
fails before it is ready, isolated interpreters, zipapps and site-packages installs, the host's own logging
and a stderr nobody reads, RLIMIT_NPROC, a blocked SIGTERM, forks racing restarts, and what ps shows.
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
    PROJECT_ROOT,
    START_DEADLINE_S,
    Reaper,
    can_bind,
    child_env,
    directory_for,
    exporter_env,
    free_port,
    healthz,
    http_get,
    metrics_url,
    reaper_fixture,
    scrape,
    start_exporter_rank,
    start_rank,
    try_scrape,
    wait_until,
)

from app.probe import credentials, helper_of, process_state

UNPRIVILEGED = 54321  # a uid (and gid) no other process of the machine uses


@pytest.fixture
def unprivileged_dir() -> Iterator[Path]:
    """A 0700 directory of UNPRIVILEGED's, which that uid can reach."""
    with directory_for("nixl-guest-", 0o700, UNPRIVILEGED) as directory:
        yield directory


# An interpreter every uid can run (the test's may live under root's 0700 home), with this package and the
# test environment's site-packages on its path: what a rank that drops root, or runs as a uid of its own, needs
# to start a helper as that uid.
SYSTEM_PYTHON = f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"


def system_python_env(environ: dict[str, str]) -> dict[str, str]:
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        pytest.skip(f"needs {SYSTEM_PYTHON}, which any uid can run")
    env = child_env(environ)
    env["PYTHONPATH"] = os.pathsep.join([str(PROJECT_ROOT), sysconfig.get_paths()["purelib"]])
    return env


class OtherRank:
    """A rank run by SYSTEM_PYTHON (as ``user``, if given), speaking lines; stderr to a file."""

    def __init__(self, script: str, env: dict[str, str], stderr: Path, user: int | None = None) -> None:
        ids: dict[str, Any] = {} if user is None else {"user": user, "group": user, "extra_groups": []}
        with open(stderr, "wb") as err:
            self.proc = subprocess.Popen([SYSTEM_PYTHON, "-c", script], cwd="/", env=env, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=err, text=True, **ids)
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


def owner(port: int, timeout: float = 2.0) -> dict[str, Any]:
    return healthz(port, timeout=timeout)["owner"]


def served_by_helper_of(port: int, rank_pid: int, not_in: tuple[int, ...] = (),
                        timeout: float = START_DEADLINE_S) -> int:
    """Wait (bounded) until a serving helper of ``rank_pid`` (none of ``not_in``) answers; its pid."""
    def helper() -> int | None:
        doc = owner(port)
        ok = doc["serving"] == "helper" and doc["pid"] == rank_pid and doc["server_pid"] not in not_in
        return int(doc["server_pid"]) if ok else None
    return wait_until(helper, timeout, message=f"a serving helper of {rank_pid} answering on port {port}")


def gone(pid: int) -> bool:
    return process_state(pid) in (None, "Z", "X")


def children_of(pid: int, zombies: bool = True) -> list[int]:
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[1]) == pid and (zombies or fields[0] != "Z"):
            found.append(int(entry))
    return found


def helper_processes_of(rank_pid: int) -> list[int]:
    """Live processes whose command line says they serve for ``rank_pid`` (a launcher, a helper)."""
    return sorted(int(p) for p in filter(str.isdigit, os.listdir("/proc"))
                  if helper_of(int(p)) == rank_pid and not gone(int(p)))


def scrape_until_gone(port: int, helper: int) -> None:
    """A helper that left the address (its rank closed, died or exec'd): one scrape, then it goes."""
    scrape(port)
    wait_until(lambda: gone(helper), 3.0, message=f"helper {helper} gone once the last values were served")


RANK = textwrap.dedent("""
    import json, logging, os, signal, sys
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    from app import Exporter
    exp = Exporter("guest")
    def reply(**doc):
        print(json.dumps({"pid": os.getpid(), **doc}), flush=True)
    reply(serving=exp.serving)
    for line in sys.stdin:
        op = line.strip()
        if op == "wait-all":  # a simple launcher's loop: wait for every child until there is none
            import time
            started, reaped = time.monotonic(), []
            while True:
                try:
                    reaped.append(os.wait()[0])
                except ChildProcessError:
                    break
            reply(waited=time.monotonic() - started, reaped=reaped)
        elif op == "exec":  # the owner execs another program (its Exporter's descriptors close on exec)
            os.execv(sys.executable, [sys.executable, "-c", "import sys; print('execd', flush=True); sys.stdin.read()"])
        elif op == "drop":  # a root rank that drops its privileges for good
            os.setgroups([])
            os.setresgid(UID, UID, UID)
            os.setresuid(UID, UID, UID)
            reply(dropped=os.getresuid())
        elif op == "close":
            import time
            started = time.monotonic()
            exp.close()
            reply(closed=time.monotonic() - started)
""").replace("UID", str(UNPRIVILEGED))


def guest_rank(reaper: Reaper, tmp_dir: Path, port: int, **extra: str):  # type: ignore[no-untyped-def]
    process = start_rank(reaper, RANK, exporter_env(tmp_dir, port, NIXL_PROMETHEUS_MP_SERVE="helper", **extra))
    pid = json.loads(process.readline(START_DEADLINE_S))["pid"]
    return process, pid


# -- 1. nobody's child: a host's wait loop, an exec ------------------------------------------------------------


def test_a_host_waiting_for_all_its_children_never_waits_for_its_helper(tmp_dir: Path, reaper: Reaper) -> None:
    port = free_port()
    process, pid = guest_rank(reaper, tmp_dir, port)
    helper = served_by_helper_of(port, pid)
    process.send("wait-all")
    answer = json.loads(process.readline(DEADLINE_S))
    assert answer["waited"] < 2.0 and helper not in answer["reaped"], answer
    assert owner(port)["server_pid"] == helper and not gone(helper)  # it serves on, nobody's child


def test_an_owner_that_execs_leaves_no_zombie(tmp_dir: Path, reaper: Reaper) -> None:
    port = free_port()
    process, pid = guest_rank(reaper, tmp_dir, port)
    helper = served_by_helper_of(port, pid)
    wait_until(lambda: children_of(pid) == [], 2.0, message="the helper's launcher reaped")  # (it exits at ready)
    process.send("exec")
    assert process.readline(DEADLINE_S) == "execd"
    # The channel's end closed with the exec: the helper serves the departed store once, then goes.
    wait_until(lambda: (owner(port).get("lingering") or {}).get("departed") == 1, DEADLINE_S, message="lingering")
    scrape_until_gone(port, helper)
    assert children_of(pid) == []  # the exec'd program has no zombie of ours
    wait_until(lambda: can_bind(port), 2.0, message="the port free")


# -- 2. a stopped helper ---------------------------------------------------------------------------------------


def test_a_stopped_helper_is_replaced(tmp_dir: Path, reaper: Reaper) -> None:
    port = free_port()
    process, pid = guest_rank(reaper, tmp_dir, port)
    helper = served_by_helper_of(port, pid)
    os.kill(helper, signal.SIGSTOP)
    try:
        started = time.monotonic()
        wait_until(lambda: gone(helper), 6.0, message="the stopped helper killed")
        assert time.monotonic() - started < 4.5  # a ping every 0.5 s, replaced 2 s after one went unanswered
        served_by_helper_of(port, pid, not_in=(helper,))
    finally:
        os.kill(helper, signal.SIGCONT) if not gone(helper) else None
    assert "has not answered for 2 s" in process.stderr_text()


def test_a_stopped_helper_of_a_killed_rank_gives_way_to_a_standby(tmp_dir: Path, reaper: Reaper) -> None:
    port = free_port()
    first = start_exporter_rank(reaper, tmp_dir, port, agent="owner", extra_env={"NIXL_PROMETHEUS_MP_SERVE": "helper"})
    helper = served_by_helper_of(port, first.pid)
    standby = start_exporter_rank(reaper, tmp_dir, port, agent="standby",
                                  extra_env={"NIXL_PROMETHEUS_MP_SERVE": "helper"})
    os.kill(helper, signal.SIGSTOP)
    try:
        first.kill()  # at once: its supervisor never got to replace the stopped helper
        started = time.monotonic()
        wait_until(lambda: owner(port, timeout=1.0)["pid"] == standby.pid, 5.0, message="the standby serving")
        assert time.monotonic() - started < 3.0
        wait_until(lambda: gone(helper), 2.0, message="the stopped orphan killed")
    finally:
        if not gone(helper):
            os.kill(helper, signal.SIGCONT)
    assert "held" in standby.stderr() and str(helper) in standby.stderr()


# -- 3. a rank that drops root ---------------------------------------------------------------------------------


def test_a_rank_that_drops_root_gets_a_helper_without_it(unprivileged_dir: Path, tmp_path: Path) -> None:
    directory = unprivileged_dir
    port = free_port()
    process = OtherRank(RANK, system_python_env(exporter_env(directory, port, NIXL_PROMETHEUS_MP_SERVE="helper")),
                        tmp_path / "stderr")
    try:
        _root_rank_drops_it(process, port)
    finally:
        process.kill()


def _root_rank_drops_it(process: OtherRank, port: int) -> None:
    pid = process.readline()["pid"]
    root_helper = served_by_helper_of(port, pid)
    assert (credentials(root_helper) or {})["Uid"].split()[0] == "0"
    process.send("drop")
    assert process.readline()["dropped"] == [UNPRIVILEGED] * 3
    new = served_by_helper_of(port, pid, not_in=(root_helper,), timeout=DEADLINE_S)
    assert (credentials(new) or {})["Uid"] == f"{UNPRIVILEGED} " * 3 + str(UNPRIVILEGED)
    assert int((credentials(new) or {})["CapEff"], 16) == 0
    wait_until(lambda: gone(root_helper), 3.0, message="the root helper gone")
    stderr = process.stderr_text()
    assert "privileges this process no longer has" in stderr
    assert "cannot SIGKILL" in stderr and "Operation not permitted" in stderr  # said, not swallowed
    process.send("close")
    assert process.readline()["closed"] < 1.5
    assert [c for c in children_of(pid) if process_state(c) == "Z"] == []


# -- 4. descriptors 0-2 closed in the rank ---------------------------------------------------------------------

CLOSED_STDIO = textwrap.dedent("""
    import json, logging, os, sys
    closed = [int(c) for c in sys.argv[1]]
    reply_fd, command_fd = os.dup(1), os.dup(0)  # the test's channel, above 2
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    for fd in closed:
        os.close(fd)
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

    # (Checked between starts: while Popen starts a helper's launcher, /dev/null holds the free ones of 0-2 for
    # that moment, so that its pipes land above them: store.fds.stdio_occupied.)
    if serve_mode == "helper":
        helper = served_by_helper_of(port, pid)
        assert low_fds() == left_open
        os.kill(helper, signal.SIGKILL)  # a restart, from the thread and back
        served_by_helper_of(port, pid, not_in=(helper,))
    else:
        wait_until(lambda: owner(port)["serving"] == "thread", message="served")
    assert low_fds() == left_open
    for n in range(20):  # warned about (and reaped) on the next scrape: the rank logs
        (tmp_dir / f"nixl.{n + 1}.9.0.mmap").write_bytes(b"not a store")
    assert scrape(port) and scrape(port)
    assert low_fds() == left_open
    lock = next(tmp_dir.glob("nixl-owner.*.lock"))
    assert lock.stat().st_size == 0  # nothing was written into it
    assert [p.stat().st_size for p in tmp_dir.glob("nixl.*.mmap")] == [6800]


# -- 4 (issue 23). a rank killed while its helper starts -------------------------------------------------------


def test_a_rank_killed_while_its_helper_starts_costs_its_standby_nothing(tmp_dir: Path, reaper: Reaper) -> None:
    port = free_port()
    env = {"NIXL_PROMETHEUS_MP_SERVE": "helper"}
    first = start_exporter_rank(reaper, tmp_dir, port, agent="owner", extra_env=env)
    helper = served_by_helper_of(port, first.pid)
    standby = start_exporter_rank(reaper, tmp_dir, port, agent="standby", extra_env=env)
    os.kill(helper, signal.SIGKILL)
    starting = wait_until(lambda: [p for p in helper_processes_of(first.pid) if p != helper], DEADLINE_S,
                          interval=0.002, message="a new helper starting")
    first.kill()
    killed = time.monotonic()
    wait_until(lambda: owner(port, timeout=1.0)["pid"] == standby.pid, 5.0, interval=0.005,
               message="the standby serving")
    assert time.monotonic() - killed < 1.0, "the half-started helper held the address"
    for pid in starting:
        wait_until(lambda p=pid: gone(p), 3.0, message="the half-started helper gone")


# -- 5. a helper that fails before it is ready -----------------------------------------------------------------


def test_a_helper_that_fails_before_it_is_ready_is_reaped_and_its_status_named(tmp_dir: Path,
                                                                               reaper: Reaper) -> None:
    port = free_port()
    process, pid = guest_rank(reaper, tmp_dir, port)
    starting = wait_until(lambda: helper_processes_of(pid), DEADLINE_S, interval=0.001, message="a helper starting")
    os.kill(starting[0], signal.SIGTERM)
    wait_until(lambda: "before it was ready" in process.stderr_text(), DEADLINE_S, message="the warning")
    assert "was killed by SIGTERM" in process.stderr_text(), process.stderr_text()
    assert owner(port)["serving"] == "thread"
    wait_until(lambda: children_of(pid) == [], 3.0, message="no child left, not even a zombie")
    wait_until(lambda: helper_processes_of(pid) == [], 3.0, message="nothing of the helper left")


# -- 6. the rank's interpreter, flags and sys.path -------------------------------------------------------------

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
def test_the_helper_runs_with_the_ranks_flags_and_ignores_what_the_rank_ignores(
        tmp_dir: Path, tmp_path: Path, reaper: Reaper, flags: list[str]) -> None:
    port = free_port()
    env = child_env(exporter_env(tmp_dir, port, NIXL_PROMETHEUS_MP_SERVE="helper"))
    env["PYTHONPATH"] = str(_shadowing_werkzeug(tmp_path))
    env["RANK_ROOT"] = str(PROJECT_ROOT)
    process = subprocess.Popen([sys.executable, *flags, "-c", FLAGGED_RANK], env=env,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        pid = json.loads(process.stdout.readline())["pid"]  # type: ignore[union-attr]
        helper = served_by_helper_of(port, pid)
        argv = Path(f"/proc/{helper}/cmdline").read_bytes().decode().split("\0")
        assert all(flag in argv[1:argv.index("-c")] for flag in flags), argv
    finally:
        process.kill()
        process.communicate(timeout=DEADLINE_S)


def _package_copy(into: Path) -> None:
    for package in ("app", "store", "election"):
        shutil.copytree(PROJECT_ROOT / package, into / package, ignore=shutil.ignore_patterns("__pycache__", "*.c"))


@pytest.mark.parametrize("install", ["zipapp", "site-packages", "debug-interpreter"])
def test_the_helper_starts_from_any_install(tmp_dir: Path, tmp_path: Path, reaper: Reaper, install: str) -> None:
    """A zipapp host; a package installed after the standard library (a module there named like a standard one
    must not shadow it in the helper); an interpreter named like a debug build."""
    port = free_port()
    env = child_env(exporter_env(tmp_dir, port, NIXL_PROMETHEUS_MP_SERVE="helper"))
    env.pop("PYTHONPATH")
    command = [sys.executable, "-E", "-c", FLAGGED_RANK]
    where = tmp_path
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
    else:
        link = tmp_path / "python3.11-dbg"
        link.symlink_to(sys.executable)
        env["RANK_EXECUTABLE"] = str(link)
        env["RANK_ROOT"] = str(PROJECT_ROOT)
        where = PROJECT_ROOT
    process = subprocess.Popen(command, cwd=tmp_path, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()  # type: ignore[union-attr]
        assert line, process.communicate(timeout=DEADLINE_S)[1]
        started = json.loads(line)
        assert started["app"].startswith(str(where)), started  # the rank's own copy of this package
        helper = served_by_helper_of(port, started["pid"])
        if install == "debug-interpreter":
            assert Path(f"/proc/{helper}/cmdline").read_bytes().split(b"\0")[0] == str(env["RANK_EXECUTABLE"]).encode()
    finally:
        process.kill()
        process.communicate(timeout=DEADLINE_S)


# -- 7. logs through the host's logging, never blocking serving ------------------------------------------------

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
        served_by_helper_of(port, pid)
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
    wait_until(lambda: host_log.read_text().count("not a valid store") >= 3 or host_log.read_text().count(
        "nixl.1.9.0.mmap") >= 1, DEADLINE_S, message="the warnings in the host's own log")
    logged = host_log.read_text()
    assert "HOST WARNING nixl_prometheus_mp.collector:" in logged, logged
    if serve_mode == "helper":
        assert "serving helper (pid" in logged, logged
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
        assert owner(port, timeout=5.0)["pid"] == pid
    finally:
        process.kill()
        process.wait(DEADLINE_S)
        os.close(read_end)
        os.close(write_end)


# -- 8. a transient spawn failure is retried -------------------------------------------------------------------

NPROC_RANK = textwrap.dedent("""
    import json, os, resource, sys
    soft, hard = resource.getrlimit(resource.RLIMIT_NPROC)
    mine = len(os.listdir("/proc/self/task"))
    # Room for this process's serving and supervising threads, not for the helper's launcher: fork is EAGAIN.
    resource.setrlimit(resource.RLIMIT_NPROC, (mine + 2, hard))
    from app import Exporter
    exp = Exporter("nproc")
    print(json.dumps({"pid": os.getpid(), "serving": exp.serving}), flush=True)
    sys.stdin.readline()
    resource.setrlimit(resource.RLIMIT_NPROC, (soft, hard))
    print(json.dumps({"lifted": True}), flush=True)
    sys.stdin.read()
""")


def test_a_helper_that_cannot_start_for_want_of_processes_is_tried_again(unprivileged_dir: Path,
                                                                        tmp_path: Path) -> None:
    port = free_port()
    process = OtherRank(NPROC_RANK, system_python_env(exporter_env(unprivileged_dir, port,
                                                                   NIXL_PROMETHEUS_MP_SERVE="helper")),
                        tmp_path / "stderr", user=UNPRIVILEGED)
    try:
        started = process.readline()
        assert started["serving"]
        wait_until(lambda: "could not start" in process.stderr_text(), DEADLINE_S, message="the start failing")
        assert "Resource temporarily unavailable" in process.stderr_text(), process.stderr_text()
        time.sleep(1.0)  # failing again and again meanwhile, said once
        assert process.stderr_text().count("could not start") == 1, process.stderr_text()
        process.send("lift")
        assert process.readline()["lifted"]
        served_by_helper_of(port, started["pid"], timeout=DEADLINE_S)  # within the back-off (5 s at most)
    finally:
        process.kill()


# -- 9. a clean signal mask -----------------------------------------------------------------------------------

BLOCKING_RANK = textwrap.dedent("""
    import json, os, signal, sys
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # to sigwait on it, as some hosts do
    from app import Exporter
    exp = Exporter("sigwait")
    print(json.dumps({"pid": os.getpid()}), flush=True)
    sys.stdin.read()
""")


def test_a_host_that_blocks_sigterm_leaves_its_helper_a_clean_mask(tmp_dir: Path, reaper: Reaper) -> None:
    port = free_port()
    process = start_rank(reaper, BLOCKING_RANK, exporter_env(tmp_dir, port, NIXL_PROMETHEUS_MP_SERVE="helper"))
    pid = json.loads(process.readline(START_DEADLINE_S))["pid"]
    helper = served_by_helper_of(port, pid)
    status = dict(line.split(":", 1) for line in Path(f"/proc/{helper}/status").read_text().splitlines())
    assert int(status["SigBlk"], 16) == 0 and int(status["SigIgn"], 16) & (1 << (signal.SIGTERM - 1)) == 0
    os.kill(helper, signal.SIGTERM)
    wait_until(lambda: gone(helper), 3.0, message="the helper gone on SIGTERM")
    served_by_helper_of(port, pid, not_in=(helper,))


# -- 10. a fork racing restarts ------------------------------------------------------------------------------

FORKING_RANK = textwrap.dedent("""
    import json, os, sys, threading
    from app import Exporter
    exp = Exporter("forker")
    print(json.dumps({"pid": os.getpid()}), flush=True)
    stop = threading.Event()
    leaks, forks = [], [0]

    def leaked() -> int:  # in the child: a pidfd or a unix socket (the helper's channel) is a leak
        unix = {line.split()[-2] if len(line.split()) > 7 else "" for line in open("/proc/self/net/unix")}
        found = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if target == "anon_inode:[pidfd]" or (target.startswith("socket:[") and target[8:-1] in unix):
                found += 1
        return found

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
    sys.stdin.readline()
    stop.set()
    thread.join()
    print(json.dumps({"forks": forks[0], "leaks": leaks}), flush=True)
    sys.stdin.read()
""")


def test_a_fork_racing_helper_restarts_never_inherits_their_descriptors(tmp_dir: Path, reaper: Reaper) -> None:
    port = free_port()
    process = start_rank(reaper, FORKING_RANK, exporter_env(tmp_dir, port, NIXL_PROMETHEUS_MP_SERVE="helper"))
    pid = json.loads(process.readline(START_DEADLINE_S))["pid"]
    killed: tuple[int, ...] = ()
    for _ in range(6):
        helper = served_by_helper_of(port, pid, not_in=killed)
        os.kill(helper, signal.SIGKILL)
        killed += (helper,)
    served_by_helper_of(port, pid, not_in=killed)
    process.send("stop")
    report = json.loads(process.readline(DEADLINE_S))
    assert report["forks"] > 100 and report["leaks"] == [], report


# -- 11. ps --------------------------------------------------------------------------------------------------


def test_ps_shows_no_more_of_the_helper_than_whom_it_serves(tmp_dir: Path, reaper: Reaper) -> None:
    port = free_port()
    secret = "agent-with-a-secret-name"
    rank = start_exporter_rank(reaper, tmp_dir, port, agent=secret, extra_env={"NIXL_PROMETHEUS_MP_SERVE": "helper"})
    helper = served_by_helper_of(port, rank.pid)
    shown = subprocess.run(["ps", "-ww", "-o", "args=", "-p", str(helper)], capture_output=True, text=True).stdout
    assert shown.rstrip().endswith(f"serving-helper --for-pid {rank.pid}"), shown
    for hidden in (secret, str(tmp_dir), str(port), "{"):
        assert hidden not in shown, shown
