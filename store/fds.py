"""Descriptors of ours are never 0, 1 or 2, even where the host closed its standard streams.

A daemon may run with descriptors 0-2 closed, and the kernel hands out the lowest free number: a lock file,
a store, a listener opened then would sit where the host (or anything it starts) reads its input or writes
its output and errors, and the host's next ``print`` or log line would land in our file.  So every
descriptor this package keeps is moved to 3 or above the moment it exists (``F_DUPFD_CLOEXEC``), and the
low number is closed again.  Between the two calls (a few microseconds, or as long as another thread holds
the GIL) the low number is ours; nothing of ours writes through it meanwhile.  A call that makes a descriptor
we never see (``mmap.mmap`` keeps a duplicate of the file's) runs while 0-2 are all open instead:
:func:`stdio_occupied`.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator

try:
    import fcntl
except ImportError:  # not POSIX: no such descriptors to protect
    fcntl = None  # type: ignore[assignment]

FIRST_FREE = 3  # the lowest number we ever keep


def above_stdio(fd: int) -> int:
    """``fd``, or a close-on-exec duplicate of it numbered 3 or above (``fd`` itself is closed then)."""
    if fd >= FIRST_FREE or fcntl is None:
        return fd
    try:
        moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, FIRST_FREE)
    finally:
        os.close(fd)  # (also when the duplicate fails, out of descriptors: the caller sees that error)
    return moved


def close_quietly(fd: int | None) -> None:
    """Close ``fd`` if it is one (``None`` or negative: nothing to close), whatever the close says: on the
    paths that drop a descriptor (teardown, a fork's child, a failed start) a close that fails has nothing
    left to undo, and raising there would skip the releases that follow it."""
    if fd is not None and fd >= 0:
        with contextlib.suppress(OSError):
            os.close(fd)


def open_above_stdio(path: str | os.PathLike[str], flags: int, mode: int = 0o777, *,
                     dir_fd: int | None = None) -> int:
    """``os.open``, the descriptor numbered 3 or above."""
    return above_stdio(os.open(path, flags, mode, dir_fd=dir_fd))


def socket_above_stdio(sock: socket.socket) -> socket.socket:
    """``sock``, or the same socket on a descriptor numbered 3 or above (``sock`` is then detached)."""
    if sock.fileno() >= FIRST_FREE:
        return sock
    return socket.socket(fileno=above_stdio(sock.detach()))


@contextlib.contextmanager
def stdio_occupied() -> Iterator[None]:
    """While held, 0, 1 and 2 are all open, so that any descriptor made meanwhile lands at 3 or above.

    The free ones are filled with /dev/null for that moment (a host's write to its closed stderr then goes
    nowhere, where it would have failed), and closed again.
    """
    placeholders: list[int] = []
    try:
        while True:
            fd = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
            if fd >= FIRST_FREE:
                os.close(fd)
                break
            placeholders.append(fd)
        yield
    finally:
        for fd in placeholders:
            os.close(fd)
