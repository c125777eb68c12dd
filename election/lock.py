"""Owner election: one serving process per scrape address, decided by flock.

The lock, not the bind, elects: two ranks binding concurrently cannot tell
which of them got there first, so the bind is gated on an exclusive lock on
``nixl-owner.<address:port>.lock``.  The kernel drops the lock when its
holder dies, however it dies, so the next rank to try wins and a crash needs
no cleanup.  Lock files have no contents and are never unlinked: unlinking
would let a late process lock a fresh inode while another still holds the
old one, and two owners would serve.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from store.fds import open_above_stdio, stdio_occupied
from store.layout import OWNER_LOCK_PREFIX, OWNER_LOCK_SUFFIX
from store.warnonce import OnceWarner

try:
    import fcntl
except ImportError:  # not POSIX: filelock's descriptor lock is the fallback primitive
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger("nixl_prometheus_mp.election")
_warner = OnceWarner(log)

# A FIFO or a terminal planted under a lock file's name is refused once fstat tells (S_ISREG), so opening
# it must neither block (O_NONBLOCK: a FIFO with no writer) nor make a terminal the controlling one of a
# rank that leads its session (O_NOCTTY).  Neither flag changes anything for a regular file or its flock.
_OPEN_FLAGS = os.O_CREAT | os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY
_PROBE_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY
_WOULD_BLOCK = frozenset({errno.EWOULDBLOCK, errno.EAGAIN})
# Shortages of the process or the system: they say nothing about the lock file, and pass.
SCARCE = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})


def lock_file_name(address: str) -> str:
    """``nixl-owner.<address:port>.lock`` with ``/`` replaced by ``_``."""
    return f"{OWNER_LOCK_PREFIX}{address.replace('/', '_')}{OWNER_LOCK_SUFFIX}"


class Outcome(Enum):
    WON = "flock"  # we hold the lock: we serve this address
    LOST = "lost"  # a sibling holds it: stay a writer
    FALLBACK = "bind-fallback"  # the lock is unusable: we count as elected, the bind decides


def try_lock(fd: int) -> bool:
    """Non-blocking exclusive lock: True if taken, False if someone holds it.

    Any other failure (ENOLCK, EOPNOTSUPP, ...) raises OSError: the caller
    must not read it as "a sibling owns the address".
    """
    if fcntl is None:
        import filelock

        _warner.warn("filelock", "fcntl is not available on this platform; the owner election uses filelock's "
                     "descriptor lock instead, which only excludes processes that use the same primitive.")
        return filelock.lock_descriptor(fd, blocking=False)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in _WOULD_BLOCK:
            return False
        raise
    return True


def _unlock(fd: int) -> None:
    if fcntl is None:
        import filelock

        filelock.unlock_descriptor(fd)
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)


@dataclass
class OwnerElection:
    """This process's stake in the election for one address."""

    directory: Path
    address: str
    _fd: int | None = None
    held: bool = False
    problem: str | None = None  # why the lock is unusable, when it is
    shortage: str | None = None  # why the last try could not tell (EMFILE, ...): not a verdict on the lock

    @property
    def path(self) -> Path:
        return self.directory / lock_file_name(self.address)

    @property
    def descriptor(self) -> int | None:
        """The lock file's descriptor while we hold the lock (a serving helper inherits it), else None."""
        return self._fd if self.held else None

    def try_win(self) -> Outcome:
        """Race for the address; idempotent while we hold it.

        A lost race keeps no descriptor: one opened for each try, and closed unless it holds the lock, is never
        a number this process may have lost to its host meanwhile (``os.closerange``) nor one that a forked
        child shares when it later wins.
        """
        if self.held:
            return Outcome.WON
        try:
            if self._fd is None:
                self._fd = self._open()
            won = try_lock(self._fd)
        except OSError as exc:
            self._close_fd()
            if exc.errno in SCARCE:
                # Out of descriptors (or memory) for now: falling back to the bind would demote the
                # election for good over a passing shortage.  Stay out of it and let the caller retry.
                self.shortage = os.strerror(exc.errno)
                return Outcome.LOST
            return self._fallback(os.strerror(exc.errno or 0) if exc.errno else str(exc))
        self.problem = self.shortage = None
        self.held = won
        if not won:
            self._close_fd()
        return Outcome.WON if won else Outcome.LOST

    def _open(self) -> int:
        return open_lock_file(self.path)

    def _fallback(self, reason: str) -> Outcome:
        self.problem = f"the owner lock {self.path} is unusable ({reason})"
        _warner.warn(
            ("fallback", str(self.path), reason),
            "%s, so this process counts itself elected for %s and the port bind decides who serves; ranks that "
            "disagree on the port would each serve. Check NIXL_TELEMETRY_MULTIPROC_DIR is a private local "
            "directory owned by this user on a filesystem with flock.", self.problem, self.address)
        self._close_fd()
        return Outcome.FALLBACK

    def release(self) -> None:
        """Concede: unlock so that the next rank to try wins."""
        if self._fd is not None and self.held:
            try:
                _unlock(self._fd)
            except OSError:
                pass  # closing below releases it anyway
        self.held = False
        self._close_fd()

    def lock_file_replaced(self) -> bool:
        """While held: whether the lock file at our path is no longer the one we hold.

        Someone removed the directory (or the file) and a new one took its place:
        ranks starting now elect on the new file and could win it while we serve.
        """
        fd = self._fd  # once: a close() in a signal handler may release the election between two reads
        if not self.held or fd is None:
            return False
        try:
            current = os.stat(self.path, follow_symlinks=False)
        except OSError:
            return True  # gone (or unreachable): not what we hold either
        try:
            held = os.fstat(fd)
        except OSError:
            return False  # released meanwhile: nothing is held to be replaced
        # (released meanwhile and the number reused: what it names now is not ours to judge)
        return self._fd == fd and not os.path.samestat(current, held)

    def move_to_current(self) -> bool:
        """While held: lock the file now at our path instead of the one we hold.

        True if we hold the new file (and released the old), False if another
        process holds it (we still hold the old one); OSError if the new file
        cannot be opened (e.g. the directory is not back yet).
        """
        fd = self._open()
        try:
            won = try_lock(fd)
        except OSError:
            os.close(fd)
            raise
        if not won:
            os.close(fd)
            return False
        old, self._fd = self._fd, fd
        if old is not None:
            os.close(old)  # the old file is unlinked: nobody can be waiting for it
        return True

    def adopt(self, fd: int) -> None:
        """Hold the election through ``fd``, a descriptor of our lock file that already holds the lock
        (a spare's that the kernel just woke, or the one a rank handed its server): the lock is not released
        and retaken, so no sibling can win in between."""
        if self.held:
            raise RuntimeError(f"the election for {self.address} is already held")
        old, self._fd = self._fd, fd
        self.held = True
        self.problem = self.shortage = None
        if old is not None:
            os.close(old)  # (a descriptor of ours that held nothing)

    def forget(self) -> None:
        """Drop our descriptor WITHOUT unlocking: in a forked child, or once an address server that stays on
        holds the same open file description.

        The lock belongs to the open file description, which another process shares: LOCK_UN would depose it.
        """
        self.held = False
        self._close_fd()

    def _close_fd(self) -> None:
        # Forget the number before closing it: a fork landing in between must
        # not leave a child that closes a number the parent already closed
        # (EBADF) or, worse, reused for another file.
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def open_lock_file(path: Path) -> int:
    """Open (creating it 0600) the lock file at ``path``, refusing one that is not a regular file of ours."""
    fd = open_above_stdio(path, _OPEN_FLAGS, 0o600)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise OSError(f"{path} is not a regular file")
    if st.st_uid != os.geteuid():
        os.close(fd)
        # A co-tenant's planted lock must not demote every rank to writer-only.
        raise OSError(f"{path} is owned by uid {st.st_uid}, not {os.geteuid()}")
    return fd


def held_addresses_except(directory: str | os.PathLike[str], address: str) -> list[str]:
    """The other addresses that some live process is elected on.

    A lock file we can lock is a leftover of an earlier run, not an owner.
    Only regular files owned by us count: a planted foreign lock proves
    nothing about the run.
    """
    own = lock_file_name(address)
    try:
        with stdio_occupied():
            names = [entry.name for entry in os.scandir(directory)]
    except OSError:
        return []
    return sorted(name[len(OWNER_LOCK_PREFIX):-len(OWNER_LOCK_SUFFIX)] for name in names
                  if name != own and name.startswith(OWNER_LOCK_PREFIX) and name.endswith(OWNER_LOCK_SUFFIX)
                  and _is_held(os.path.join(directory, name)))


def address_is_held(directory: str | os.PathLike[str], address: str) -> bool:
    """Whether some live process (this one included) is elected on ``address``."""
    return _is_held(os.path.join(directory, lock_file_name(address)))


def _is_held(path: str) -> bool:
    # A new open file description conflicts with every other one, ours included.
    try:
        fd = open_above_stdio(path, _PROBE_FLAGS)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return False
        if try_lock(fd):
            _unlock(fd)  # a leftover: nobody is elected there
            return False
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
