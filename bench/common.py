"""Helpers shared by the scenarios: workers, statistics, the machine, HTTP."""

from __future__ import annotations

import datetime
import gzip
import http.client
import json
import os
import platform
import select
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

# Variables that would switch a worker into the other implementation's mode.
_FOREIGN_ENV = ("PROMETHEUS_MULTIPROC_DIR", "prometheus_multiproc_dir", "NIXL_TELEMETRY_MULTIPROC_DIR",
                "NIXL_TELEMETRY_PROMETHEUS_PORT", "NIXL_TELEMETRY_PROMETHEUS_LOCAL", "NIXL_TELEMETRY_ENABLED_METRICS",
                "NIXL_TELEMETRY_HISTOGRAM_BUCKETS_US", "LOCAL_RANK", "NIXL_TELEMETRY_RANK_ENV")


def worker_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """A clean environment for a worker: the project importable, neither mode pre-selected."""
    env = {k: v for k, v in os.environ.items() if k not in _FOREIGN_ENV}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.update(extra or {})
    return env


class Worker:
    """A ``python -m bench.worker KIND`` subprocess answering JSON-line commands."""

    def __init__(self, kind: str, env: Mapping[str, str] | None = None, *args: str) -> None:
        self.kind = kind
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.worker", kind, *args], cwd=ROOT, env=worker_env(env),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self.hello = self.receive()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def receive(self) -> dict[str, Any]:
        """The worker's next reply (to a command sent with send())."""
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait(timeout=30)
            raise RuntimeError(f"worker {self.kind} exited ({code}) without answering")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"worker {self.kind}: {reply['error']}")
        return reply

    def send(self, op: str, **args: Any) -> None:
        """A command whose reply is read later (receive()), for a worker that answers only once it is done."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        self.send(op, **args)
        return self.receive()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def median(values: Iterable[float]) -> float:
    data = list(values)
    return statistics.median(data) if data else float("nan")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# What Prometheus 3.x sends when it scrapes (scrape_protocols at their defaults).
PROMETHEUS_HEADERS: Mapping[str, str] = {
    "Accept": "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.5,"
              "application/openmetrics-text;version=0.0.1;q=0.4,text/plain;version=1.0.0;escaping=allow-utf-8;q=0.3,"
              "text/plain;version=0.0.4;q=0.2,*/*;q=0.1",
    "Accept-Encoding": "gzip",
}


def http_get(port: int, path: str = "/metrics", timeout: float = 120.0,
             headers: Mapping[str, str] | None = None) -> tuple[int, bytes]:
    """One GET on a fresh connection, body read to the end (as sent: still compressed if it was)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path, headers=dict(headers or {}))
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def timed_get(port: int, headers: Mapping[str, str] | None = None) -> tuple[float, bytes]:
    """Seconds for one GET /metrics (connect, request, the whole body), and the body as sent."""
    start = time.perf_counter()
    status, body = http_get(port, headers=headers)
    elapsed = time.perf_counter() - start
    if status != 200:
        raise RuntimeError(f"GET /metrics on port {port} answered {status}")
    return elapsed, body


class Persistent:
    """One client connection kept across GETs, as Prometheus keeps one per target: http.client opens a new one
    only when the server closed the last (the time of that reconnection is then part of the scrape's)."""

    def __init__(self, port: int, timeout: float = 120.0) -> None:
        self._conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        self.connections = 0  # opened so far

    def get(self, headers: Mapping[str, str] | None = None, path: str = "/metrics") -> tuple[float, bytes]:
        """Seconds for one GET (a new connection's connect included, where one was needed), and the body."""
        start = time.perf_counter()
        # As Go's client (Prometheus's) does: a connection the server closed is not reused, and a request that
        # finds it closed before any answer is sent again on a new one.
        if self._conn.sock is not None and _closed_by_peer(self._conn.sock):
            self._conn.close()
        reused = self._conn.sock is not None
        try:
            response = self._request(path, headers)
        except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
            if not reused:
                raise
            self._conn.close()
            response = self._request(path, headers)
        body = response.read()
        elapsed = time.perf_counter() - start
        if response.status != 200:
            raise RuntimeError(f"GET {path} answered {response.status}")
        return elapsed, body

    def _request(self, path: str, headers: Mapping[str, str] | None) -> http.client.HTTPResponse:
        if self._conn.sock is None:
            self.connections += 1
        self._conn.request("GET", path, headers=dict(headers or {}))
        return self._conn.getresponse()

    def close(self) -> None:
        self._conn.close()


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether the server has closed a connection that waits between two requests (it then reads as EOF)."""
    if not select.select([sock], [], [], 0)[0]:
        return False
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def answered_on_one_connection(port: int, requests: int, headers: Mapping[str, str] | None = None) -> int:
    """How many of ``requests`` GETs, sent one after the other on a persistent client, the first connection
    answered before the server closed it."""
    client = Persistent(port)
    try:
        for sent in range(requests):
            client.get(headers)
            if client.connections > 1:
                return sent
        return requests
    finally:
        client.close()


def eof_after_body(port: int, timeout: float = 120.0) -> float:
    """Seconds from the last byte of an answer's body (GET /metrics, Connection: close) to the server's EOF, as
    the client sees them; NaN for an answer without Content-Length (its end is the EOF)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(1 << 16)
            if not chunk:
                raise RuntimeError(f"port {port} closed before its answer's headers")
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        lengths = [line.split(b":", 1)[1] for line in head.split(b"\r\n")[1:]
                   if line.lower().startswith(b"content-length:")]
        if not lengths:
            return float("nan")
        left = int(lengths[0]) - len(body)
        while left > 0:
            chunk = sock.recv(1 << 20)
            if not chunk:
                raise RuntimeError(f"port {port} closed before the end of its answer's body")
            left -= len(chunk)
        body_done = time.perf_counter()
        while sock.recv(1 << 16):
            pass
        return time.perf_counter() - body_done


def decoded(body: bytes) -> bytes:
    """A body as the scraper reads it (gunzipped if it was sent compressed)."""
    return gzip.decompress(body) if body[:2] == b"\x1f\x8b" else body


def sample_lines(body: bytes) -> int:
    return sum(1 for line in body.split(b"\n") if line and not line.startswith(b"#"))


def read_status_kib(pid: int | str, field: str) -> int:
    """A ``VmRSS``-like field of /proc/<pid>/status, in KiB."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def process_gone(pid: int) -> bool:
    """Whether ``pid`` has exited: no longer in /proc, or a zombie (dead, its parent not having reaped it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rpartition(")")[2].split()[0] in ("Z", "X")


def filesystem_of(path: Path) -> str:
    """The type of the filesystem holding ``path`` (longest mount-point match in /proc/mounts)."""
    best, kind = "", "?"
    target = str(path.resolve())
    try:
        with open("/proc/mounts") as mounts:
            for line in mounts:
                parts = line.split()
                point = parts[1]
                if (target == point or target.startswith(point.rstrip("/") + "/")) and len(point) > len(best):
                    best, kind = point, parts[2]
    except OSError:
        pass
    return kind


def machine() -> dict[str, str]:
    model = "?"
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    versions = {}
    for dist in ("prometheus_client", "werkzeug"):
        try:
            from importlib.metadata import version

            versions[dist] = version(dist)
        except Exception:  # pragma: no cover - reporting only
            versions[dist] = "?"
    try:
        load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        load = "?"
    return {
        "nproc": str(os.cpu_count()),
        "cpu": model,
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "kernel": platform.release(),
        "prometheus_client": versions["prometheus_client"],
        "werkzeug": versions["werkzeug"],
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "load_at_start": load,
    }


def ratio(reference: float, ours: float) -> float:
    return reference / ours if ours > 0 else float("inf")


def fmt_ratio(value: float) -> str:
    return f"{value:.1f}x"


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def log(message: str) -> None:
    """Progress on stderr, so stdout stays the report."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)
