"""Worker processes: ``python -m bench.worker KIND [ARGS]``.

Each prints one JSON line when ready, then answers one JSON line per JSON
command read from stdin, until stdin closes.  The reference's workers get
PROMETHEUS_MULTIPROC_DIR in their environment from the start, so
prometheus_client picks its multiprocess value class at import, as in a real
multiprocess deployment; ours never import it for recording.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.workload import rank_history, reference_rank, transfers

Handler = Callable[[dict[str, Any]], dict[str, Any]]


def _raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as status:
        for line in status:
            key = line.split(":", 1)[0]
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(line.split()[1])
    return out


def _run_threads(count: int, body: Callable[[], None]) -> float:
    """Wall seconds for ``count`` threads running ``body`` at once, released together."""
    barrier = threading.Barrier(count + 1)

    def run() -> None:
        barrier.wait()
        body()

    threads = [threading.Thread(target=run) for _ in range(count)]
    for thread in threads:
        thread.start()
    barrier.wait()
    start = time.perf_counter()
    for thread in threads:
        thread.join()
    return time.perf_counter() - start


# -- a. and b.: recording ------------------------------------------------------------------------------------

_WORKLOAD = transfers(seed=42, count=1000)


class _NoOp:
    """The floor for one export_event: a Python method with the same signature that does nothing."""

    def export_event(self, event: int, value: int) -> None:
        pass


def record_ours() -> tuple[dict[str, Any], Handler]:
    import store.recorders
    from app import Exporter
    from store import EventType as E
    from store import layout as L

    exp = Exporter("bench-rank")
    export_event, record_transfer = exp.export_event, exp.record_transfer
    post_ev, xfer_ev, bytes_ev, req_ev = (E.AGENT_XFER_POST_TIME, E.AGENT_XFER_TIME, E.AGENT_TX_BYTES,
                                          E.AGENT_TX_REQUESTS_NUM)
    noop = _NoOp()

    def events(n: int) -> None:
        work = _WORKLOAD
        for _ in range(n // len(work)):
            for xfer, post, nbytes, _w in work:
                export_event(post_ev, post)
                export_event(xfer_ev, xfer)
                export_event(bytes_ev, nbytes)
                export_event(req_ev, 1)

    def transfer(n: int) -> None:
        work = _WORKLOAD
        for _ in range(n // len(work)):
            for xfer, post, nbytes, is_write in work:
                record_transfer(xfer, post, nbytes, is_write)

    # One call per transfer, looked up on the object as user code does: ours, and the no-op floor.
    def one(n: int) -> None:
        work = _WORKLOAD
        for _ in range(n // len(work)):
            for xfer, _p, _n, _w in work:
                exp.export_event(xfer_ev, xfer)

    def floor(n: int) -> None:
        work = _WORKLOAD
        for _ in range(n // len(work)):
            for xfer, _p, _n, _w in work:
                noop.export_event(xfer_ev, xfer)

    def requests() -> int:
        """Requests counted so far (TX + RX): the threads' totals must be exact."""
        words = memoryview(exp.store_path.read_bytes()).cast("Q")
        return int(words[L.W_COUNTERS + E.AGENT_TX_REQUESTS_NUM] + words[L.W_COUNTERS + E.AGENT_RX_REQUESTS_NUM])

    hello = {"serving": exp.serving, "store": str(exp.store_path), "native": store.recorders.NATIVE is not None}
    return hello, _record_handler({"events": events, "transfer": transfer, "one": one, "noop": floor},
                                  requests)
def record_ref() -> tuple[dict[str, Any], Handler]:
    from prometheus_client import values

    if not getattr(values.ValueClass, "_multiprocess", False):
        raise RuntimeError("prometheus_client is not in multiprocess mode (PROMETHEUS_MULTIPROC_DIR unset?)")
    rank = reference_rank(socket.gethostname(), "bench-rank", os.getpid(), 0, "0")
    tx_c, rx_c = rank.counters[0], rank.counters[1]
    txr_c, rxr_c = rank.counters[2], rank.counters[3]
    tx_g, rx_g = rank.gauges[0], rank.gauges[1]
    xfer_c, post_c = rank.counters[6], rank.counters[7]
    xfer_g, post_g = rank.gauges[6], rank.gauges[7]
    xfer_h, post_h = rank.histograms[6], rank.histograms[7]

    def updates(n: int) -> None:
        # The nine updates of ReferenceRank.transfer_recorder, written out in the loop rather than called
        # through it: our four export_event calls sit in the loop too, so neither side pays an extra call.
        work = _WORKLOAD
        for _ in range(n // len(work)):
            for xfer, post, nbytes, is_write in work:
                if is_write:
                    tx_c.inc(nbytes)
                    tx_g.set(nbytes)
                    txr_c.inc(1)
                else:
                    rx_c.inc(nbytes)
                    rx_g.set(nbytes)
                    rxr_c.inc(1)
                post_c.inc(post)
                post_g.set(post)
                post_h.observe(post)
                xfer_c.inc(xfer)
                xfer_g.set(xfer)
                xfer_h.observe(xfer)

    return {"value_class": values.ValueClass.__name__}, _record_handler({"updates": updates})


# Requests each mode records per transfer (for the exactness check).
_REQUESTS_PER_TRANSFER = {"events": 1, "transfer": 1}


def _record_handler(modes: dict[str, Callable[[int], None]], requests: Callable[[], int] | None = None) -> Handler:
    def handle(cmd: dict[str, Any]) -> dict[str, Any]:
        mode = cmd["mode"]
        body = modes[mode]
        n = int(cmd["n"])
        threads = int(cmd.get("threads", 1))
        before = requests() if requests and mode in _REQUESTS_PER_TRANSFER else 0
        if threads == 1 and not cmd.get("in_thread"):
            start = time.perf_counter()
            body(n)
            elapsed = time.perf_counter() - start
        else:
            elapsed = _run_threads(threads, lambda: body(n))
        reply: dict[str, Any] = {"ns_per_transfer": elapsed * 1e9 / (n * threads)}
        if requests and mode in _REQUESTS_PER_TRANSFER:
            reply["exact"] = requests() - before == n * threads * _REQUESTS_PER_TRANSFER[mode]
        return reply

    return handle


# -- c. and e.: directories of ranks, and their servers -------------------------------------------------------

def fill_ours(count: int, directory: str) -> tuple[dict[str, Any], Handler]:
    """``count`` live stores, each locked by this process for as long as it runs."""
    from store import DEFAULT_BUCKETS_US, StoreIdentity, StoreWriter

    _raise_fd_limit()
    hostname = socket.gethostname()
    writers = []
    for i in range(count):
        writer = StoreWriter(directory, StoreIdentity(f"rank-{i}", hostname, str(i % 8), i, DEFAULT_BUCKETS_US))
        history, extras = rank_history(i)
        for xfer, post, nbytes, is_write in history:
            writer.record_transfer(xfer, post, nbytes, is_write)
        for event, value in extras:
            writer.record(event, value)
        writers.append(writer)

    def handle(cmd: dict[str, Any]) -> dict[str, Any]:
        return {"files": [str(w.path) for w in writers]}

    return {"ranks": count, "pid": os.getpid()}, handle


def fill_ref(count: int, directory: str) -> tuple[dict[str, Any], Handler]:
    """``count`` processes' prometheus_client files, written by prometheus_client itself.

    Each simulated process gets its own multiprocess value class with its own
    pid (prometheus_client's documented process_identifier hook), so the
    files are byte for byte what ``count`` processes would have written.
    """
    from prometheus_client import values

    hostname = socket.gethostname()
    for i in range(count):
        pid = 100_000 + i
        values.ValueClass = values.MultiProcessValue(process_identifier=lambda pid=pid: pid)
        rank = reference_rank(hostname, f"rank-{i}", pid, 0, str(i % 8))
        record = rank.transfer_recorder()
        history, extras = rank_history(i)
        for xfer, post, nbytes, is_write in history:
            record(xfer, post, nbytes, is_write)
        for event, value in extras:
            rank.extra(event, value)
        values.ValueClass.close_all_files()  # type: ignore[attr-defined]
    files = sorted(str(p) for p in Path(directory).glob("*.db"))

    def handle(cmd: dict[str, Any]) -> dict[str, Any]:
        return {"files": files}

    return {"ranks": count, "files": len(files)}, handle


def _serve(app: Any) -> tuple[int, Any]:
    from app.listener import bind_listener
    from app.server import serve_in_thread

    sock = bind_listener("127.0.0.1", 0)
    port = sock.getsockname()[1]
    try:
        server, _thread = serve_in_thread(sock, app, "bench-server")
    finally:
        sock.close()  # the server serves its own duplicate
    return port, server


def serve_ours(directory: str) -> tuple[dict[str, Any], Handler]:
    """Our WSGI app over the directory, under the endpoint's werkzeug server."""
    from app.collector import Collector
    from app.exposition import Renderer
    from app.web import MetricsApp

    _raise_fd_limit()
    collector = Collector(directory, 30.0)
    app = MetricsApp(collector, lambda: {"pid": os.getpid(), "mode": "bench"})
    port, _server = _serve(app)
    renderer = Renderer()

    def inproc() -> int:
        # What a scrape does: the stores rendered batch by batch as the collection reads them, the body's
        # pieces never joined (the server sends them as they are).
        body = renderer.exposition()
        collector.collect(lambda views: body.add([view.snapshot for view in views]))
        return sum(map(len, body.finish()))

    return {"port": port, "pid": os.getpid(), **_status()}, _serve_handler(inproc)


def serve_ref(directory: str) -> tuple[dict[str, Any], Handler]:
    """prometheus_client's make_wsgi_app over MultiProcessCollector, under the same werkzeug server."""
    from prometheus_client import CollectorRegistry, generate_latest, make_wsgi_app
    from prometheus_client.multiprocess import MultiProcessCollector

    _raise_fd_limit()
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=directory)
    port, _server = _serve(make_wsgi_app(registry))

    def inproc() -> int:
        return len(generate_latest(registry))

    return {"port": port, "pid": os.getpid(), **_status()}, _serve_handler(inproc)


def _serve_handler(inproc: Callable[[], int]) -> Handler:
    def handle(cmd: dict[str, Any]) -> dict[str, Any]:
        if cmd["op"] == "inproc":
            times, size = [], 0
            for _ in range(int(cmd.get("k", 1))):  # back to back: the warm, per-scrape CPU cost
                start = time.perf_counter()
                size = inproc()
                times.append(time.perf_counter() - start)
            return {"seconds": times, "bytes": size}
        if cmd["op"] == "status":
            gc.collect()
            return _status()
        raise ValueError(f"unknown op {cmd['op']!r}")

    return handle


# -- f.: the C++ plug-in's endpoint, and our in-process owner under load ------------------------------------

def plugin_owner() -> tuple[dict[str, Any], Handler]:
    """A NIXL agent (nixl-cu12's C++ prometheus_mp plug-in) that wins the election and serves the directory.

    Its environment (NIXL_TELEMETRY_*) comes from the scenario; it writes one store of its own.
    """
    from nixl_cu12 import nixl_agent, nixl_agent_config

    agent = nixl_agent(f"cpp-{os.getpid()}", nixl_agent_config(backends=[]))

    def handle(cmd: dict[str, Any]) -> dict[str, Any]:
        return {"agent": agent.name}

    return {"pid": os.getpid()}, handle


def busy_owner() -> tuple[dict[str, Any], Handler]:
    """An Exporter that serves in-process while one thread of its rank records transfers flat out.

    The recording loop notes every gap between two of its iterations longer than 0.5 ms (the GIL taken
    away from it), so the scenario can ask for the longest one during each scrape.
    """
    from app import Exporter

    constructing = time.monotonic()
    exp = Exporter(f"busy-{os.getpid()}")
    record_transfer = exp.record_transfer
    running = threading.Event()
    gaps: list[tuple[float, float]] = []

    def loop() -> None:
        while running.wait():
            last = time.monotonic()
            while running.is_set():
                record_transfer(1200, 30, 4096, True)
                now = time.monotonic()
                if now - last > 0.0005:
                    gaps.append((last, now))
                last = now

    threading.Thread(target=loop, daemon=True).start()

    def handle(cmd: dict[str, Any]) -> dict[str, Any]:
        if cmd["op"] == "busy":
            gaps.clear()
            running.set()
        elif cmd["op"] == "idle":
            running.clear()
        elif cmd["op"] == "stall":  # the longest gap overlapping the window [start, end] (monotonic s)
            start, end = float(cmd["start"]), float(cmd["end"])
            return {"seconds": max((b - a for a, b in gaps if b > start and a < end), default=0.0)}
        return {"serving": exp.serving}

    return {"serving": exp.serving, "pid": os.getpid(), "constructing": constructing}, handle


# -- d.: a rank for the takeover ---------------------------------------------------------------------------

def rank(rate: float) -> tuple[dict[str, Any], Handler]:
    """An Exporter exporting ``rate`` events per second (none if 0) from a background thread until killed.

    ``close`` closes the Exporter (the job's end).  ``hold_gil`` makes the main thread keep the GIL in one C
    call of ``us`` microseconds (as some extensions do), answered once it returns, with when it began and ended
    (CLOCK_MONOTONIC, the same in every process).
    """
    from app import Exporter
    from store import EventType

    constructing = time.monotonic()
    exp = Exporter(f"takeover-{os.getpid()}")

    stopping = threading.Event()

    def loop() -> None:
        interval = 1.0 / rate
        due = time.monotonic()
        while not stopping.is_set():
            exp.export_event(EventType.AGENT_TX_BYTES, 4096)
            due += interval
            stopping.wait(max(0.0, due - time.monotonic()))

    ticker = threading.Thread(target=loop, daemon=True)
    if rate > 0:
        ticker.start()

    def handle(cmd: dict[str, Any]) -> dict[str, Any]:
        if cmd["op"] == "close":  # the job's end: this rank's Exporter closes (its recording thread first)
            stopping.set()
            if ticker.is_alive():
                ticker.join()
            exp.close()
            return {"closed": True}
        if cmd["op"] == "hold_gil":
            import ctypes

            usleep = ctypes.PyDLL(None).usleep  # PyDLL: the call keeps the GIL
            start = time.monotonic()
            usleep(int(cmd["us"]))
            return {"start": start, "end": time.monotonic()}
        return {"serving": exp.serving}

    return {"serving": exp.serving, "pid": os.getpid(), "constructing": constructing}, handle


KINDS: dict[str, Callable[..., tuple[dict[str, Any], Handler]]] = {
    "record-ours": record_ours,
    "record-ref": record_ref,
    "fill-ours": lambda n, d: fill_ours(int(n), d),
    "fill-ref": lambda n, d: fill_ref(int(n), d),
    "serve-ours": serve_ours,
    "serve-ref": serve_ref,
    "rank": lambda rate: rank(float(rate)),
    "plugin-owner": plugin_owner,
    "busy-owner": busy_owner,
}


def main(argv: list[str]) -> int:
    # The protocol gets its own descriptor; whatever else writes to stdout (the C++ plug-in's agent logs
    # there) goes to stderr, so it cannot corrupt the JSON lines.
    out = open(os.dup(sys.stdout.fileno()), "w", buffering=1)  # open for the process's life
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    try:
        hello, handle = KINDS[argv[0]](*argv[1:])
    except Exception:
        out.write(json.dumps({"error": traceback.format_exc()}) + "\n")
        out.flush()
        return 1
    out.write(json.dumps(hello) + "\n")
    out.flush()
    for line in sys.stdin:
        try:
            reply = handle(json.loads(line))
        except Exception:
            reply = {"error": traceback.format_exc()}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
