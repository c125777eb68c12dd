"""The rank's side of its serving helper: start it, watch it, restart it, stop it (HelperSupervisor).

The serving helper is a process that serves a rank's address outside the rank's interpreter; its program is
app.rank.helper, and what passes between the two is app.rank.channel.

A rank is someone else's program, with one GIL.  A serving thread inside it waits behind the host's own
threads (a busy host makes scrapes 5-30x slower), makes the host wait behind each scrape, and goes down with
a host that keeps its GIL in a long C call or is stopped: the whole directory's endpoint with it.  So an
elected rank (app.rank.endpoint) serves from a process of its own instead, which must be as harmless to its
host as a thread (a good guest):

* **Started by exec, never a bare fork of the host**: ``python [the rank's interpreter flags] -c BOOTSTRAP
  serving-helper --for-pid PID`` (subprocess, with every other descriptor closed, in a session of its own,
  in ``/``).  Its command line says that and no more (``ps`` shows it to every local user); the rest comes
  over the channel, its stdin: the bootstrap (the rank's own ``sys.path``, the standard library first, so it
  imports the very code the rank runs whatever PYTHONPATH or the working directory say), then the state.
* **Nobody's child in the host**: the process started (the launcher) forks the helper and exits as soon as
  the helper is ready (or with its status, if it failed first): the rank reaps the launcher, and init (or
  the nearest subreaper) the helper.  A host that waits for all its children, or execs another program,
  never waits for the helper nor leaves it a zombie.  The supervisor watches it through a pidfd, which works
  for any process.
* **Given nothing before it watches its rank**: the listener and the lock travel over the channel
  (SCM_RIGHTS) once the helper holds a pidfd of the rank, so a rank that dies while its helper starts leaves
  its standbys a free lock at once.
* **Never outlives its rank** (unless it lingers for departed ranks by design, app.rank.linger): it polls the
  rank's pidfd (whichever of the rank's threads started it, however it died) and the channel, whose end of
  file says the rank died or exec'd.  PR_SET_PDEATHSIG would need the helper to be the rank's child.
* **Answers, or is replaced**: the supervisor pings it every PING_S and replaces one that does not answer
  within PING_TIMEOUT_S (stopped, under a debugger).  A stopped helper whose rank is gone cannot be helped
  by anyone in the rank: a standby kills it (app.rank.standby).
* **Never has more privileges than its rank**: at every ping its uids, gids, groups and capabilities
  (/proc) are compared with this thread's; a rank that dropped some (setresuid) gets a new helper started
  with what it has now.  A kill the kernel refuses (EPERM: the helper is another user's now) is said, and
  the helper is told over the channel to quit, which it does.
* **Logs through the rank's logging, never blocking**: its records come over the channel and are handled by
  the rank's loggers (app.logsink: from a thread that alone may wait for the host's log sink).

The rank serves from a thread until the helper says it is ready, and again whenever the helper is gone, so
neither a takeover nor a helper's restart waits for an interpreter to start: the listener is shared, the
thread stops accepting once the helper does, and what waits in the backlog is the helper's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import threading
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from app.logsink import emit_later, never_block_on_logs
from app.probe import credentials, exit_words, privileges_beyond
from app.rank.channel import (
    ERROR,
    LEAVE,
    LOG,
    MAX_MESSAGE,
    PING,
    PONG,
    QUIT,
    READY,
    TRANSIENT_EXIT,
    WATCHING,
    decode_record,
    state_message,
)
from app.rank.helper import WATCH_S, HelperArgs
from app.rank.spawn import KILL_WAIT_S, HelperProcess, StartFailed, bootstrap, launch, readable
from app.rank.spawn import helper_unusable as helper_unusable
from app.server import holding_off_fork
from store.fds import above_stdio
from store.warnonce import OnceWarner

log = logging.getLogger("nixl_prometheus_mp.helper")
_warner = OnceWarner(log)

READY_TIMEOUT_S = 30.0  # a helper that has not said it is ready by then is killed (and another one tried later)
RESTART_BACKOFF_MIN_S, RESTART_BACKOFF_MAX_S = 0.05, 5.0  # between restarts of a helper that keeps dying
STABLE_S = 10.0  # a helper that served this long before it died is restarted at once
PING_S = 0.5  # how often the supervisor asks the helper whether it answers
PING_TIMEOUT_S = 2.0  # a helper that has not answered a ping this long after it was sent is replaced


@dataclass(frozen=True)
class HelperSpec:
    """What a helper must know of the rank it serves for, besides the descriptors."""

    directory: Path
    stale_ttl_s: float
    address: str
    agent_name: str | None


@dataclass(frozen=True)
class HelperState:
    """The election as the rank holds it when it starts a helper (a change restarts the helper)."""

    listener_fd: int
    lock_fd: int | None  # None: the election fell back to the bind (no usable lock)
    problem: str | None  # why the lock is unusable, for /healthz
    serving_since: float | None
    replaced_at: float | None  # when the rank found its directory replaced, for /healthz


class HelperHost(Protocol):
    """What a supervisor asks of the endpoint it serves for; every call comes from the supervisor's thread."""

    def helper_state(self, supervisor: HelperSupervisor) -> AbstractContextManager[HelperState | None]:
        """The descriptors and the election's state, held still for a start; None once ``supervisor`` is not
        the endpoint's any more (closed, re-elected)."""

    def helper_ready(self, supervisor: HelperSupervisor) -> None:
        """A helper accepts connections: retire the thread server."""

    def helper_gone(self, supervisor: HelperSupervisor) -> None:
        """A ready helper died: serve from a thread again, at once."""

    def watch(self) -> None:
        """Every WATCH_S: the endpoint's own periodic check (its lock file), which an idle rank never makes."""


class HelperSupervisor:
    """Starts a rank's serving helper, watches it from a thread of its own, restarts it, stops it."""

    def __init__(self, spec: HelperSpec, host: HelperHost) -> None:
        self.spec = spec
        self._host = host
        self._stopping = threading.Event()
        self._restart = threading.Event()
        self._ready = threading.Event()  # the current helper accepts connections
        self._leaving = threading.Event()  # the rank left the address to it: it is not ours to stop or restart
        self._lock = threading.RLock()  # reentrant: stop() may run in a signal handler that interrupted stop()
        self._child: HelperProcess | None = None
        self._thread = threading.Thread(target=self._run, name=f"nixl-metrics-{spec.address}-helper", daemon=True)

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def start(self) -> None:
        """Start the supervising thread (RuntimeError where the process is out of threads)."""
        self._thread.start()

    def restart(self) -> None:
        """Replace the helper (the election changed under it): the thread serves while the next one starts."""
        self._restart.set()
        with self._lock:
            if self._child is not None:
                self._child.tell(QUIT)
                self._child.kill()

    def stop(self, timeout_s: float = KILL_WAIT_S) -> None:
        """Stop the helper and wait (bounded) until it is gone; from any thread, a signal handler included.

        When this returns, the helper holds neither the listener nor the lock any more (unless it could not
        be stopped within ``timeout_s``, which is logged).
        """
        self._stopping.set()
        if not self._lock.acquire(timeout=timeout_s):
            log.warning("stopping the serving helper of %s: its supervisor is stuck; the helper exits with this "
                        "process", self.spec.address)
            return
        try:
            child = self._child
            if child is not None:
                self._end(child, timeout_s)
        finally:
            self._lock.release()
        if threading.current_thread() is not self._thread and self._thread.is_alive():
            self._thread.join(timeout_s)

    def _end(self, child: HelperProcess, timeout_s: float) -> bool:
        """Tell the helper to quit and SIGKILL it; whether it is gone within ``timeout_s``.

        A kill the kernel refuses (the helper runs as another user since its rank dropped privileges) is said;
        the helper still quits as it is told over the channel.
        """
        child.tell(QUIT)
        with contextlib.suppress(OSError):
            child.channel.shutdown(socket.SHUT_WR)  # a helper still starting reads the end of file, and goes
        refused = child.kill()
        if refused is not None:
            log.warning("cannot SIGKILL the serving helper of %s (%s): %s; it was told to exit over its channel",
                        self.spec.address, child.name, refused)
        gone = child.wait_gone(timeout_s)
        if not gone:
            log.warning("the serving helper of %s (%s) did not exit within %.0f s of SIGKILL; the port is free "
                        "once it does", self.spec.address, child.name, timeout_s)
        return gone

    def leave(self, timeout_s: float) -> bool:
        """Leave the address to the helper, which decides whether to serve on for departed ranks (see
        app.rank.helper).

        Waits (bounded) for a helper that is starting.  True if the helper was told; from then on the
        supervisor only forwards its logs until it is gone.  False: no helper to leave it to (the caller
        stops as usual).
        """
        if not self._ready.wait(timeout_s):
            return False
        if not self._lock.acquire(timeout=timeout_s):
            return False
        try:
            child = self._child
            if child is None or self._stopping.is_set() or not self._ready.is_set():
                return False
            try:
                child.channel.send(LEAVE)
            except OSError:
                return False  # it is gone: nothing to leave the address to
            self._leaving.set()
            return True
        finally:
            self._lock.release()

    def forget_after_fork(self) -> None:
        """In a forked child: the helper is the parent's; drop our descriptors without signalling it."""
        child, self._child = self._child, None
        self._stopping.set()
        if child is not None:
            child.launcher.returncode = 0  # not this process's child: Popen must never wait for it here
            child.close()

    # -- the supervising thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        never_block_on_logs()
        try:
            self._supervise()
        except Exception:  # a bug of ours must cost the helper only: the endpoint serves from its thread again
            log.warning("the supervisor of the serving helper of %s failed; this process serves its telemetry "
                        "endpoint from a thread from now on", self.spec.address, exc_info=True)
            with self._lock:
                child = self._child
            if child is not None:
                child.tell(QUIT)
                child.kill()
                self._finish(child)
            self._host.helper_gone(self)

    def _supervise(self) -> None:
        backoff_s = 0.0
        while not self._stopping.is_set():
            child = None
            try:
                child = self._spawn()
                if child is None:
                    return  # the endpoint stopped serving meanwhile
                self._start(child)
            except StartFailed as failure:
                if child is not None:  # killed and gone, reaped what is ours, closed (each step idempotent)
                    self._end(child, KILL_WAIT_S)
                    self._finish(child)
                if self._stopping.is_set():
                    return
                if not failure.transient:
                    _warner.warn(("not-ready", self.spec.address),
                                 "the serving helper of %s %s before it was ready; this process serves its telemetry "
                                 "endpoint from a thread instead, which a busy or stopped process holds up",
                                 self.spec.address, failure.words)
                    return
                backoff_s = min(max(2 * backoff_s, RESTART_BACKOFF_MIN_S), RESTART_BACKOFF_MAX_S)
                _warner.warn(("transient", self.spec.address),
                             "the serving helper of %s could not start (%s); this process serves from a thread "
                             "meanwhile and tries again, after a growing pause (at most %.0f s)",
                             self.spec.address, failure.words, RESTART_BACKOFF_MAX_S)
                if self._stopping.wait(backoff_s):
                    return
                continue
            self._host.helper_ready(self)
            self._ready.set()
            ended = self._watch(child)
            self._ready.clear()
            lifetime_s = time.monotonic() - child.started
            self._finish(child)
            if self._stopping.is_set() or self._leaving.is_set():
                return
            self._host.helper_gone(self)
            if ended == "privileges" and credentials("thread-self") == child.spawned_with:
                _warner.warn(("privileges", self.spec.address),
                             "a serving helper started by this process has privileges it does not have (%s); this "
                             "process serves its telemetry endpoint from a thread instead", child.said)
                return
            if self._restart.is_set() or ended in ("privileges", "unresponsive"):
                self._restart.clear()
                backoff_s = 0.0
                continue
            backoff_s = 0.0 if lifetime_s >= STABLE_S else min(max(2 * backoff_s, RESTART_BACKOFF_MIN_S),
                                                                 RESTART_BACKOFF_MAX_S)
            log.warning("the serving helper of %s (%s) %s after %.1f s; this process serves from a thread "
                        "meanwhile and starts a new helper in %.2f s", self.spec.address, child.name,
                        f"exited ({child.said})" if child.said else "is gone (killed, or it exited)", lifetime_s,
                        backoff_s)
            if self._stopping.wait(backoff_s):
                return

    def _finish(self, child: HelperProcess) -> None:
        """Reap what is ours of a helper that is gone and close our descriptors of it, then forget it: under
        holding_off_fork, so that a fork meanwhile finds them recorded (and closes its copies) or closed."""
        if child.launcher_status is None and child.launcher_fd >= 0 and readable(child.launcher_fd, KILL_WAIT_S):
            child.reap_launcher()  # (it exits once the helper is ready or gone, or was killed with it)
        child.reap_helper()
        with holding_off_fork(), self._lock:
            child.close()
            if self._child is child:
                self._child = None

    def _spawn(self) -> HelperProcess | None:
        """Start the launcher; None if the endpoint stopped serving meanwhile."""
        # Every descriptor made here is recorded in self._child before a fork of the host can see it: a child
        # forked meanwhile finds all of them (and the fork hooks close them) or none.
        with holding_off_fork():
            if self._stopping.is_set():
                return None
            child = launch()
            with self._lock:
                self._child = child
        child.tell(bootstrap())
        return child

    def _start(self, child: HelperProcess) -> None:
        """Until the helper is ready: its pid, then the descriptors and the state, then ``R``.  StartFailed
        (the helper killed and gone) if it is not."""
        # A stop() that came while the launcher started found no child to kill, and nothing would wake the
        # poll below until the helper spoke (an interpreter's start): it is seen here, once _spawn recorded
        # the child under the lock stop() takes after setting the flag.
        if self._stopping.is_set():
            raise StartFailed("was stopped", transient=False)
        deadline = time.monotonic() + READY_TIMEOUT_S
        poller = select.poll()
        poller.register(child.channel.fileno(), select.POLLIN)
        poller.register(child.launcher_fd, select.POLLIN)
        while (left := deadline - time.monotonic()) > 0:
            events = dict(poller.poll(int(left * 1000) + 1))
            if self._stopping.is_set():
                raise StartFailed("was stopped", transient=False)
            if child.channel.fileno() in events:
                message = self._receive(child)
                if message is None:
                    break  # end of file: it died (its launcher says how)
                if message.startswith(WATCHING):
                    self._give(child, int(message[1:]))
                    if child.pidfd >= 0:
                        poller.register(child.pidfd, select.POLLIN)
                elif message == READY:
                    # Its launcher exits now: reaped before anything else, so that a host that execs another
                    # program from here on leaves no child of ours to it.
                    if child.launcher_status is None and readable(child.launcher_fd, KILL_WAIT_S):
                        child.reap_launcher()
                    return
                continue
            if child.launcher_fd in events:
                if child.reap_launcher() != 0:
                    break  # the helper failed (or its launcher did); a 0 comes with READY, read next
                poller.unregister(child.launcher_fd)
            if child.pidfd in events:
                break
        else:
            raise StartFailed(f"was not ready within {READY_TIMEOUT_S:.0f} s", transient=True)
        self._end(child, KILL_WAIT_S)
        self._finish(child)  # (reaps the launcher: its status says how the helper ended)
        status = child.launcher_status
        words = exit_words(status) if status is not None else "exited"
        if child.said:
            words += f" ({child.said})"
        raise StartFailed(words, transient=status == TRANSIENT_EXIT)

    def _give(self, child: HelperProcess, pid: int) -> None:
        """The helper watches its rank: record its pidfd, then send it the descriptors and the state."""
        with holding_off_fork():
            try:
                child.pidfd = above_stdio(os.pidfd_open(pid))
            except OSError:
                return  # gone already (its launcher says how)
            child.pid = pid
        # The pid was the helper's when we opened the pidfd if the helper still holds its end of the channel
        # now (nothing else does: the launcher closed its copy before it forked): no hang-up yet.
        poller = select.poll()
        poller.register(child.channel.fileno(), select.POLLIN)
        if any(revents & select.POLLHUP for _, revents in poller.poll(0)):
            return
        with self._host.helper_state(self) as state:
            if state is None:
                raise StartFailed("was stopped", transient=False)
            fds = [state.listener_fd] + ([] if state.lock_fd is None else [state.lock_fd])
            args = HelperArgs(
                for_pid=os.getpid(), address=self.spec.address, directory=self.spec.directory,
                has_lock=state.lock_fd is not None, problem=state.problem, agent_name=self.spec.agent_name,
                stale_ttl_s=self.spec.stale_ttl_s, serving_since=state.serving_since, replaced_at=state.replaced_at,
                log_level=logging.getLogger("nixl_prometheus_mp").getEffectiveLevel())
            with contextlib.suppress(OSError):  # gone meanwhile: its pidfd says so
                socket.send_fds(child.channel, [state_message(args.to_json())], fds)

    def _receive(self, child: HelperProcess) -> bytes | None:
        """One message from the helper, its logs re-emitted through ours; None at the end of file."""
        try:
            message = child.channel.recv(MAX_MESSAGE, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return b""
        except OSError:
            return None
        if not message:
            return None
        if message.startswith(LOG):
            record = decode_record(message[1:], child.pid or 0)
            if record is not None:
                emit_later(record)
        elif message.startswith(ERROR):
            child.said = message[1:].decode(errors="replace")
        return message

    def _watch(self, child: HelperProcess) -> str:
        """Until the helper is gone or must go; why: gone, unresponsive, privileges, stopping, left."""
        poller = select.poll()
        poller.register(child.pidfd, select.POLLIN)
        poller.register(child.channel.fileno(), select.POLLIN)
        if child.launcher_status is None and child.launcher_fd >= 0:
            poller.register(child.launcher_fd, select.POLLIN)
        now = time.monotonic()
        next_ping, next_watch, pinged_at = now + PING_S, now + WATCH_S, None
        while True:
            # Once the address was left to it, nothing is due: only its logs, and its end, are waited for.
            timeout = None if self._leaving.is_set() else max(0, int((min(next_ping, next_watch) - time.monotonic())
                                                                     * 1000)) + 1
            events = dict(poller.poll(timeout))
            if child.launcher_fd in events:
                child.reap_launcher()
                poller.unregister(child.launcher_fd)
            if child.pidfd in events:
                return "gone"
            if child.channel.fileno() in events:
                while (message := self._receive(child)):
                    if message == PONG:
                        pinged_at = None
                if message is None:  # end of file: it is exiting
                    child.wait_gone(KILL_WAIT_S)
                    return "gone"
            if self._leaving.is_set():  # it serves on for departed ranks: only forward its logs until it is done
                continue
            if self._stopping.is_set():
                return "stopping"
            now = time.monotonic()
            if pinged_at is not None and now - pinged_at > PING_TIMEOUT_S:
                return self._replace(child, "unresponsive", f"has not answered for {PING_TIMEOUT_S:.0f} s "
                                     "(stopped, or under a debugger?)")
            if now >= next_ping:
                next_ping = now + PING_S
                if pinged_at is None:
                    pinged_at = now
                    child.tell(PING)
                beyond = self._privileges_beyond(child)
                if beyond is not None:
                    child.said = beyond
                    return self._replace(child, "privileges", f"has privileges this process no longer has ({beyond})")
            if now >= next_watch:
                next_watch = now + WATCH_S
                self._host.watch()

    def _replace(self, child: HelperProcess, reason: str, words: str) -> str:
        log.warning("the serving helper of %s (%s) %s; this process replaces it", self.spec.address, child.name, words)
        self._end(child, KILL_WAIT_S)
        return reason

    @staticmethod
    def _privileges_beyond(child: HelperProcess) -> str | None:
        helper = credentials(child.pid) if child.pid is not None else None
        rank = credentials("thread-self")
        if helper is None or rank is None:
            return None  # gone (its pidfd says so next), or no /proc: nothing to compare
        return privileges_beyond(helper, rank)
