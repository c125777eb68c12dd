"""``python -m app`` / ``nixl-prometheus-mp``: demo, serve, inspect.

Errors are one line on stderr and a non-zero exit, never a traceback: the
people running this are operators reading a terminal or a pod log.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from app.collector import Collector
from app.config import DIR_ENV, LOCAL_ENV, PORT_ENV, TTL_ENV, ConfigError
from store import EventType
from store.layout import STORE_PREFIX, STORE_SUFFIX
from store.reader import Snapshot, Unreadable, open_store, probe_alive, read_fd

log = logging.getLogger("nixl_prometheus_mp.cli")
PROG = "nixl-prometheus-mp"


class CliError(Exception):
    """A user-facing failure: printed as one line, exit status 2."""


# -- demo -------------------------------------------------------------------

def _demo_rank(args: argparse.Namespace) -> int:
    """One demo rank: NIXL-like transfers until SIGTERM or the duration ends."""
    from app import Exporter

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    rng = random.Random(os.getpid())
    deadline = time.monotonic() + args.duration if args.duration else None
    with Exporter(args.name) as exp:
        exp.record_memory_registered(1 << 30)  # a 1 GiB registered buffer, as a KV cache would be
        while not stop.is_set() and (deadline is None or time.monotonic() < deadline):
            nbytes = 1 << rng.randint(12, 26)  # 4 KiB .. 64 MiB
            post_us = rng.randint(3, 60)
            xfer_us = int(post_us + nbytes / 20_000 * rng.uniform(0.8, 1.6))  # ~20 GB/s with jitter
            exp.record_transfer(xfer_us, post_us, nbytes, is_write=rng.random() < 0.5)
            if rng.random() < 0.002:
                exp.record_error(rng.choice(["backend", "remote_disconnect", "canceled"]))
            stop.wait(1.0 / args.rate)
        exp.record_memory_deregistered(1 << 30)
    return 0


def _summary(directory: Path, port: int, started: float) -> str:
    coll = Collector(directory, stale_ttl_s=1e9).collect()  # a huge TTL: the demo never reaps
    snaps = coll.published
    tx = sum(s.counters[EventType.AGENT_TX_BYTES] + s.counters[EventType.AGENT_RX_BYTES] for s in snaps)
    reqs = sum(s.counters[EventType.AGENT_TX_REQUESTS_NUM] + s.counters[EventType.AGENT_RX_REQUESTS_NUM]
               for s in snaps)
    errors = sum(s.counters[ev] for s in snaps for ev in EventType if ev.name.startswith("AGENT_ERR_"))
    elapsed = max(time.monotonic() - started, 1e-9)
    return (f"ranks live {len(coll.live)} departed {len(coll.stale)} | transfers {reqs} | "
            f"{tx / 1e9:.1f} GB moved ({tx / elapsed / 1e9:.2f} GB/s) | errors {errors} | "
            f"http://127.0.0.1:{port}/metrics")


def cmd_demo(args: argparse.Namespace) -> int:
    if args.ranks < 1:
        raise CliError(f"--ranks {args.ranks}: at least one rank is needed")
    directory = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="nixl-metrics-demo-"))
    env = dict(os.environ)
    env.update({DIR_ENV: str(directory), PORT_ENV: str(args.port), LOCAL_ENV: "y", TTL_ENV: "10"})
    procs: list[subprocess.Popen[bytes]] = []
    interactive = sys.stdout.isatty()
    try:
        for rank in range(args.ranks):
            env["LOCAL_RANK"] = str(rank)
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "app", "_rank", "--name", f"demo-agent-{rank}", "--rate", str(args.rate),
                 "--duration", str(args.duration or 0)], env=env))
        print(f"{args.ranks} ranks recording into {directory}; one of them serves "
              f"http://127.0.0.1:{args.port}/metrics and /healthz (Ctrl-C to stop)", flush=True)
        started = time.monotonic()
        while any(p.poll() is None for p in procs):
            line = _summary(directory, args.port, started)
            print(f"\r{line}  " if interactive else line, end="" if interactive else "\n", flush=True)
            time.sleep(1.0)
        failed = [p.returncode for p in procs if p.returncode]
        print(("\n" if interactive else "") + _summary(directory, args.port, started), flush=True)
        if failed:
            raise CliError(f"{len(failed)} demo rank(s) failed (exit status {failed[0]})")
    except KeyboardInterrupt:
        print("\nstopping the ranks", flush=True)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    return 0


# -- serve ------------------------------------------------------------------

def cmd_serve(args: argparse.Namespace) -> int:
    from app.endpoint import bind_listener, serve_in_thread
    from app.standalone import build_app, hold_election, prepare_standalone, release_election

    config = prepare_standalone()
    hold_election(config)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        try:
            sock = bind_listener(config.host, config.port)
        except OSError as exc:
            raise CliError(f"cannot bind {config.address}: {os.strerror(exc.errno or 0)}") from None
        server, thread = serve_in_thread(sock, build_app(config), "nixl-aggregator")
        log.info("serving %s on http://%s/metrics", config.directory, config.address)
        try:
            while not stop.wait(0.5) and thread.is_alive():
                pass
        except KeyboardInterrupt:
            pass
        server.shutdown()
        thread.join(timeout=5)
    finally:
        release_election()
    return 0


# -- inspect ----------------------------------------------------------------

def _inspect_rows(directory: Path) -> list[dict[str, Any]]:
    """Every store, read without ever reaping or locking for long."""
    try:
        names = sorted(n for n in os.listdir(directory) if n.startswith(STORE_PREFIX) and n.endswith(STORE_SUFFIX))
    except OSError as exc:
        raise CliError(f"cannot list {directory}: {os.strerror(exc.errno or 0)}") from None
    now = time.monotonic_ns()
    rows: list[dict[str, Any]] = []
    for name in names:
        path = directory / name
        fd = open_store(path)
        if isinstance(fd, Unreadable):
            rows.append({"store": name, "problem": fd.reason})
            continue
        try:
            alive = probe_alive(fd)
            content = read_fd(fd, path)
        finally:
            os.close(fd)
        if not isinstance(content, Snapshot):
            rows.append({"store": name, "problem": content.reason, "alive": alive})
            continue
        c = content.counters
        rows.append({
            "store": name, "agent_name": content.agent_name, "pid": content.pid, "agent_instance": content.instance,
            "local_rank": content.local_rank or None, "hostname": content.hostname, "alive": alive,
            "age_s": round(max(0, now - content.last_update_ns) / 1e9, 1),
            "tx_bytes": c[EventType.AGENT_TX_BYTES], "rx_bytes": c[EventType.AGENT_RX_BYTES],
            "requests": c[EventType.AGENT_TX_REQUESTS_NUM] + c[EventType.AGENT_RX_REQUESTS_NUM],
            "errors": sum(c[ev] for ev in EventType if ev.name.startswith("AGENT_ERR_")),
        })
    return rows


def cmd_inspect(args: argparse.Namespace) -> int:
    rows = _inspect_rows(Path(args.directory))
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    columns = ("agent_name", "pid", "agent_instance", "local_rank", "state", "age_s", "tx_bytes", "rx_bytes",
               "requests", "errors")
    table: list[tuple[str, ...]] = [
        ("AGENT", "PID", "INST", "RANK", "STATE", "AGE(s)", "TX BYTES", "RX BYTES", "REQUESTS", "ERRORS")]
    for row in rows:
        if "problem" in row:
            table.append((row["store"], "-", "-", "-", "invalid", "-", "-", "-", "-", row["problem"]))
            continue
        row = {**row, "state": "alive" if row["alive"] else "departed"}
        table.append(tuple("-" if row[c] is None else str(row[c]) for c in columns))
    widths = [max(len(r[i]) for r in table) for i in range(len(columns))]
    for r in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())
    if not rows:
        print(f"(no stores in {args.directory})")
    return 0


# -- entry point ------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line too (the usage is in --help)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="NIXL multi-process Prometheus telemetry exporter")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run N rank processes recording NIXL-like transfers behind one endpoint")
    demo.add_argument("--ranks", type=int, default=4, help="rank processes to start (default 4)")
    demo.add_argument("--port", type=int, default=9090, help="scrape port, bound on 127.0.0.1 (default 9090)")
    demo.add_argument("--duration", type=float, default=0, help="seconds to run (default: until Ctrl-C)")
    demo.add_argument("--rate", type=float, default=200, help="transfers per second per rank (default 200)")
    demo.add_argument("--dir", help="shared directory (default: a new private temporary directory)")
    demo.set_defaults(func=cmd_demo)
    serve = sub.add_parser("serve", help=f"the standalone aggregator on werkzeug (configured by {DIR_ENV} etc.)")
    serve.set_defaults(func=cmd_serve)
    inspect = sub.add_parser("inspect", help="list every store in a directory (never reaps)")
    inspect.add_argument("directory")
    inspect.add_argument("--json", action="store_true", help="JSON instead of a table")
    inspect.set_defaults(func=cmd_inspect)
    rank = sub.add_parser("_rank")  # a demo rank process (internal)
    rank.add_argument("--name", required=True)
    rank.add_argument("--rate", type=float, default=200)
    rank.add_argument("--duration", type=float, default=0)
    rank.set_defaults(func=_demo_rank)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (CliError, ConfigError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
