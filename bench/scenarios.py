"""The scenarios: each runs ours and the reference side by side, interleaved, and returns raw results."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import random
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import (
    PROMETHEUS_HEADERS,
    Worker,
    decoded,
    filesystem_of,
    free_port,
    http_get,
    log,
    read_status_kib,
    sample_lines,
    timed_get,
)
from store import native
from store.native import PURE_PYTHON_ENV


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
    takeover_repeats: int = 9
    takeover_rate: float = 10.0
    tmp: str | None = None


@dataclass
class Results:
    record: dict[str, list[float]] = field(default_factory=dict)
    threads: dict[str, list[float]] = field(default_factory=dict)
    exact: dict[str, bool] = field(default_factory=dict)  # recorded totals matched what was sent
    scrape: dict[int, dict[str, Any]] = field(default_factory=dict)
    takeover: list[float] = field(default_factory=list)
    takeover_failures: int = 0
    memory: dict[str, Any] = field(default_factory=dict)
    plugin: dict[int, dict[str, Any]] = field(default_factory=dict)
    plugin_missing: str | None = None  # why the plug-in rows are empty
    busy: dict[int, dict[str, Any]] = field(default_factory=dict)
    fs: str = "?"


@contextlib.contextmanager
def _tempdir(settings: Settings, tag: str) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix=f"nixl-bench-{tag}-", dir=settings.tmp))
    os.chmod(path, 0o700)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _ours_env(directory: Path, port: int) -> dict[str, str]:
    return {"NIXL_TELEMETRY_MULTIPROC_DIR": str(directory), "NIXL_TELEMETRY_PROMETHEUS_PORT": str(port),
            "NIXL_TELEMETRY_PROMETHEUS_LOCAL": "y", "LOCAL_RANK": "0"}


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
        pair = [("inproc_ours", srv_ours, 6), ("inproc_ref", srv_ref, 2 if big else 6)]
        for key, worker, k in pair if rep % 2 == 0 else pair[::-1]:
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

def _wait_serving(port: int, deadline_s: float, timeout_s: float = 0.25) -> float | None:
    """Poll GET /metrics until it answers 200 (each GET given ``timeout_s``); seconds waited, or None past the
    deadline."""
    start = time.perf_counter()
    while True:
        try:
            status, _ = http_get(port, timeout=timeout_s)
            if status == 200:
                return time.perf_counter() - start
        except OSError:
            pass
        if time.perf_counter() - start > deadline_s:
            return None
        time.sleep(0.001)


def takeover(settings: Settings, results: Results) -> None:
    """SIGKILL the owner; seconds until a writer exporting ``rate`` events/s serves /metrics."""
    rng = random.Random(7)
    for rep in range(settings.takeover_repeats):
        with _tempdir(settings, "takeover") as directory:
            env = _ours_env(directory, free_port())
            port = int(env["NIXL_TELEMETRY_PROMETHEUS_PORT"])
            owner = Worker("rank", env, str(settings.takeover_rate))
            writer = None
            try:
                if not owner.hello["serving"]:
                    raise RuntimeError("the first rank did not win the election")
                writer = Worker("rank", env, str(settings.takeover_rate))
                if writer.hello["serving"]:
                    raise RuntimeError("the second rank serves too")
                if _wait_serving(port, 10) is None:
                    raise RuntimeError("the owner never served")
                # Kill at a random phase of the writer's export/claim cycle.
                time.sleep(0.5 + rng.random() * 0.5)
                os.kill(owner.pid, signal.SIGKILL)
                waited = _wait_serving(port, 10)
                owner.proc.wait()
                if waited is None:
                    results.takeover_failures += 1
                    log(f"takeover {rep + 1}: no owner within 10 s")
                else:
                    results.takeover.append(waited)
                    log(f"takeover {rep + 1}/{settings.takeover_repeats}: {waited * 1e3:.0f} ms "
                        f"(writer serving: {writer.call('status')['serving']})")
            finally:
                for worker in (writer, owner):
                    if worker is not None and worker.proc.poll() is None:
                        worker.proc.kill()
                    if worker is not None:
                        with contextlib.suppress(subprocess.TimeoutExpired):
                            worker.proc.wait(timeout=10)


# -- f. -----------------------------------------------------------------------------------------------------

PLUGIN_WHEEL = "nixl-cu12==1.5.1"


def _plugin_env(directory: Path, port: int) -> dict[str, str]:
    return {"NIXL_TELEMETRY_ENABLE": "y", "NIXL_TELEMETRY_EXPORTER": "prometheus_mp",
            "NIXL_TELEMETRY_MULTIPROC_DIR": str(directory), "NIXL_TELEMETRY_PROMETHEUS_PORT": str(port),
            "NIXL_TELEMETRY_PROMETHEUS_LOCAL": "y", "NIXL_LOG_LEVEL": "WARN"}


def plugin(settings: Settings, results: Results) -> None:
    """Ours vs the C++ plug-in's endpoint (prometheus-cpp) over the same live stores, interleaved.

    One directory per size: ``count - 1`` live stores written by our StoreWriter (one process holds
    them all, locked) plus the store of the C++ agent that wins the election and serves with
    prometheus-cpp; our MetricsApp (the in-process endpoint's server) serves the same directory on
    another port.  Each is scraped as Prometheus scrapes (its Accept header, gzip) and plainly.
    """
    if importlib.util.find_spec("nixl_cu12") is None:
        results.plugin_missing = f"not installed (pip install --no-deps {PLUGIN_WHEEL} numpy)"
        log(f"plugin: {results.plugin_missing}")
        return
    for count in settings.ranks:
        with _tempdir(settings, f"plugin-{count}") as directory:
            log(f"plugin {count} ranks: filling the directory, starting both owners")
            cpp_port = free_port()
            with Worker("fill-ours", None, str(count - 1), str(directory)), \
                    Worker("plugin-owner", _plugin_env(directory, cpp_port)), \
                    Worker("serve-ours", None, str(directory)) as ours:
                results.plugin[count] = _plugin_one(settings, count, ours.hello["port"], cpp_port)


def _plugin_one(settings: Settings, count: int, ours_port: int, cpp_port: int) -> dict[str, Any]:
    if _wait_serving(cpp_port, 30, timeout_s=10) is None:  # a scrape of 1024 ranks takes a while
        raise RuntimeError("the C++ plug-in never served its port")
    entry: dict[str, Any] = {"prom_ours": [], "prom_cpp": [], "plain_ours": [], "plain_cpp": []}
    for side, port in (("ours", ours_port), ("cpp", cpp_port)):
        _, wire = timed_get(port, PROMETHEUS_HEADERS)  # warm-up, and the sizes
        _, plain = timed_get(port)
        entry[f"wire_{side}"], entry[f"bytes_{side}"] = len(wire), len(plain)
        entry[f"gzip_{side}"] = wire[:2] == b"\x1f\x8b"
        entry[f"samples_{side}"] = sample_lines(decoded(wire))
    repeats = settings.plugin_repeats if count <= 256 else max(3, settings.plugin_repeats // 2)
    for rep in range(repeats):
        plan = [("prom_ours", ours_port, PROMETHEUS_HEADERS), ("prom_cpp", cpp_port, PROMETHEUS_HEADERS),
                ("plain_ours", ours_port, None), ("plain_cpp", cpp_port, None)]
        for key, port, headers in plan if rep % 2 == 0 else plan[::-1]:
            entry[key].append(timed_get(port, headers)[0])
    log(f"plugin {count} ranks: {repeats} interleaved scrapes of each kind "
        f"(wire bytes ours {entry['wire_ours']:,}, plug-in {entry['wire_cpp']:,})")
    return entry


def busy(settings: Settings, results: Results) -> None:
    """Our in-process owner's scrape while one thread of its rank records flat out, vs the same owner idle.

    Idle and busy scrapes alternate; for each busy one, the owner reports the longest gap its recording
    loop saw during the scrape (the GIL taken away from the rank).  Where the C speedups are built, a second
    owner forced onto the pure-Python path (NIXL_PROMETHEUS_MP_PURE_PYTHON=1) runs beside it, each over
    its own directory of the same size, their scrapes interleaved.
    """
    paths = {"c": {}, "python": {PURE_PYTHON_ENV: "1"}} if native.load("_scan") is not None else \
        {"python": {PURE_PYTHON_ENV: "1"}}
    for count in (c for c in settings.busy_ranks if not settings.ranks or c <= max(settings.ranks)):
        log(f"busy owner {count} ranks ({' and '.join(paths)} speedups)")
        with contextlib.ExitStack() as stack:
            owners = []
            for path, extra in paths.items():
                directory = stack.enter_context(_tempdir(settings, f"busy-{path}-{count}"))
                port = free_port()
                stack.enter_context(Worker("fill-ours", None, str(count - 1), str(directory)))
                owner = stack.enter_context(Worker("busy-owner", {**_ours_env(directory, port), **extra}))
                if not owner.hello["serving"]:
                    raise RuntimeError("the busy owner did not win the election")
                timed_get(port, PROMETHEUS_HEADERS)  # warm-up
                owners.append((path, owner, port))
            entry: dict[str, Any] = {f"{kind}_{path}": [] for path in paths for kind in ("idle", "busy", "stall")}
            for rep in range(settings.busy_repeats):
                for path, owner, port in owners if rep % 2 == 0 else owners[::-1]:
                    entry[f"idle_{path}"].append(timed_get(port, PROMETHEUS_HEADERS)[0])
                    owner.call("busy")
                    time.sleep(0.05)  # the loop is running flat out before the scrape starts
                    start = time.monotonic()
                    entry[f"busy_{path}"].append(timed_get(port, PROMETHEUS_HEADERS)[0])
                    end = time.monotonic()
                    entry[f"stall_{path}"].append(owner.call("stall", start=start, end=end)["seconds"])
                    owner.call("idle")
                    time.sleep(0.02)
            results.busy[count] = entry
