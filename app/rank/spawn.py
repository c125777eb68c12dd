"""Starting a serving helper: which interpreter, with what command line and bootstrap, and its handles.

app.rank.supervisor says how a helper is started, watched and stopped, and why; this module holds the parts
that touch no supervisor state: whether an interpreter can run a helper at all, the helper's command line
(the rank's interpreter flags, then ``-c BOOT_COMMAND serving-helper --for-pid PID``: nothing ``ps`` should
not show), the bootstrap sent over the channel (the rank's ``sys.path``, so that the helper imports the very
code the rank runs), and ``HelperProcess``: one helper's launcher, pid, pidfd and channel.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import select
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from app.probe import credentials, helper_command
from app.rank.channel import MAX_MESSAGE, pair
from store.fds import above_stdio, open_above_stdio, socket_above_stdio, stdio_occupied

KILL_WAIT_S = 2.0  # how long stopping waits for a SIGKILLed helper to be gone (it frees the port then)
# The failures of a start that the system may not repeat a moment later: tried again, with the back-off.
TRANSIENT_ERRNOS = frozenset({errno.EAGAIN, errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
# sys.executable names the interpreter only where it is one: an embedded interpreter (uWSGI, a C++ host) sets it
# to its own program, or to nothing, and exec'ing that with "-c ..." would start who knows what.  Debug builds
# (python3.12d, python3-dbg, python_d.exe) and GraalPy are interpreters too.
_INTERPRETER_NAME = re.compile(r"(python|pypy|graalpy|graalpython)[0-9.]*(d|dm|m|t|_d|-dbg)?(\.exe)?",
                               re.IGNORECASE)
# The directory holding this package (a .pyz for a zipapp): on the helper's sys.path if the rank's lacks it.
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]
# The helper's whole command line but its interpreter's flags and helper_command(): read the rest from stdin.
BOOT_COMMAND = f"import os;exec(os.read(0,{MAX_MESSAGE}))"


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


def helper_sys_path() -> list[str]:
    """The helper's sys.path: the rank's, less what depends on the rank's working directory (the helper runs
    in /), with this package's root where the rank has none of it, after the standard library."""
    path: list[str] = []
    for entry in sys.path:
        if entry and os.path.isabs(entry) and entry not in path:
            path.append(entry)
    root = str(_PACKAGE_ROOT)
    if root not in path:
        stdlib = [p for p in (sysconfig.get_path("stdlib"), sysconfig.get_path("platstdlib")) if p]
        after = [i + 1 for i, entry in enumerate(path)
                 if entry.endswith(".zip") or any(entry == p or entry.startswith(p + os.sep) for p in stdlib)]
        path.insert(max(after, default=len(path)), root)
    return path


def bootstrap() -> bytes:
    return (f"import sys\nsys.path[:] = {helper_sys_path()!r}\n"
            "from app.rank.helper import main\nmain()\n").encode()


class StartFailed(Exception):
    """A helper that did not start: in words, and whether trying again later may do better."""

    def __init__(self, words: str, transient: bool) -> None:
        super().__init__(words)
        self.words, self.transient = words, transient


class HelperProcess:
    """One helper: its launcher (our child), the helper's pid and pidfd once it said them, the channel."""

    def __init__(self, launcher: subprocess.Popen[bytes], launcher_fd: int, channel: socket.socket) -> None:
        self.launcher, self.launcher_fd, self.channel = launcher, launcher_fd, channel
        self.pid: int | None = None
        self.pidfd = -1
        self.started = time.monotonic()
        self.said: str | None = None  # its last word (``E``) before it exited
        self.launcher_status: int | None = None  # (reaped) its exit status, as Popen reports it
        self.spawned_with = credentials("thread-self")  # this thread's credentials when it was started

    @property
    def name(self) -> str:
        return f"pid {self.pid}" if self.pid is not None else f"launcher pid {self.launcher.pid}"

    def kill(self) -> str | None:
        """SIGKILL the helper (and its launcher); why the kernel refused, if it did."""
        refused = None
        for fd in (self.pidfd, self.launcher_fd):
            if fd < 0:
                continue
            try:
                signal.pidfd_send_signal(fd, signal.SIGKILL)  # a pidfd never names a reused pid
            except PermissionError as exc:  # it runs as another user now (its rank dropped privileges)
                refused = os.strerror(exc.errno or errno.EPERM)
            except OSError:
                pass  # gone already
        return refused

    def tell(self, message: bytes) -> bool:
        """Send ``message`` without ever blocking; False if it could not go."""
        try:
            self.channel.send(message, socket.MSG_DONTWAIT)
        except OSError:
            return False
        return True

    def gone_fd(self) -> int:
        """The descriptor that polls readable once the helper is gone (the launcher's until it said its pid)."""
        return self.pidfd if self.pidfd >= 0 else self.launcher_fd

    def wait_gone(self, timeout_s: float | None) -> bool:
        try:
            return readable(self.gone_fd(), timeout_s)
        except (OSError, ValueError):
            return True

    def reap_launcher(self, block: bool = False) -> int | None:
        """Reap the launcher (only it, through its pidfd); its exit status, None if not yet or someone else's."""
        if self.launcher_status is not None or self.launcher_fd < 0:
            return self.launcher_status
        try:
            result = os.waitid(os.P_PIDFD, self.launcher_fd, os.WEXITED | (0 if block else os.WNOHANG))
        except ChildProcessError:  # a host that ignores SIGCHLD or reaps in its own handler got there first
            self.launcher.returncode = 0  # Popen must not try to reap (or remember to reap) a pid no longer ours
            return None
        except OSError:
            return None
        if result is None:
            return None
        status = -result.si_status if result.si_code in (os.CLD_KILLED, os.CLD_DUMPED) else result.si_status
        if status > 128:  # the launcher's word for "the helper was killed by signal N" (app.rank.helper)
            status = -(status - 128)
        self.launcher.returncode = self.launcher_status = status
        return status

    def reap_helper(self) -> None:
        """Reap the helper where it became our child (this process is pid 1 or a subreaper)."""
        if self.pidfd >= 0:
            with contextlib.suppress(OSError):
                os.waitid(os.P_PIDFD, self.pidfd, os.WEXITED | os.WNOHANG)

    def close(self) -> None:
        """Close our descriptors of it (the caller holds holding_off_fork: a fork sees them all, or none)."""
        for name in ("pidfd", "launcher_fd"):
            fd = getattr(self, name)
            setattr(self, name, -1)
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        with contextlib.suppress(OSError):
            self.channel.close()


def readable(fd: int, timeout_s: float | None) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(None if timeout_s is None else int(timeout_s * 1000)))


def launch() -> HelperProcess:
    """Start a helper's launcher (the caller holds holding_off_fork and records the result before it lets
    go); StartFailed if it cannot."""
    command = [sys.executable, *subprocess._args_from_interpreter_flags(),  # type: ignore[attr-defined]
               "-c", BOOT_COMMAND, *helper_command(os.getpid())]
    ours = theirs = None
    null = -1
    try:
        ours, theirs = (socket_above_stdio(end) for end in pair())
        null = open_above_stdio(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        # Its stdin is the channel; stdout and stderr /dev/null (it logs over the channel); every other
        # descriptor closed; in /, so that it keeps no directory busy.
        with stdio_occupied():  # (Popen's own pipes, for the moment it takes, never on 0-2: see store.fds)
            launcher = subprocess.Popen(command, cwd="/", stdin=theirs.fileno(), stdout=null, stderr=null,
                                        start_new_session=True)
    except (OSError, subprocess.SubprocessError) as exc:  # no descriptors, processes or memory
        if ours is not None:
            ours.close()
        raise StartFailed(f"cannot start it: {exc}", isinstance(exc, OSError)
                          and exc.errno in TRANSIENT_ERRNOS) from None
    finally:
        if theirs is not None:
            theirs.close()  # the helper's end is the helper's alone: its death is then our end of file
        if null >= 0:
            os.close(null)
    try:
        launcher_fd = above_stdio(os.pidfd_open(launcher.pid))
    except OSError as exc:
        launcher.kill()
        launcher.wait()
        ours.close()
        raise StartFailed(f"cannot watch it: {exc}", exc.errno in TRANSIENT_ERRNOS) from None
    return HelperProcess(launcher, launcher_fd, ours)
