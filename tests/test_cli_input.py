"""Bad input to the command line: one line on stderr, exit status 2 (usage) or 1 (runtime), no traceback.

Everything runs the real command, ``python -m app`` and the installed
``nixl-prometheus-mp`` console script, in subprocesses with bounded waits.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import runpy
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest
from support import Reaper, free_port, http_get, listening_socket, wait_until
from support_e2e import REPO, VENV_BIN, procfile_web_command, rank_env

from store import EventType, StoreIdentity, StoreWriter

COMMANDS = {"module": [sys.executable, "-m", "app"], "script": [str(VENV_BIN / "nixl-prometheus-mp")]}
NOBODY = 65534


@pytest.fixture(params=sorted(COMMANDS))
def cli(request: pytest.FixtureRequest) -> list[str]:
    return COMMANDS[request.param]


def run(command: list[str], *args: str, env: dict[str, str] | None = None, timeout: float = 60,
        cwd: Path = REPO, **popen: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*command, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, **popen)  # type: ignore[call-overload]


def one_line_error(done: subprocess.CompletedProcess[str], status: int, *words: str) -> str:
    assert done.returncode == status, (done.returncode, done.stderr, done.stdout)
    assert "Traceback" not in done.stderr + done.stdout, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("nixl-prometheus-mp") and "error:" in lines[0], lines
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def demo_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The environment of a demo whose temporary directory lands in tmp_path/tmp."""
    (tmp_path / "tmp").mkdir(exist_ok=True)
    env = rank_env(tmp_path / "unused", 1, TMPDIR=str(tmp_path / "tmp"), **extra)
    del env["NIXL_TELEMETRY_MULTIPROC_DIR"], env["NIXL_TELEMETRY_PROMETHEUS_PORT"]
    return env


# -- argument validation ------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("option", "value"), [
    ("--rate", "0"), ("--rate", "-5"), ("--rate", "inf"), ("--rate", "nan"), ("--rate", "fast"),
    ("--duration", "-1"), ("--duration", "inf"), ("--duration", "nan"),
    ("--port", "0"), ("--port", "70000"), ("--port", "1_9111"), ("--port", "١٩١١١"),
    ("--ranks", "0"), ("--ranks", "-2"), ("--ranks", "three"),
])
def test_demo_refuses_a_bad_argument_before_starting_anything(cli: list[str], tmp_path: Path, option: str,
                                                              value: str) -> None:
    done = run(cli, "demo", option, value, "--duration", "1", env=demo_env(tmp_path)) if option != "--duration" \
        else run(cli, "demo", option, value, env=demo_env(tmp_path))
    one_line_error(done, 2, option, repr(value))
    assert done.stdout == ""  # no URL advertised
    assert os.listdir(tmp_path / "tmp") == []  # no temporary directory


@pytest.mark.parametrize(("name", "value"), [
    ("NIXL_TELEMETRY_MP_STALE_TTL", "1e300"),
    ("NIXL_TELEMETRY_HISTOGRAM_BUCKETS_US", "100,10"),
])
def test_demo_refuses_a_bad_setting_once_not_once_per_rank(cli: list[str], tmp_path: Path, name: str,
                                                          value: str) -> None:
    done = run(cli, "demo", "--port", str(free_port()), "--duration", "1", env=demo_env(tmp_path, **{name: value}))
    one_line_error(done, 2, name, repr(value))
    assert os.listdir(tmp_path / "tmp") == []


@pytest.mark.parametrize(("name", "value"), [
    ("NIXL_TELEMETRY_MP_STALE_TTL", "1e300"),
    ("NIXL_TELEMETRY_PROMETHEUS_PORT", "١٩١١١"),
    ("NIXL_TELEMETRY_MULTIPROC_DIR", "relative/mp"),
])
def test_serve_refuses_a_bad_setting_before_creating_the_directory(cli: list[str], tmp_path: Path, name: str,
                                                                  value: str) -> None:
    env = rank_env(tmp_path / "mp", free_port(), **{name: value})
    done = run(cli, "serve", env=env, cwd=tmp_path)
    one_line_error(done, 2, name, repr(value))
    assert os.listdir(tmp_path) == []


def test_help_lists_the_rank_command_but_not_the_demos_own_flag(cli: list[str]) -> None:
    """``rank`` is public (ranks only, deploy/nixl-ranks.yaml); the pid it dies with is the demo's business."""
    done = run(cli, "--help")
    assert done.returncode == 0, done.stderr
    assert re.search(r"^    rank +one rank recording", done.stdout, re.M) and "_rank" not in done.stdout, done.stdout
    done = run(cli, "rank", "--help")
    assert done.returncode == 0 and "--name" in done.stdout and "--parent-pid" not in done.stdout, done.stdout


def test_the_rank_command_validates(cli: list[str], tmp_path: Path) -> None:
    one_line_error(run(cli, "rank", "--name", "a", "--rate", "0", env=rank_env(tmp_path / "mp", free_port())),
                   2, "--rate", "'0'")
    assert not (tmp_path / "mp").exists()
    # Configured by the environment alone, as a NIXL rank: without the directory, one line naming the variable.
    env = rank_env(tmp_path / "mp", free_port())
    del env["NIXL_TELEMETRY_MULTIPROC_DIR"]
    one_line_error(run(cli, "rank", "--name", "a", "--duration", "1", env=env), 2, "NIXL_TELEMETRY_MULTIPROC_DIR")


# -- the port -------------------------------------------------------------------------------------------------

def test_demo_default_port_is_not_prometheus_9090(cli: list[str]) -> None:
    done = run(cli, "demo", "--help")
    assert re.search(r"--port PORT\s+scrape port, bound on 127.0.0.1 \(default 9111\)", done.stdout), done.stdout


def test_demo_refuses_a_port_another_program_holds_and_names_it(cli: list[str], tmp_path: Path) -> None:
    port = free_port()
    sock = listening_socket(port)
    try:
        done = run(cli, "demo", "--port", str(port), "--duration", "2", env=demo_env(tmp_path))
    finally:
        sock.close()
    line = one_line_error(done, 1, f"port {port}", "already in use", f"pid {os.getpid()}", "--port")
    assert "http://" not in done.stdout + line  # never advertised
    assert os.listdir(tmp_path / "tmp") == []


# -- the directory --------------------------------------------------------------------------------------------


def run_module_as_nobody(*args: str, env: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """``python -m app ARGS`` as uid/gid 65534: a forked child drops privileges, then runs the module.

    (Neither the interpreter nor its standard library can be read as 65534
    where they live under root's 0700 home, so the child imports what it
    needs first and then runs the module as ``-m`` would.)
    """
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        status = 70
        try:
            with open(out, "w") as o, open(err, "w") as e:
                os.dup2(o.fileno(), 1)
                os.dup2(e.fileno(), 2)
            sys.stdout, sys.stderr = open(1, "w", closefd=False), open(2, "w", closefd=False)  # not pytest's capture
            for module in ("app.cli", "app.rank.endpoint", "app.rank.exporter", "app.aggregator.hooks",
                           "app.aggregator.settings", "app.aggregator.wsgi"):
                importlib.import_module(module)  # while the interpreter's own files are still readable
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            os.environ.clear()
            os.environ.update(env)
            sys.argv = ["nixl-prometheus-mp", *args]
            runpy.run_module("app", run_name="__main__", alter_sys=True)
        except SystemExit as exc:
            status = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
    deadline = time.monotonic() + 30  # inside pytest's own timeout, so the child is always killed here
    try:
        while (done := os.waitpid(pid, os.WNOHANG)) == (0, 0):
            if time.monotonic() > deadline:
                raise AssertionError("python -m app as uid 65534 did not finish within 30 s")
            time.sleep(0.05)
    except BaseException:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise
    return subprocess.CompletedProcess(args, os.waitstatus_to_exitcode(done[1]), out.read_text(), err.read_text())


@pytest.mark.parametrize("command", ["demo", "serve"])
def test_a_directory_this_user_cannot_write_is_one_line(root_owned_dir: Path, tmp_path: Path, command: str) -> None:
    """Was a bare PermissionError naming only the path (four tracebacks from the demo's ranks)."""
    port = str(free_port())
    if command == "demo":
        done = run_module_as_nobody("demo", "--dir", str(root_owned_dir), "--port", port, "--duration", "1",
                                    env=demo_env(tmp_path), tmp_path=tmp_path)
    else:
        done = run_module_as_nobody("serve", env=rank_env(root_owned_dir, int(port)), tmp_path=tmp_path)
    # The demo's user gave the directory with --dir and never set the variable: the error names what they typed.
    named = "--dir" if command == "demo" else "NIXL_TELEMETRY_MULTIPROC_DIR"
    line = one_line_error(done, 2, f"{named}={str(root_owned_dir)!r}", "not writable", "uid 65534")
    assert command == "serve" or "NIXL_TELEMETRY_MULTIPROC_DIR" not in line, line
    assert os.listdir(root_owned_dir) == []


def test_demo_dir_that_cannot_be_created_names_the_flag(root_owned_dir: Path, tmp_path: Path) -> None:
    wanted = root_owned_dir / "run"
    done = run_module_as_nobody("demo", "--dir", str(wanted), "--port", str(free_port()), "--duration", "1",
                                env=demo_env(tmp_path), tmp_path=tmp_path)
    line = one_line_error(done, 2, f"--dir={str(wanted)!r}", "cannot be created", "Permission denied")
    assert "NIXL_TELEMETRY_MULTIPROC_DIR" not in line, line
    assert not wanted.exists()


def server_log(directory: Path, port: int) -> str:
    """The address server's log file in ``directory`` (once the rank that started it is gone)."""
    return (directory / f"nixl-server.127.0.0.1:{port}.log").read_text()


# The demo's directories do not depend on how it was started: these run it one way (the entry points' tests
# above run both).
DEMO = COMMANDS["module"]


def test_demo_removes_only_the_directory_it_created(tmp_path: Path) -> None:
    # A short TTL: at the end the demo waits for its address server to publish the final values until the TTL (the
    # ranks are gone by then, and the server logs to its file).  Not shorter: a server that starts after the TTL
    # has passed since the ranks' last update (a loaded host) finds nothing live to publish, and gives the port up.
    env = demo_env(tmp_path, NIXL_TELEMETRY_MP_STALE_TTL="5")
    done = run(DEMO, "demo", "--ranks", "2", "--port", str(free_port()), "--duration", "1", "--rate", "50", env=env)
    assert done.returncode == 0, done.stderr
    assert "ranks recording into" in done.stdout and os.listdir(tmp_path / "tmp") == [], done.stdout

    given, port = tmp_path / "given", free_port()
    done = run(DEMO, "demo", "--ranks", "2", "--port", str(port), "--duration", "1", "--rate", "50",
               "--dir", str(given), env=env)
    assert done.returncode == 0, done.stderr
    # A --dir is the user's: kept, with what the run left there.  The stores the address server reaped after
    # the TTL (its log, in the directory, says so), so that the demo ended once their final values were served.
    assert given.is_dir() and (given / f"nixl-owner.127.0.0.1:{port}.lock").exists()
    log = server_log(given, port)
    assert "agent 'demo-agent-0'" in log and "agent 'demo-agent-1'" in log, log


def test_demo_waits_for_a_server_still_starting_once_its_ranks_are_done(tmp_path: Path) -> None:
    # The address server starts 3 s late (a sitecustomize of its own pauses it as its launcher forks it), while
    # the ranks are done after 1 s: the demo waits for the server they started rather than give up once they
    # ended, and the server publishes their final values (within the TTL of their last update: 8 s covers it).
    slow = tmp_path / "slow"
    slow.mkdir()
    (slow / "sitecustomize.py").write_text(
        'import os, sys, time\n'
        'if "serving-helper" in sys.argv:\n'
        '    os.register_at_fork(after_in_child=lambda: time.sleep(3))\n')
    env = demo_env(tmp_path, NIXL_TELEMETRY_MP_STALE_TTL="8")
    env["PYTHONPATH"] = os.pathsep.join((str(slow), env["PYTHONPATH"]))
    done = run(DEMO, "demo", "--ranks", "2", "--port", str(free_port()), "--duration", "1", "--rate", "50", env=env)
    assert done.returncode == 0, done.stderr
    assert "started the server of" in done.stdout and "ranks live 0 departed 2" in done.stdout, done.stdout


def test_demo_with_a_relative_dir_gives_the_ranks_an_absolute_one(tmp_path: Path) -> None:
    """The rank's store, and the address server (which runs in /), are in tmp_path/rel."""
    port = free_port()
    done = run(DEMO, "demo", "--ranks", "1", "--port", str(port), "--duration", "1", "--dir", "rel",
               env=demo_env(tmp_path, NIXL_TELEMETRY_MP_STALE_TTL="5"), cwd=tmp_path)  # (5 s: see above)
    assert done.returncode == 0, done.stderr
    assert f"recording into {tmp_path / 'rel'};" in done.stdout, done.stdout
    log = server_log(tmp_path / "rel", port)  # it reaped the rank's store there, after the TTL
    assert "agent 'demo-agent-0'" in log, log


# -- progress line --------------------------------------------------------------------------------------------

def test_demo_totals_never_go_back_when_a_departed_store_is_reaped(tmp_path: Path) -> None:
    """A departed rank's store is reaped after the TTL; the demo's totals must not drop by its values."""
    directory, port = tmp_path / "mp", free_port()
    # A TTL of several of the demo's 1 s progress lines: the departed store must be seen before it is reaped
    # (with 1 s, a loaded demo once drew its next line after the reaping, and never counted the store).
    env = demo_env(tmp_path, NIXL_TELEMETRY_MP_STALE_TTL="3")
    with Reaper() as r:
        demo = r.spawn([*DEMO, "demo", "--ranks", "1", "--rate", "2", "--port", str(port),
                        "--dir", str(directory)], env)
        demo.wait_line(lambda line: "ranks recording into" in line, 30)
        departed = StoreWriter(directory, StoreIdentity("departed", "host", "9", 0, (10.0,)))
        departed.record(EventType.AGENT_TX_BYTES, 10**15)
        departed.record(EventType.AGENT_TX_REQUESTS_NUM, 10**6)
        departed.close()
        demo.wait_line(lambda line: "departed 1" in line and "transfers 1000" in line, 15)
        wait_until(lambda: http_get(f"http://127.0.0.1:{port}/metrics", timeout=2) and not departed.path.exists(),
                   15, "the owner rank to reap the departed store")
        seen = len(demo.lines)
        wait_until(lambda: len([x for x in demo.lines[seen:] if x.startswith("ranks live")]) >= 2, 15,
                   "two progress lines after the reaping")
        demo.killpg(signal.SIGINT)
        assert demo.popen.wait(timeout=20) == 0, demo.output  # (once its rank's final values were served: 3 s)
    out = demo.output.splitlines()
    progress = [line for line in out[:out.index("stopping the ranks (Ctrl-C again to stop at once)")]
                if line.startswith("ranks live")]
    transfers = [int(line.split("transfers ")[1].split()[0]) for line in progress]
    moved = [float(line.split(" GB moved")[0].rsplit(" ", 1)[1]) for line in progress]
    assert transfers == sorted(transfers) and moved == sorted(moved), progress
    assert transfers[-1] >= 10**6 and moved[-1] >= 1e6, progress  # the reaped store still counts
    assert "departed 1" in progress[-1], progress


# -- inspect --------------------------------------------------------------------------------------------------

def test_inspect_lists_invalid_stores_apart_by_file_name(cli: list[str], tmp_dir: Path) -> None:
    good = StoreWriter(tmp_dir, StoreIdentity("agent-ok", "host", "0", 0, (10.0,)))
    try:
        bad = tmp_dir / "nixl.1.2.3.mmap"
        bad.write_bytes(b"not a store")
        done = run(cli, "inspect", str(tmp_dir))
    finally:
        good.close()
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    agents = [line.split()[0] for line in lines[1:lines.index("")]]
    assert agents == ["agent-ok"], lines  # the table lists agents only
    invalid = lines[lines.index("") + 1:]
    assert invalid[0].split() == ["INVALID", "STORE", "PROBLEM"], invalid
    name, problem = invalid[1].split(None, 1)
    assert name == bad.name and problem.strip(), invalid


def test_inspect_lists_names_that_only_look_like_a_store_apart_unopened(cli: list[str], tmp_dir: Path) -> None:
    """nixl.<not a pid...>.mmap is not a store (docs/format.md): never "too small", never opened."""
    good = StoreWriter(tmp_dir, StoreIdentity("agent-ok", "host", "0", 0, (10.0,)))
    try:
        (tmp_dir / "nixl.backup.mmap").write_bytes(b"x")  # read as a store, it would be "too small"
        os.mkfifo(tmp_dir / "nixl.abc.mmap")  # opened as a store, it would be "not a regular file"
        done = run(cli, "inspect", str(tmp_dir))
        as_json = run(cli, "inspect", "--json", str(tmp_dir))
    finally:
        good.close()
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "INVALID STORE" not in done.stdout and "too small" not in done.stdout, lines
    heading = next(i for i, line in enumerate(lines) if line.startswith("NOT A STORE"))
    assert lines[heading + 1:heading + 3] == ["nixl.abc.mmap", "nixl.backup.mmap"], lines
    assert lines[heading - 1] == "" and lines[heading + 3] == "", lines
    # docs/operations.md shows the same heading, and says the names are not opened.
    page = (REPO / "docs" / "operations.md").read_text()
    assert f"\n{lines[heading]}\n" in page
    assert [row["store"] for row in json.loads(as_json.stdout)] == [good.path.name]


@pytest.mark.parametrize(("name", "value"), [
    ("NIXL_TELEMETRY_MP_STALE_TTL", "1e300"),  # was an 85-line traceback and "Worker failed to boot"
    ("NIXL_TELEMETRY_PROMETHEUS_PORT", "1_9111"),
    ("NIXL_TELEMETRY_MULTIPROC_DIR", "relative/mp"),
])
def test_gunicorn_refuses_a_bad_setting_in_one_line(tmp_path: Path, name: str, value: str) -> None:
    env = rank_env(tmp_path / "mp", free_port(), **{name: value})
    with Reaper() as r:
        proc = r.spawn(procfile_web_command(), env, cwd=REPO)
        assert proc.popen.wait(timeout=30) != 0
    assert "Traceback" not in proc.output, proc.output
    lines = proc.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nixl-prometheus-mp: error: "), lines
    assert name in lines[0] and repr(value) in lines[0], lines
    assert os.listdir(tmp_path) == [] and not (REPO / "relative").exists()
