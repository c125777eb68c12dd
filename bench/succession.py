"""Who serves the address: the job's address server and its spare, through rank deaths, the server's own death
and stop, and the job's end.

* rank death: four ranks recording 50 events/s, killed one by one (the one that started the server first),
  /metrics polled every 5 ms from another process: requests that failed, of all sent.
* server death: SIGKILL the address server of a job of idle (or recording) ranks, or of a Python rank and C++
  ranks (NIXL's plug-in) writing beside it, five times in a row, /metrics polled every 5 ms on fresh
  connections: requests that failed once the server was dead, milliseconds until its spare answered /healthz
  as the server, and until the spare had a spare of its own.  A stopped server (SIGSTOP): seconds until its
  spare serves, failed requests meanwhile.  A C++ owner killed: until a recording Python rank serves.  Thread
  mode: the serving rank killed, until a recording rank serves.
* waiting: the CPU a rank that lost, and a spare, use while the server lives.
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

from app.probe import SERVER_COMM, SPARE_COMM, is_address_server, listening_pids, signal_address_server
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
SPARE_ANSWERS_TARGET_S, NEW_SPARE_TARGET_S, STOPPED_TARGET_S = 0.5, 1.0, 4.0
JOB_RANKS = 3
END_TTL_S = 5.0  # the job-end trials' TTL: each scraper has this long to see the final values
TARGET_S, GOAL_S = 0.5, 0.05
WAIT_CPU_TARGET_S = 0.05  # per 5 s
IDLE_CPU_TARGET_S = 0.05  # per second
FREE_AFTER_TTL_TARGET_S = 1.0
NEW_RUN_TARGET_S = 1.0
KINDS = {"idle": 0.0, "recording": 10.0, "C++ writing": 0.0}
ENDINGS = {"closed at once": (0.0, True, "close"), "50 ms apart, starting rank first": (0.05, True, "close"),
           "150 ms apart, starting rank first": (0.15, True, "close"),
           "50 ms apart, starting rank last": (0.05, False, "close"), "SIGKILLed at once": (0.0, True, "kill")}


def succession(settings: Settings, results: Results) -> None:
    out: dict[str, Any] = results.succession
    trials = 2 if settings.quick else 20
    cpp = importlib.util.find_spec("nixl_cu12") is not None
    for rep in range(max(1, settings.takeover_repeats // 3)):
        with _tempdir(settings, "rank-death") as directory:
            failed, sent = _rank_death(directory)
        out.setdefault("rank_death", []).append([failed, sent])
        log(f"rank death: {failed} of {sent} requests failed")
        for kind, rate in KINDS.items():
            if kind == "C++ writing" and not cpp:
                continue
            with _tempdir(settings, "server-death") as directory:
                figures = _server_deaths(directory, kind, rate, measure_cpu=rep == 0 and kind == "idle")
            for key in ("failed", "sent", "spare_s", "new_spare_s"):
                out.setdefault("server_death", {}).setdefault(kind, {}).setdefault(key, []).extend(figures[key])
            if "cpu" in figures:
                out["cpu"] = figures["cpu"]
            log(f"server death, ranks {kind}: {sum(figures['failed'])} of {sum(figures['sent'])} failed; spare "
                "answered " + ", ".join(f"{s * 1e3:.0f}" for s in figures["spare_s"]) + " ms")
        with _tempdir(settings, "stopped") as directory:
            stopped = _stopped_server(directory)
        out.setdefault("stopped", []).append(stopped)
        log(f"stopped server replaced in {stopped['replaced_s']:.2f} s, {stopped['failed']} of {stopped['sent']} "
            "failed")
        with _tempdir(settings, "thread-death") as directory:
            waited = _thread_owner_death(directory)
        out.setdefault("thread", []).append(waited)
        log(f"thread mode, serving rank killed: served again in {waited * 1e3:.0f} ms")
        if cpp:
            with _tempdir(settings, "cpp-owner") as directory:
                waited = _from_cpp_owner(directory)
            out.setdefault("cpp_owner", []).append(waited)
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


def _roles(port: int) -> tuple[list[int], list[int]]:
    """(address servers, spares) listening on 127.0.0.1:``port``, from /proc."""
    address = f"127.0.0.1:{port}"
    holders = listening_pids(port)
    return ([p for p in holders if is_address_server(p, address)],
            [p for p in holders if is_address_server(p, address, (SPARE_COMM,))])


def _one_of_each(port: int, not_server: int = 0) -> tuple[float, tuple[int, int]] | None:
    def found() -> tuple[int, int] | None:
        servers, spares = _roles(port)
        return (servers[0], spares[0]) if len(servers) == 1 == len(spares) and servers[0] != not_server else None
    return _poll_until(found, 30, 0.002)


class _Poller:
    """GET /metrics every 5 ms on a fresh connection; counts the requests sent and failed after ``since``."""

    def __init__(self, port: int) -> None:
        self.port, self.since = port, float("inf")
        self.sent = self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            sent_at = time.monotonic()
            ok = _get(self.port)[0] == 200
            if sent_at >= self.since:
                self.sent += 1
                self.failed += not ok
            self._stop.wait(0.005)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def _server_deaths(directory: Path, kind: str, rate: float, measure_cpu: bool) -> dict[str, Any]:
    """SIGKILL the address server SUCCESSIVE_KILLS times; what each death cost."""
    env = _ours_env(directory, free_port(), "helper")
    port = int(env["NIXL_TELEMETRY_PROMETHEUS_PORT"])
    workers = [Worker("rank", env, str(rate)) for _ in range(1 if kind == "C++ writing" else SUCCESSIVE_KILLS + 1)]
    figures: dict[str, Any] = {"failed": [], "sent": [], "spare_s": [], "new_spare_s": []}
    poller = None
    try:
        first = _one_of_each(port)
        if first is None:
            raise RuntimeError("the job never had a server and a spare")
        if kind == "C++ writing":  # NIXL's plug-in's ranks, writing beside the Python rank's server
            workers += [Worker("plugin-owner", _plugin_env(directory, port)) for _ in range(2)]
        server, spare = first[1]
        if measure_cpu:
            idle = workers[-1]
            before = _cpu_s(idle.pid), _cpu_s(spare)
            time.sleep(5.0)
            figures["cpu"] = {"rank": _cpu_s(idle.pid) - before[0], "spare": _cpu_s(spare) - before[1]}
        for _ in range(SUCCESSIVE_KILLS):
            poller = _Poller(port)
            time.sleep(0.3)
            killed = time.monotonic()
            os.kill(server, signal.SIGKILL)
            poller.since = killed
            answered = _poll_until(lambda s=spare: _owner(port)["server_pid"] == s or None, 30, 0.002)
            replaced = _one_of_each(port, not_server=server)
            time.sleep(0.3)
            poller.close()
            figures["failed"].append(poller.failed)
            figures["sent"].append(poller.sent)
            figures["spare_s"].append(float("inf") if answered is None else answered[0] - killed)
            figures["new_spare_s"].append(float("inf") if replaced is None else replaced[0] - killed)
            if replaced is None:
                break
            server, spare = replaced[1]
    finally:
        if poller is not None:
            poller.close()
        _stop_all(workers)
        _stop_ours(port)
    return figures


def _stopped_server(directory: Path) -> dict[str, Any]:
    """SIGSTOP the address server: seconds until its spare serves, requests failed meanwhile."""
    env = _ours_env(directory, free_port(), "helper")
    port = int(env["NIXL_TELEMETRY_PROMETHEUS_PORT"])
    workers = [Worker("rank", env, "0") for _ in range(2)]
    poller = None
    try:
        first = _one_of_each(port)
        if first is None:
            raise RuntimeError("the job never had a server and a spare")
        server, spare = first[1]
        poller = _Poller(port)
        time.sleep(0.3)
        stopped = time.monotonic()
        os.kill(server, signal.SIGSTOP)
        poller.since = stopped
        done = _poll_until(lambda: _owner(port)["server_pid"] == spare or None, 30, 0.005)
        os.kill(server, signal.SIGCONT)
        time.sleep(0.3)
        poller.close()
        return {"replaced_s": float("inf") if done is None else done[0] - stopped, "failed": poller.failed,
                "sent": poller.sent}
    finally:
        if poller is not None:
            poller.close()
        _stop_all(workers)
        _stop_ours(port)


def _thread_owner_death(directory: Path) -> float:
    """Thread mode: SIGKILL the serving rank; seconds until a rank recording 10/s serves again."""
    env = _ours_env(directory, free_port(), "thread")
    port = int(env["NIXL_TELEMETRY_PROMETHEUS_PORT"])
    workers = [Worker("rank", env, "10") for _ in range(3)]
    try:
        if _wait_serving(port, 10) is None:
            raise RuntimeError("the job never served")
        owner = int(_owner(port)["server_pid"])
        os.kill(owner, signal.SIGKILL)
        waited = _wait_serving(port, 10, gone=owner)
        return float("inf") if waited is None else waited
    finally:
        _stop_all(workers)


def _stop_ours(port: int) -> None:
    """Stop the address server and spare a scenario left (spares first: each would replace its server)."""
    address = f"127.0.0.1:{port}"
    for comm in (SPARE_COMM, SERVER_COMM):
        for pid in listening_pids(port):
            signal_address_server(pid, address, signal.SIGKILL, (comm,))


def _from_cpp_owner(directory: Path) -> float:
    """A C++ rank (NIXL's plug-in) owns the address, two Python ranks record 10/s; SIGKILL the C++ rank."""
    port = free_port()
    cpp = Worker("plugin-owner", _plugin_env(directory, port))
    workers = [cpp]
    try:
        if _wait_serving(port, 10) is None:
            raise RuntimeError("the C++ rank never served")
        workers += [Worker("rank", _ours_env(directory, port, "helper"), "10") for _ in range(2)]
        os.kill(cpp.pid, signal.SIGKILL)
        cpp.proc.wait()
        waited = _wait_serving(port, 10)
        return float("inf") if waited is None else waited
    finally:
        _stop_all(workers)
        _stop_ours(port)


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
    out = results.succession
    if not out:
        return []
    lines = [f"**Server death** (SIGKILL of the address server, {SUCCESSIVE_KILLS} in a row per job, /metrics polled "
             "every 5 ms on fresh connections)", "",
             "| ranks | failed requests | spare answered (median, max) | new spare (median, max) |",
             "| --- | --- | --- | --- |"]
    for kind, figures in out.get("server_death", {}).items():
        lines.append(f"| {kind} | {sum(figures['failed'])} of {sum(figures['sent'])} | {_ms(figures['spare_s'])} | "
                     f"{_ms(figures['new_spare_s'])} |")
    cpu = out.get("cpu", {})
    deaths = out.get("rank_death", [])
    lines += ["", "Stopped server (SIGSTOP): replaced in " + ", ".join(
                  f"{s['replaced_s']:.2f} s ({s['failed']} of {s['sent']} failed)" for s in out.get("stopped", [])),
              "", f"Thread mode, the serving rank killed (ranks recording 10/s): {_ms(out.get('thread', []))}; a C++ "
              f"owner killed (Python ranks recording 10/s): {_ms(out.get('cpp_owner', []))}",
              "", "CPU over 5 s, while the server lives: "
              + ", ".join(f"{who} {used:.3f} s" for who, used in cpu.items()),
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
    out = results.succession
    if not out:
        return []
    rows = []
    deaths = out.get("rank_death", [])
    if deaths:
        failed = sum(f for f, _ in deaths)
        rows.append(["rank death, the starting rank's included: no failed request (polled every 5 ms)",
                     f"{failed} of {sum(s for _, s in deaths)}", _met(failed == 0)])
    for kind, figures in out.get("server_death", {}).items():
        failed = sum(figures["failed"])
        rows.append([f"server death, ranks {kind}: no failed request (polled every 5 ms)",
                     f"{failed} of {sum(figures['sent'])}", _met(failed == 0)])
        spare = statistics.median(figures["spare_s"])
        rows.append([f"server death, ranks {kind}: the spare answers within {SPARE_ANSWERS_TARGET_S * 1e3:.0f} ms",
                     f"{spare * 1e3:.0f} ms median", _met(spare <= SPARE_ANSWERS_TARGET_S)])
        worst = max(figures["new_spare_s"])
        rows.append([f"server death, ranks {kind}: a new spare within {NEW_SPARE_TARGET_S:.0f} s of each",
                     f"{worst * 1e3:.0f} ms at most", _met(worst <= NEW_SPARE_TARGET_S)])
    stopped = out.get("stopped", [])
    if stopped:
        worst = max(s["replaced_s"] for s in stopped)
        rows.append([f"a stopped server replaced within {STOPPED_TARGET_S:.0f} s", f"{worst:.2f} s at most",
                     _met(worst <= STOPPED_TARGET_S)])
    for key, label in (("thread", "thread mode, the serving rank SIGKILLed, ranks recording 10/s"),
                       ("cpp_owner", "a C++ owner SIGKILLed, Python ranks recording 10/s")):
        values = out.get(key, [])
        if values:
            median = statistics.median(values)
            rows.append([f"{label}: served again within {TARGET_S * 1e3:.0f} ms", f"{median * 1e3:.0f} ms median",
                         _met(median <= TARGET_S)])
    for who, used in out.get("cpu", {}).items():
        rows.append([f"a waiting {who}'s CPU per 5 s: under {WAIT_CPU_TARGET_S} s", f"{used:.3f} s",
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
