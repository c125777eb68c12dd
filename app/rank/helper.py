"""The serving helper program: ``python -m app serving-helper ...``, a rank's child serving its address.

Started by the rank's supervisor (app.rank.supervisor, which says why a helper exists and how it is
watched), with the listener, the election's lock and one end of a readiness channel as inherited descriptors.
Everything else it is told is one ``HelperArgs``, which the supervisor writes as a command line and ``main``
reads back.  It serves the same collector and WSGI app as any owner and imports nothing of the rank's own
code (the Exporter, the endpoint, the supervisor): only the serving core and app.health.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from app.rank.linger import Linger

log = logging.getLogger("nixl_prometheus_mp.helper")

HELPER_COMMAND = "serving-helper"  # python -m app serving-helper ...: what ps shows (not in the CLI's --help)
WATCH_S = 1.0  # how often the helper checks its serving thread (and the supervisor lets the endpoint check)
READY = b"R"  # the helper's message on the channel: it accepts connections
LEAVE = b"L"  # the rank's: it is closing, and leaves the address to the helper (see main)
KILL_WAIT_S = 2.0  # how long a helper that goes waits for the answers being written
# The terminal's signals, which are for the rank: the helper is in a session of its own, so a terminal does not
# send them to it, and it ignores them in case someone sends them to its process group by hand.
_TERMINAL_SIGNALS = (signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU)
_ON_COMMAND_LINE = ("for_pid", "address", "directory")  # shown by ps; the rest goes in --state as JSON


@dataclass(frozen=True)
class HelperArgs:
    """Everything a helper is started with, besides the descriptors' contents."""

    for_pid: int  # the rank: the helper serves until it exits
    address: str
    directory: Path
    listener_fd: int
    channel_fd: int  # the helper's end of the readiness channel
    lock_fd: int | None  # None: the election fell back to the bind (no usable lock)
    problem: str | None  # why the lock is unusable, for /healthz
    agent_name: str | None
    stale_ttl_s: float
    serving_since: float | None
    replaced_at: float | None  # when the rank found its directory replaced, for /healthz
    log_level: int

    def argv(self) -> list[str]:
        """The arguments after ``python -m app``."""
        state = {name: value for name, value in asdict(self).items() if name not in _ON_COMMAND_LINE}
        return [HELPER_COMMAND, "--for-pid", str(self.for_pid), "--address", self.address, "--directory",
                str(self.directory), "--state", json.dumps(state, separators=(",", ":"))]

    @classmethod
    def parse(cls, argv: list[str] | None) -> HelperArgs:
        """Read back what argv() wrote (the arguments after the command's name)."""
        parser = argparse.ArgumentParser(prog=f"python -m app {HELPER_COMMAND}",
                                         description="the serving helper of a rank (started by the rank itself)")
        parser.add_argument("--for-pid", type=int, required=True)
        parser.add_argument("--address", required=True)
        parser.add_argument("--directory", type=Path, required=True)
        parser.add_argument("--state", type=json.loads, required=True)
        args = parser.parse_args(argv)
        return cls(for_pid=args.for_pid, address=args.address, directory=args.directory, **args.state)


def main(argv: list[str] | None = None) -> int:
    """``python -m app serving-helper --for-pid PID --address A --directory D --state JSON``: serve until PID exits."""
    for signum in _TERMINAL_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    args = HelperArgs.parse(argv)
    try:
        rank = os.pidfd_open(args.for_pid)
    except ProcessLookupError:
        return 0  # the rank is gone already
    if os.getppid() != args.for_pid:
        return 0  # the rank died before we could watch it (the pidfd may name another process): nothing to serve
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format=f"%(levelname)s nixl-prometheus-mp serving helper (pid {os.getpid()}, for pid "
                               f"{args.for_pid}): %(message)s")
    listener = socket.socket(fileno=args.listener_fd)
    channel = socket.socket(fileno=args.channel_fd)
    server, thread, linger = _serve(args, listener)
    with contextlib.suppress(OSError):  # EPIPE: the rank is gone already (it exited as we started): see below
        channel.sendall(READY)
    poller = select.poll()
    poller.register(rank, select.POLLIN)
    poller.register(channel.fileno(), select.POLLIN)  # LEAVE, or EOF: the rank's end is closed, it is gone too
    while not poller.poll(int(WATCH_S * 1000)):
        if not thread.is_alive():
            log.error("the serving thread ended; exiting so that the rank starts a new helper")
            return 1
    # The rank is gone, or leaves the address to us.  With no live writer left, nobody else would serve the
    # departed stores: serve on for their last values (app.rank.linger), unless the election fell back to the
    # bind (no lock: a new rank would take a held port for a foreign service and back off for seconds).
    if args.lock_fd is not None:
        why = linger.run()
        log.info("%s: %s", "no longer serving the departed ranks" if linger.since is not None else
                 "the rank is gone; leaving the address", why)
    # Without any clean-up that could be slow.  The port first: the lock's release (as we exit) wakes a standby
    # at once, which must find it free; then the answers being written (the one that served the last values).
    server.abandon()
    listener.close()
    deadline = time.monotonic() + KILL_WAIT_S
    while server.busy() and time.monotonic() < deadline:
        time.sleep(0.005)
    os._exit(0)


def _serve(args: HelperArgs, listener: socket.socket) -> tuple[Any, threading.Thread, Linger]:
    # Imported here, not above: ``python -m app`` reads HELPER_COMMAND from this module for every command.
    from app.collector import Collector
    from app.health import OwnerWatch, WarningDoc, health_warnings, owner_doc, replaced_warning
    from app.rank.linger import Linger
    from app.server import serve_in_thread
    from app.web import MetricsApp
    from election import OwnerElection
    from election.standby import waiting_pids

    election = OwnerElection(args.directory, args.address, problem=args.problem)
    owners = OwnerWatch(args.directory, args.address, logs=False)  # the rank logs it, from its supervisor's watch
    lock_fd = args.lock_fd
    linger = Linger(args.directory, args.stale_ttl_s, waiting=lambda: [] if lock_fd is None else waiting_pids(lock_fd))

    def owner() -> dict[str, Any]:
        return owner_doc(pid=args.for_pid, agent_name=args.agent_name, address=args.address, mode="in-process",
                         flock=args.problem is None, since=args.serving_since, server_pid=os.getpid(),
                         serving="helper", lingering=linger.doc())

    def warnings() -> list[WarningDoc]:
        replaced = [] if args.replaced_at is None else [replaced_warning(args.directory, args.replaced_at)]
        return replaced + health_warnings(owners, election)

    app = MetricsApp(Collector(args.directory, args.stale_ttl_s), owner, warnings)
    app.on_served = linger.served
    server, thread = serve_in_thread(listener, app, f"nixl-helper-{args.address}")
    return server, thread, linger
