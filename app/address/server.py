"""The address server's program: one process per scrape address, serving what the directory publishes.

The rank that wins an address's election starts it (app.rank.spawn) and hands it the election's lock and the
bound listener over its stdin, a SOCK_SEQPACKET channel (app.rank.channel), then keeps no copy of either: from
then on this process alone holds the address.  It belongs to the job, not to the rank that started it:

* **It publishes what any owner publishes, for as long as that lasts**: every live store, and every departed
  one until its TTL after its last update.  A rank's death or close() changes nothing here.
* **It exits only when nothing is left to publish**: no store live, none within its TTL.  Then the port is
  closed and the lock released at once, in that order (a standby that wins must find the port free).  While
  nobody scrapes it looks at the directory only when something can have ended: every CHECK_S while a store is
  live (a live writer may depart at any moment; its values then stay for the TTL anyway), and at the instant
  the last departed store's TTL runs out otherwise.  No polling in between.
* **It gives the port up to a new run** of another directory (SIGUSR1 from that run's rank, which found the
  port held): at once if nothing here is live, else it keeps it and the newcomer warns naming this process.
  Of its own directory removed and recreated, it gives the port up to the rank elected on the new lock file,
  when that rank asks, and only then: a lock file there says nobody wants the port until someone asks.
* **Its logs** go to the rank that started it while that rank holds the channel, then to a bounded file in the
  directory (LOG_NAME), which /healthz names.  Never to a terminal: its stdout and stderr are /dev/null.
* **A stopped server is replaced** by the rank that started it, which pings it over the channel (it answers
  from the main loop).  Its death frees the lock, and a standby rank starts another (app.rank.endpoint).

Signals: SIGTERM ends it cleanly (the address is given up, a standby takes it); SIGUSR1 asks it to yield the
port; the terminal's signals are ignored (they are for the job).  Handlers only write to the wake pipe: one
loop (``_Server.run``) decides everything, as gunicorn's arbiter does.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import logging
import logging.handlers
import os
import select
import signal
import socket
import time
from pathlib import Path
from typing import Any

from app.channel import (
    ERROR,
    MAX_MESSAGE,
    PING,
    PONG,
    READY,
    STATE,
    TRANSIENT_EXIT,
    ChannelHandler,
    ServerArgs,
)
from app.collector import Collection, Collector
from app.health import OwnerWatch, health_warnings, owner_doc, replaced_warning
from app.server import serve_in_thread
from app.web import MetricsApp
from election import OwnerElection

log = logging.getLogger("nixl_prometheus_mp")

CHECK_S = 10.0  # while a store is live: how often the directory is looked at (at most the TTL, at least MIN_CHECK_S)
MIN_CHECK_S = 1.0
SERVER_COMM = "nixl-server"  # its process name (``ps -e``, /proc/PID/comm), set as it starts
LOG_NAME = "nixl-server.{address}.log"  # in the directory, once the starting rank is gone
LOG_MAX_BYTES = 1 << 20  # the log file is rotated at this size, one old file kept: at most 2 MiB
KILL_WAIT_S = 2.0  # how long an exiting server lets the answers being written finish
_TERMINAL_SIGNALS = (signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU)
_PR_SET_NAME = 15  # <linux/prctl.h>
_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
_LINUX_CAPABILITY_VERSION_3 = 0x20080522  # <linux/capability.h>
_DAC_CAPABILITIES = (1 << 1) | (1 << 2) | (1 << 3)  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER
_SCARCE = frozenset({errno.EAGAIN, errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})


def log_path(directory: Path, address: str) -> Path:
    """The file a server's records go to once the rank that started it is gone."""
    return directory / LOG_NAME.format(address=address.replace("/", "_"))


def exit_code(exc: BaseException) -> int:
    """The exit status of a server that failed with ``exc``: TRANSIENT_EXIT for a shortage of the system."""
    if isinstance(exc, MemoryError) or (isinstance(exc, OSError) and exc.errno in _SCARCE):
        return TRANSIENT_EXIT
    if isinstance(exc, RuntimeError) and "thread" in str(exc):  # "can't start new thread": RLIMIT_NPROC
        return TRANSIENT_EXIT
    return 1


def next_check_s(collection: Collection, ttl_s: float) -> float | None:
    """How long until the directory can next have changed what is published; None: nothing is left.

    Only a live writer's departure, or a departed store's TTL, ends a store's publication; a new store only
    prolongs it, so it need not be seen any sooner.
    """
    if collection.live:
        return max(MIN_CHECK_S, min(CHECK_S, ttl_s))
    pending = [view.reap_in_s for view in collection.stale if view.reap_in_s is not None and view.reap_in_s > 0]
    return max(pending, default=None)


def main() -> None:
    """The program (the bootstrap forked already: this process is nobody's child in the host); never returns."""
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    _set_comm(SERVER_COMM)
    for signum in _TERMINAL_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # a host may have ignored it: exec keeps SIG_IGN
    channel = socket.socket(fileno=0)
    try:
        data, fds, flags, _ = socket.recv_fds(channel, MAX_MESSAGE, 2)
        if not data.startswith(STATE):
            os._exit(0)  # end of file: the rank stopped us before it gave us anything
        if flags & socket.MSG_CTRUNC:  # no descriptor free for what it sent
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        args = ServerArgs.from_json(json.loads(data[1:]))
        _drop_capabilities(args.directory)
        server = _Server(args, channel, socket.socket(fileno=fds[0]), fds[1] if len(fds) > 1 else None)
    except BaseException as exc:
        with contextlib.suppress(OSError):  # best effort, never blocking: the rank logs why we failed
            channel.send(ERROR + f"{type(exc).__name__}: {exc}".encode(errors="replace")[:4000], socket.MSG_DONTWAIT)
        os._exit(exit_code(exc))
    os._exit(server.run())


def _set_comm(name: str) -> None:
    """PR_SET_NAME: ``ps -e`` and /proc/PID/comm name the server, not "python" (nothing else changes)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, name.encode(), 0, 0, 0)


def _drop_capabilities(directory: Path) -> None:
    """Keep no capability the server does not need (a root rank's would be all of them): none, or only those
    that read and reap a directory of another owner (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER).

    Its uid stays the rank's: the stores are the rank's, and a reader skips stores of another owner.  The
    listener and the lock were handed over open, so neither a low port nor the lock file needs anything.
    """
    if os.geteuid() != 0:
        return  # an unprivileged process has no capability to drop (unless granted by file: never to python)
    try:
        keep = 0 if os.stat(directory).st_uid == os.geteuid() else _DAC_CAPABILITIES
    except OSError:
        keep = _DAC_CAPABILITIES
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header = (ctypes.c_uint32 * 2)(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)(keep, keep, 0, 0, 0, 0)  # (effective, permitted, inheritable) x 2 words
    if libc.capset(header, data) != 0:
        log.warning("the address server could not drop its capabilities: %s", os.strerror(ctypes.get_errno()))


class _Server:
    def __init__(self, args: ServerArgs, channel: socket.socket, listener: socket.socket, lock_fd: int | None) -> None:
        self.args = args
        self.channel: socket.socket | None = channel
        self.listener = listener
        self.log_file = log_path(args.directory, args.address)
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._signals: set[int] = set()
        for signum in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(signum, self._on_signal)
        self._root = logging.getLogger("nixl_prometheus_mp")
        self._root.setLevel(args.log_level)
        self._root.propagate = False
        self._handler: logging.Handler = ChannelHandler(channel, f"address server (pid {os.getpid()}): ")
        self._root.addHandler(self._handler)
        election = self.election = OwnerElection(args.directory, args.address, problem=args.problem)
        if lock_fd is not None:
            election.adopt(lock_fd)  # (no unlock and relock: the lock stays held throughout)
        owners = OwnerWatch(args.directory, args.address)
        self.collector = Collector(args.directory, args.stale_ttl_s)

        def owner() -> dict[str, Any]:
            return owner_doc(pid=os.getpid(), agent_name=args.agent_name, address=args.address, mode="in-process",
                             flock=args.problem is None, since=args.serving_since, server_pid=os.getpid(),
                             serving="helper", started_by=args.started_by,
                             log_file=None if self.channel is not None else str(self.log_file))

        def warnings() -> list[Any]:
            replaced = [] if args.replaced_at is None else [replaced_warning(args.directory, args.replaced_at)]
            return replaced + health_warnings(owners, election)

        self.app = MetricsApp(self.collector, owner, warnings, on_scrape=owners.poll)
        self.server, self.thread = serve_in_thread(listener, self.app, f"nixl-server-{args.address}")

    def _on_signal(self, signum: int, frame: Any) -> None:
        # Only queue it: the loop decides (a handler may interrupt anything, the serving threads' locks included).
        self._signals.add(signum)
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"!")

    def run(self) -> int:
        if self.channel is not None:
            with contextlib.suppress(OSError):  # the rank may be gone already: the end of file comes next
                self.channel.send(READY + str(os.getpid()).encode(), socket.MSG_DONTWAIT)
        why = self._loop()
        log.info("giving %s up: %s", self.args.address, why)
        # The port first, then the lock: a standby that wins the lock must find the port free.  Then the
        # answers being written finish (bounded) before the process exits.
        self.server.abandon()
        self.listener.close()
        self.election.release()
        deadline = time.monotonic() + KILL_WAIT_S
        while self.server.busy() and time.monotonic() < deadline:
            time.sleep(0.005)
        logging.shutdown()
        return 0 if why is not None else 1

    def _loop(self) -> str | None:
        """Serve until nothing is left to publish (why, for the log), or the serving thread died (None)."""
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        if self.channel is not None:
            poller.register(self.channel.fileno(), select.POLLIN)
        check_at = time.monotonic()
        lost_since: float | None = None  # the directory has been out of sight since then
        pong_owed = False
        while True:
            now = time.monotonic()
            if now >= check_at:
                collection = self.collector.collect()
                left_s = None if collection.scan_error is not None else next_check_s(collection, self.args.stale_ttl_s)
                # A lock file at our path that is not ours does not make us leave: a rank of a new run elected on
                # it asks for the port (SIGUSR1, below) once its store is there to publish; another process may
                # have made it and let it go (a C++ rank re-electing as it exports) and asks nothing.
                lost = collection.scan_error or ("the directory was removed and recreated"
                                                 if self.election.lock_file_replaced() else None)
                if left_s is None and lost is not None:
                    # Out of sight: unlistable (removed, its permissions changed; /healthz says so with a 503), or
                    # recreated and nothing in it yet.  The ranks may still live: each recreates its store at its
                    # next export, which a check between the two would miss.  Nothing comes back after the TTL.
                    if lost_since is None and collection.scan_error is None:  # (unlistable: /healthz's 503 says so)
                        log.warning("%s was removed and recreated: its ranks are missing from /metrics until they "
                                    "record again; %s is kept for them for the TTL (%g s), then given up",
                                    self.args.directory, self.args.address, self.args.stale_ttl_s)
                    lost_since = now if lost_since is None else lost_since
                    if now - lost_since >= self.args.stale_ttl_s:
                        return f"{lost} for the TTL"
                    check_at = now + MIN_CHECK_S
                elif left_s is None:
                    return "no rank is live and every departed rank's TTL has passed"
                else:
                    lost_since = None
                    check_at = now + left_s
            timeout_s = 0.05 if pong_owed else max(0.0, check_at - time.monotonic())
            events = dict(poller.poll(int(timeout_s * 1000) + 1))
            if self._wake_r in events:
                with contextlib.suppress(OSError):
                    os.read(self._wake_r, 4096)
                signals, self._signals = self._signals, set()
                if signal.SIGTERM in signals:
                    return "SIGTERM"
                if signal.SIGUSR1 in signals:
                    collection = self.collector.collect()
                    if self._replaced():
                        return "the directory was removed and recreated, and a rank of the new one asks for the port"
                    if collection.scan_error is None and not collection.live:
                        return "a rank of another run asks for the port, and no rank is live here"
                    log.info("a rank of another run asks for %s, but %d rank(s) of %s are live: keeping it",
                             self.args.address, len(collection.live), self.args.directory)
            if self.channel is not None and self.channel.fileno() in events:
                pong_owed = self._read_channel(poller) or pong_owed
            if pong_owed and self.channel is not None:
                try:
                    self.channel.send(PONG, socket.MSG_DONTWAIT)
                    pong_owed = False
                except BlockingIOError:
                    pass  # full of log records the rank has not read yet: again in a moment
                except OSError:
                    self._rank_gone(poller)
            if not self.thread.is_alive():
                log.error("the serving thread of %s ended; exiting so that a standby rank starts a new server",
                          self.args.address)
                return None

    def _replaced(self) -> bool:
        """The lock file at our path is another one than ours: a new directory took the old one's place."""
        return self.election.path.exists() and self.election.lock_file_replaced()

    def _read_channel(self, poller: select.poll) -> bool:
        """Read what the rank sent; whether a ping wants its answer."""
        assert self.channel is not None
        pinged = False
        while True:
            try:
                message = self.channel.recv(MAX_MESSAGE, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return pinged
            except OSError:
                message = b""
            if not message:
                self._rank_gone(poller)
                return False
            pinged = pinged or message == PING

    def _rank_gone(self, poller: select.poll) -> None:
        """The starting rank closed its channel (closed its Exporter, exited, died): logs go to the file."""
        assert self.channel is not None
        poller.unregister(self.channel.fileno())
        try:
            handler: logging.Handler = logging.handlers.RotatingFileHandler(
                self.log_file, maxBytes=LOG_MAX_BYTES, backupCount=1, delay=True)
            handler.setFormatter(logging.Formatter("%(asctime)s pid %(process)d %(levelname)s %(name)s: %(message)s"))
        except OSError:
            handler = logging.NullHandler()
        self._root.removeHandler(self._handler)
        self._root.addHandler(handler)
        self._handler = handler
        with contextlib.suppress(OSError):
            self.channel.close()
        self.channel = None
