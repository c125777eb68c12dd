"""Starting a process of the address server's: the server itself (from a rank) or its spare (from a server).

Everything the process needs travels in its stdin, a memfd holding its bootstrap: the code that finds this
package, the role, the state (``ServerArgs``) and the numbers of the descriptors it inherits (the listener,
and a description of the election's lock file).  A memfd has no size limit and never blocks: a rank whose
``sys.path`` is 200 KB starts a server like any other (a pipe or a socket would have to be drained by a
process that is not running yet).  Its command line is ``python [the rank's interpreter flags] -c BOOT
serving-helper ADDRESS``: ``ps`` shows every local user nothing more.

The process started (the launcher) forks at once and exits, so the server is nobody's child in the host
(init, or the nearest subreaper, reaps it): the starter only reaps the launcher, without waiting (``reap``).
Its stdout is a pipe the starter reads without blocking (``read_status``): one line ``R<pid>`` once it
serves (a spare: once it waits for the lock), ``W<text>`` for each warning its starter should log, ``E<text>``
for why it failed; then the end of file.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import subprocess
import sys
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from app.probe import helper_command
from store.fds import open_above_stdio, stdio_occupied

READY, WARNING, ERROR = "R", "W", "E"
# The failures of a start that the system may not repeat a moment later (a process, a descriptor, memory).
TRANSIENT_ERRNOS = frozenset({errno.EAGAIN, errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
# sys.executable names the interpreter only where it is one: an embedded interpreter (uWSGI, a C++ host) sets it
# to its own program, or to nothing, and exec'ing that with "-c ..." would start who knows what.  Debug builds
# (python3.12d, python3-dbg, python_d.exe) and GraalPy are interpreters too.
_INTERPRETER_NAME = re.compile(r"(python|pypy|graalpy|graalpython)[0-9.]*(d|dm|m|t|_d|-dbg)?(\.exe)?",
                               re.IGNORECASE)
# The directory holding this package (a .pyz for a zipapp): on the process's sys.path if the starter's lacks it.
_PACKAGE_ROOT = Path(__file__).resolve().parents[1]
# The whole program but the interpreter's flags and helper_command(): the rest is read from stdin, whole.
BOOT_COMMAND = "import os;exec(os.read(0,os.fstat(0).st_size))"


@dataclass(frozen=True)
class ServerArgs:
    """What a server (or its spare) is told of the address it serves."""

    address: str
    directory: Path
    has_lock: bool  # False: the election fell back to the bind (no usable lock); only the listener is handed on
    problem: str | None  # why the lock is unusable, for /healthz
    started_by: int  # the pid of the rank that started the first server of this line
    agent_name: str | None  # that rank's agent
    stale_ttl_s: float
    drain_max_s: float  # after a SIGTERM, the longest it goes on publishing departed ranks' final values
    serving_since: float
    replaced_at: float | None  # when the rank found its directory replaced, for /healthz
    log_level: int

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "directory": str(self.directory)}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> ServerArgs:
        return cls(**{**doc, "directory": Path(doc["directory"])})


def unusable() -> str | None:
    """Why no address server can run from this interpreter, or None when one can."""
    executable = sys.executable
    if not executable:
        return "the interpreter does not know its own executable (sys.executable is empty)"
    if not _INTERPRETER_NAME.fullmatch(os.path.basename(executable)):
        return f"sys.executable ({executable}) is not a Python interpreter (an embedded interpreter?)"
    if not os.access(executable, os.X_OK):
        return f"sys.executable ({executable}) is not executable"
    if not hasattr(os, "pidfd_open") or not hasattr(os, "memfd_create"):
        return "this platform has no pidfd or memfd (Linux 5.3 or later is needed)"
    return None


def helper_sys_path() -> list[str]:
    """The process's sys.path: the starter's, less what depends on its working directory (the process runs
    in /), with this package's root where the starter has none of it, after the standard library."""
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


def bootstrap(state: dict[str, Any]) -> bytes:
    # SIGUSR1 first: a rank of another run may ask the port's holder to yield before main() handles it, and its
    # default action would kill us.  Then the fork, before any import: the launcher (the starter's child)
    # exits within milliseconds, and the process is nobody's child in the host from then on.
    return ("import os, signal, sys\nsignal.signal(signal.SIGUSR1, signal.SIG_IGN)\n"
            "if os.fork():\n    os._exit(0)\n"
            f"sys.path[:] = {helper_sys_path()!r}\n"
            # What fails before main() (memory for the imports, a broken install) is said on the status pipe as
            # main() says its own failures, for the starter's log: this process's stderr goes nowhere.
            "try:\n    from app.address.server import main\nexcept BaseException as exc:\n"
            "    os.write(1, f'E{type(exc).__name__}: {exc} (as it loaded its code)'[:4000].encode(errors='replace')"
            " + b'\\n')\n    os._exit(1)\n"
            f"main({json.dumps(state)!r})\n").encode()


class StartFailed(Exception):
    """A process that could not even be launched: in words, and whether trying again later may do better."""

    def __init__(self, words: str, transient: bool) -> None:
        super().__init__(words)
        self.words, self.transient = words, transient


@dataclass
class Started:
    """A process on its way: the launcher (the starter's child, to reap) and the read end of its status.

    The status descriptor is read and closed only while it is still the pipe it was (``pipe``: its inode): a
    host that closed it (``os.closerange``) may have a file of its own under that number by now.
    """

    launcher: subprocess.Popen[bytes] | None
    status_fd: int
    pipe: int
    lines: str = ""  # what was read of the status and is not a whole line yet
    lost: bool = False  # the status descriptor stopped being ours: nothing more will be heard

    def _ours(self) -> bool:
        try:
            return os.fstat(self.status_fd).st_ino == self.pipe
        except OSError:
            return False

    def reap(self) -> bool:
        """Reap the launcher without waiting; whether it is reaped (it exits within milliseconds)."""
        if self.launcher is not None and self.launcher.poll() is None:
            return False
        self.launcher = None
        return True

    def read_status(self) -> tuple[list[str], bool]:
        """The status lines that arrived (never waiting), and whether its end of file came (then closed)."""
        ended = False
        if self.status_fd >= 0 and not self._ours():
            self.status_fd, self.lost, ended = -1, True, True  # (never closed: not ours)
        while self.status_fd >= 0:
            try:
                chunk = os.read(self.status_fd, 4096)
            except BlockingIOError:
                break
            except OSError:
                chunk = b""
            if not chunk:
                ended = True
                self.close()
                break
            self.lines += chunk.decode(errors="replace")
        *whole, self.lines = self.lines.split("\n")
        if ended and self.lines:
            whole.append(self.lines)
        return whole, ended

    def close(self) -> None:
        if self.status_fd >= 0 and self._ours():
            os.close(self.status_fd)
        self.status_fd = -1


def launch(role: str, args: ServerArgs, listener_fd: int, lock_fd: int | None,
           extra: dict[str, Any] | None = None) -> Started:
    """Start a ``role`` process ("server" or "spare") that inherits ``listener_fd`` and ``lock_fd``;
    StartFailed if it cannot be started.  The caller closes its own copies once this returns."""
    state = {"role": role, "args": args.to_json(), "listener_fd": listener_fd, "lock_fd": lock_fd, **(extra or {})}
    command = [sys.executable, *subprocess._args_from_interpreter_flags(),  # type: ignore[attr-defined]
               "-c", BOOT_COMMAND, *helper_command(args.address)]
    boot = status_r = status_w = null = -1
    try:
        with stdio_occupied():
            boot = os.memfd_create("nixl-bootstrap", os.MFD_CLOEXEC)
            status_r, status_w = os.pipe2(os.O_CLOEXEC)
        null = open_above_stdio(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        os.write(boot, bootstrap(state))
        os.lseek(boot, 0, os.SEEK_SET)
        os.set_blocking(status_r, False)
        # In /, so that it keeps no directory busy; a session of its own (the terminal's signals are the job's);
        # every descriptor closed but those handed on.
        with stdio_occupied():  # (Popen's own pipes, for the moment it takes, never on 0-2: see store.fds)
            launcher = subprocess.Popen(command, cwd="/", stdin=boot, stdout=status_w, stderr=null,
                                        pass_fds=[fd for fd in (listener_fd, lock_fd) if fd is not None],
                                        start_new_session=True)
    except (OSError, subprocess.SubprocessError) as exc:  # no descriptors, processes or memory
        if status_r >= 0:
            os.close(status_r)
        raise StartFailed(f"cannot start it: {exc}", isinstance(exc, OSError)
                          and exc.errno in TRANSIENT_ERRNOS) from None
    finally:
        for fd in (boot, status_w, null):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
    return Started(launcher, status_r, os.fstat(status_r).st_ino)
