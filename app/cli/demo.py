"""``nixl-prometheus-mp demo``: N rank processes recording NIXL-like transfers behind one endpoint, and
``rank``, one such rank (ranks only: whoever owns the job's address serves it).
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from app.cli.common import DURATION, RATE, CliError, error_count
from app.collector import Collector
from app.config import DIR_ENV, LOCAL_ENV, MAX_TTL_S, PORT_ENV, TTL_ENV, Config, prepare_directory
from app.probe import (
    SERVER_COMM,
    SPARE_COMM,
    die_with_parent,
    exit_words,
    get_healthz,
    is_address_server,
    listening_pids,
    listening_sockets,
    port_holders,
    runs_helper_command,
    signal_address_server,
)
from app.stopsignals import StopSignals
from store import EventType

RANK_COMMAND = "rank"  # one rank: the demo's, deploy/nixl-ranks.yaml's, or ranks fed to a standalone aggregator
DEMO_PORT = 9111  # not 9090, which a Prometheus on the same host listens on by default
OWNER_WAIT_S = 20.0  # for the first demo rank to serve: imports on a loaded host take seconds
RANK_STOP_S = 10.0  # for the ranks to close their stores after SIGTERM, before SIGKILL
SERVER_STOP_S = 5.0  # for a stopped address server to give the port up
# A rank ended by one of these crashed by itself; any other signal was sent to it (kill, the OOM killer).
CRASH_SIGNALS = frozenset({signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL, signal.SIGABRT,
                           signal.SIGSYS})


def cmd_rank(args: argparse.Namespace) -> int:
    """One rank: NIXL-like transfers until SIGTERM/SIGINT/SIGHUP or the duration ends.

    Configured by the environment only, as a NIXL rank is (no port or bind
    scope of its own): it joins whichever job shares its directory, port and
    NIXL_TELEMETRY_PROMETHEUS_LOCAL, and a standalone aggregator of that job
    serves it.  Stopped by a signal, it closes its store and then ends by
    that signal: status 128 + N to a shell or a container runtime.
    """
    from app.rank.exporter import Exporter

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
    # Out now, not through the interpreter's shutdown, which resets the signal handlers and then reports
    # ("Signal 15 ignored due to race condition", a traceback) a stop signal of a burst that arrived just before.
    # The store is released and nothing else of this process needs finalizing: flush what it wrote, and exit.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    if stop.signum:
        # Ended by the signal, not with 0: the demo can then name a rank someone else stopped (its own stop it
        # knows of), and a supervisor sees the signal, as of any Unix program that cleans up and re-raises it.
        signal.signal(stop.signum, signal.SIG_DFL)
        signal.raise_signal(stop.signum)  # to this thread: delivered before it returns
        os._exit(128 + stop.signum)  # (only if the default action did not end the process)
    os._exit(0)


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
                error_count(c))
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


def _report_ended(procs: list[subprocess.Popen[bytes]], reported: dict[int, str], interactive: bool,
                  stop: StopSignals) -> None:
    """A line for each rank that ended other than cleanly since the last call, kept in ``reported``."""
    ended = [(rank, p) for rank, p in enumerate(procs) if p.poll() and rank not in reported]
    if stop.signum:
        return  # a Ctrl-C reaches the ranks too (one process group), which end by it: not news
    for rank, p in ended:
        reported[rank] = f"rank {rank} (pid {p.pid}) {exit_words(p.returncode)}"
        _show(("\n" if interactive else "") + reported[rank])


def _failures(procs: list[subprocess.Popen[bytes]], reported: dict[int, str]) -> None:
    """CliError naming the reported ranks that failed by themselves."""
    failed = [line for rank, line in reported.items() if _is_failure(procs[rank].returncode)]
    if failed:
        raise CliError(f"{len(failed)} of {len(procs)} demo ranks failed: {', '.join(failed)}")


def _check_port_free(port: int) -> None:
    """Refuse, naming the holder, a port another program already listens on."""
    from app.listener import bind_listener

    try:
        bind_listener("127.0.0.1", port).close()
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise CliError(f"port {port} on 127.0.0.1 is already in use by {port_holders(port)}: stop it or "
                           "choose another port with --port") from None
        raise CliError(f"cannot listen on 127.0.0.1:{port}: {os.strerror(exc.errno or 0)}") from None


def _serving_rank(port: int, procs: list[subprocess.Popen[bytes]], stop: StopSignals) -> int | None:
    """The pid of the demo rank that started the server of ``port`` (None if stopped first); CliError if none
    did."""
    pids = {p.pid for p in procs}
    deadline = time.monotonic() + OWNER_WAIT_S
    while not stop.wait(0.1):
        # Looked at before asking: a server a rank started outlives the ranks (it publishes their final values),
        # and may still be starting once a short run's ranks are done: its port listens from the rank's bind on.
        ended = all(p.poll() is not None for p in procs)
        owner = get_healthz("127.0.0.1", port).owner
        pid = None if owner is None else owner.get("started_by")
        if isinstance(pid, int) and pid in pids:
            return pid
        if ended and not listening_sockets(port):
            raise CliError(f"every demo rank ended before serving: rank 0 {exit_words(procs[0].returncode)}")
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
    # The TTL is the library's default (30 s) unless told otherwise: deploy/prometheus-static.yml scrapes the
    # demo's port every 15 s, and only a TTL above that interval gets the ranks' final values to it.
    env = {**os.environ, PORT_ENV: str(args.port), LOCAL_ENV: "y"}
    chosen = Path(args.dir).absolute() if args.dir else None  # the ranks need an absolute path
    # The ranks' settings, refused once here rather than once per rank, and
    # before any directory is created (the temporary one has no name yet).
    ttl_s = Config.from_env({**env, DIR_ENV: str(chosen or tempfile.gettempdir())}).stale_ttl_s
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
        _show(f"{args.ranks} ranks recording into {directory}; rank pid {owner} started the server of "
              f"http://127.0.0.1:{args.port}/metrics and /healthz; a departed rank stays published "
              f"{ttl_s:g} s ({TTL_ENV}) (Ctrl-C to stop)")
        totals = _Totals(directory, args.port, started)
        reported: dict[int, str] = {}  # rank -> how it ended, for every rank that did not end cleanly
        while any(p.poll() is None for p in procs):
            _report_ended(procs, reported, interactive, stop)
            line = totals.line()
            _show(f"\r{line}  " if interactive else line, end="" if interactive else "\n")
            if stop.wait(1.0):
                break
        if stop.signum == signal.SIGHUP:
            # The terminal is gone, and with it whoever could cut a wait short: stop everything at once.
            _failures(procs, reported)  # only what ended before the stop: the stop itself ends the ranks
            return 0
        if stop.signum:
            # A first Ctrl-C or SIGTERM ends the ranks but lets their server finish: the final values stay
            # published until the TTL, as at the end of a --duration; a second stop ends the wait.
            _show("\nstopping the ranks (Ctrl-C again to stop at once)" if interactive
                  else "stopping the ranks (Ctrl-C again to stop at once)")
            stop.rearm()
            _stop_ranks(procs)
        else:
            _report_ended(procs, reported, interactive, stop)
        final = totals.line()  # the ranks' final values, read before the server reaps them after the TTL
        if not stop.signum:  # (a second stop ends the demo now)
            if interactive:
                _show("")  # the progress line has no end of its own
            # A failed run too: its final values are what tells what went wrong.
            _serve_final_values(args.port, ttl_s, stop)
        _show(final)  # the last line of the totals, every rank's final values included (then a failure's)
        _failures(procs, reported)
        return 0
    finally:
        _stop_ranks(procs)
        _stop_server(args.port)
        if not args.dir:
            shutil.rmtree(directory, ignore_errors=True)  # only the directory this demo created


def _serve_final_values(port: int, ttl_s: float, stop: StopSignals) -> None:
    """The ranks are done: their address server publishes their final values until the TTL after their last
    update has passed, then gives the port up.  The demo waits for that, so that a Prometheus scraping it gets
    them too, unless it is stopped first."""
    if get_healthz("127.0.0.1", port).owner is None:
        return  # nothing serves (thread mode: the ranks' threads went with them)
    _show(f"the ranks are done: their final values stay on http://127.0.0.1:{port}/metrics until {ttl_s:g} s "
          f"({TTL_ENV}) after their last update, for Prometheus to scrape (Ctrl-C to stop now)")
    deadline = time.monotonic() + ttl_s + OWNER_WAIT_S
    while get_healthz("127.0.0.1", port, timeout_s=0.5).owner is not None and time.monotonic() < deadline:
        if stop.wait(0.2):
            return  # (the caller stops the server)


def _stop_server(port: int) -> None:
    """Stop the demo's address server and its spare, if they still serve (the demo was stopped twice or hung up
    on, or stopped during start-up, or an error ended it), before its directory goes.  Found through /proc: a
    /healthz slow to answer on a loaded host must not leave it running.  A server or spare still starting holds
    the port before it shows as ours (its launcher has our command line, not yet our name): waited on until it
    does."""
    address = f"127.0.0.1:{port}"
    deadline = time.monotonic() + SERVER_STOP_S
    while listening_sockets(port) and time.monotonic() < deadline:
        holders = listening_pids(port)
        ours = [pid for pid in holders if is_address_server(pid, address, (SERVER_COMM, SPARE_COMM))]
        if holders and not any(runs_helper_command(pid, address) for pid in holders):
            return  # another program's listener: not the demo's to stop
        for pid in ours:  # SIGINT: a server gives the port up at once (its spare first; SIGTERM would let it
            # finish publishing first) and exits; a spare just ends
            signal_address_server(pid, address, signal.SIGINT, (SERVER_COMM, SPARE_COMM))
        time.sleep(0.02)


def add_rank_parser(sub: argparse._SubParsersAction[Any]) -> None:
    """``rank``: one rank of the demo's kind, configured by the environment alone (ranks only)."""
    rank = sub.add_parser(RANK_COMMAND, help=f"one rank recording NIXL-like transfers into ${DIR_ENV}, configured "
                                             "by the environment like any rank: ranks only, served by the job's "
                                             "owner (a standalone aggregator, else the rank elected)")
    rank.add_argument("--name", required=True, help="the agent_name label")
    rank.add_argument("--rate", type=RATE, default=200, help="transfers per second (default 200)")
    rank.add_argument("--duration", type=DURATION, default=0,
                      help="seconds to run (default 0: until SIGTERM, SIGINT or SIGHUP)")
    rank.add_argument("--parent-pid", type=int, default=0, help=argparse.SUPPRESS)  # the demo's: die with it
    rank.set_defaults(func=cmd_rank)
