"""One scrape's directory scan: list the stores, then open, probe and read them, a batch at a time.

``scan(directory, first)`` returns the names in it that are store names
(``nixl.<pid>.<run_marker>.<instance>.mmap``, decimal fields; nothing else in
the directory is ever opened), sorted, and the first batch of about ``first``
of them read (``batch_end``); an unreadable directory raises ``OSError``.
``read_stores(directory, names)`` reads a later batch.  Each read is one
``Entry`` per name, in order: each store is opened without following symlinks, blocking or taking
a terminal (``O_NONBLOCK | O_NOCTTY``: a device node named like a store is
opened, but nothing more), must be a regular file owned by our effective uid
(anything else is never read), gets its writer's lock probed
(``LOCK_SH|LOCK_NB``: any failure to take it reads as alive), then is read.
Calls interrupted by a signal are made again (PEP 475), on both paths.

Why a module of its own: every one of those system calls releases the GIL,
and when another thread of the serving process (a rank recording flat out)
wants it, each one waits up to a switch interval (5 ms) to get it back.  The
C speedup ``store._scan`` makes the listing with the first batch's reads, and
each later batch's, one GIL release; this pure-Python twin is used where it is not built or when
NIXL_PROMETHEUS_MP_PURE_PYTHON=1, and gives identical results (the tests
compare both on the same directory).
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Final, NamedTuple

from store import native
from store.fds import open_above_stdio, stdio_occupied
from store.layout import STORE_SIZE, is_store_name
from store.reader import Unreadable, foreign_owner, not_regular, open_failure

# Outcomes (the same numbers in store/_scan.c).
OK: Final = 0  # read in full: ``data`` holds STORE_SIZE bytes
MISSING: Final = 1  # gone since the listing (another scraper reaped it)
FOREIGN: Final = 2  # owned by another uid: never read
NOT_REGULAR: Final = 3  # a FIFO, socket, device or directory
UNREADABLE: Final = 4  # a call failed with ``err`` (ELOOP: a symbolic link; EACCES: no read permission)
SHORT: Final = 5  # read, but shorter than a store: ``data`` holds what there was

_OPEN_FLAGS: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY


class Entry(NamedTuple):
    name: str
    outcome: int
    err: int  # errno of the failed call, else 0
    alive: bool  # a writer holds the store (or the probe failed); False unless read
    uid: int  # the file's owner, once fstat succeeded (else 0)
    ino: int  # its inode, once fstat succeeded (else 0): the reaper checks the name still points at it
    data: bytes | None  # OK and SHORT only


def _one(dir_fd: int, name: str, euid: int) -> Entry:
    try:
        fd = open_above_stdio(name, _OPEN_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        err = exc.errno or 0
        outcome = MISSING if err == errno.ENOENT else UNREADABLE
        return Entry(name, outcome, err, False, 0, 0, None)
    try:
        try:
            st = os.fstat(fd)
        except OSError as exc:
            return Entry(name, UNREADABLE, exc.errno or 0, False, 0, 0, None)
        if not stat.S_ISREG(st.st_mode):
            return Entry(name, NOT_REGULAR, 0, False, st.st_uid, st.st_ino, None)
        if st.st_uid != euid:
            return Entry(name, FOREIGN, 0, False, st.st_uid, st.st_ino, None)
        # Probe before reading: a writer that dies in between then only makes
        # us publish values that were final anyway.
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # a lock we took goes with the close below
        except OSError:
            alive = True  # a false "dead" would get a live writer's store reaped
        else:
            alive = False
        try:
            data = os.pread(fd, STORE_SIZE, 0)
        except OSError as exc:
            return Entry(name, UNREADABLE, exc.errno or 0, False, st.st_uid, st.st_ino, None)
        return Entry(name, OK if len(data) == STORE_SIZE else SHORT, 0, alive, st.st_uid, st.st_ino, data)
    finally:
        os.close(fd)


def batch_end(names: list[str], start: int, size: int) -> int:
    """Where the batch of about ``size`` of ``names`` (sorted) from ``start`` ends: never between two stores of
    one pid, which a scrape must decide between in one batch (app.collector).  Every ``nixl.<pid>.`` name of one
    pid sorts together, since the "." after the pid sorts before any digit."""
    end = min(start + max(size, 0), len(names))
    if end > start:
        last = names[end - 1]
        prefix = last[:last.index(".", 5) + 1]
        while end < len(names) and names[end].startswith(prefix):
            end += 1
    return end


def list_python(directory: str | os.PathLike[str]) -> list[str]:
    """The directory's store names, sorted."""
    with stdio_occupied():  # (the listing's descriptor, never on 0-2: see store.fds)
        return sorted(name for name in os.listdir(directory) if is_store_name(name))


def read_python(directory: str | os.PathLike[str], names: list[str]) -> list[Entry]:
    """The pure-Python twin of ``store._scan.read``."""
    for name in names:
        if not isinstance(name, str) or len(name) > 255 or not is_store_name(name):
            raise ValueError(f"read: {name!r} is not a store name")  # only a store name is ever opened
    # One directory descriptor for the opens: as in C, a process short of descriptors opens no store.
    dir_fd = open_above_stdio(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        euid = os.geteuid()
        return [_one(dir_fd, name, euid) for name in names]
    finally:
        os.close(dir_fd)


def scan_python(directory: str | os.PathLike[str], first: int) -> tuple[list[str], list[Entry]]:
    """The pure-Python twin of ``store._scan.scan``."""
    names = list_python(directory)
    end = batch_end(names, 0, first)
    return names, read_python(directory, names[:end]) if end else []


def _pick() -> tuple[Callable[[str | os.PathLike[str], int], tuple[list[str], list[Entry]]],
                     Callable[[str | os.PathLike[str], list[str]], list[Entry]]]:
    module = native.load("_scan")
    if module is None:
        return scan_python, read_python
    c_scan, c_read = module.scan, module.read

    def scan_c(directory: str | os.PathLike[str], first: int) -> tuple[list[str], list[Entry]]:
        with stdio_occupied():  # (its opens, in C, never on 0-2: see store.fds)
            names, entries = c_scan(directory, first)
        return names, list(map(Entry._make, entries))

    def read_c(directory: str | os.PathLike[str], names: list[str]) -> list[Entry]:
        with stdio_occupied():
            entries = c_read(directory, names)
        return list(map(Entry._make, entries))

    return scan_c, read_c


# scan(directory, first): the store names (sorted) and the first batch of about ``first`` of them read, in one
# call (a directory of one batch: one GIL release); read_stores(directory, names): a later batch.
scan, read_stores = _pick()


def unreadable(entry: Entry, path: Path) -> Unreadable:
    """Why an entry that was not read (``data`` is None) could not be, as the reader words it."""
    if entry.outcome == NOT_REGULAR:
        return not_regular(path)
    if entry.outcome == FOREIGN:
        return foreign_owner(path, entry.uid)
    return open_failure(path, entry.err)
