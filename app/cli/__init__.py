"""``python -m app`` / ``nixl-prometheus-mp``: demo, serve, inspect, top.

Errors are one line on stderr and a non-zero exit, never a traceback: the
people running this are operators reading a terminal or a pod log.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import functools
import json
import logging
import math
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from app.collector import Collector
from app.config import (
    DIR_ENV,
    LOCAL_ENV,
    MAX_TTL_S,
    PORT_ENV,
    TTL_ENV,
    Config,
    ConfigError,
    ascii_int,
    prepare_directory,
)
from app.probe import die_with_parent, exit_words, get_healthz, port_holders
from store import EventType, native
from store.layout import STORE_PREFIX, STORE_SUFFIX, is_store_name
from store.reader import Snapshot, Unreadable, open_store, probe_alive, read_fd

log = logging.getLogger("nixl_prometheus_mp.cli")
PROG = "nixl-prometheus-mp"


class CliError(Exception):
    """A user-facing runtime failure: printed as one line, exit status 1.

    Bad arguments (argparse) and bad settings (ConfigError) exit with 2.
    """


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class StopSignals:
    """SIGTERM, SIGINT and SIGHUP as a flag plus a byte on a self-pipe, for the main thread.

    SIGHUP is a stop too: a closed terminal must not end a command by the
    default action, which skips its clean-up (a demo would leave its
    temporary directory behind, a rank its store, serve its election).

    The handler does nothing else.  It runs between two bytecodes of the
    main thread, which may be inside threading.Event.wait(), or inside an
    earlier run of the handler, holding the lock Event.set() needs: a
    handler calling set() hung about one stop in five under repeated
    signals.  os.write on a non-blocking pipe takes no lock.
    """

    def __init__(self) -> None:
        self.signum = 0
        self._read, self._write = os.pipe()
        for fd in (self._read, self._write):
            os.set_blocking(fd, False)  # a full pipe already holds a pending wake-up
        self._previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}

    def _handle(self, signum: int, frame: object) -> None:
        self.signum = signum
        with contextlib.suppress(OSError):
            os.write(self._write, b"\0")

    def wait(self, timeout: float) -> bool:
        """Sleep up to ``timeout`` seconds, less if a stop signal arrives; True once one has."""
        if not self.signum:
            # After a signal, select is resumed (PEP 475) and sees the byte.
            select.select([self._read], [], [], max(0.0, timeout))
        return bool(self.signum)

    def close(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        os.close(self._read)
        os.close(self._write)


# -- demo -------------------------------------------------------------------

RANK_COMMAND = "_rank"  # a demo rank process (internal, but deploy/ starts ranks with it)
DEMO_PORT = 9111  # not 9090, which a Prometheus on the same host listens on by default
OWNER_WAIT_S = 20.0  # for the first demo rank to serve: imports on a loaded host take seconds
RANK_STOP_S = 10.0  # for the ranks to close their stores after SIGTERM, before SIGKILL
# A rank ended by one of these crashed by itself; any other signal was sent to it (kill, the OOM killer).
CRASH_SIGNALS = frozenset({signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL, signal.SIGABRT,
                           signal.SIGSYS})


def _demo_rank(args: argparse.Namespace) -> int:
    """One demo rank: NIXL-like transfers until SIGTERM/SIGINT or the duration ends."""
    from app.exporter import Exporter

    stop = StopSignals()
    if args.parent_pid:
        die_with_parent(args.parent_pid)  # a demo killed with SIGKILL cannot forward SIGTERM to its ranks
    rng = random.Random(os.getpid())
    deadline = time.monotonic() + args.duration if args.duration else None
    with Exporter(args.name) as exp:
        exp.record_memory_registered(1 << 30)  # a 1 GiB registered buffer, as a KV cache would be
        while not stop.signum and (deadline is None or time.monotonic() < deadline):
            nbytes = 1 << rng.randint(12, 26)  # 4 KiB .. 64 MiB
            post_us = rng.randint(3, 60)
            xfer_us = int(post_us + nbytes / 20_000 * rng.uniform(0.8, 1.6))  # ~20 GB/s with jitter
            exp.record_transfer(xfer_us, post_us, nbytes, is_write=rng.random() < 0.5)
            if rng.random() < 0.002:
                exp.record_error(rng.choice(["backend", "remote_disconnect", "canceled"]))
            stop.wait(1.0 / args.rate)
        exp.record_memory_deregistered(1 << 30)
    return 0


class _Totals:
    """The demo's progress line, from the last values seen in every store.

    The owner reaps a departed rank's store after the TTL; summing only the
    stores on disk would make the totals drop, which reads as a counter
    reset.  A store's counters only grow, so remembering each store's last
    values keeps the totals monotonic.
    """

    def __init__(self, directory: Path, port: int, started: float) -> None:
        self.directory, self.port = directory, port
        self.started = started  # when the ranks were started: the GB/s average is over their run
        self.collector = Collector(directory, stale_ttl_s=MAX_TTL_S)  # the demo itself never reaps
        self.seen: dict[str, tuple[int, int, int]] = {}  # store name -> (bytes, requests, errors)

    def line(self) -> str:
        coll = self.collector.collect()
        for s in coll.published:
            c = s.counters
            self.seen[s.path.name] = (
                c[EventType.AGENT_TX_BYTES] + c[EventType.AGENT_RX_BYTES],
                c[EventType.AGENT_TX_REQUESTS_NUM] + c[EventType.AGENT_RX_REQUESTS_NUM],
                sum(c[ev] for ev in EventType if ev.name.startswith("AGENT_ERR_")))
        moved, reqs, errors = (sum(column) for column in zip(*self.seen.values(), strict=True)) if self.seen \
            else (0, 0, 0)
        live = len(coll.live)
        elapsed = max(time.monotonic() - self.started, 1e-9)
        return (f"ranks live {live} departed {len(self.seen) - live} | transfers {reqs} | "
                f"{moved / 1e9:.1f} GB moved ({moved / elapsed / 1e9:.2f} GB/s) | errors {errors} | "
                f"http://127.0.0.1:{self.port}/metrics")


def _show(text: str, end: str = "\n") -> None:
    """Print a line of the demo's progress, unless its terminal has hung up.

    Writing to a terminal that went away fails with EIO, and may do so
    before its SIGHUP is handled: then stop as that signal does, without a
    traceback, and send the rest (stdout's unwritten buffer too) nowhere.
    """
    try:
        print(text, end=end, flush=True)
    except OSError as exc:
        if exc.errno != errno.EIO:
            raise
        sys.stdout = open(os.devnull, "w")  # for the rest of the process: the terminal is gone
        signal.raise_signal(signal.SIGHUP)


def _is_failure(status: int) -> bool:
    """A rank's own failure; a rank someone killed (kill -9 of the serving rank, say) is not the demo's."""
    return status > 0 or (status < 0 and -status in CRASH_SIGNALS)


def _report_ended(procs: list[subprocess.Popen[bytes]], reported: dict[int, str], interactive: bool) -> None:
    """A line for each rank that ended other than cleanly since the last call, kept in ``reported``."""
    for rank, p in enumerate(procs):
        if p.poll() and rank not in reported:
            reported[rank] = f"rank {rank} (pid {p.pid}) {exit_words(p.returncode)}"
            _show(("\n" if interactive else "") + reported[rank])


def _failures(procs: list[subprocess.Popen[bytes]], reported: dict[int, str]) -> None:
    """CliError naming the reported ranks that failed by themselves."""
    failed = [line for rank, line in reported.items() if _is_failure(procs[rank].returncode)]
    if failed:
        raise CliError(f"{len(failed)} of {len(procs)} demo ranks failed: {', '.join(failed)}")


def _check_port_free(port: int) -> None:
    """Refuse, naming the holder, a port another program already listens on."""
    from app.server import bind_listener

    try:
        bind_listener("127.0.0.1", port).close()
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise CliError(f"port {port} on 127.0.0.1 is already in use by {port_holders(port)}: stop it or "
                           "choose another port with --port") from None
        raise CliError(f"cannot listen on 127.0.0.1:{port}: {os.strerror(exc.errno or 0)}") from None


def _serving_rank(port: int, procs: list[subprocess.Popen[bytes]], stop: StopSignals) -> int | None:
    """The pid of the demo rank that serves ``port`` (None if stopped first); CliError if none does."""
    pids = {p.pid for p in procs}
    deadline = time.monotonic() + OWNER_WAIT_S
    while not stop.wait(0.1):
        if all(p.poll() is not None for p in procs):
            raise CliError(f"every demo rank ended before serving: rank 0 {exit_words(procs[0].returncode)}")
        owner = get_healthz("127.0.0.1", port).owner
        pid = None if owner is None else owner.get("pid")
        if isinstance(pid, int) and pid in pids:
            return pid
        if time.monotonic() > deadline:
            raise CliError(f"no demo rank serves 127.0.0.1:{port} after {OWNER_WAIT_S:.0f} s; the port is held by "
                           f"{port_holders(port)}")
    return None


def _stop_ranks(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM every rank, SIGKILL those still running after RANK_STOP_S; always reaps."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + RANK_STOP_S
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def cmd_demo(args: argparse.Namespace) -> int:
    stop = StopSignals()  # first: a stop during start-up must still reap the ranks and remove the directory
    try:
        return _run_demo(args, stop)
    finally:
        stop.close()


def _run_demo(args: argparse.Namespace, stop: StopSignals) -> int:
    _check_port_free(args.port)
    env = {**os.environ, PORT_ENV: str(args.port), LOCAL_ENV: "y"}
    env.setdefault(TTL_ENV, "10")  # departed demo ranks leave /metrics 10 s after they stop, unless told otherwise
    chosen = Path(args.dir).absolute() if args.dir else None  # the ranks need an absolute path
    # The ranks' settings, refused once here rather than once per rank, and
    # before any directory is created (the temporary one has no name yet).
    Config.from_env({**env, DIR_ENV: str(chosen or tempfile.gettempdir())})
    if chosen:
        prepare_directory(chosen, "--dir")  # the user named the directory with the flag, not the variable
    directory = chosen or Path(tempfile.mkdtemp(prefix="nixl-metrics-demo-"))
    env[DIR_ENV] = str(directory)
    procs: list[subprocess.Popen[bytes]] = []
    interactive = sys.stdout.isatty()
    started = time.monotonic()
    try:
        for rank in range(args.ranks):
            if stop.signum:
                return 0
            env["LOCAL_RANK"] = str(rank)
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "app", RANK_COMMAND, "--name", f"demo-agent-{rank}", "--rate", str(args.rate),
                 "--duration", str(args.duration), "--parent-pid", str(os.getpid())], env=env))
        owner = _serving_rank(args.port, procs, stop)
        if owner is None:
            return 0
        _show(f"{args.ranks} ranks recording into {directory}; rank pid {owner} serves "
              f"http://127.0.0.1:{args.port}/metrics and /healthz (Ctrl-C to stop)")
        totals = _Totals(directory, args.port, started)
        reported: dict[int, str] = {}  # rank -> how it ended, for every rank that did not end cleanly
        while any(p.poll() is None for p in procs):
            _report_ended(procs, reported, interactive)
            line = totals.line()
            _show(f"\r{line}  " if interactive else line, end="" if interactive else "\n")
            if stop.wait(1.0):
                if stop.signum != signal.SIGHUP:  # nobody reads it after a hang-up
                    _show("\nstopping the ranks" if interactive else "stopping the ranks")
                # Only what ended before the stop: the stop itself ends the ranks.
                _failures(procs, reported)
                return 0
        _report_ended(procs, reported, interactive)
        _show(("\n" if interactive else "") + totals.line())
        _failures(procs, reported)
        return 0
    finally:
        _stop_ranks(procs)
        if not args.dir:
            shutil.rmtree(directory, ignore_errors=True)  # only the directory this demo created


# -- serve ------------------------------------------------------------------

def cmd_serve(args: argparse.Namespace) -> int:
    from app.server import bind_listener, close_listener, serve_in_thread
    from app.standalone import build_app, hold_election, prepare_standalone, release_election

    config = Config.from_env()
    prepare_standalone(config)
    hold_election(config)
    stop = StopSignals()
    try:
        try:
            sock = bind_listener(config.host, config.port)
        except OSError as exc:
            raise CliError(f"cannot bind {config.address}: {os.strerror(exc.errno or 0)}") from None
        try:
            server, thread = serve_in_thread(sock, build_app(config), "nixl-aggregator")
        finally:
            close_listener(sock)  # the server serves its own duplicate
        log.info("serving %s on http://%s/metrics", config.directory, config.address)
        while not stop.wait(0.5) and thread.is_alive():
            pass
        server.shutdown()
        thread.join(timeout=5)
    finally:
        stop.close()
        release_election()
    return 0


# -- aggregate --------------------------------------------------------------

AGGREGATE_COMMAND = "aggregate"
AGGREGATOR_CONFIG, AGGREGATOR_APP = "python:app.gunicorn_conf", "app:wsgi"


def cmd_aggregate(gunicorn_args: list[str]) -> int:
    """``gunicorn -c python:app.gunicorn_conf [ARGS] app:wsgi``, with this installation's packages.

    The gunicorn command puts its working directory first on sys.path before it imports the configuration
    and the app, so an app/ or store.py there is imported instead of these. Run from this console script,
    whose sys.path does not start with the working directory, app, store and election are already imported
    when gunicorn looks them up: no working directory changes what runs.
    """
    from gunicorn.app.wsgiapp import WSGIApplication
    from gunicorn.config import Config as GunicornConfig

    prog = f"{PROG} {AGGREGATE_COMMAND}"
    given = GunicornConfig(prog=prog).parser().parse_args(gunicorn_args)  # --help and bad options: gunicorn's
    if given.config or given.args:  # a usage error, as argparse's are: one line, exit status 2
        print(f"{PROG}: error: {prog} runs gunicorn -c {AGGREGATOR_CONFIG} [OPTIONS] {AGGREGATOR_APP}: give it "
              f"gunicorn options only, not {'-c ' + given.config if given.config else ' '.join(given.args)}",
              file=sys.stderr)
        return 2
    sys.argv = [prog, "-c", AGGREGATOR_CONFIG, *gunicorn_args, AGGREGATOR_APP]  # what gunicorn parses
    WSGIApplication("%(prog)s [GUNICORN OPTIONS]", prog=prog).run()  # exits: gunicorn's master ends with sys.exit
    return 0


# -- inspect ----------------------------------------------------------------

def _store_like_names(directory: Path) -> tuple[list[str], list[str]]:
    """The directory's store names, and the names that only look like one (``nixl.*.mmap``, never opened)."""
    try:
        names = sorted(n for n in os.listdir(directory) if n.startswith(STORE_PREFIX) and n.endswith(STORE_SUFFIX))
    except OSError as exc:
        raise CliError(f"cannot list {directory}: {os.strerror(exc.errno or 0)}") from None
    return [n for n in names if is_store_name(n)], [n for n in names if not is_store_name(n)]


def _inspect_rows(directory: Path, names: list[str]) -> list[dict[str, Any]]:
    """Every store, read without ever reaping or locking for long."""
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


def _print_table(table: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    for r in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())


def _speedups_line() -> str:
    """Which path this installation's hot paths take (as /healthz's ``speedups`` says for the serving process)."""
    status = native.status()
    forced = f" ({native.PURE_PYTHON_ENV} forces the Python path)" if status.pop("pure_python_forced") else ""
    paths = ", ".join(f"{name} {path}" for name, path in status.items())
    return f"speedups of this installation (c or python): {paths}{forced}"


def cmd_inspect(args: argparse.Namespace) -> int:
    directory = Path(args.directory)
    stores, lookalikes = _store_like_names(directory)
    rows = _inspect_rows(directory, stores)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    columns = ("agent_name", "pid", "agent_instance", "local_rank", "state", "age_s", "tx_bytes", "rx_bytes",
               "requests", "errors")
    table: list[tuple[str, ...]] = [
        ("AGENT", "PID", "INST", "RANK", "STATE", "AGE(s)", "TX BYTES", "RX BYTES", "REQUESTS", "ERRORS")]
    invalid: list[tuple[str, ...]] = [("INVALID STORE", "PROBLEM")]
    for row in rows:
        if "problem" in row:  # not a store's columns: listed apart, by file name
            invalid.append((row["store"], row["problem"]))
            continue
        row = {**row, "state": "alive" if row["alive"] else "departed"}
        table.append(tuple("-" if row[c] is None else str(row[c]) for c in columns))
    _print_table(table)
    if len(invalid) > 1:
        print()
        _print_table(invalid)
    if not rows:
        print(f"(no stores in {args.directory})")
    if lookalikes:
        # Readers only ever open names that parse: saying "too small" here would claim this file was read.
        print()
        print("NOT A STORE (not named nixl.<pid>.<run_marker>.<instance>.mmap: never read nor reaped)")
        print("\n".join(lookalikes))
    print()
    print(_speedups_line())
    return 0


# -- top ----------------------------------------------------------------------

def cmd_top(args: argparse.Namespace) -> int:
    from app.top import run

    return run(args.directory, args.once, args.json, args.interval, args.ttl)


def _ttl_flag(text: str) -> float:
    from app.config import stale_ttl

    try:
        return stale_ttl(text, "--ttl")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# -- entry point ------------------------------------------------------------

def _bounded(kind: Callable[[str], float], what: str, ok: Callable[[float], bool]) -> Callable[[str], Any]:
    """An argparse ``type``: refuses, naming the value, anything but ``what``."""
    def parse(text: str) -> Any:
        try:
            value = ascii_int(text) if kind is int else kind(text.strip())
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value
    return parse


_RANKS = _bounded(int, "a number of ranks >= 1", lambda v: v >= 1)
_PORT = _bounded(int, "a port number 1..65535", lambda v: 1 <= v <= 65535)
_RATE = _bounded(float, "a finite number of transfers per second > 0", lambda v: math.isfinite(v) and v > 0)
_DURATION = _bounded(float, "a finite number of seconds >= 0", lambda v: math.isfinite(v) and v >= 0)
_INTERVAL = _bounded(float, "a finite number of seconds > 0", lambda v: math.isfinite(v) and v > 0)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line too (the usage is in --help)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="NIXL multi-process Prometheus telemetry exporter")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run N rank processes recording NIXL-like transfers behind one endpoint")
    demo.add_argument("--ranks", type=_RANKS, default=4, help="rank processes to start (default 4)")
    demo.add_argument("--port", type=_PORT, default=DEMO_PORT,
                      help=f"scrape port, bound on 127.0.0.1 (default {DEMO_PORT})")
    demo.add_argument("--duration", type=_DURATION, default=0, help="seconds to run (default 0: until Ctrl-C)")
    demo.add_argument("--rate", type=_RATE, default=200, help="transfers per second per rank (default 200)")
    demo.add_argument("--dir", help="shared directory (default: a new private temporary directory, removed on exit)")
    demo.set_defaults(func=cmd_demo)
    serve = sub.add_parser("serve", help=f"the standalone aggregator on werkzeug (configured by {DIR_ENV} etc.)")
    serve.set_defaults(func=cmd_serve)
    # Listed for --help; main() hands every argument after it to gunicorn unparsed.
    sub.add_parser(AGGREGATE_COMMAND, help=f"the standalone aggregator on gunicorn, from any working directory: "
                                           f"gunicorn -c {AGGREGATOR_CONFIG} [GUNICORN OPTIONS] {AGGREGATOR_APP}",
                   add_help=False)
    inspect = sub.add_parser("inspect", help="list every store in a directory (never reaps)")
    inspect.add_argument("directory")
    inspect.add_argument("--json", action="store_true", help="JSON instead of a table")
    inspect.set_defaults(func=cmd_inspect)
    top = sub.add_parser("top", help="a live per-rank view of a directory: rates, transfer time p50/p99, errors "
                                     "(never reaps)")
    top.add_argument("directory", nargs="?", help=f"the shared directory (default: ${DIR_ENV})")
    top.add_argument("--once", action="store_true", help="print one snapshot over --interval and exit")
    top.add_argument("--json", action="store_true", help="one snapshot (as --once) as a JSON list of stores")
    top.add_argument("--interval", type=_INTERVAL, default=1.0, help="seconds per refresh (default 1)")
    top.add_argument("--ttl", type=_ttl_flag, help=f"seconds a departed rank stays published (default: ${TTL_ENV} "
                                                   "or 30, as the ranks read it)")
    top.set_defaults(func=cmd_top)
    return parser


def build_rank_parser() -> argparse.ArgumentParser:
    """``_rank``: one demo rank; parsed apart so that --help and usage errors never list it."""
    rank = _Parser(prog=f"{PROG} {RANK_COMMAND}")
    rank.add_argument("--name", required=True)
    rank.add_argument("--rate", type=_RATE, default=200)
    rank.add_argument("--duration", type=_DURATION, default=0)
    rank.add_argument("--parent-pid", type=int, default=0)  # the demo's: die with it
    rank.set_defaults(func=_demo_rank)
    return rank


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    run: Callable[[], int]
    if argv[:1] == [AGGREGATE_COMMAND]:  # gunicorn's options and gunicorn's logging, not ours
        run = functools.partial(cmd_aggregate, argv[1:])
    else:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        args = (build_rank_parser().parse_args(argv[1:]) if argv[:1] == [RANK_COMMAND]
                else build_parser().parse_args(argv))
        run = functools.partial(args.func, args)
    try:
        return int(run())
    except ConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except CliError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C before a command installed its own handling (serve's wait for the address)
        return 128 + signal.SIGINT
