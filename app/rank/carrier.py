"""The rank's link to the address server it started, for as long as both live: one thread (Carrier).

The server is the job's, not the rank's: nothing here stops it, and a rank's close() or death leaves it
serving.  While the starting rank lives, its carrier thread:

* reaps the launcher (the rank's child, which exits within milliseconds: app.rank.spawn);
* carries the server's log records into the rank's own logging (``Logger.handle``; the server never waits
  for this thread: it drops what the channel cannot take, and says so);
* pings the server every PING_S and SIGKILLs one that has not answered for PING_TIMEOUT_S (stopped, or under a
  debugger): its death frees the lock, and a standby starts a new server;
* reports how the server ended: before it said it was ready (a failed start, retried with a back-off by the
  endpoint) or after.

Closing it (the rank's close(), or a fork's child) only closes the rank's end of the channel: the server then
logs to its file.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import socket
import threading
import time
import weakref
from collections.abc import Callable

from app.channel import ERROR, LOG, MAX_MESSAGE, PING, PONG, READY, decode_record
from app.rank.spawn import Launched
from app.server import holding_off_fork
from store.fds import close_quietly, stdio_occupied

log = logging.getLogger("nixl_prometheus_mp.helper")

PING_S = 0.5  # how often the carrier asks the server whether it answers
PING_TIMEOUT_S = 2.0  # a server that has not answered a ping this long after it was sent is killed
READY_TIMEOUT_S = 30.0  # a server that has not said it is ready by then is killed (a standby starts another)
_JOIN_S = 2.0  # close() waits at most this long for the thread

_carriers: weakref.WeakSet[Carrier] = weakref.WeakSet()


class Carrier:
    """One started server, seen from the rank that started it."""

    def __init__(self, launched: Launched, address: str, on_end: Callable[[bool, str], None]) -> None:
        self._launched = launched
        self.address = address
        self._on_end = on_end  # (ready, how it ended), from the carrier's thread, when the server is gone
        with stdio_occupied():
            self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._closing = False
        self.pid: int | None = None  # the server's, once it said it is ready
        self._pidfd = -1
        self.said: str | None = None  # its last word (``E``) before it exited
        self._thread = threading.Thread(target=self._run, name=f"nixl-server-log-{address}", daemon=True)
        _carriers.add(self)

    @property
    def running(self) -> bool:
        """The server has not been seen to end (it may still be starting: connections wait in the backlog)."""
        return self._thread.is_alive() and not self._closing

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop carrying (bounded; from any thread, a signal handler included): the server goes on."""
        self._closing = True
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"!")
        if threading.current_thread() is not self._thread and self._thread.is_alive():
            self._thread.join(_JOIN_S)

    def forget_after_fork(self) -> None:
        """In a forked child: the server and its channel are the parent's; drop our copies, say nothing."""
        self._closing = True
        self._launched.launcher.returncode = 0  # not this process's child: Popen must never wait for it here
        for fd in (self._pidfd, self._launched.launcher_fd, self._wake_r, self._wake_w):
            close_quietly(fd)
        self._pidfd = self._launched.launcher_fd = self._wake_r = self._wake_w = -1
        with contextlib.suppress(OSError):
            self._launched.channel.close()

    # -- the carrier's thread ---------------------------------------------------------------------------------

    def _run(self) -> None:
        ended = "is gone"
        try:
            ended = self._carry()
        except Exception:  # a bug of ours must cost the log records only, never the server
            log.warning("carrying the address server's records for %s failed", self.address, exc_info=True)
        finally:
            self._launched.reap_launcher(block=True)  # it forks and exits at once: never waits long
            for fd in (self._pidfd, self._wake_r, self._wake_w):
                close_quietly(fd)
            self._pidfd = self._wake_r = self._wake_w = -1
            with contextlib.suppress(OSError):
                self._launched.channel.close()  # the server logs to its file from now on
        if not self._closing:
            self._on_end(self.pid is not None, ended)

    def _carry(self) -> str:
        """Until the server is gone (how, in words) or this rank stops carrying (``closed``)."""
        channel = self._launched.channel
        poller = select.poll()
        poller.register(channel.fileno(), select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        if self._launched.launcher_fd >= 0:
            poller.register(self._launched.launcher_fd, select.POLLIN)
        started = time.monotonic()
        next_ping, pinged_at = started + PING_S, None
        while not self._closing:
            events = dict(poller.poll(int(max(0.0, next_ping - time.monotonic()) * 1000) + 1))
            if self._launched.launcher_fd >= 0 and self._launched.launcher_fd in events:
                poller.unregister(self._launched.launcher_fd)
                self._launched.reap_launcher(block=False)
            if channel.fileno() in events:
                while (message := self._receive()):
                    if message == PONG:
                        pinged_at = None
                if message is None:  # end of file: it exited or was killed
                    return f"exited ({self.said})" if self.said else "is gone (killed, or it exited)"
            now = time.monotonic()
            if self.pid is None:
                if now - started > READY_TIMEOUT_S:
                    self._kill(f"was not ready within {READY_TIMEOUT_S:.0f} s")
                    started = float("inf")
                continue
            # Every message read above came first: a pong that arrived while this thread waited for the
            # rank's log handlers counts.
            if pinged_at is not None and now - pinged_at > PING_TIMEOUT_S:
                self._kill(f"has not answered for {PING_TIMEOUT_S:.0f} s (stopped, or under a debugger?)")
                pinged_at = float("inf")  # killed once; its end of file comes next
            if now >= next_ping:
                next_ping = now + PING_S
                if pinged_at is None:
                    pinged_at = now
                    with contextlib.suppress(OSError):
                        channel.send(PING, socket.MSG_DONTWAIT)
        return "closed"

    def _receive(self) -> bytes | None:
        """One message; its log record handled by our logging; b"" when nothing waits; None at the end."""
        try:
            message = self._launched.channel.recv(MAX_MESSAGE, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return b""
        except OSError:
            return None
        if not message:
            return None
        if message.startswith(LOG):
            record = decode_record(message[1:], self.pid or 0)
            if record is not None:
                logger = logging.getLogger(record.name)
                with contextlib.suppress(Exception):  # a handler's bug is the host's; carrying goes on
                    if logger.isEnabledFor(record.levelno):
                        logger.handle(record)
        elif message.startswith(READY):
            self._watch(int(message[1:]))
        elif message.startswith(ERROR):
            self.said = message[1:].decode(errors="replace")
        return message

    def _watch(self, pid: int) -> None:
        # Opened and recorded under the lock fork() waits for: a host's thread forking meanwhile would otherwise
        # give its child the pidfd before forget_after_fork() could see it, and the child would hold it.
        try:
            with holding_off_fork(), stdio_occupied():
                self._pidfd = os.pidfd_open(pid)
        except OSError:
            return  # gone already: its end of file comes next
        self.pid = pid

    def _kill(self, words: str) -> None:
        fd = self._pidfd if self._pidfd >= 0 else -1
        log.warning("the address server of %s (pid %s) %s; killing it, so that a standby rank starts another",
                    self.address, self.pid, words)
        if fd >= 0:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(fd, signal.SIGKILL)  # a pidfd never names a reused pid
        else:
            with contextlib.suppress(OSError):
                self._launched.channel.shutdown(socket.SHUT_RDWR)  # not ready: it reads the end of file and goes


def _after_fork_in_child() -> None:
    for carrier in list(_carriers):
        carrier.forget_after_fork()
    _carriers.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
