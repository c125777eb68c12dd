"""The scenarios: each runs ours and the reference side by side, interleaved, and returns raw results."""

from __future__ import annotations

import contextlib
import http.client
import importlib.util
import json
import os
import random
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from app.config import SERVE_ENV, SERVE_MODES
from bench.common import (
    PROMETHEUS_HEADERS,
    Persistent,
    Worker,
    answered_on_one_connection,
    decoded,
    eof_after_body,
    filesystem_of,
    free_port,
    http_get,
    log,
    process_gone,
    read_status_kib,
    sample_lines,
    timed_get,
)

T = TypeVar("T")


@dataclass
class Settings:
    ranks: list[int]
    record_repeats: int = 15
    record_transfers: int = 10_000  # per repeat, per thread (a multiple of 1000)
    # Threaded runs are this many times longer: starting and joining the threads must stay well under 1% of a
    # run (at ~100 ns per transfer, 10,000 transfers per thread take about as long as starting the threads).
    thread_run_factor: int = 10
    threads: int = 4
    scrape_repeats: int = 9
    inproc_repeats: int = 9
    plugin_repeats: int = 11
    busy_repeats: int = 9
    busy_ranks: tuple[int, ...] = (8, 64, 256)
    # Each busy repetition scrapes every busy_scrape_every_s for busy_window_s, then leaves the rank alone as long.
    busy_window_s: float = 0.4
    busy_scrape_every_s: float = 0.05
    takeover_repeats: int = 9
    takeover_rate: float = 10.0  # events/s of the rank that takes over, and of the "recording" rank of respawn
    frozen_repeats: int = 3
    frozen_hold_s: float = 4.0  # the rank's C call holding its GIL
    frozen_stop_s: float = 2.0  # the rank's SIGSTOP
    frozen_scrape_every_s: float = 0.1
    respawn_repeats: int = 9
    respawn_scrape_every_s: float = 0.01
    tmp: str | None = None
    quick: bool = False  # --quick: a smoke run, which the report says its targets are not judged by


@dataclass
class Results:
    record: dict[str, list[float]] = field(default_factory=dict)
    threads: dict[str, list[float]] = field(default_factory=dict)
    exact: dict[str, bool] = field(default_factory=dict)  # recorded totals matched what was sent
    scrape: dict[int, dict[str, Any]] = field(default_factory=dict)
    takeover: dict[str, list[float]] = field(default_factory=dict)  # by serving mode: seconds to the first 200
    takeover_failures: dict[str, int] = field(default_factory=dict)
    memory: dict[str, Any] = field(default_factory=dict)
    plugin: dict[int, dict[str, Any]] = field(default_factory=dict)
    plugin_missing: str | None = None  # why the plug-in rows are empty
    busy: dict[int, dict[str, Any]] = field(default_factory=dict)
    # By serving mode, "gil" and "stop": each repetition's worst scrape while the rank was frozen (inf: failed).
    frozen: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    # By rank ("recording", "idle"): seconds from the helper's SIGKILL to the first 200 ("served") and to a new
    # helper serving ("helper").
    respawn: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    respawn_failures: int = 0
    succession: dict[str, Any] = field(default_factory=dict)  # bench/succession.py's figures
    pods: dict[str, Any] = field(default_factory=dict)  # bench/pods.py's figures
    helper_start: list[float] = field(default_factory=list)  # an Exporter's construction to its helper serving
    helper_rss_kib: list[int] = field(default_factory=list)  # a helper serving one rank, after a scrape
    fs: str = "?"


@contextlib.contextmanager
def _tempdir(settings: Settings, tag: str) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix=f"nixl-bench-{tag}-", dir=settings.tmp))
    os.chmod(path, 0o700)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _ours_env(directory: Path, port: int, serve: str | None = None) -> dict[str, str]:
    """A rank's environment; ``serve`` chooses how an elected rank serves (SERVE_MODES; None: the default)."""
    env = {"NIXL_TELEMETRY_MULTIPROC_DIR": str(directory), "NIXL_TELEMETRY_PROMETHEUS_PORT": str(port),
           "NIXL_TELEMETRY_PROMETHEUS_LOCAL": "y", "LOCAL_RANK": "0"}
    if serve is not None:
        env[SERVE_ENV] = serve
    return env


# -- a. and b. ----------------------------------------------------------------------------------------------

def record(settings: Settings, results: Results, threads: int) -> None:
    """Per-transfer ns: ours (C path and pure-Python path) and prometheus_client's nine updates.

    With one thread also one export_event per transfer against a no-op Python
    method of the same signature (the floor any Python API pays).
    """
    target = results.record if threads == 1 else results.threads
    n = settings.record_transfers * (1 if threads == 1 else settings.thread_run_factor)
    pure_python = {"NIXL_PROMETHEUS_MP_PURE_PYTHON": "1"}
    with _tempdir(settings, "rec-ours") as ours_dir, _tempdir(settings, "rec-py") as py_dir, \
            _tempdir(settings, "rec-ref") as ref_dir:
        with Worker("record-ours", _ours_env(ours_dir, free_port())) as ours, \
                Worker("record-ours", {**_ours_env(py_dir, free_port()), **pure_python}) as py, \
                Worker("record-ref", {"PROMETHEUS_MULTIPROC_DIR": str(ref_dir)}) as ref:
            if not ours.hello["native"] or py.hello["native"]:
                raise RuntimeError("expected the C path in one worker and the pure-Python path in the other "
                                   "(build the extension: pip install -e .)")
            log(f"record x{threads} thread(s): ours pid {ours.pid} (serving={ours.hello['serving']}), "
                f"pure-Python pid {py.pid}, reference pid {ref.pid} ({ref.hello['value_class']})")
            plan = [("ours: 4 x export_event", ours, "events", threads),
                    ("ours: record_transfer", ours, "transfer", threads),
                    ("pure Python: 4 x export_event", py, "events", threads),
                    ("pure Python: record_transfer", py, "transfer", threads),
                    ("prometheus_client mp", ref, "updates", threads)]
            if threads == 1:
                plan += [("ours: 1 x export_event", ours, "one", 1), ("no-op method", ours, "noop", 1)]
            else:  # the scaling's baseline, interleaved: one thread, started and joined like the N threads
                plan += [("ours: record_transfer, 1 thread", ours, "transfer", 1),
                         ("pure Python: record_transfer, 1 thread", py, "transfer", 1)]
            in_thread = threads > 1
            for _, worker, mode, count in plan:  # warm-up: first-touch of every page, caches, specialisation
                worker.call("run", mode=mode, n=min(n, 2000), threads=count, in_thread=in_thread)
            for rep in range(settings.record_repeats):
                order = plan if rep % 2 == 0 else plan[::-1]
                for name, worker, mode, count in order:
                    reply = worker.call("run", mode=mode, n=n, threads=count, in_thread=in_thread)
                    target.setdefault(name, []).append(reply["ns_per_transfer"])
                    if "exact" in reply:
                        key = f"{name} x{count}"
                        results.exact[key] = results.exact.get(key, True) and reply["exact"]


# -- c. and e. ----------------------------------------------------------------------------------------------

def _dir_usage(files: list[str]) -> tuple[int, int]:
    size = blocks = 0
    for name in files:
        st = os.stat(name)
        size += st.st_size
        blocks += st.st_blocks * 512
    return size, blocks


def scrape(settings: Settings, results: Results, with_http: bool = True) -> None:
    """HTTP GET /metrics and in-process collect+render, ours vs MultiProcessCollector, per rank count."""
    largest = max(settings.ranks)
    for count in settings.ranks:
        with _tempdir(settings, f"scrape-ours-{count}") as ours_dir, \
                _tempdir(settings, f"scrape-ref-{count}") as ref_dir:
            results.fs = filesystem_of(ours_dir)
            log(f"scrape {count} ranks: filling both directories")
            ref_env = {"PROMETHEUS_MULTIPROC_DIR": str(ref_dir)}
            with Worker("fill-ours", None, str(count), str(ours_dir)) as fill_ours, \
                    Worker("fill-ref", ref_env, str(count), str(ref_dir)) as fill_ref:
                ours_files = fill_ours.call("files")["files"]
                ref_files = fill_ref.call("files")["files"]
                fill_ref.close()  # its files stay: the reference's readers need no live writer
                with Worker("serve-ours", None, str(ours_dir)) as srv_ours, \
                        Worker("serve-ref", ref_env, str(ref_dir)) as srv_ref:
                    entry = _scrape_one(settings, count, srv_ours, srv_ref, with_http)
                    entry["ours_files"], entry["ref_files"] = len(ours_files), len(ref_files)
                    results.scrape[count] = entry
                    if count == largest:
                        results.memory = _memory(count, ours_files, ref_files, srv_ours, srv_ref)


def _scrape_one(settings: Settings, count: int, srv_ours: Worker, srv_ref: Worker, with_http: bool) -> dict[str, Any]:
    entry: dict[str, Any] = {"http_ours": [], "http_ref": [], "inproc_ours": [], "inproc_ref": []}
    ours_port, ref_port = srv_ours.hello["port"], srv_ref.hello["port"]
    # Warm-up (and the sizes): both bodies once.
    _, body_ours = timed_get(ours_port)
    _, body_ref = timed_get(ref_port)
    entry.update(bytes_ours=len(body_ours), bytes_ref=len(body_ref), samples_ours=sample_lines(body_ours),
                 samples_ref=sample_lines(body_ref))
    # The reference costs seconds per scrape from 256 ranks on: fewer repeats there (and two calls per
    # in-process batch for it, one kept) keep the default run within a few minutes.
    big = count >= 256
    repeats = min(3, settings.scrape_repeats) if big else settings.scrape_repeats
    log(f"scrape {count} ranks: {repeats} interleaved GETs each ({len(body_ours)} vs {len(body_ref)} bytes)")
    if with_http:
        for rep in range(repeats):
            pair = [("http_ours", ours_port), ("http_ref", ref_port)]
            for key, port in pair if rep % 2 == 0 else pair[::-1]:
                entry[key].append(timed_get(port)[0])
    # In-process: batches of back-to-back calls (the first of each batch dropped: it pays for the caches
    # the pause before it cooled), ours and the reference's batches alternating.
    for rep in range(repeats if big else settings.inproc_repeats):
        batches = [("inproc_ours", srv_ours, 6), ("inproc_ref", srv_ref, 2 if big else 6)]
        for key, worker, k in batches if rep % 2 == 0 else batches[::-1]:
            entry[key] += worker.call("inproc", k=k)["seconds"][1:]
    return entry


def _memory(count: int, ours_files: list[str], ref_files: list[str], srv_ours: Worker,
            srv_ref: Worker) -> dict[str, Any]:
    timed_get(srv_ours.hello["port"])  # "after a scrape"
    timed_get(srv_ref.hello["port"])
    ours_size, ours_blocks = _dir_usage(ours_files)
    ref_size, ref_blocks = _dir_usage(ref_files)
    return {
        "ranks": count,
        "ours_size_per_rank": ours_size / count, "ours_blocks_per_rank": ours_blocks / count,
        "ref_size_per_rank": ref_size / count, "ref_blocks_per_rank": ref_blocks / count,
        "ref_files_per_rank": len(ref_files) / count,
        "ours_rss_idle_kib": srv_ours.hello["VmRSS"], "ref_rss_idle_kib": srv_ref.hello["VmRSS"],
        "ours_rss_kib": read_status_kib(srv_ours.pid, "VmRSS"), "ref_rss_kib": read_status_kib(srv_ref.pid, "VmRSS"),
        "ours_hwm_kib": read_status_kib(srv_ours.pid, "VmHWM"), "ref_hwm_kib": read_status_kib(srv_ref.pid, "VmHWM"),
    }


# -- d. -----------------------------------------------------------------------------------------------------

_UNANSWERED = (OSError, http.client.HTTPException, ValueError)  # refused, cut, timed out, or a garbled answer


def _poll_until(check: Callable[[], T | None], deadline_s: float, interval_s: float) -> tuple[float, T] | None:
    """Call ``check`` every ``interval_s`` until it returns something (a failed request counts as nothing);
    (the monotonic time it did, what it returned), or None past the deadline."""
    start = time.monotonic()
    while True:
        with contextlib.suppress(*_UNANSWERED):
            found = check()
            if found is not None:
                return time.monotonic(), found
        if time.monotonic() - start > deadline_s:
            return None
        time.sleep(interval_s)


def _wait_serving(port: int, deadline_s: float, timeout_s: float = 0.25, interval_s: float = 0.001,
                  gone: int | None = None) -> float | None:
    """Poll GET /metrics until it answers 200 (each GET given ``timeout_s``); seconds waited, or None past the
    deadline.  With ``gone``, only GETs sent once that process has exited count (a killed rank's helper answers
    until it notices its rank's death: its answers are not the takeover's)."""
    def served() -> bool | None:
        if gone is not None and not process_gone(gone):
            return None
        return http_get(port, timeout=timeout_s)[0] == 200 or None

    start = time.monotonic()
    done = _poll_until(served, deadline_s, interval_s)
    return None if done is None else done[0] - start


def _owner(port: int) -> dict[str, Any]:
    """/healthz's owner: who holds the address (pid), which process answers (server_pid), how (serving)."""
    status, body = http_get(port, "/healthz", timeout=1.0)
    if status != 200:
        raise ValueError(f"GET /healthz answered {status}")
    owner: dict[str, Any] = json.loads(body)["owner"]
    return owner


def _await_helper(results: Results, rank: Worker, port: int) -> int:
    """Wait until ``rank``'s serving helper answers its address; the helper's pid.  Records the helper's start
    time: from just before the rank constructed its Exporter to /healthz first saying serving == helper."""
    def helper() -> int | None:
        doc = _owner(port)
        return int(doc["server_pid"]) if doc["serving"] == "helper" and doc["started_by"] == rank.pid else None

    done = _poll_until(helper, 30, 0.01)
    if done is None:
        raise RuntimeError(f"rank {rank.pid} never served from a helper")
    results.helper_start.append(done[0] - rank.hello["constructing"])
    return done[1]


def _stop_all(workers: list[Worker]) -> None:
    """Kill what the scenario started and is still running (the rank workers run until killed), and reap it."""
    for worker in workers:
        if worker.proc.poll() is None:
            worker.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            worker.proc.wait(timeout=10)


def takeover(settings: Settings, results: Results) -> None:
    """SIGKILL the process that holds the address (helper mode: the address server; thread mode: the serving
    rank); seconds until a writer exporting ``rate`` events/s serves /metrics again, in each serving mode
    (alternating)."""
    rng = random.Random(7)
    for rep in range(settings.takeover_repeats):
        for mode in SERVE_MODES if rep % 2 == 0 else SERVE_MODES[::-1]:
            with _tempdir(settings, f"takeover-{mode}") as directory:
                _takeover_one(settings, results, rng, mode, directory)
        log(f"takeover {rep + 1}/{settings.takeover_repeats}: " + ", ".join(
            f"{mode} {results.takeover[mode][-1] * 1e3:.0f} ms" for mode in SERVE_MODES if results.takeover.get(mode)))


def _takeover_one(settings: Settings, results: Results, rng: random.Random, mode: str, directory: Path) -> None:
    env = _ours_env(directory, free_port(), mode)
    port = int(env["NIXL_TELEMETRY_PROMETHEUS_PORT"])
    workers: list[Worker] = []
    try:
        owner = Worker("rank", env, str(settings.takeover_rate))
        workers.append(owner)
        if not owner.hello["serving"]:
            raise RuntimeError("the first rank did not win the election")
        writer = Worker("rank", env, str(settings.takeover_rate))
        workers.append(writer)
        if writer.hello["serving"]:
            raise RuntimeError("the second rank serves too")
        holder = _await_helper(results, owner, port) if mode == "helper" else owner.pid
        if _wait_serving(port, 10) is None:
            raise RuntimeError("the owner never served")
        # Kill at a random phase of the writer's export/claim cycle.
        time.sleep(0.5 + rng.random() * 0.5)
        os.kill(holder, signal.SIGKILL)
        waited = _wait_serving(port, 10, gone=holder)
        if waited is None:
            results.takeover_failures[mode] = results.takeover_failures.get(mode, 0) + 1
            log(f"takeover ({mode}): no owner within 10 s")
        else:
            results.takeover.setdefault(mode, []).append(waited)
    finally:
        _stop_all(workers)


# -- g. and h.: the serving rank frozen; its helper killed alone ----------------------------------------------

@contextlib.contextmanager
def _scraping(ports: dict[str, int], every_s: float,
              timeout_s: float) -> Iterator[dict[str, list[tuple[float, float]]]]:
    """Scrape each port every ``every_s`` from a thread of its own (a scrape held up must not hold up the other
    port's) until the block ends; per key, (monotonic start, seconds) of every scrape, inf for a failed one."""
    scrapes: dict[str, list[tuple[float, float]]] = {key: [] for key in ports}
    stop = threading.Event()

    def scrape(key: str, port: int) -> None:
        while not stop.is_set():
            start = time.monotonic()
            try:
                scrapes[key].append((start, timed_get(port, PROMETHEUS_HEADERS)[0]))
            except (*_UNANSWERED, RuntimeError):  # (RuntimeError: not a 200)
                scrapes[key].append((start, float("inf")))
            stop.wait(max(0.0, start + every_s - time.monotonic()))

    threads = [threading.Thread(target=scrape, args=item, daemon=True) for item in ports.items()]
    for thread in threads:
        thread.start()
    try:
        yield scrapes
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout_s + 1)


def _worst(scrapes: list[tuple[float, float]], start: float, end: float) -> float:
    """The slowest scrape under way at some time in [start, end] (one that began before and waited through it
    included)."""
    return max((seconds for began, seconds in scrapes if began <= end and began + seconds >= start),
               default=float("nan"))


def frozen(settings: Settings, results: Results) -> None:
    """The worst scrape while the serving rank keeps its GIL in a long C call, and while it is SIGSTOPped.

    A rank in each serving mode (each exporting ``takeover_rate`` events/s over its own directory) is frozen
    at the same time as the other, each scraped every ``frozen_scrape_every_s`` from a thread of this process.
    """
    rng = random.Random(11)
    for rep in range(settings.frozen_repeats):
        with contextlib.ExitStack() as stack:
            ranks: dict[str, tuple[Worker, int]] = {}
            for mode in SERVE_MODES:
                directory = stack.enter_context(_tempdir(settings, f"frozen-{mode}"))
                port = free_port()
                worker = Worker("rank", _ours_env(directory, port, mode), str(settings.takeover_rate))
                stack.callback(_stop_all, [worker])
                if not worker.hello["serving"]:
                    raise RuntimeError(f"the {mode} rank did not win the election")
                if mode == "helper":
                    _await_helper(results, worker, port)
                timed_get(port, PROMETHEUS_HEADERS)  # warm-up
                ranks[mode] = (worker, port)
            ports = {mode: port for mode, (_, port) in ranks.items()}
            timeout_s = max(settings.frozen_hold_s, settings.frozen_stop_s) + 5
            with _scraping(ports, settings.frozen_scrape_every_s, timeout_s) as scrapes:
                time.sleep(settings.frozen_scrape_every_s * rng.random())  # at any phase of the scrapes
                for worker, _ in ranks.values():
                    worker.send("hold_gil", us=int(settings.frozen_hold_s * 1e6))
                held = {mode: worker.receive() for mode, (worker, _) in ranks.items()}
            for mode in SERVE_MODES:
                worst = _worst(scrapes[mode], held[mode]["start"], held[mode]["end"])
                results.frozen.setdefault(mode, {}).setdefault("gil", []).append(worst)
            with _scraping(ports, settings.frozen_scrape_every_s, timeout_s) as scrapes:
                time.sleep(settings.frozen_scrape_every_s * rng.random())
                start = time.monotonic()
                for worker, _ in ranks.values():
                    os.kill(worker.pid, signal.SIGSTOP)
                try:
                    time.sleep(settings.frozen_stop_s)
                finally:
                    for worker, _ in ranks.values():
                        os.kill(worker.pid, signal.SIGCONT)
                end = time.monotonic()
            for mode in SERVE_MODES:
                results.frozen[mode].setdefault("stop", []).append(_worst(scrapes[mode], start, end))
        log(f"frozen {rep + 1}/{settings.frozen_repeats}: worst scrape (GIL held / stopped) " + ", ".join(
            f"{mode} {results.frozen[mode]['gil'][-1]:.3f} / {results.frozen[mode]['stop'][-1]:.3f} s"
            for mode in SERVE_MODES))


def respawn(settings: Settings, results: Results) -> None:
    """SIGKILL a rank's serving helper alone: seconds until the address answers 200 again (scraped every
    ``respawn_scrape_every_s``) and until a new helper serves it, for a rank recording ``takeover_rate``
    events/s and for an idle one (alternating).  Also the helper's RSS serving one rank, after a scrape."""
    kinds = {"recording": settings.takeover_rate, "idle": 0.0}
    for rep in range(settings.respawn_repeats):
        for kind, rate in kinds.items() if rep % 2 == 0 else reversed(kinds.items()):
            with _tempdir(settings, f"respawn-{kind}") as directory:
                port = free_port()
                rank = Worker("rank", _ours_env(directory, port, "helper"), str(rate))
                try:
                    _respawn_one(settings, results, kind, rank, port)
                finally:
                    _stop_all([rank])
        log(f"respawn {rep + 1}/{settings.respawn_repeats}: served again / new helper " + ", ".join(
            f"{kind} {entry['served'][-1] * 1e3:.0f} / {entry['helper'][-1] * 1e3:.0f} ms"
            for kind, entry in results.respawn.items() if entry["helper"]))


def _respawn_one(settings: Settings, results: Results, kind: str, rank: Worker, port: int) -> None:
    if not rank.hello["serving"]:
        raise RuntimeError("the rank did not win the election")
    helper = _await_helper(results, rank, port)
    timed_get(port, PROMETHEUS_HEADERS)
    results.helper_rss_kib.append(read_status_kib(helper, "VmRSS"))
    os.kill(helper, signal.SIGKILL)
    killed = time.monotonic()
    served = _wait_serving(port, 10, interval_s=settings.respawn_scrape_every_s)

    def new_helper() -> int | None:
        doc = _owner(port)
        return 1 if doc["serving"] == "helper" and doc["server_pid"] not in (helper, rank.pid) else None

    replaced = _poll_until(new_helper, 30, settings.respawn_scrape_every_s)
    if served is None or replaced is None:
        results.respawn_failures += 1
        log(f"respawn ({kind}): {'not served again' if served is None else 'no new helper'} within the deadline")
        return
    entry = results.respawn.setdefault(kind, {"served": [], "helper": []})
    entry["served"].append(served)
    entry["helper"].append(replaced[0] - killed)


# -- f. -----------------------------------------------------------------------------------------------------

PLUGIN_WHEEL = "nixl-cu12==1.5.1"


def _plugin_env(directory: Path, port: int) -> dict[str, str]:
    return {"NIXL_TELEMETRY_ENABLE": "y", "NIXL_TELEMETRY_EXPORTER": "prometheus_mp",
            "NIXL_TELEMETRY_MULTIPROC_DIR": str(directory), "NIXL_TELEMETRY_PROMETHEUS_PORT": str(port),
            "NIXL_TELEMETRY_PROMETHEUS_LOCAL": "y", "NIXL_LOG_LEVEL": "WARN"}


PLUGIN_SIDES = {"helper": "ours", "thread": "thread"}  # serving mode -> its key in results.plugin ("cpp": the plug-in)
ONE_CONNECTION_REQUESTS = 20  # GETs sent on one persistent connection, to count those it answers


def plugin(settings: Settings, results: Results) -> None:
    """Ours, in each serving mode, vs the C++ plug-in's endpoint (prometheus-cpp) over the same live stores,
    interleaved.

    One directory per size: the store of the C++ agent that wins the election for its port and serves with
    prometheus-cpp, one rank of ours per serving mode (an idle Exporter, elected for a port of its own, serving
    from its helper or its thread), and live stores written by our StoreWriter (one process holds them all,
    locked) to make up ``count``.  Each server is scraped as Prometheus scrapes (its Accept header, gzip) on a
    fresh connection and on a persistent one, and plainly on a fresh one; then, once, how many of 20 GETs one
    persistent connection answers, and how long after an answer's body (Connection: close) the server closes.
    """
    if importlib.util.find_spec("nixl_cu12") is None:
        results.plugin_missing = f"not installed (pip install --no-deps {PLUGIN_WHEEL} numpy)"
        log(f"plugin: {results.plugin_missing}")
        return
    for count in settings.ranks:
        with _tempdir(settings, f"plugin-{count}") as directory, contextlib.ExitStack() as stack:
            log(f"plugin {count} ranks: filling the directory, starting the plug-in and our owners")
            ports = {"cpp": free_port()}
            stack.enter_context(Worker("fill-ours", None, str(max(0, count - 1 - len(SERVE_MODES))), str(directory)))
            stack.enter_context(Worker("plugin-owner", _plugin_env(directory, ports["cpp"])))
            for mode in SERVE_MODES:
                port = free_port()
                owner = stack.enter_context(Worker("busy-owner", _ours_env(directory, port, mode)))
                if not owner.hello["serving"]:
                    raise RuntimeError(f"our {mode} owner did not win the election of its port")
                if mode == "helper":
                    _await_helper(results, owner, port)
                ports[PLUGIN_SIDES[mode]] = port
            results.plugin[count] = _plugin_one(settings, count, ports)


def _plugin_one(settings: Settings, count: int, ports: dict[str, int]) -> dict[str, Any]:
    if _wait_serving(ports["cpp"], 30, timeout_s=10) is None:  # a scrape of 1024 ranks takes a while
        raise RuntimeError("the C++ plug-in never served its port")
    entry: dict[str, Any] = {f"{kind}_{side}": [] for side in ports for kind in ("prom", "plain", "kept", "eof")}
    clients = {side: Persistent(port) for side, port in ports.items()}
    for side, port in ports.items():
        _, wire = timed_get(port, PROMETHEUS_HEADERS)  # warm-up, and the sizes
        _, plain = timed_get(port)
        clients[side].get(PROMETHEUS_HEADERS)
        entry[f"wire_{side}"], entry[f"bytes_{side}"] = len(wire), len(plain)
        entry[f"gzip_{side}"] = wire[:2] == b"\x1f\x8b"
        entry[f"samples_{side}"] = sample_lines(decoded(wire))
    repeats = settings.plugin_repeats if count <= 256 else max(3, settings.plugin_repeats // 2)
    for rep in range(repeats):
        plan = [(kind, side) for side in ports for kind in ("prom", "kept", "plain", "eof")]
        for kind, side in plan if rep % 2 == 0 else plan[::-1]:
            entry[f"{kind}_{side}"].append(_plugin_measure(kind, ports[side], clients[side]))
    for side, port in ports.items():
        clients[side].close()
        entry[f"one_connection_{side}"] = answered_on_one_connection(port, ONE_CONNECTION_REQUESTS,
                                                                     PROMETHEUS_HEADERS)
    log(f"plugin {count} ranks: {repeats} interleaved scrapes of each kind "
        f"(wire bytes ours {entry['wire_ours']:,}, plug-in {entry['wire_cpp']:,})")
    return entry


def _plugin_measure(kind: str, port: int, client: Persistent) -> float:
    if kind == "prom":
        return timed_get(port, PROMETHEUS_HEADERS)[0]
    if kind == "kept":
        return client.get(PROMETHEUS_HEADERS)[0]
    if kind == "plain":
        return timed_get(port)[0]
    return eof_after_body(port)


def busy(settings: Settings, results: Results) -> None:
    """The serving rank's scrape while one thread of it records flat out, vs the same rank idle, in each
    serving mode (their repetitions interleaved, each over its own directory of the same size).

    Each repetition: one idle scrape; then, the rank recording, a window of busy_window_s with a scrape every
    busy_scrape_every_s, followed by an equal window without; the rank reports its recording loop's longest gap
    (the GIL taken away from it, or the CPU) in each window.
    """
    for count in (c for c in settings.busy_ranks if not settings.ranks or c <= max(settings.ranks)):
        log(f"busy owner {count} ranks ({' and '.join(SERVE_MODES)} serving)")
        with contextlib.ExitStack() as stack:
            owners, helper = [], 0
            for mode in SERVE_MODES:
                directory = stack.enter_context(_tempdir(settings, f"busy-{mode}-{count}"))
                port = free_port()
                stack.enter_context(Worker("fill-ours", None, str(count - 1), str(directory)))
                owner = stack.enter_context(Worker("busy-owner", _ours_env(directory, port, mode)))
                if not owner.hello["serving"]:
                    raise RuntimeError("the busy owner did not win the election")
                if mode == "helper":
                    helper = _await_helper(results, owner, port)
                timed_get(port, PROMETHEUS_HEADERS)  # warm-up
                owners.append((mode, owner, port))
            entry: dict[str, Any] = {f"{kind}_{mode}": [] for mode in SERVE_MODES
                                     for kind in ("idle", "busy", "stall", "quiet")}
            for rep in range(settings.busy_repeats):
                for mode, owner, port in owners if rep % 2 == 0 else owners[::-1]:
                    entry[f"idle_{mode}"].append(timed_get(port, PROMETHEUS_HEADERS)[0])
                    owner.call("busy")
                    time.sleep(0.05)  # the loop is running flat out before the window starts
                    start = due = time.monotonic()
                    while due < start + settings.busy_window_s:
                        entry[f"busy_{mode}"].append(timed_get(port, PROMETHEUS_HEADERS)[0])
                        due += settings.busy_scrape_every_s
                        time.sleep(max(0.0, due - time.monotonic()))
                    end = time.monotonic()
                    time.sleep(end - start)
                    quiet_end = time.monotonic()
                    entry[f"stall_{mode}"].append(owner.call("stall", start=start, end=end)["seconds"])
                    entry[f"quiet_{mode}"].append(owner.call("stall", start=end, end=quiet_end)["seconds"])
                    owner.call("idle")
                    time.sleep(0.02)
            entry["helper_rss_kib"] = read_status_kib(helper, "VmRSS")
            results.busy[count] = entry
