"""Starting an address server (app.address.server): which interpreter, with what command line and bootstrap.

The rank that wins the election starts the server and hands it the address at once (app.rank.endpoint): the
bootstrap, then the state with the lock's and the listener's descriptors (SCM_RIGHTS), are queued on the
channel before the interpreter has even started, and the rank closes its own copies right away.  So a rank
never waits for an interpreter's start, and a rank that dies (or closes) the next instant has handed the
address over all the same: what is queued on a socket reaches its reader whatever became of the sender.  A
server that fails to start closes its end, and the kernel drops the descriptors queued on it: the lock is
released and a standby takes the address over.

The command line is ``python [the rank's interpreter flags] -c BOOT_COMMAND serving-helper ADDRESS`` (``ps``
shows it to every local user: nothing more).  The process started (the launcher) forks at once and exits:
the rank reaps it within milliseconds, and the server is nobody's child in the host (init, or the nearest
subreaper, reaps it), so a host that waits for all its children never waits for it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import socket
import subprocess
import sys
import sysconfig
from pathlib import Path

from app.channel import MAX_MESSAGE, ServerArgs, pair, state_message
from app.probe import helper_command
from store.fds import open_above_stdio, stdio_occupied

# The failures of a start that the system may not repeat a moment later: tried again, with the back-off.
TRANSIENT_ERRNOS = frozenset({errno.EAGAIN, errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
# sys.executable names the interpreter only where it is one: an embedded interpreter (uWSGI, a C++ host) sets it
# to its own program, or to nothing, and exec'ing that with "-c ..." would start who knows what.  Debug builds
# (python3.12d, python3-dbg, python_d.exe) and GraalPy are interpreters too.
_INTERPRETER_NAME = re.compile(r"(python|pypy|graalpy|graalpython)[0-9.]*(d|dm|m|t|_d|-dbg)?(\.exe)?",
                               re.IGNORECASE)
# The directory holding this package (a .pyz for a zipapp): on the server's sys.path if the rank's lacks it.
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]
# The server's whole command line but its interpreter's flags and helper_command(): read the rest from stdin.
BOOT_COMMAND = f"import os;exec(os.read(0,{MAX_MESSAGE}))"


def helper_unusable() -> str | None:
    """Why no address server can run from this interpreter, or None when one can."""
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
    """The server's sys.path: the rank's, less what depends on the rank's working directory (the server runs
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
    # The fork comes first, before any import: the launcher (the rank's child) exits within milliseconds of
    # its start, and the server is nobody's child in the host from then on.
    return (f"import os, sys\nif os.fork():\n    os._exit(0)\nsys.path[:] = {helper_sys_path()!r}\n"
            "from app.address.server import main\nmain()\n").encode()


class StartFailed(Exception):
    """A server that could not even be launched: in words, and whether trying again later may do better."""

    def __init__(self, words: str, transient: bool) -> None:
        super().__init__(words)
        self.words, self.transient = words, transient


class Launched:
    """A server on its way: the launcher (our child, reaped through its pidfd) and our end of the channel."""

    def __init__(self, launcher: subprocess.Popen[bytes], launcher_fd: int, channel: socket.socket) -> None:
        self.launcher, self.launcher_fd, self.channel = launcher, launcher_fd, channel

    def reap_launcher(self, block: bool) -> bool:
        """Reap the launcher (only it); whether it is reaped (by us, or by a host that reaps all its children)."""
        if self.launcher_fd < 0:
            return True
        try:
            if os.waitid(os.P_PIDFD, self.launcher_fd, os.WEXITED | (0 if block else os.WNOHANG)) is None:
                return False  # not yet
        except ChildProcessError:  # a host that ignores SIGCHLD or reaps in its own handler got there first
            pass
        except OSError:
            return False
        self.launcher.returncode = 0  # Popen must never try to reap (or remember to reap) it again
        os.close(self.launcher_fd)
        self.launcher_fd = -1
        return True


def launch(lock_fd: int | None, listener: socket.socket, args: ServerArgs) -> Launched:
    """Start a server and queue it everything it serves with; StartFailed if it cannot be started.

    The caller closes its own copies of ``lock_fd`` and ``listener`` once this returns (or keeps them, and
    concedes, on StartFailed).
    """
    command = [sys.executable, *subprocess._args_from_interpreter_flags(),  # type: ignore[attr-defined]
               "-c", BOOT_COMMAND, *helper_command(args.address)]
    ours = theirs = None
    null = -1
    try:
        with stdio_occupied():
            ours, theirs = pair()
        # Queued before the launcher runs: the server reads them whenever it gets there.
        ours.send(bootstrap())
        fds = [listener.fileno()] + ([] if lock_fd is None else [lock_fd])
        socket.send_fds(ours, [state_message(args.to_json())], fds)
        null = open_above_stdio(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        # Its stdin is the channel; stdout and stderr /dev/null (it logs over the channel, then to its file);
        # every other descriptor closed; in /, so that it keeps no directory busy; a session of its own.
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
            theirs.close()  # the server's end is the server's alone: its death is then our end of file
        if null >= 0:
            os.close(null)
    try:
        with stdio_occupied():
            launcher_fd = os.pidfd_open(launcher.pid)
    except OSError:
        launcher_fd = -1
        with contextlib.suppress(OSError):
            launcher.wait(2.0)  # it forks and exits at once
    return Launched(launcher, launcher_fd, ours)
