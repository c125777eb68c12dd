"""Pods and containers: real PID namespaces (``unshare --pid --fork --mount-proc``), each container under tini, as
deploy/nixl-ranks.yaml's image runs.

* pod end: the gunicorn aggregator in a container of its own, started first; three ranks, one per container,
  counting a request every 20 ms; the pod ended in the kubelet's order (every rank container SIGTERMed, their
  exits awaited, then the sidecar's); an HA pair (scrapes every 1 s, 0.5 s apart) and a slower Prometheus
  (every 3 s), TTL 4 s: trials in which a scraper never saw some rank's final value, and how long after the
  last departed store's TTL the sidecar exited.
* the sidecar signalled twice: seconds from the second SIGTERM to its exit.
* a waiting aggregator as its container's PID 1 (another process holds the address): seconds from SIGTERM to
  its exit.
* zombies: a rank as its container's main process, its server and spare SIGKILLed five times (the recording
  rank starts another each time): zombies left, under tini and with the rank itself as PID 1.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from app.probe import SERVER_COMM, SPARE_COMM, is_address_server, listening_pids
from bench.common import ROOT, free_port, http_get, log, worker_env
from bench.scenarios import Results, Settings, _owner, _poll_until, _tempdir
from store import EventType, Snapshot, read_snapshot

POD_TRIALS = 10
POD_TTL_S = 4.0  # scaled down with the scrape intervals: a scrape every 3 s still lands within it
SCRAPERS = ((1.0, 0.0), (1.0, 0.5), (3.0, 0.25))  # (interval, offset): an HA pair and a slower Prometheus
SIDECAR_EXIT_TARGET_S = 1.0  # after the last departed store's TTL
WAITING_EXIT_TARGET_S = 1.0
KILLS = 5
CONTAINER = ("unshare", "--pid", "--fork", "--mount-proc")
COUNTING_RANK = """
import signal, threading
from app import Exporter
from store import EventType
stop = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: stop.set())
with Exporter("pod-rank") as exp:
    while not stop.wait(0.02):
        exp.export_event(EventType.AGENT_RX_REQUESTS_NUM, 1)
"""
AGGREGATOR = (sys.executable, "-m", "gunicorn", "-c", "python:app.gunicorn_conf", "app:wsgi")


def available() -> str | None:
    """Why the scenario cannot run here, or None."""
    if os.geteuid() != 0:
        return "a PID namespace needs root"
    missing = [tool for tool in ("unshare", "tini") if shutil.which(tool) is None]
    return f"{' and '.join(missing)} not installed" if missing else None


def pods(settings: Settings, results: Results) -> None:
    out: dict[str, Any] = results.pods
    why = available()
    if why is not None:
        out["skipped"] = why
        log(f"pods: skipped ({why})")
        return
    trials = 2 if settings.quick else POD_TRIALS
    out["end"] = [_pod_end(settings, trial) for trial in range(trials)]
    out["twice_s"] = _sidecar_signalled_twice(settings)
    out["waiting_s"] = _waiting_aggregator(settings)
    out["zombies"] = {init: _zombies(settings, init) for init in ("tini", "the rank itself")}


class _Container:
    """A process as a container's main process: a PID namespace of its own, under ``init``."""

    def __init__(self, command: tuple[str, ...], env: dict[str, str], init: tuple[str, ...] = ("tini", "--")) -> None:
        self.proc = subprocess.Popen([*CONTAINER, *init, *command], cwd=ROOT, env=worker_env(env),
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)

    def first_process(self) -> int:
        """The namespace's PID 1, as this namespace sees it: what a container runtime signals."""
        found = _poll_until(lambda: _children(self.proc.pid)[0] if _children(self.proc.pid) else None, 10.0, 0.01)
        if found is None:
            raise RuntimeError("the container's first process never started")
        return found[1]

    def terminate(self) -> None:
        os.kill(self.first_process(), signal.SIGTERM)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _env(directory: Path, port: int, **extra: str) -> dict[str, str]:
    return {"NIXL_TELEMETRY_MULTIPROC_DIR": str(directory), "NIXL_TELEMETRY_PROMETHEUS_PORT": str(port),
            "NIXL_TELEMETRY_PROMETHEUS_LOCAL": "y", "NIXL_TELEMETRY_MP_STALE_TTL": str(POD_TTL_S),
            "GUNICORN_WORKERS": "1", **extra}


def _counts(directory: Path) -> dict[str, int]:
    snaps = [read_snapshot(path) for path in directory.glob("nixl.*.mmap")]
    return {s.local_rank: s.counters[EventType.AGENT_RX_REQUESTS_NUM] for s in snaps if isinstance(s, Snapshot)}


class _Scraper:
    """A Prometheus: GET /metrics every ``interval_s``; keeps each answer's requests by local rank."""

    def __init__(self, port: int, interval_s: float, offset_s: float) -> None:
        self.port, self.interval_s, self.offset_s = port, interval_s, offset_s
        self.seen: list[dict[str, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self._stop.wait(self.offset_s)
        while not self._stop.is_set():
            try:
                status, body = http_get(self.port, timeout=2.0)
            except OSError:
                status, body = 0, b""
            if status == 200:
                self.seen.append(_requests_by_rank(body.decode()))
            self._stop.wait(self.interval_s)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)


def _requests_by_rank(text: str) -> dict[str, int]:
    out = {}
    for line in text.splitlines():
        if line.startswith("agent_rx_requests_num_total{"):
            labels, _, value = line.rpartition(" ")
            rank = labels.split('local_rank="', 1)[1].split('"', 1)[0] if 'local_rank="' in labels else ""
            out[rank] = int(float(value))
    return out


def _draining_until(port: int) -> float | None:
    """When the draining aggregator said it exits (epoch seconds), None while it says nothing of it."""
    for warning in json.loads(http_get(port, "/healthz", timeout=1.0)[1])["warnings"]:
        if warning["kind"] == "draining":
            return datetime.datetime.fromisoformat(warning["details"]["until"]).timestamp()
    return None


def _serving_standalone(port: int) -> bool | None:
    return _owner(port).get("mode") == "standalone" or None


def _pod_end(settings: Settings, trial: int) -> dict[str, Any]:
    port = free_port()
    with _tempdir(settings, "pod") as tmp:
        directory = tmp / "mp"
        sidecar = _Container(AGGREGATOR, _env(directory, port))
        ranks: list[_Container] = []
        scrapers: list[_Scraper] = []
        try:
            if _poll_until(lambda: _serving_standalone(port), 30.0, 0.05) is None:
                raise RuntimeError("the sidecar never served")
            ranks = [_Container((sys.executable, "-c", COUNTING_RANK), _env(directory, port, LOCAL_RANK=str(i)))
                     for i in range(3)]
            if _poll_until(lambda: len(_counts(directory)) == 3 or None, 30.0, 0.05) is None:
                raise RuntimeError("the ranks never recorded")
            scrapers = [_Scraper(port, interval, offset) for interval, offset in SCRAPERS]
            time.sleep(1.5)  # a job's last second and a half, scraped
            for rank in ranks:  # the kubelet: every app container at once, then the sidecar
                rank.terminate()
            for rank in ranks:
                rank.proc.wait(30)
            truth = _counts(directory)
            sidecar.terminate()
            until = _poll_until(lambda: _draining_until(port), 10.0, 0.01)  # the last departed store's TTL
            sidecar.proc.wait(POD_TTL_S + 30)
            exited = time.time()
        finally:
            for scraper in scrapers:
                scraper.close()
            for container in (*ranks, sidecar):
                container.kill()
    missed = [f"{s.interval_s:g} s" for s in scrapers
              if not any(all(seen.get(r) == v for r, v in truth.items()) for seen in s.seen)]
    lag_s = exited - until[1] if until is not None else float("inf")  # (no drain said: a failure of its own)
    log(f"pods: trial {trial + 1}: missed by {missed or 'nobody'}; the sidecar exited {lag_s:+.2f} s after the TTL")
    return {"missed": missed, "exit_after_ttl_s": lag_s}


def _sidecar_signalled_twice(settings: Settings) -> float:
    port = free_port()
    with _tempdir(settings, "pod-twice") as tmp:
        directory = tmp / "mp"
        sidecar = _Container(AGGREGATOR, _env(directory, port, NIXL_TELEMETRY_MP_STALE_TTL="600",
                                              NIXL_PROMETHEUS_MP_DRAIN_MAX="600"))
        rank: _Container | None = None
        try:
            _poll_until(lambda: _serving_standalone(port), 30.0, 0.05)  # (first: else the rank may win the address)
            rank = _Container((sys.executable, "-c", COUNTING_RANK), _env(directory, port, LOCAL_RANK="0",
                                                                          NIXL_TELEMETRY_MP_STALE_TTL="600"))
            _poll_until(lambda: len(_counts(directory)) == 1 or None, 30.0, 0.05)
            rank.terminate()
            rank.proc.wait(30)
            sidecar.terminate()
            _poll_until(lambda: _draining_until(port), 30.0, 0.05)
            started = time.monotonic()
            sidecar.terminate()
            sidecar.proc.wait(30)
            return time.monotonic() - started
        finally:
            if rank is not None:
                rank.kill()
            sidecar.kill()


def _waiting_aggregator(settings: Settings) -> float:
    port = free_port()
    with _tempdir(settings, "pod-waiting") as tmp:
        directory = tmp / "mp"
        rank = _Container((sys.executable, "-c", COUNTING_RANK), _env(directory, port, LOCAL_RANK="0"))
        waiting: _Container | None = None
        try:
            _poll_until(lambda: _owner(port).get("serving") == "helper" or None, 30.0, 0.05)
            waiting = _Container(AGGREGATOR, _env(directory, port), init=())  # the aggregator itself as PID 1
            pid_1 = waiting.first_process()
            # Waiting: the election held elsewhere, gunicorn's own handlers not installed yet.
            _poll_until(lambda: "gunicorn" in Path(f"/proc/{pid_1}/cmdline").read_text() or None, 30.0, 0.05)
            time.sleep(2.0)  # well into its wait for the address
            started = time.monotonic()
            os.kill(pid_1, signal.SIGTERM)
            waiting.proc.wait(30)
            return time.monotonic() - started
        finally:
            rank.kill()
            if waiting is not None:
                waiting.kill()


def _zombies(settings: Settings, init: str) -> int:
    port = free_port()
    with _tempdir(settings, "pod-zombies") as tmp:
        directory = tmp / "mp"
        rank = _Container((sys.executable, "-c", COUNTING_RANK), _env(directory, port, LOCAL_RANK="0"),
                          ("tini", "--") if init == "tini" else ())
        try:
            first = rank.first_process()
            address = f"127.0.0.1:{port}"
            for _ in range(KILLS):
                found = _poll_until(lambda: _server_and_spare(port, address), 30.0, 0.02)
                if found is None:
                    raise RuntimeError("no server and spare to kill")
                for pid in found[1]:
                    os.kill(pid, signal.SIGKILL)
            _poll_until(lambda: _server_and_spare(port, address), 30.0, 0.02)
            time.sleep(0.5)  # an init reaps within milliseconds
            return sum(1 for entry in Path("/proc").iterdir() if entry.name.isdigit() and _zombie_of(entry, first))
        finally:
            rank.kill()


def _server_and_spare(port: int, address: str) -> tuple[int, int] | None:
    holders = listening_pids(port)
    servers = [pid for pid in holders if is_address_server(pid, address, (SERVER_COMM,))]
    spares = [pid for pid in holders if is_address_server(pid, address, (SPARE_COMM,))]
    return (servers[0], spares[0]) if servers and spares else None


def _zombie_of(entry: Path, parent: int) -> bool:
    try:
        fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return False
    return fields[0] == "Z" and int(fields[1]) == parent


# -- the report ---------------------------------------------------------------------------------------------

def section(results: Results) -> list[str]:
    out = results.pods
    if not out:
        return []
    if "skipped" in out:
        return [f"**Pods and containers**: not measured ({out['skipped']})", ""]
    end = out["end"]
    lags = [trial["exit_after_ttl_s"] for trial in end]
    return [f"**Pods and containers** (real PID namespaces, every container under tini; TTL {POD_TTL_S:g} s)", "",
            f"Pod end with the sidecar, in the kubelet's order: a scraper (HA pair every 1 s, and every 3 s) missed "
            f"a rank's final value in {sum(1 for t in end if t['missed'])} of {len(end)} trials; the sidecar exited "
            f"{statistics.median(lags):+.2f} s after the last departed store's TTL (median; latest "
            f"{max(lags):+.2f} s). Signalled twice: exited {out['twice_s']:.2f} s after the second SIGTERM. A "
            f"waiting aggregator as PID 1: exited {out['waiting_s']:.2f} s after SIGTERM. Zombies after {KILLS} "
            "server and spare kills: " + ", ".join(f"{n} with {init} as PID 1" for init, n in out["zombies"].items()),
            ""]


def targets(results: Results) -> list[list[str]]:
    out = results.pods
    if not out or "skipped" in out:
        return []
    end = out["end"]
    missed = sum(1 for t in end if t["missed"])
    latest = max(t["exit_after_ttl_s"] for t in end)
    return [
        ["pod end with the sidecar: every scraper sees every rank's final value", f"{len(end) - missed} of "
         f"{len(end)} trials", "met" if missed == 0 else "NOT met"],
        [f"the sidecar exits within {SIDECAR_EXIT_TARGET_S:g} s after the last TTL", f"{latest:+.2f} s at most",
         "met" if latest <= SIDECAR_EXIT_TARGET_S else "NOT met"],
        ["the sidecar signalled twice exits at once (1 s)", f"{out['twice_s']:.2f} s",
         "met" if out["twice_s"] <= 1.0 else "NOT met"],
        [f"a waiting aggregator as PID 1 exits within {WAITING_EXIT_TARGET_S:g} s of SIGTERM",
         f"{out['waiting_s']:.2f} s", "met" if out["waiting_s"] <= WAITING_EXIT_TARGET_S else "NOT met"],
        ["zombies under tini after 5 server deaths: 0", str(out["zombies"]["tini"]),
         "met" if out["zombies"]["tini"] == 0 else "NOT met"],
    ]
