"""Helpers for the process-level tests (CLI, gunicorn, real Prometheus, deploy/).

Everything here binds loopback only, waits with a deadline, and reaps what
it starts: every child gets its own session (process group), and
``Reaper`` SIGKILLs the whole group on the way out, whatever happened.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

from prometheus_client.parser import text_string_to_metric_families
from support import open_direct

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"  # the configurations operators are given, tested as shipped
VENV_BIN = Path(sys.executable).parent  # gunicorn, promtool-free tools of this interpreter
T = TypeVar("T")

# What a test rank records (see RANK_CODE): deterministic per local rank.
XFER_US = (30, 300, 3000)  # one value per rank (mod 3), each inside one default bucket
XFER_BUCKET = {30: (25.0, 50.0), 300: (250.0, 500.0), 3000: (2500.0, 5000.0)}
XFER_COUNT = 4


def expected(rank: int) -> dict[str, float]:
    """The values RANK_CODE records for ``rank``, by metric name."""
    xfer = XFER_US[rank % len(XFER_US)]
    return {
        "agent_tx_bytes_total": 1000.0 * (rank + 1),
        "agent_rx_bytes_total": 10.0 * (rank + 1),
        "agent_xfer_time_total": float(xfer * XFER_COUNT),
        "agent_xfer_time": float(xfer),
        "agent_xfer_time_us_count": float(XFER_COUNT),
        "agent_xfer_time_us_sum": float(xfer * XFER_COUNT),
        "agent_errors_total{status=backend}": float(rank + 1),
    }


# The children a test reads through Proc write their stderr into the same pipe as their stdout, and this
# machine's environment (CI's too) has PYTHONUNBUFFERED=1, under which print() writes its text and its newline
# in two write(2) calls: a log line of another thread (the library's, http.server's) landed between them once,
# and the line a test waited for never came ("ready127.0.0.1 - - ..."). One write(2) of a whole line, well
# under PIPE_BUF, is never split.
SAY_CODE = """
import os
def say(line):
    os.write(1, (line + "\\n").encode())
"""


# A rank: records the values above once, prints "ready <pid> serving=<bool>", then
# exports a no-op event every 50 ms (which re-runs the election, changing no
# value) and prints "serving=<bool>" on every change, until stdin closes or SIGTERM.
# Each line is one write(2) (SAY_CODE): see there.
RANK_CODE = SAY_CODE + """
import os, signal, sys, threading
from app import Exporter
from store import EventType

name, rank = sys.argv[1], int(sys.argv[2])
xfer_us, xfer_count = int(sys.argv[3]), int(sys.argv[4])
stop = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: stop.set())
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
with Exporter(name) as exp:
    exp.export_event(EventType.AGENT_TX_BYTES, 1000 * (rank + 1))
    exp.export_event(EventType.AGENT_RX_BYTES, 10 * (rank + 1))
    for _ in range(xfer_count):
        exp.export_event(EventType.AGENT_XFER_TIME, xfer_us)
    for _ in range(rank + 1):
        exp.record_error("backend")
    serving = exp.serving
    say(f"ready {os.getpid()} serving={serving}")
    while not stop.wait(0.05):
        exp.export_event(EventType.AGENT_TX_REQUESTS_NUM, 0)
        if exp.serving != serving:
            serving = exp.serving
            say(f"serving={serving}")
"""


def free_port() -> int:
    """A loopback port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(probe: Callable[[], T | None], timeout: float, what: str | Callable[[], str],
               interval: float = 0.05) -> T:
    """Poll ``probe`` until it returns something truthy; fail naming ``what`` after ``timeout`` s.

    ``what`` may be a callable, evaluated only on failure (to describe the state then).
    """
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while True:
        try:
            value = probe()
            if value:
                return value
        except (OSError, ValueError, KeyError, AssertionError, http.client.HTTPException) as exc:
            last_error = exc  # (HTTPException: a server that went away mid-answer, IncompleteRead)
        if time.monotonic() > deadline:
            if callable(what):
                what = what()
            raise AssertionError(f"timed out after {timeout} s waiting for {what} (last error: {last_error!r})")
        time.sleep(interval)


def http_get(url: str, headers: Mapping[str, str] | None = None, timeout: float = 5.0) -> tuple[int, dict[str, str],
                                                                                                 bytes]:
    """(status, headers, body), never through a proxy; HTTP errors are returned, not raised."""
    request = urllib.request.Request(url, headers=dict(headers or {}))
    try:
        with open_direct(request, timeout) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def get_json(url: str, timeout: float = 5.0) -> Any:
    status, _, body = http_get(url, timeout=timeout)
    if status != 200:
        raise AssertionError(f"GET {url}: HTTP {status}: {body[:300]!r}")
    return json.loads(body)


def parse_text(body: bytes) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Prometheus text 0.0.4 -> {(sample name, labels): value}."""
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def by_rank(samples: Mapping[tuple[str, frozenset[tuple[str, str]]], float], name: str,
            **match: str) -> dict[str, float]:
    """{local_rank: value} of the samples named ``name`` whose labels include ``match``."""
    out = {}
    for (sample, labels), value in samples.items():
        d = dict(labels)
        if sample == name and all(d.get(k) == v for k, v in match.items()):
            out[d.get("local_rank", "")] = value
    return out


def rank_env(directory: Path, port: int, **extra: str) -> dict[str, str]:
    """The environment of a rank (or aggregator) of one run, loopback-bound."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NIXL_TELEMETRY_")}
    env.update({
        "NIXL_TELEMETRY_MULTIPROC_DIR": str(directory),
        "NIXL_TELEMETRY_PROMETHEUS_PORT": str(port),
        "NIXL_TELEMETRY_PROMETHEUS_LOCAL": "y",
        "PYTHONPATH": str(REPO),
        "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    })
    env.pop("LOCAL_RANK", None)
    env.update(extra)
    return env


class Proc:
    """A child in its own process group, its output collected by a thread."""

    def __init__(self, args: list[str], env: Mapping[str, str], cwd: Path = REPO, stdin: bool = False) -> None:
        self.args = args
        self.popen = subprocess.Popen(args, env=dict(env), cwd=cwd, start_new_session=True, text=True,
                                      stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()

    def wait_line(self, predicate: Callable[[str], bool], timeout: float) -> str:
        """The first output line (so far or to come) satisfying ``predicate``."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for line in self.lines:
                    if predicate(line):
                        return line
                left = deadline - time.monotonic()
                if left <= 0 or (self.popen.poll() is not None and not self._reader.is_alive()):
                    raise AssertionError(f"{shlex.join(self.args)[:120]}: no matching line within {timeout} s "
                                         f"(exit status {self.popen.poll()}); output:\n" + self.output)
                self._cond.wait(min(left, 0.1))

    @property
    def output(self) -> str:
        with self._cond:
            return "\n".join(self.lines)

    def release(self) -> None:
        """Let a gated rank (``Reaper.rank(..., gated=True)``) start recording."""
        assert self.popen.stdin is not None
        self.popen.stdin.write("go\n")
        self.popen.stdin.flush()

    def killpg(self, sig: int = signal.SIGKILL) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, sig)

    def stop(self, timeout: float = 5.0) -> int:
        """SIGTERM the group, SIGKILL it after ``timeout``; always reaps."""
        if self.popen.poll() is None:
            self.killpg(signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        self.killpg(signal.SIGKILL)  # whatever of the group is left (gunicorn workers, ...)
        self.popen.wait(timeout=10)
        self._reader.join(timeout=5)
        return self.popen.returncode


class Reaper:
    """Starts children and guarantees they, and their process groups, are gone afterwards."""

    def __init__(self) -> None:
        self.procs: list[Proc] = []

    def start(self, args: list[str], env: Mapping[str, str], cwd: Path = REPO, stdin: bool = False) -> Proc:
        proc = Proc(args, env, cwd, stdin)
        self.procs.append(proc)
        return proc

    def rank(self, directory: Path, port: int, rank: int, name: str | None = None, gated: bool = False,
             **extra: str) -> Proc:
        """A RANK_CODE rank; wait for it with ``wait_ready``. ``gated``: its interpreter started and the library
        imported, it waits for ``Proc.release()`` to start recording (a start without the interpreter's)."""
        env = rank_env(directory, port, LOCAL_RANK=str(rank), **extra)
        xfer = XFER_US[rank % len(XFER_US)]
        code = f"import sys, app\nsys.stdin.readline()\n{RANK_CODE}" if gated else RANK_CODE
        return self.start([sys.executable, "-c", code, name or f"agent-{rank}", str(rank), str(xfer),
                           str(XFER_COUNT)], env, stdin=True)

    def close(self) -> None:
        for proc in self.procs:
            if proc.popen.stdin is not None:
                with contextlib.suppress(OSError):
                    proc.popen.stdin.close()
        for proc in reversed(self.procs):
            proc.stop()

    def __enter__(self) -> Reaper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def reaper() -> Iterator[Reaper]:
    r = Reaper()
    try:
        yield r
    finally:
        r.close()


def wait_ready(rank: Proc, timeout: float = 15.0) -> bool:
    """Wait for a RANK_CODE rank's "ready" line; True if it serves the address."""
    line = rank.wait_line(lambda s: s.startswith("ready "), timeout)
    return line.endswith("serving=True")


def procfile_web_command(procfile: Path = REPO / "Procfile") -> list[str]:
    """The Procfile's ``web:`` command, split as a shell would."""
    for line in procfile.read_text().splitlines():
        key, sep, command = line.partition(":")
        if sep and key.strip() == "web":
            return shlex.split(command)
    raise AssertionError(f"{procfile} has no web: line")


def shell_commands(markdown: str, heading: str) -> list[str]:
    """The non-comment lines of the sh blocks under ``## heading``."""
    section = markdown.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```sh\n(.*?)```", section, re.S)
    return [line for block in blocks for line in block.replace("\\\n", " ").splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def lock_is_free(path: Path) -> bool:
    """Whether a separate process could take the flock on ``path`` right now."""
    code = ("import fcntl, os, sys\nfd = os.open(sys.argv[1], os.O_RDONLY)\n"
            "try:\n    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\nexcept BlockingIOError:\n    sys.exit(3)\n")
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=30)
    if done.returncode not in (0, 3):
        raise AssertionError(f"lock probe failed: {done.stderr}")
    return done.returncode == 0


def pids_alive(pids: list[int]) -> list[int]:
    """Those of ``pids`` that still exist as processes (zombies of ours count as gone)."""
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            alive.append(pid)
    return alive


def children_of(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux /proc)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    out: list[int] = []
    for tid in tasks:
        with contextlib.suppress(OSError):
            out += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
    return out
