"""Descriptors of ours are never 0, 1 or 2, even where the host closed its standard streams.

A daemon may run with descriptors 0-2 closed, and the kernel hands out the lowest free number: a lock file,
a store, a socket opened then would sit where the host (or anything it starts) reads its input or writes
its output and errors, and the host's next ``print`` or log line (the rank's logging carrying an address
server's records included) would land in our file, or in a scrape's answer.  So every descriptor of ours is
made while 0, 1 and 2 are all open (:func:`stdio_occupied` fills the free ones with /dev/null for that
moment, one thread at a time), and so is numbered 3 or above from the instant it exists; meanwhile the host's
writes to its closed streams go to /dev/null, where they would have failed.

A child forked while another thread fills keeps /dev/null on the streams its parent had closed (harmless:
its writes there go nowhere either).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

FIRST_FREE = 3  # the lowest number we ever keep
# One filler at a time: a filler that closes its placeholders frees 0-2 under another's open.  Reentrant: a
# signal handler may make a descriptor while its thread fills (each call closes only what it opened).
_filling = threading.RLock()


def reset_after_fork() -> None:
    """In a forked child (store.writer's fork hook): another thread of the parent may have held the lock."""
    global _filling
    _filling = threading.RLock()


def close_quietly(fd: int | None) -> None:
    """Close ``fd`` if it is one (``None`` or negative: nothing to close), whatever the close says: on the
    paths that drop a descriptor (teardown, a fork's child, a failed start) a close that fails has nothing
    left to undo, and raising there would skip the releases that follow it."""
    if fd is not None and fd >= 0:
        with contextlib.suppress(OSError):
            os.close(fd)


def open_above_stdio(path: str | os.PathLike[str], flags: int, mode: int = 0o777, *,
                     dir_fd: int | None = None) -> int:
    """``os.open``, the descriptor numbered 3 or above from the instant it exists."""
    with stdio_occupied():
        return os.open(path, flags, mode, dir_fd=dir_fd)


@contextlib.contextmanager
def stdio_occupied() -> Iterator[None]:
    """While held, 0, 1 and 2 are all open, so that any descriptor made meanwhile lands at 3 or above.

    The free ones are filled with /dev/null for that moment, and closed again.  Cheap where none is free (one
    open and one close): every descriptor of ours is made under it.
    """
    with _filling:
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
