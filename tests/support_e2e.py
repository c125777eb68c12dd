"""What the process-level tests (CLI, gunicorn, real Prometheus, deploy/) have of their own: the values their
ranks record (RANK_CODE, ``expected``), a rank's environment, the Procfile's and the docs' commands.

Ports, processes, waits, HTTP and reaping are support.py's (``free_port``, ``wait_until``, ``http_get``,
``Reaper``...): every process is started through a ``support.Reaper``, in a session (process group) of its own
(``Reaper.spawn``), and its whole group is SIGKILLed and reaped on the way out, whatever happened.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
from support import PROJECT_ROOT, Proc, Reaper, children_of, wait_until

REPO = PROJECT_ROOT
DEPLOY = REPO / "deploy"  # the configurations operators are given, tested as shipped
VENV_BIN = Path(sys.executable).parent  # gunicorn, promtool-free tools of this interpreter

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


def spawn_rank(r: Reaper, directory: Path, port: int, rank: int, name: str | None = None, gated: bool = False,
               **extra: str) -> Proc:
    """A RANK_CODE rank started through ``r`` (in a process group of its own); wait for it with ``wait_ready``.
    ``gated``: its interpreter started and the library imported, it waits for ``Proc.release()`` to start
    recording (a start without the interpreter's)."""
    env = rank_env(directory, port, LOCAL_RANK=str(rank), **extra)
    xfer = XFER_US[rank % len(XFER_US)]
    code = f"import sys, app\nsys.stdin.readline()\n{RANK_CODE}" if gated else RANK_CODE
    return r.spawn([sys.executable, "-c", code, name or f"agent-{rank}", str(rank), str(xfer), str(XFER_COUNT)], env,
                   stdin=True)


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


def kubelet_stop(containers: Sequence[Proc], sidecars: Sequence[Proc] = (), timeout: float = 60.0,
                 between: Callable[[], object] = lambda: None) -> None:
    """A pod's end, in the kubelet's order: SIGTERM to every app container at once, each one's exit awaited
    (exit status 0), then ``between()`` (to read what the ranks left, before a sidecar reaps it after the TTL),
    then SIGTERM to the sidecars, the last started first, each awaited in turn.

    A container here is a process started as ``unshare --pid --fork ... COMMAND``: the runtime signals the
    namespace's first process (the child ``unshare`` forked), not ``unshare``; any other process is signalled
    itself.  ``timeout``: how long each may take (a sidecar drains up to the TTL).
    """
    def first_process(proc: Proc) -> int:
        if proc.popen.args[0] != "unshare":
            return proc.pid
        return wait_until(lambda: next(iter(children_of(proc.pid)), None), message="the container's first process")

    for proc in containers:
        os.kill(first_process(proc), signal.SIGTERM)
    for proc in containers:
        assert proc.popen.wait(timeout) == 0, proc.output
    between()
    for proc in reversed(sidecars):
        os.kill(first_process(proc), signal.SIGTERM)
        assert proc.popen.wait(timeout) == 0, proc.output
