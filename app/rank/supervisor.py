"""The rank's side of its serving helper: start it, watch it, restart it, stop it (HelperSupervisor).

The serving helper is a child process that serves a rank's address outside the rank's interpreter; its
program is app.rank.helper.

A rank is someone else's program, with one GIL.  A serving thread inside it waits behind the host's own
threads (a busy host makes scrapes 5-30x slower), makes the host wait behind each scrape, and goes down with
a host that keeps its GIL in a long C call or is stopped: the whole directory's endpoint with it.  So an
elected rank (app.rank.endpoint) serves from a child process of its own instead:

* The rank wins the election and binds, exactly as without a helper, then starts ``python -m app serving-helper``
  (an exec through subprocess, never a bare fork of the host), handing it the listener and the election's
  lock descriptor.  The lock belongs to the open file description, which both now hold: the address stays
  elected while either lives, and the port bound.
* The helper runs the same collector and WSGI app; it records nothing and has no store.  It is in a session
  of its own and ignores the terminal's signals (Ctrl-C, a closed terminal, Ctrl-Z are for the rank), and
  its command line says whom it serves.
* It never outlives its rank: it polls a pidfd of the rank (readable once the whole process has exited,
  whichever of its threads started the helper, however it died) and exits at once.  PR_SET_PDEATHSIG would
  follow the creating thread instead: a takeover on a short-lived thread would kill the helper with it.
  A pidfd names the rank's pid only, so a child the rank forks is never mistaken for it.
* The rank's side (HelperSupervisor) waits for the helper on a thread blocked in poll() on the helper's
  pidfd, which costs the host's GIL nothing, restarts it with a bounded backoff when it dies, and reaps only
  that child, through its pidfd (never waitpid(-1)): a host that ignores SIGCHLD, or reaps children in its
  own handler, reaps it first, which is then simply done.
* The rank serves from a thread until the helper says it is ready, and again whenever the helper is gone,
  so neither a takeover nor a helper's restart waits for an interpreter to start: the listener is shared,
  the thread stops accepting once the helper does, and what waits in the backlog is the helper's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from app.probe import exit_words
from app.rank.helper import LEAVE, READY, WATCH_S, HelperArgs
from app.server import holding_off_fork
from store.warnonce import OnceWarner

log = logging.getLogger("nixl_prometheus_mp.helper")
_warner = OnceWarner(log)

READY_TIMEOUT_S = 30.0  # a helper that has not said it is ready by then is given up (the thread serves)
KILL_WAIT_S = 2.0  # how long stopping waits for a SIGKILLed helper to be gone (it frees the port then)
RESTART_BACKOFF_MIN_S, RESTART_BACKOFF_MAX_S = 0.05, 5.0  # between restarts of a helper that keeps dying
STABLE_S = 10.0  # a helper that served this long before it died is restarted at once
# sys.executable names the interpreter only where it is one: an embedded interpreter (uWSGI, a C++ host) sets it
# to its own program, or to nothing, and exec'ing that with "-m app serving-helper" would start who knows what.
_INTERPRETER_NAME = re.compile(r"(python|pypy)[0-9.]*(d|dm|m|t)?(\.exe)?", re.IGNORECASE)
# The directory holding this package, put first on the helper's sys.path (it runs there): the helper imports the
# very code the rank runs, whatever the rank's working directory holds.
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]


def helper_unusable() -> str | None:
    """Why no serving helper can run from this interpreter, or None when one can."""
    executable = sys.executable
    if not executable:
        return "the interpreter does not know its own executable (sys.executable is empty)"
    if not _INTERPRETER_NAME.fullmatch(os.path.basename(executable)):
        return f"sys.executable ({executable}) is not a Python interpreter (an embedded interpreter?)"
    if not os.access(executable, os.X_OK):
        return f"sys.executable ({executable}) is not executable"
    if not hasattr(os, "pidfd_open"):
        return "this platform has no pidfd (Linux 5.3 or later is needed)"
    return None


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


# -- the rank's side ------------------------------------------------------------------------------------------


class _Child:
    """One helper process: its Popen, its pidfd and the rank's end of the readiness channel."""

    def __init__(self, proc: subprocess.Popen[bytes], pidfd: int, channel: socket.socket) -> None:
        self.proc, self.pidfd, self.channel = proc, pidfd, channel
        self.started = time.monotonic()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, OSError):
            signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)  # the pidfd never names a reused pid

    def wait_gone(self, timeout_s: float) -> bool:
        """Whether the process has exited (its descriptors, the listener's copy among them, are closed)."""
        try:
            return _readable(self.pidfd, timeout_s)
        except OSError:
            return True

    def reap(self) -> int | None:
        """Reap this child (only it); its exit status as Popen reports it, None if someone else reaped it."""
        try:
            result = os.waitid(os.P_PIDFD, self.pidfd, os.WEXITED | os.WNOHANG)
        except ChildProcessError:  # a host that ignores SIGCHLD or reaps in its own handler got there first
            self.proc.returncode = 0  # Popen must not try to reap (or remember to reap) a pid no longer ours
            return None
        if result is None:  # not gone yet (it did not die within KILL_WAIT_S of SIGKILL): Popen reaps it later
            return None
        status = -result.si_status if result.si_code in (os.CLD_KILLED, os.CLD_DUMPED) else result.si_status
        self.proc.returncode = status
        return status

    def close(self) -> None:
        fd, self.pidfd = self.pidfd, -1  # forget the number first: see forget_after_fork
        if fd >= 0:
            os.close(fd)
        self.channel.close()


def _readable(fd: int, timeout_s: float | None) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(None if timeout_s is None else int(timeout_s * 1000)))


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
        self._child: _Child | None = None
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
                self._child.kill()

    def stop(self, timeout_s: float = KILL_WAIT_S) -> None:
        """Kill the helper and wait (bounded) until it is gone; from any thread, a signal handler included.

        When this returns, the helper holds neither the listener nor the lock any more (unless it could not
        be killed within ``timeout_s``, which is logged).
        """
        self._stopping.set()
        if not self._lock.acquire(timeout=timeout_s):
            log.warning("stopping the serving helper of %s: its supervisor is stuck; the helper exits with this "
                        "process", self.spec.address)
            return
        try:
            child = self._child
            if child is not None:
                child.kill()
                if not child.wait_gone(timeout_s):
                    log.warning("the serving helper of %s (pid %d) did not exit within %.0f s of SIGKILL; the "
                                "port is free once it does", self.spec.address, child.proc.pid, timeout_s)
        finally:
            self._lock.release()
        if threading.current_thread() is not self._thread and self._thread.is_alive():
            self._thread.join(timeout_s)

    def leave(self, timeout_s: float) -> bool:
        """Leave the address to the helper, which decides whether to serve on for departed ranks (see main).

        Waits (bounded) for a helper that is starting.  True if the helper was told; from then on the
        supervisor only reaps it.  False: no helper to leave it to (the caller stops as usual).
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
                child.channel.sendall(LEAVE)
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
            child.proc.returncode = 0  # not this process's child: Popen must never wait for it here
            with contextlib.suppress(OSError):
                child.close()

    # -- the supervising thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._supervise()
        except Exception:  # a bug of ours must cost the helper only: the endpoint serves from its thread again
            log.warning("the supervisor of the serving helper of %s failed; this process serves its telemetry "
                        "endpoint from a thread from now on", self.spec.address, exc_info=True)
            with self._lock:
                child, self._child = self._child, None
            if child is not None:
                child.kill()
            self._host.helper_gone(self)

    def _supervise(self) -> None:
        backoff_s = 0.0
        while not self._stopping.is_set():
            child = self._spawn()
            if child is None:
                return  # warned: the endpoint goes on serving from its thread
            ready = self._await_ready(child)
            if ready:
                self._host.helper_ready(self)
                self._ready.set()
                self._watch(child)
            self._ready.clear()
            with self._lock:
                self._child = None
                status = child.reap()
                lifetime_s = time.monotonic() - child.started
                child.close()
            if self._stopping.is_set() or self._leaving.is_set():
                return
            if not ready:
                _warner.warn(("not-ready", self.spec.address),
                             "the serving helper of %s (pid %d) %s before it was ready; this process serves its "
                             "telemetry endpoint from a thread instead, which a busy or stopped process holds up",
                             self.spec.address, child.proc.pid, exit_words(status))
                return
            self._host.helper_gone(self)
            if self._restart.is_set():
                self._restart.clear()
                backoff_s = 0.0
                continue
            backoff_s = 0.0 if lifetime_s >= STABLE_S else min(max(2 * backoff_s, RESTART_BACKOFF_MIN_S),
                                                                 RESTART_BACKOFF_MAX_S)
            log.warning("the serving helper of %s (pid %d) %s after %.1f s; this process serves from a thread "
                        "meanwhile and starts a new helper in %.2f s", self.spec.address, child.proc.pid,
                        exit_words(status), lifetime_s, backoff_s)
            if self._stopping.wait(backoff_s):
                return

    def _spawn(self) -> _Child | None:
        env = dict(os.environ)
        env.pop("PYTHONSAFEPATH", None)  # the helper finds this package through its working directory
        # The endpoint's state is held still (its descriptors cannot be closed, and their numbers reused) until
        # the helper has its copies.  A fork of the host while we spawn must find either none of the helper's
        # descriptors or all of them recorded in self._child, which the fork hooks drop in the child.
        with self._host.helper_state(self) as state, holding_off_fork():
            if state is None:
                return None  # the endpoint stopped serving meanwhile
            try:
                ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            except OSError as exc:  # out of descriptors
                self._cannot_start(exc)
                return None
            fds = [state.listener_fd, theirs.fileno()] + ([] if state.lock_fd is None else [state.lock_fd])
            args = HelperArgs(
                for_pid=os.getpid(), address=self.spec.address, directory=self.spec.directory,
                listener_fd=state.listener_fd, channel_fd=theirs.fileno(), lock_fd=state.lock_fd,
                problem=state.problem, agent_name=self.spec.agent_name, stale_ttl_s=self.spec.stale_ttl_s,
                serving_since=state.serving_since, replaced_at=state.replaced_at,
                log_level=logging.getLogger("nixl_prometheus_mp").getEffectiveLevel())
            command = [sys.executable, "-m", "app", *args.argv()]
            proc = None
            try:
                proc = subprocess.Popen(command, cwd=_PACKAGE_ROOT, env=env, stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, pass_fds=fds, start_new_session=True)
                pidfd = os.pidfd_open(proc.pid)
            except (OSError, subprocess.SubprocessError) as exc:  # no descriptors, processes or memory
                ours.close()
                if proc is not None:
                    proc.kill()
                    proc.wait()
                self._cannot_start(exc)
                return None
            finally:
                theirs.close()  # the helper's end is the helper's alone: its death is then the rank's EOF
            child = _Child(proc, pidfd, ours)
            with self._lock:
                self._child = child
                if self._stopping.is_set():  # stop() ran while we were spawning: it could not see this child
                    child.kill()
        return child

    def _cannot_start(self, exc: BaseException) -> None:
        _warner.warn(("spawn", self.spec.address),
                     "cannot start the serving helper of %s (%s); this process serves its telemetry endpoint from "
                     "a thread instead, which a busy or stopped process holds up", self.spec.address, exc)

    def _await_ready(self, child: _Child) -> bool:
        poller = select.poll()
        poller.register(child.channel.fileno(), select.POLLIN)
        poller.register(child.pidfd, select.POLLIN)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while (left := deadline - time.monotonic()) > 0:
            events = dict(poller.poll(int(left * 1000) + 1))
            if child.pidfd in events:
                return False
            if child.channel.fileno() in events:
                with contextlib.suppress(OSError):
                    return child.channel.recv(1) == READY and not self._stopping.is_set()
                return False
        child.kill()
        _warner.warn(("ready-timeout", self.spec.address),
                     "the serving helper of %s (pid %d) was not ready within %.0f s; this process serves its "
                     "telemetry endpoint from a thread instead", self.spec.address, child.proc.pid, READY_TIMEOUT_S)
        child.wait_gone(KILL_WAIT_S)
        return False

    def _watch(self, child: _Child) -> None:
        """Until the helper dies: the endpoint's periodic check, from a thread that holds no GIL in between."""
        while not _readable(child.pidfd, WATCH_S):
            if self._leaving.is_set():
                _readable(child.pidfd, None)  # it serves on for departed ranks: only reap it when it is done
                return
            if self._stopping.is_set():
                return
            self._host.watch()
