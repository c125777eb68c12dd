"""Who serves the address: the job's address server, through rank deaths, its own death and the job's end.

* rank death: four ranks recording 50 events/s, killed one by one (the one that started the server first),
  /metrics polled every 5 ms from another process: requests that failed, of all sent.
* server death: SIGKILL the address server of a job of idle (or recording) ranks, five times in a row; seconds
  until /metrics answers again, from a new server.  Also from a C++ owner (NIXL's plug-in), and in thread mode
  (the serving rank killed: its standby takes over).
* waiting: the CPU an idle standby uses while the server lives.
* job end: three ranks recording, ended five ways (closed at once, 50 and 150 ms apart with the starting rank
  first, 50 ms apart with it last, SIGKILLed at once), scraped by an HA pair (two scrapers 1 s apart) and an
  operator's curl right after the end: trials in which a scraper never saw some rank's final value.
* idle: after the job, unscraped, 200 departed stores: the server's CPU per second, and how long after the
  last store's TTL the port is free.
* new run: a rank of the same directory (failed scrapes across its start, polled every 20 ms), and of another
  directory on the same port (seconds from its Exporter's construction until its own server answers).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from app.config import SERVE_MODES
from bench.common import Worker, free_port, http_get, log
from bench.scenarios import (
    _UNANSWERED,
    Results,
    Settings,
    _ours_env,
    _owner,
    _plugin_env,
    _poll_until,
    _stop_all,
    _tempdir,
    _wait_serving,
)
from store import EventType, Snapshot, StoreIdentity, StoreWriter, read_snapshot

SUCCESSIVE_KILLS = 5
JOB_RANKS = 3
END_TTL_S = 5.0  # the job-end trials' TTL: each scraper has this long to see the final values
TARGET_S, GOAL_S = 0.5, 0.05
WAIT_CPU_TARGET_S = 0.05  # per 5 s
IDLE_CPU_TARGET_S = 0.05  # per second
FREE_AFTER_TTL_TARGET_S = 1.0
NEW_RUN_TARGET_S = 1.0
KINDS = {"idle": 0.0, "recording": 10.0}
ENDINGS = {"closed at once": (0.0, True, "close"), "50 ms apart, starting rank first": (0.05, True, "close"),
           "150 ms apart, starting rank first": (0.15, True, "close"),
           "50 ms apart, starting rank last": (0.05, False, "close"), "SIGKILLed at once": (0.0, True, "kill")}


def standby(settings: Settings, results: Results) -> None:
    out: dict[str, Any] = results.standby
    trials = 2 if settings.quick else 20
    for rep in range(max(1, settings.takeover_repeats // 3)):
        with _tempdir(settings, "rank-death") as directory:
            failed, sent = _rank_death(directory)
        out.setdefault("rank_death", []).append([failed, sent])
        log(f"rank death: {failed} of {sent} requests failed")
        for mode in SERVE_MODES if rep % 2 == 0 else SERVE_MODES[::-1]:
            for kind, rate in KINDS.items():
                with _tempdir(settings, f"server-death-{mode}") as directory:
                    figures = _successive_kills(directory, mode, rate, measure_cpu=rep == 0 and kind == "idle")
                out.setdefault("takeover", {}).setdefault(mode, {}).setdefault(kind, []).extend(figures["takeover"])
                if "cpu" in figures:
                    out.setdefault("cpu", {})[mode] = figures["cpu"]
                log(f"server death {mode} {kind}: " + ", ".join(f"{s * 1e3:.0f} ms" for s in figures["takeover"]))
        if importlib.util.find_spec("nixl_cu12") is not None:
            with _tempdir(settings, "standby-cpp") as directory:
                waited = _from_cpp_owner(directory)
            out.setdefault("takeover", {}).setdefault("helper", {}).setdefault("idle, C++ owner", []).append(waited)
            log(f"C++ owner killed: {waited * 1e3:.0f} ms")
    for trial in range(trials):
        for ending in ENDINGS if trial % 2 == 0 else list(ENDINGS)[::-1]:
            with _tempdir(settings, "job-end") as directory:
                lost = _job_end(directory, ending)
            out.setdefault("end", {}).setdefault(ending, []).append(lost)
            log(f"job end ({ending}): {'no loss' if not lost else f'{lost} scraper(s) missed a final value'}")
    with _tempdir(settings, "idle") as directory:
        out["idle"] = _idle(directory)
    log(f"idle server: {out['idle']['cpu_per_s']:.4f} CPU s per s, port free {out['idle']['free_after_ttl_s']:.2f} s "
        "after the TTL")
    with _tempdir(settings, "new-run") as directory, _tempdir(settings, "new-run-other") as other:
        out["new_run"] = _new_run(directory, other)
    log(f"new run: {out['new_run']['same_failed']} failed scrapes (same directory), served in "
        f"{out['new_run']['other_s'] * 1e3:.0f} ms (another directory)")


def _get(port: int, path: str = "/metrics", timeout: float = 5.0) -> tuple[int | None, bytes]:
    """One GET: (status, body), status None when nothing answered (refused, cut, timed out)."""
    try:
        return http_get(port, path, timeout=timeout)
    except _UNANSWERED:
        return None, b""


def _server_of(port: int) -> int:
    done = _poll_until(lambda: _owner(port)["server_pid"], 30, 0.01)
    if done is None:
        raise RuntimeError("no server answered")
    return int(done[1])


def _rank_death(directory: Path) -> tuple[int, int]:
    env = _ours_env(directory, free_port(), "helper")
    port = int(env["NIXL_TELEMETRY_PROMETHEUS_PORT"])
    workers = [Worker("rank", env, "50") for _ in range(4)]
    counts, stop = [0, 0], threading.Event()

    def poll() -> None:
        while not stop.is_set():
            counts[0 if _get(port)[0] == 200 else 1] += 1
            stop.wait(0.005)

    try:
        _server_of(port)
        starter = int(_owner(port)["started_by"])
        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        for worker in sorted(workers, key=lambda w: w.pid != starter):
            time.sleep(0.3)
            os.kill(worker.pid, signal.SIGKILL)
            worker.proc.wait()
        time.sleep(0.3)
        stop.set()
        poller.join()
        return counts[1], sum(counts)
    finally:
        _stop_all(workers)


def _successive_kills(directory: Path, mode: str, rate: float, measure_cpu: bool) -> dict[str, Any]:
    """Helper mode: SIGKILL the address server; thread mode: the serving rank.  Seconds until served again."""
    env = _ours_env(directory, free_port(), mode)
    port = int(env["NIXL_TELEMETRY_PROMETHEUS_PORT"])
    workers = [Worker("rank", env, str(rate)) for _ in range(SUCCESSIVE_KILLS + 1)]
    by_pid = {w.pid: w for w in workers}
    figures: dict[str, Any] = {"takeover": []}
    try:
        if _wait_serving(port, 10) is None:
            raise RuntimeError("the job never served")
        if measure_cpu:
            idle = next(w for w in workers if w.pid != _owner(port)["started_by"])
            before = _cpu_s(idle.pid)
            time.sleep(5.0)
            figures["cpu"] = _cpu_s(idle.pid) - before
        for _ in range(SUCCESSIVE_KILLS):
            time.sleep(0.3)
            server = _server_of(port)
            os.kill(server, signal.SIGKILL)
            if mode == "thread":  # the serving rank itself
                by_pid.pop(server).proc.wait()
            waited = _wait_serving(port, 10, gone=server)
            figures["takeover"].append(float("inf") if waited is None else waited)
    finally:
        _stop_all(workers)
    return figures


def _from_cpp_owner(directory: Path) -> float:
    """A C++ rank (NIXL's plug-in) owns the address, two idle Python ranks stand by; SIGKILL the C++ rank."""
    port = free_port()
    cpp = Worker("plugin-owner", _plugin_env(directory, port))
    workers = [cpp]
    try:
        if _wait_serving(port, 10) is None:
            raise RuntimeError("the C++ rank never served")
        workers += [Worker("rank", _ours_env(directory, port, "helper"), "0") for _ in range(2)]
        os.kill(cpp.pid, signal.SIGKILL)
        cpp.proc.wait()
        waited = _wait_serving(port, 10)
        return float("inf") if waited is None else waited
    finally:
        _stop_all(workers)


class _Scraper:
    """One Prometheus of an HA pair: scrapes every second; every answer's agent_tx_bytes_total by pid."""

    def __init__(self, port: int, offset_s: float) -> None:
        self.port = port
        self.seen: list[tuple[float, dict[int, int] | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(offset_s,), daemon=True)
        self._thread.start()

    def _run(self, offset_s: float) -> None:
        self._stop.wait(offset_s)
        while not self._stop.is_set():
            status, body = _get(self.port)
            self.seen.append((time.monotonic(), _tx_bytes(body.decode()) if status == 200 else None))
            self._stop.wait(1.0)

    def saw(self, since: float, truth: dict[int, int]) -> bool:
        return any(v is not None and all(v.get(pid) == n for pid, n in truth.items())
                   for at, v in self.seen if at > since)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def _job_end(directory: Path, ending: str) -> int:
    """How many of the two scrapers never saw some rank's final value before the TTL."""
    spacing_s, starter_first, how = ENDINGS[ending]
    env = {**_ours_env(directory, free_port(), "helper"), "NIXL_TELEMETRY_MP_STALE_TTL": str(END_TTL_S)}
    port = int(env["NIXL_TELEMETRY_PROMETHEUS_PORT"])
    workers = [Worker("rank", env, "50") for _ in range(JOB_RANKS)]
    scrapers: list[_Scraper] = []
    try:
        _server_of(port)
        starter = int(_owner(port)["started_by"])
        scrapers = [_Scraper(port, 0.0), _Scraper(port, 0.5)]
        time.sleep(1.5)
        for worker in sorted(workers, key=lambda w: (w.pid == starter) != starter_first):
            if how == "close":
                worker.send("close")
            else:
                os.kill(worker.pid, signal.SIGKILL)
            if spacing_s:
                time.sleep(spacing_s)
        if how == "close":
            for worker in workers:
                worker.receive()
        _stop_all(workers)
        ended = time.monotonic()
        _get(port)  # an operator's curl right after the end
        snaps = [read_snapshot(path) for path in directory.glob("nixl.*.mmap")]
        truth = {s.pid: s.counters[EventType.AGENT_TX_BYTES] for s in snaps if isinstance(s, Snapshot)}
        deadline = ended + END_TTL_S
        while time.monotonic() < deadline and not all(s.saw(ended, truth) for s in scrapers):
            time.sleep(0.05)
        return sum(not s.saw(ended, truth) for s in scrapers) if len(truth) == JOB_RANKS else len(scrapers)
    finally:
        for scraper in scrapers:
            scraper.close()
        _stop_all(workers)


def _idle(directory: Path) -> dict[str, float]:
    ttl_s = 6.0
    for instance in range(200):
        StoreWriter(directory, StoreIdentity("departed", "host", "", instance, (10.0, 100.0))).close()
    env = {**_ours_env(directory, free_port(), "helper"), "NIXL_TELEMETRY_MP_STALE_TTL": str(ttl_s)}
    port = int(env["NIXL_TELEMETRY_PROMETHEUS_PORT"])
    rank = Worker("rank", env, "0")
    try:
        server = _server_of(port)
        rank.call("close")
        time.sleep(0.5)
        before = _cpu_s(server)
        time.sleep(4.0)
        cpu_per_s = (_cpu_s(server) - before) / 4.0
        snaps = [read_snapshot(path) for path in directory.glob("nixl.*.mmap")]
        expiry_s = max(s.last_update_ns for s in snaps if isinstance(s, Snapshot)) / 1e9 + ttl_s
        done = _poll_until(lambda: _get(port, "/healthz", timeout=0.5)[0] is None or None, 30, 0.01)
        free_after = float("inf") if done is None else done[0] - expiry_s
        return {"cpu_per_s": cpu_per_s, "free_after_ttl_s": free_after}
    finally:
        _stop_all([rank])


def _new_run(directory: Path, other: Path) -> dict[str, Any]:
    env = _ours_env(directory, free_port(), "helper")
    port = int(env["NIXL_TELEMETRY_PROMETHEUS_PORT"])
    workers = [Worker("rank", env, "0")]
    try:
        _server_of(port)
        workers[0].call("close")
        failed, stop = [0], threading.Event()

        def poll() -> None:
            while not stop.is_set():
                failed[0] += _get(port)[0] != 200
                stop.wait(0.02)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        workers.append(Worker("rank", env, "0"))
        _poll_until(lambda: workers[1].pid in _tx_bytes(_get(port)[1].decode()) or None, 10, 0.02)
        stop.set()
        poller.join()
        workers[1].call("close")
        newcomer = Worker("rank", {**env, "NIXL_TELEMETRY_MULTIPROC_DIR": str(other)}, "0")
        workers.append(newcomer)
        done = _poll_until(lambda: json.loads(_get(port, "/healthz")[1])["directory"] == str(other) or None,
                           10, 0.002)
        return {"same_failed": failed[0], "other_s": float("inf") if done is None else
                done[0] - newcomer.hello["constructing"]}
    finally:
        _stop_all(workers)


def _tx_bytes(text: str) -> dict[int, int]:
    out = {}
    for line in text.splitlines():
        if line.startswith("agent_tx_bytes_total{"):
            labels, _, value = line.rpartition(" ")
            pid = int(labels.split('pid="', 1)[1].split('"', 1)[0])
            out[pid] = int(float(value))
    return out


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- the report ---------------------------------------------------------------------------------------------


def _ms(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values) * 1e3:.0f} ms (max {max(values) * 1e3:.0f})"


def section(results: Results) -> list[str]:
    out = results.standby
    if not out:
        return []
    lines = ["**Who serves the address** (helper: SIGKILL of the address server; thread: of the serving rank; five "
             f"in a row per job of {SUCCESSIVE_KILLS + 1} ranks; until /metrics answers from another process)", "",
             "| ranks | helper | thread |", "| --- | --- | --- |"]
    for kind in (*KINDS, "idle, C++ owner"):
        cells = [_ms(out.get("takeover", {}).get(mode, {}).get(kind, [])) for mode in SERVE_MODES]
        lines.append(f"| {kind} | {' | '.join(cells)} |")
    cpu = out.get("cpu", {})
    deaths = out.get("rank_death", [])
    lines += ["", "An idle standby's CPU over 5 s: "
              + ", ".join(f"{m} {cpu[m]:.3f} s" for m in SERVE_MODES if m in cpu),
              "", "Rank death (four ranks killed one by one, polled every 5 ms): " + ", ".join(
                  f"{failed} of {sent} failed" for failed, sent in deaths),
              "", "Job end, trials in which a scraper of the HA pair missed a final value: " + ", ".join(
                  f"{ending}: {sum(1 for lost in v if lost)} of {len(v)}" for ending, v in out.get("end", {}).items())]
    idle = out.get("idle")
    if idle:
        lines += ["", f"Idle server (200 departed stores, unscraped): {idle['cpu_per_s']:.4f} CPU s per s; the port "
                  f"free {idle['free_after_ttl_s']:.2f} s after the TTL"]
    new_run = out.get("new_run")
    if new_run:
        lines += ["", f"New run: {new_run['same_failed']} failed scrapes across a rank's start in the same directory; "
                  f"another directory's rank served in {new_run['other_s'] * 1e3:.0f} ms"]
    return [*lines, ""]


def targets(results: Results) -> list[list[str]]:
    out = results.standby
    if not out:
        return []
    rows = []
    deaths = out.get("rank_death", [])
    if deaths:
        failed = sum(f for f, _ in deaths)
        rows.append(["rank death, the starting rank's included: no failed request (polled every 5 ms)",
                     f"{failed} of {sum(s for _, s in deaths)}", _met(failed == 0)])
    takeover = out.get("takeover", {})
    for mode in SERVE_MODES:
        for kind, label in (("idle", "every rank idle"), ("recording", "standbys recording 10/s"),
                            ("idle, C++ owner", "a C++ owner, idle Python standbys")):
            values = takeover.get(mode, {}).get(kind, [])
            if values:
                median = statistics.median(values)
                who = "the address server" if mode == "helper" and "C++" not in kind else "the owner"
                rows.append([f"{who} SIGKILLed, {label} ({mode}): served again within {TARGET_S * 1e3:.0f} ms",
                             f"{median * 1e3:.0f} ms median", _met(median <= TARGET_S)])
    for mode, used in out.get("cpu", {}).items():
        rows.append([f"an idle standby's CPU per 5 s ({mode}): under {WAIT_CPU_TARGET_S} s", f"{used:.3f} s",
                     _met(used < WAIT_CPU_TARGET_S)])
    for ending, losses in out.get("end", {}).items():
        lost = sum(1 for v in losses if v)
        rows.append([f"job end, ranks {ending}: every final value at both scrapers of an HA pair",
                     f"{lost} of {len(losses)} trials lost some", _met(lost == 0)])
    idle = out.get("idle")
    if idle:
        rows.append([f"idle server with 200 departed stores: at most {IDLE_CPU_TARGET_S} CPU s per s",
                     f"{idle['cpu_per_s']:.4f} s", _met(idle["cpu_per_s"] <= IDLE_CPU_TARGET_S)])
        rows.append([f"the address free within {FREE_AFTER_TTL_TARGET_S:.0f} s after the TTL",
                     f"{idle['free_after_ttl_s']:.2f} s", _met(idle["free_after_ttl_s"] <= FREE_AFTER_TTL_TARGET_S)])
    new_run = out.get("new_run")
    if new_run:
        rows.append(["a new run in the same directory: no failed scrape", str(new_run["same_failed"]),
                     _met(new_run["same_failed"] == 0)])
        rows.append([f"a new run of another directory on the same port: served within {NEW_RUN_TARGET_S:.0f} s",
                     f"{new_run['other_s'] * 1e3:.0f} ms", _met(new_run["other_s"] <= NEW_RUN_TARGET_S)])
    return rows


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"
