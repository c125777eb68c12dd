"""Helpers for multi-process tests: ports, processes, bounded waits, HTTP, exposition parsing, reaping.

The one home of ``free_port``, ``wait_until``, ``http_get`` and ``Reaper`` (support_e2e.py keeps what only the
end-to-end tests need, and imports these from here). Import from a test module with ``from support import ...``
(pytest puts ``tests/`` on ``sys.path``). The ``reaper`` and ``make_exporter`` fixtures are made available by
importing their definitions into the test module, then requested by name as usual::

    from support import make_exporter_fixture, reaper_fixture  # noqa: F401  (pytest fixtures)

A test that wants processes reaped before it goes on uses ``with Reaper() as r:`` instead.

Everything here is bounded: every wait has a deadline, every process started through a ``Reaper`` (a rank,
``Reaper.start``; a command in a process group of its own, ``Reaper.spawn``) is SIGKILLed -- its whole process
group where it leads one -- and waited for when the ``Reaper`` closes, whatever the test did.
"""

from __future__ import annotations

import contextlib
import fcntl
import gzip
import json
import os
import queue
import shlex
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
from prometheus_client.parser import text_string_to_metric_families

import store
from app.exposition import ENDPOINT_PREFIX

PROJECT_ROOT = Path(store.__file__).resolve().parents[1]
HOSTNAME = socket.gethostname()
DEADLINE_S = 10.0  # the default bound of every wait: generous, the machine is shared and loaded
START_DEADLINE_S = 20.0  # a fresh interpreter importing the app, on a loaded 2-core machine

T = TypeVar("T")
SeriesKey = tuple[str, frozenset[tuple[str, str]]]


# -- ports ----------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def directory_for(prefix: str, mode: int, uid: int | None = None) -> Iterator[Path]:
    """An ``mp`` directory of ``mode`` (owned by ``uid``, else root's) that any uid can reach: pytest's tmp_path
    is root's and 0700.  Needs root; skips the test otherwise."""
    if os.geteuid() != 0:
        pytest.skip("needs root to make a directory of another uid's, or one another uid cannot write")
    top = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        top.chmod(0o755)
        (top / "mp").mkdir()
        (top / "mp").chmod(mode)
        if uid is not None:
            os.chown(top / "mp", uid, uid)
        yield top / "mp"
    finally:
        shutil.rmtree(top)


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago (bind port 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def listening_socket(port: int) -> socket.socket:
    """A plain foreign socket bound and listening on 127.0.0.1:port (the caller closes it)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", port))
        sock.listen(8)
    except BaseException:
        sock.close()
        raise
    return sock


def can_bind(port: int, reuse: bool = True) -> bool:
    """Whether a new listener can bind 127.0.0.1:port now.

    With ``reuse`` (the default) it sets SO_REUSEADDR, as a taking-over owner binds: connections of a
    previous owner left in TIME_WAIT do not count, a listener does.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        if reuse:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(1)
    except OSError:
        return False
    finally:
        sock.close()
    return True


# -- bounded waits --------------------------------------------------------------------------------------------


def open_fds(pid: int | str = "self") -> dict[int, str]:
    """Process ``pid``'s descriptors (this process's by default) and what each is open on."""
    out = {}
    for name in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # (listdir's own, closed by now)
            out[int(name)] = os.readlink(f"/proc/{pid}/fd/{name}")
    return out


def wait_until(condition: Callable[[], T | None], timeout: float = DEADLINE_S,
               message: str | Callable[[], str] = "condition", *, interval: float = 0.02) -> T:
    """Call ``condition`` until it returns something truthy (returned); AssertionError after ``timeout`` s naming
    ``message`` (a callable is called only then, to describe the state at that time).

    Exceptions raised by ``condition`` count as "not yet" (the last one is reported on timeout).
    """
    deadline = time.monotonic() + timeout
    last_exc: BaseException | None = None
    while True:
        try:
            value = condition()
        except Exception as exc:
            last_exc = exc
        else:
            if value:
                return value
        if time.monotonic() >= deadline:
            detail = f" (last error: {last_exc!r})" if last_exc is not None else ""
            what = message() if callable(message) else message
            raise AssertionError(f"timed out after {timeout} s waiting for {what}{detail}")
        time.sleep(interval)


# -- HTTP -----------------------------------------------------------------------------------------------------


@dataclass
class HttpResponse:
    status: int
    headers: dict[str, str]  # lower-cased names
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode("utf-8")

    def json(self) -> Any:
        return json.loads(self.body)


def open_direct(request: urllib.request.Request | str, timeout: float,
                context: ssl.SSLContext | None = None) -> Any:
    """urlopen, but never through a proxy: every URL the tests open is on this host, and an http_proxy or
    https_proxy from the environment (many corporate shells set one) would not reach it."""
    handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
    if context is not None:
        handlers.append(urllib.request.HTTPSHandler(context=context))
    return urllib.request.build_opener(*handlers).open(request, timeout=timeout)


def http_request(url: str, method: str = "GET", headers: Mapping[str, str] | None = None,
                 timeout: float = 5.0, data: bytes | None = None) -> HttpResponse:
    """One request with urllib, never through a proxy; 4xx/5xx are returned, not raised. Connection errors raise
    OSError."""
    request = urllib.request.Request(url, method=method, headers=dict(headers or {}), data=data)
    try:
        with open_direct(request, timeout) as response:
            return HttpResponse(response.status, {k.lower(): v for k, v in response.headers.items()},
                                response.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return HttpResponse(exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read())


def http_get(url: str, headers: Mapping[str, str] | None = None, timeout: float = 5.0) -> HttpResponse:
    """GET ``url`` (never through a proxy); 4xx/5xx are returned, not raised."""
    return http_request(url, "GET", headers, timeout)


def get_json(url: str, timeout: float = 5.0) -> Any:
    """GET ``url``'s JSON document; fails the test unless 200."""
    response = http_get(url, timeout=timeout)
    if response.status != 200:
        raise AssertionError(f"GET {url}: HTTP {response.status}: {response.body[:300]!r}")
    return response.json()


def metrics_url(port: int, path: str = "/metrics") -> str:
    return f"http://127.0.0.1:{port}{path}"


def scrape(port: int, timeout: float = 5.0) -> str:
    """GET /metrics; the body as text (fails the test unless 200)."""
    response = http_get(metrics_url(port), timeout=timeout)
    assert response.status == 200, (response.status, response.body[:500])
    return response.text


def healthz(port: int, timeout: float = 5.0) -> dict[str, Any]:
    response = http_get(metrics_url(port, "/healthz"), timeout=timeout)
    assert response.status == 200, (response.status, response.body[:500])
    return response.json()


def try_scrape(port: int, timeout: float = 2.0) -> str | None:
    """The /metrics body if something answers 200 on the port right now, else None."""
    try:
        response = http_get(metrics_url(port), timeout=timeout)
    except OSError:
        return None
    return response.text if response.status == 200 else None


def wait_until_settled(port: int, environ: Mapping[str, str] | None = None, timeout: float = START_DEADLINE_S) -> None:
    """Wait (bounded) until the owner on ``port`` serves the way it will go on serving: from its address server
    (unless NIXL_PROMETHEUS_MP_SERVE=thread in ``environ``, default os.environ) or from a rank's thread."""
    env = os.environ if environ is None else environ
    final = "thread" if env.get(SERVE_ENV) == "thread" else "helper"
    wait_until(lambda: healthz(port)["owner"]["serving"] == final, timeout, message=f"the owner serving from a {final}")


def wait_for_metrics(port: int, timeout: float = DEADLINE_S) -> str:
    """Wait (bounded) until /metrics answers 200 on 127.0.0.1:port; its body."""
    return wait_until(lambda: try_scrape(port), timeout, message=f"/metrics answering on port {port}")


def gunzip(body: bytes) -> bytes:
    return gzip.decompress(body)


# -- exposition -----------------------------------------------------------------------------------------------


def parse_exposition(text: str, own: bool = False) -> dict[SeriesKey, float]:
    """Prometheus text exposition -> {(sample name, frozenset(labels.items())): value}: NIXL's series, and the
    endpoint's own (nixl_prometheus_mp_*: the job's live and departed ranks, draining) only when ``own``."""
    samples: dict[SeriesKey, float] = {}
    for family in text_string_to_metric_families(text):
        if not own and family.name.startswith(ENDPOINT_PREFIX):
            continue
        for sample in family.samples:
            key = (sample.name, frozenset(sample.labels.items()))
            assert key not in samples, f"duplicate series {key}"
            samples[key] = sample.value
    return samples


def series(name: str, **labels: object) -> SeriesKey:
    """A key of ``parse_exposition``'s result."""
    return name, frozenset((k, str(v)) for k, v in labels.items())


def pids_in(samples: Mapping[SeriesKey, float]) -> set[int]:
    """Every pid label in a parsed exposition."""
    return {int(v) for _, labels in samples for k, v in labels if k == "pid"}


def select_pid(samples: Mapping[SeriesKey, float], pid: int) -> dict[SeriesKey, float]:
    """The series of one process."""
    return {key: value for key, value in samples.items() if ("pid", str(pid)) in key[1]}


# -- processes ------------------------------------------------------------------------------------------------


# The serving mode the test runs in (the serve_mode fixture sets it): passed on to every rank and Exporter.
SERVE_ENV = "NIXL_PROMETHEUS_MP_SERVE"


def serve_mode_env() -> dict[str, str]:
    """{NIXL_PROMETHEUS_MP_SERVE: mode} where the test chose a serving mode (the serve_mode fixture), else {}."""
    return {SERVE_ENV: os.environ[SERVE_ENV]} if SERVE_ENV in os.environ else {}


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The test process's environment without any NIXL_* / LOCAL_RANK variable (but the serving mode the test
    chose), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NIXL_") and k != "LOCAL_RANK"}
    env.update(serve_mode_env())
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PROJECT_ROOT), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def kill_process(popen: subprocess.Popen[Any], leads_group: bool, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to the process group ``popen`` leads (what it started too: gunicorn's workers, the demo's
    ranks) if it leads one, else to the process alone while it is not reaped (its pid is not reused before)."""
    if leads_group:
        # (A group outlives its leader's reaping while a member lives, and its id is not reused before.)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(popen.pid, sig)
    elif popen.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(popen.pid, sig)


def kill_and_reap(popen: subprocess.Popen[Any], leads_group: bool, timeout: float = DEADLINE_S) -> int:
    """SIGKILL the process (its group where it leads one, ``kill_process``) and wait for it, bounded; its exit
    status."""
    kill_process(popen, leads_group)
    return popen.wait(timeout=timeout)


class RankProcess:
    """A Python subprocess speaking lines: ``send`` writes stdin, ``readline`` reads stdout (bounded).

    stderr goes to a file (never a pipe that could fill up), read back with ``stderr_text``. It stays in the test's
    process group (``leads_group`` False): killing it kills it alone.
    """

    leads_group = False

    def __init__(self, script: str, env: Mapping[str, str], args: tuple[str, ...] = ()) -> None:
        self._stderr = tempfile.TemporaryFile()  # closed in close()
        self.proc = subprocess.Popen([sys.executable, "-c", script, *args], cwd=PROJECT_ROOT, env=dict(env),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
                                     text=True, bufsize=1)
        self.pid = self.proc.pid
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read_stdout, name=f"rank-{self.pid}-stdout", daemon=True)
        self._reader.start()

    @property
    def popen(self) -> subprocess.Popen[str]:
        return self.proc

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        with contextlib.suppress(ValueError, OSError):
            for line in self.proc.stdout:
                self._lines.put(line.rstrip("\n"))
        self._lines.put(None)  # EOF

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def readline(self, timeout: float = DEADLINE_S) -> str:
        """The next stdout line; AssertionError on timeout or EOF (with the process's stderr)."""
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"pid {self.pid}: no output within {timeout} s; stderr:\n"
                                 f"{self.stderr_text()}") from None
        if line is None:
            self._lines.put(None)
            self.proc.wait(timeout=DEADLINE_S)
            raise AssertionError(f"pid {self.pid} exited (status {self.proc.returncode}) without answering; "
                                 f"stderr:\n{self.stderr_text()}")
        return line

    def stderr_text(self) -> str:
        try:  # pread: the offset is shared with the child's stderr, never move it
            fd = self._stderr.fileno()
            return os.pread(fd, os.fstat(fd).st_size, 0).decode("utf-8", errors="replace")
        except (OSError, ValueError):
            return ""

    def kill(self) -> None:
        """SIGKILL (if still running) and wait; the exit status is in ``proc.returncode``."""
        kill_and_reap(self.proc, self.leads_group)

    def close(self) -> None:
        self.kill()
        for stream in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError, ValueError):
                if stream is not None:
                    stream.close()
        self._reader.join(timeout=DEADLINE_S)
        self._stderr.close()


class Proc:
    """A command-line process in a session (so a process group) of its own, its stdout and stderr (one pipe)
    collected line by line by a thread; killing it kills its group (``leads_group`` True)."""

    leads_group = True

    def __init__(self, args: list[str], env: Mapping[str, str], cwd: Path = PROJECT_ROOT, stdin: bool = False) -> None:
        self.args = args
        self.popen = subprocess.Popen(args, env=dict(env), cwd=cwd, start_new_session=True, text=True,
                                      stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, name=f"proc-{self.pid}-output", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def _read(self) -> None:
        assert self.popen.stdout is not None
        with contextlib.suppress(ValueError, OSError):
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
        """Let a gated rank (``support_e2e.spawn_rank(..., gated=True)``) start recording."""
        assert self.popen.stdin is not None
        self.popen.stdin.write("go\n")
        self.popen.stdin.flush()

    def killpg(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the process group (the process and what it started)."""
        kill_process(self.popen, self.leads_group, sig)

    def stop(self, timeout: float = 5.0) -> int:
        """SIGTERM the group, SIGKILL whatever is left of it after ``timeout`` s (gunicorn's workers, ...), reap
        (bounded): the exit status."""
        if self.popen.poll() is None:
            self.killpg(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout=timeout)
        return self.close()

    def close(self) -> int:
        """SIGKILL the group and reap (bounded); the exit status."""
        returncode = kill_and_reap(self.popen, self.leads_group)
        self._reader.join(timeout=DEADLINE_S)
        with contextlib.suppress(OSError, ValueError):
            if self.popen.stdin is not None:
                self.popen.stdin.close()
        if not self._reader.is_alive():  # (else a process outside the group holds the pipe: the reader reads on)
            self.popen.stdout.close()  # type: ignore[union-attr]
        return returncode


class Reaper:
    """Owns every process started through it, a rank (``start``) or a command in its own process group
    (``spawn``): ``close()`` SIGKILLs them all -- the process group of those leading one -- then waits for each
    (bounded), always."""

    def __init__(self) -> None:
        self._processes: list[RankProcess | Proc] = []

    def start(self, script: str, env: Mapping[str, str], args: tuple[str, ...] = ()) -> RankProcess:
        """``python -c script *args`` with exactly ``env`` (``start_rank`` builds it from the test's)."""
        rank = RankProcess(script, env, args)
        self._processes.append(rank)
        return rank

    def spawn(self, args: list[str], env: Mapping[str, str], cwd: Path = PROJECT_ROOT, stdin: bool = False) -> Proc:
        """The command ``args`` with exactly ``env``, in a process group of its own (``stdin``: a pipe, else
        /dev/null)."""
        proc = Proc(args, env, cwd, stdin)
        self._processes.append(proc)
        return proc

    def close(self) -> None:
        processes, self._processes = self._processes, []
        for process in processes:  # all at once: none waits for another's end
            kill_process(process.popen, process.leads_group)
        errors = []
        for process in processes:
            try:
                process.close()
            except Exception as exc:  # keep reaping the others
                errors.append(exc)
        if errors:
            raise errors[0]

    def __enter__(self) -> Reaper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def lock_is_free(path: Path) -> bool:
    """Whether a new open file description can take the flock on ``path`` right now (what another rank would do:
    flock conflicts between open file descriptions, in one process or not)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def pids_alive(pids: list[int]) -> list[int]:
    """Those of ``pids`` that still exist as processes (zombies of ours count as gone)."""
    return [pid for pid in pids if process_state(pid) not in (None, "Z", "X")]


def process_state(pid: int) -> str | None:
    """The process's state letter (R, S, T, Z, ...), or None once it is gone (reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return None


def parent_of(pid: int) -> int | None:
    """The process's parent pid, or None once it is gone (reaped)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def children_of(pid: int) -> list[int]:
    """The pids of ``pid``'s child processes, zombies included (every process of /proc whose parent it is)."""
    return [int(entry) for entry in filter(str.isdigit, os.listdir("/proc")) if parent_of(int(entry)) == pid]


@pytest.fixture(name="reaper")
def reaper_fixture() -> Iterator[Reaper]:
    """A Reaper closed at teardown: every process the test started is killed and waited for."""
    with Reaper() as r:
        yield r


def start_rank(reaper: Reaper, script: str, env: Mapping[str, str] | None = None,
               args: tuple[str, ...] = ()) -> RankProcess:
    """Start ``python -c script`` with ``child_env(env)``, owned by ``reaper``."""
    return reaper.start(script, child_env(env), args)


# -- the exporter rank ----------------------------------------------------------------------------------------

# A rank that creates one Exporter from its environment and then obeys JSON commands on stdin, one JSON
# answer per command on stdout. RANK_AGENT names the agent, RANK_LOG_LEVEL configures logging on stderr
# (default WARNING), RANK_TICK_HZ > 0 starts a thread exporting AGENT_TX_REQUESTS_NUM=1 at that rate.
EXPORTER_RANK_SCRIPT = textwrap.dedent("""
    import json, logging, os, sys, threading
    logging.basicConfig(level=getattr(logging, os.environ.get("RANK_LOG_LEVEL", "WARNING")), stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    from app import Exporter
    from app.health import OwnerWatch

    if "RANK_OWNER_WATCH_NS" in os.environ:  # how often the duplicate-owner check may run (default 10 s)
        OwnerWatch.WATCH_INTERVAL_NS = int(os.environ["RANK_OWNER_WATCH_NS"])
    exp = Exporter(os.environ.get("RANK_AGENT", "agent"))

    def status(**extra):
        return {"pid": os.getpid(), "serving": exp.serving, "store": str(exp.store_path), **extra}

    def reply(doc):
        sys.stdout.write(json.dumps(doc) + "\\n")
        sys.stdout.flush()

    stop = threading.Event()
    hz = float(os.environ.get("RANK_TICK_HZ", "0"))
    ticker = None
    if hz > 0:
        def tick():
            while not stop.wait(1.0 / hz):
                exp.export_event(3, 1)  # AGENT_RX_REQUESTS_NUM
        ticker = threading.Thread(target=tick, daemon=True)
        ticker.start()

    def stop_ticking():  # joined, or an export already past stop.wait() lands after close() (and is warned of)
        stop.set()
        if ticker is not None:
            ticker.join()

    reply(status(ready=True))
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "events":
            for event, value in cmd["events"]:
                exp.export_event(event, value)
            reply(status())
        elif op == "status":
            reply(status())
        elif op == "hold_gil":  # one C call that keeps the GIL (as some extensions do), answered after it
            import ctypes
            reply(status(holding=True))
            ctypes.PyDLL(None).usleep(int(cmd["us"]))
            reply(status(held=True))
        elif op == "close":
            stop_ticking()
            exp.close()
            reply(status(closed=True))
        elif op == "exit":
            break
        else:
            reply({"error": f"unknown op {op!r}"})
    stop_ticking()
    exp.close()
""")


class ExporterRank:
    """Handle on a running EXPORTER_RANK_SCRIPT process."""

    def __init__(self, process: RankProcess, ready: dict[str, Any]) -> None:
        self.process = process
        self.pid: int = ready["pid"]
        self.store = Path(ready["store"])
        self.serving_at_start: bool = ready["serving"]

    def command(self, op: str, timeout: float = DEADLINE_S, **fields: Any) -> dict[str, Any]:
        self.process.send(json.dumps({"op": op, **fields}))
        answer = json.loads(self.process.readline(timeout))
        assert "error" not in answer, answer
        return answer

    def events(self, events: list[tuple[int, int]]) -> dict[str, Any]:
        return self.command("events", events=[[int(e), int(v)] for e, v in events])

    def serving(self) -> bool:
        return bool(self.command("status")["serving"])

    def stderr(self) -> str:
        return self.process.stderr_text()

    def kill(self) -> None:
        self.process.kill()


def start_exporter_rank(reaper: Reaper, directory: Path, port: int, agent: str = "agent",
                        extra_env: Mapping[str, str] | None = None, log_level: str = "WARNING",
                        tick_hz: float = 0) -> ExporterRank:
    """Start a rank process running one Exporter on 127.0.0.1:port over ``directory``; wait until ready."""
    env = {
        "NIXL_TELEMETRY_MULTIPROC_DIR": str(directory),
        "NIXL_TELEMETRY_PROMETHEUS_PORT": str(port),
        "NIXL_TELEMETRY_PROMETHEUS_LOCAL": "y",
        "RANK_AGENT": agent,
        "RANK_LOG_LEVEL": log_level,
        "RANK_TICK_HZ": str(tick_hz),
        **(extra_env or {}),
    }
    process = start_rank(reaper, EXPORTER_RANK_SCRIPT, env)
    ready = json.loads(process.readline(START_DEADLINE_S))
    assert ready.get("ready"), ready
    return ExporterRank(process, ready)


HOLD_FLOCK_SCRIPT = textwrap.dedent("""
    import fcntl, os, sys
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    print("locked", flush=True)
    sys.stdin.read()  # hold until killed or stdin closes
""")


def hold_flock(reaper: Reaper, path: Path) -> RankProcess:
    """A separate process holding flock(LOCK_EX) on ``path`` until it is reaped."""
    holder = start_rank(reaper, HOLD_FLOCK_SCRIPT, args=(str(path),))
    assert holder.readline(START_DEADLINE_S) == "locked"
    return holder


# -- in-process exporters -------------------------------------------------------------------------------------


def exporter_env(directory: Path, port: int, **extra: str) -> dict[str, str]:
    """The environment of an Exporter on 127.0.0.1:port over ``directory`` (for ``Exporter(name, env)``)."""
    return {
        "NIXL_TELEMETRY_MULTIPROC_DIR": str(directory),
        "NIXL_TELEMETRY_PROMETHEUS_PORT": str(port),
        "NIXL_TELEMETRY_PROMETHEUS_LOCAL": "y",
        **serve_mode_env(),
        **extra,
    }


@pytest.fixture(name="make_exporter")
def make_exporter_fixture() -> Iterator[Callable[..., Any]]:
    """``make_exporter(name, environ)``: an in-process Exporter closed at teardown (port freed)."""
    from app import Exporter

    made: list[Exporter] = []

    def build(agent_name: str, environ: Mapping[str, str]) -> Exporter:
        exporter = Exporter(agent_name, environ)
        made.append(exporter)
        return exporter

    yield build
    for exporter in made:
        exporter.close()


def proc_cpu_s(pid: int) -> float:
    """The CPU time (user + system, in seconds) process ``pid`` has used so far, from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# A child's census of what it must never inherit from a rank (a test's script defines it with this, at its top
# level): listening TCP sockets (a child's copy keeps the port bound once the rank's server or thread is gone)
# and descriptors of the election's lock file (a child's copy of a locked description keeps the address held).
HELD_DESCRIPTORS = textwrap.dedent("""
    def held():
        listening = set()
        for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
            for line in list(open(table))[1:]:
                fields = line.split()
                if fields[3] == "0A":
                    listening.add(fields[9])
        found = {"listeners": 0, "locks": 0}
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in listening:
                found["listeners"] += 1
            elif os.path.basename(target).startswith("nixl-owner.") and target.endswith(".lock"):
                found["locks"] += 1
        return found
""").lstrip()


def kill_server_and_spare(port: int) -> tuple[int, ...]:
    """SIGKILL the address server of 127.0.0.1:``port`` and its spare together (their pids), once the spare waits
    (one still starting would take the lock up after them): the server stopped first, so that it cannot start
    another spare between the two kills."""
    from app.probe import SPARE_COMM, is_address_server, listening_pids

    address = f"127.0.0.1:{port}"
    wait_for_spare(port)
    holders = listening_pids(port)
    servers = [pid for pid in holders if is_address_server(pid, address)]
    spares = [pid for pid in holders if is_address_server(pid, address, (SPARE_COMM,))]
    assert servers, f"no address server of {address} to kill"
    for pid in servers:
        os.kill(pid, signal.SIGSTOP)
    for pid in (*spares, *servers):
        os.kill(pid, signal.SIGKILL)
    return (*servers, *spares)


def wait_for_spare(port: int) -> int:
    """Wait (bounded) until the address server of 127.0.0.1:``port`` has a spare waiting; its pid."""
    from app.probe import SPARE_COMM, is_address_server, listening_pids

    def spare() -> int | None:
        return next((pid for pid in listening_pids(port)
                     if is_address_server(pid, f"127.0.0.1:{port}", (SPARE_COMM,))), None)
    return wait_until(spare, START_DEADLINE_S, message=f"a spare for 127.0.0.1:{port}")


def server_log(pid: int) -> str:
    """What address server ``pid`` wrote to its log file so far, read through its own descriptor (the file may
    have been deleted with its directory); "" if it has none."""
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if os.path.basename(target).startswith("nixl-server.") and ".log" in target:
                return Path(f"/proc/{pid}/fd/{fd}").read_text(errors="replace")
    return ""


class Scraper:
    """A Prometheus: GET /metrics every ``interval_s`` (after ``offset_s``) from a thread; keeps what each scrape
    saw, as ``read`` makes it of the exposition's text ({series key: value}), None for a failed scrape."""

    def __init__(self, port: int, interval_s: float, offset_s: float = 0.0,
                 read: Callable[[str], Mapping[Any, float]] = lambda text: {}) -> None:
        self.port, self.interval_s, self.offset_s, self.read = port, interval_s, offset_s, read
        self.scrapes: list[tuple[float, Mapping[Any, float] | None]] = []  # (monotonic, what it saw or None)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self._stop.wait(self.offset_s)
        while not self._stop.is_set():
            text = try_scrape(self.port, timeout=5.0)
            self.scrapes.append((time.monotonic(), None if text is None else self.read(text)))
            self._stop.wait(self.interval_s)

    def saw_since(self, since: float, truth: Mapping[Any, float]) -> bool:
        """Whether a scrape sent after ``since`` (CLOCK_MONOTONIC) saw every value of ``truth``."""
        return any(seen is not None and all(seen.get(key) == value for key, value in truth.items())
                   for at, seen in self.scrapes if at > since)

    def failures(self) -> int:
        return sum(seen is None for _, seen in self.scrapes)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(DEADLINE_S)
