"""What an address server (or its spare) does to itself as it starts: where its records go, and the privileges
it gives up.

Its log file is in the run's directory, where a co-tenant may have put anything at its path: it is opened as
hostile input (``LogFile``).  A root rank's server keeps no capability (``drop_capabilities``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import logging.handlers
import os
import stat
from pathlib import Path
from typing import Any

from app.launch import ServerArgs

LOG_NAME = "nixl-server.{address}.log"  # in the directory
LOG_MAX_BYTES = 1 << 20  # the log file is rotated at this size, one old file kept: at most 2 MiB
_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
_LINUX_CAPABILITY_VERSION_3 = 0x20080522  # <linux/capability.h>
_PR_SET_SECUREBITS, _SECBIT_NOROOT, _SECBIT_NOROOT_LOCKED = 28, 1 << 0, 1 << 1  # <linux/securebits.h>
_PR_SET_NO_NEW_PRIVS = 38


def log_path(directory: Path, address: str) -> Path:
    """The file a server's records go to."""
    return directory / LOG_NAME.format(address=address.replace("/", "_"))


class LogFile(logging.handlers.RotatingFileHandler):
    """The server's log file, opened as hostile input: in a shared directory, a co-tenant may have put a
    symlink, a FIFO or a file of its own at its path.  Only a regular file of ours is written (created 0600,
    never following a link, never blocking); anything else raises, and the server logs nowhere."""

    def _open(self) -> Any:
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
        fd = os.open(self.baseFilename, flags, 0o600)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            os.close(fd)
            raise OSError(errno.EPERM, f"{self.baseFilename} is not a regular file of uid {os.geteuid()}")
        return open(fd, "a", encoding=self.encoding, errors=self.errors)


def log_to_file(args: ServerArgs) -> str | None:
    """Send the records of ``nixl_prometheus_mp.*`` to the server's file, or nowhere; why nowhere, if so."""
    root = logging.getLogger("nixl_prometheus_mp")
    root.setLevel(args.log_level)
    root.propagate = False
    try:
        handler: logging.Handler = LogFile(log_path(args.directory, args.address), maxBytes=LOG_MAX_BYTES,
                                            backupCount=1)
        handler.setFormatter(logging.Formatter("%(asctime)s pid %(process)d %(levelname)s %(name)s: %(message)s"))
    except OSError as exc:
        root.addHandler(logging.NullHandler())
        return f"the address server of {args.address} logs nowhere: its log file cannot be used ({exc.strerror or exc})"
    root.addHandler(handler)
    return None


def drop_capabilities(directory: Path) -> str | None:
    """Keep no capability (a root rank's server would have all of them); what it cannot do without, in words.

    Its uid stays the rank's: the stores are the rank's (0600), and a reader skips stores of another owner.  The
    listener and the lock were handed over open, so neither a low port nor the lock file needs anything.  A root
    rank's directory of another owner (a project's group directory, 2770) is reached through its group, which the
    server joins first (its only supplementary group); one it can reach only through a DAC override (another
    user's private 0700 directory) is said, and nothing is served from it.  Root's capabilities never come back:
    no exec of ours regains them (SECBIT_NOROOT, locked), nor does anything else (no_new_privs).
    """
    if os.geteuid() != 0:
        return None  # an unprivileged process has no capability to drop (unless granted by file: never to python)
    libc = ctypes.CDLL(None, use_errno=True)
    with contextlib.suppress(OSError):
        owner = os.stat(directory)
        if owner.st_uid != 0:
            os.setgroups([owner.st_gid])
    libc.prctl(_PR_SET_SECUREBITS, _SECBIT_NOROOT | _SECBIT_NOROOT_LOCKED, 0, 0, 0)
    libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header = (ctypes.c_uint32 * 2)(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)(0, 0, 0, 0, 0, 0)  # (effective, permitted, inheritable) x 2 words
    if libc.capset(header, data) != 0:
        return f"the address server could not drop its capabilities ({os.strerror(ctypes.get_errno())})"
    try:
        os.listdir(directory)
    except PermissionError:
        return (f"the address server of a root rank keeps no capability, and cannot list {directory} without "
                "one (another user's private directory?): it serves nothing from it. Give the directory to the "
                "run's user, or to a group (mode 2770, as docs/operations.md shows)")
    except OSError:
        pass  # (gone, or not there yet: the server says so as it scans)
    return None
