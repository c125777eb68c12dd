"""Standbys: wait for an address's lock in the kernel, not on the next export.

A rank that lost the election has nothing to do until the holder is gone, and only the kernel knows that
moment: it releases the holder's flock as the holder's last descriptor of the lock closes, however the
holder went.  So a standby blocks in ``flock(LOCK_EX)`` on a thread of its own, on an open file description
of its own: the call holds no GIL and polls nothing, and it returns holding the lock the moment the holder
is gone, whether or not anyone records.  The C++ plug-in's ranks keep re-electing with ``LOCK_NB`` as they
export; both kinds contend for the same lock, so there is still one owner at a time.

Two properties make a waiter safe in someone else's process:

* **A fork never inherits a stake.**  The waiter's descriptor is opened and recorded under a lock that
  ``fork()`` waits for, and the child closes it: the child holds neither the lock (had the waiter just won
  it) nor a descriptor that would keep it held once the parent is gone.  The thread itself does not exist
  in the child.
* **Stopping is bounded, from anywhere.**  A blocked ``flock`` cannot be woken short of a signal handler
  (which a library must not install in its host), so :meth:`LockWaiter.detach` replaces the waiter's
  descriptor with ``/dev/null`` instead, with one atomic ``dup2``: the blocked call then holds the last
  reference to the lock file, and whatever it wins the kernel releases as the call returns, before any
  Python code runs.  The thread, which alone ever closes that number (so it is never reused under it),
  ends as soon as the call returns, unless someone stood by again meanwhile (attach()): then the same thread
  waits anew.  Until the call returns, a detached waiter is one parked thread and one descriptor of
  ``/dev/null``: it holds nothing, takes nothing and does nothing; and a process never has more than one
  waiter per lock file, however often its Exporters come and go.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable
from pathlib import Path

from election.lock import SCARCE, flock_entries, open_lock_file
from store.fds import close_quietly, open_above_stdio
from store.forkguard import ForkGuard

try:
    import fcntl
except ImportError:  # not POSIX: no waiters (the export path's election still runs)
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger("nixl_prometheus_mp.election")

_waiters: weakref.WeakSet[LockWaiter] = weakref.WeakSet()
# (A detach() waits for the guard's lock, bounded, as fork() does: a signal handler may have interrupted its
# holder.)
_LOCK_WAIT_S = 1.0


class LockWaiter:
    """One thread blocked in ``flock(LOCK_EX)`` on ``path``, handing each win to ``on_won``.

    ``on_won(waiter)`` runs on the waiter's thread with the lock held: it either takes the descriptor with
    :meth:`hand_over` (the thread then ends) or returns without it, conceding (the lock is released and the
    thread waits ``backoff_s``, or until detached, before it waits for the lock again: never a tight loop of
    taking and conceding).
    """

    def __init__(self, path: Path, on_won: Callable[[LockWaiter], None], *, name: str, backoff_s: float,
                 first: int | None = None) -> None:
        self.path = path
        self._on_won = on_won
        self._backoff_s = backoff_s
        self._fd: int | None = None  # ours while recorded here; the thread alone closes it
        # What to wait on next instead of opening the path: a description of the lock file an endpoint of ours
        # just handed to its server (OwnerElection.hand_off), which names that server's lock however the
        # directory changes meanwhile.  It holds nothing yet; a child's copy, which would share the lock once
        # this waiter wins it, is closed by the fork hook like the waiter's own descriptor.
        self._next = first
        self._detached = threading.Event()
        self._ended = False  # the thread has returned, or is about to: attach() cannot revive it
        self.problem: str | None = None  # why the lock file could not be opened (the thread then ended)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    @property
    def detached(self) -> bool:
        return self._detached.is_set()

    @property
    def waiting(self) -> bool:
        """Whether it still waits (or is about to offer a win): not detached, not ended."""
        return not self._detached.is_set() and self._thread.is_alive()

    def start(self) -> None:
        """Start waiting (RuntimeError where the process is out of threads)."""
        _waiters.add(self)
        try:
            self._thread.start()
        except RuntimeError:
            self._close_next()
            raise

    def hand_over(self) -> int | None:
        """(From ``on_won``) the descriptor holding the lock, now the caller's; None once detached.

        Call it under :func:`holding_off_fork` and record the descriptor before releasing that: a fork must
        find it recorded here or there, never nowhere.
        """
        with _guard.lock:
            if self._detached.is_set():
                return None  # detach() may have replaced it with /dev/null already: it holds nothing
            fd, self._fd = self._fd, None
        return fd

    def attach(self, first: int | None = None) -> bool:
        """Wait for the lock again after a detach() (someone stands by anew), on ``first`` if given (taken, see
        the constructor): the parked thread is reused, so a process has one waiter per lock file however often
        its Exporters come and go.  False once the thread has ended (start a new waiter; ``first`` stays the
        caller's)."""
        with _guard.lock:
            if self._ended:
                return False
            if first is not None:
                self._close_next()
                self._next = first
            self._detached.clear()
            return True

    def detach(self) -> None:
        """Act no more (until attach()); from any thread or a signal handler, bounded.  See the module's doc."""
        self._detached.set()
        if not _guard.lock.acquire(timeout=_LOCK_WAIT_S):
            return  # the thread is between an open and its record: it sees the flag right after
        try:
            if self._fd is not None:
                null = open_above_stdio(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    os.dup2(null, self._fd, inheritable=False)
                finally:
                    os.close(null)
        finally:
            _guard.lock.release()

    def _run(self) -> None:
        try:
            self._wait_and_offer()
        finally:
            self._close()
            self._close_next()

    def _wait_and_offer(self) -> None:
        while True:
            with _guard.lock:
                if self._detached.is_set():
                    self._ended = True  # decided under the lock attach() takes: it either revives us or sees this
                    return
                try:
                    self._fd = self._next if self._next is not None else open_lock_file(self.path)
                    self._next = None
                except OSError as exc:
                    # Unusable (or out of descriptors): the export path's election covers that case, and says why.
                    self.problem = os.strerror(exc.errno) if exc.errno in SCARCE else str(exc)
                    self._ended = True
                    return
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX)  # blocks, without the GIL, until the holder is gone
            except OSError as exc:  # ENOLCK and the like: nothing to wait on here
                self.problem = str(exc)
                self._end()
                return
            if self._detached.is_set() or not self._still_the_lock_file():
                # Detached: what the call won, the kernel released as it returned (see detach); reattached since,
                # or the directory replaced: wait again, on the file that is there now.
                self._close()
                continue
            try:
                self._on_won(self)
            except Exception:  # a bug of the taker's must not end the waiting: concede, pause, wait again
                log.warning("taking over %s after its holder left failed; waiting for the lock again",
                            self.path.name, exc_info=True)
            if self._fd is None:
                self._end()
                return  # handed over: the taker serves, and stands by anew if it concedes later
            self._close()  # conceded: released, then a pause before contending again
            self._detached.wait(self._backoff_s)

    def _end(self) -> None:
        with _guard.lock:
            self._ended = True

    def _still_the_lock_file(self) -> bool:
        assert self._fd is not None
        try:
            return os.path.samestat(os.stat(self.path, follow_symlinks=False), os.fstat(self._fd))
        except OSError:
            return False

    def _close(self) -> None:
        with _guard.lock:
            fd, self._fd = self._fd, None
        close_quietly(fd)

    def _close_next(self) -> None:
        with _guard.lock:
            fd, self._next = self._next, None
        close_quietly(fd)


def _close_in_child() -> None:
    # The child's copy only: closing it releases nothing of the parent's (the lock belongs to the open file
    # description, which the parent's descriptor keeps), and a child must keep nothing that holds it.
    for waiter in list(_waiters):
        fd, waiter._fd = waiter._fd, None
        close_quietly(waiter._next)
        waiter._next = None
        # A new flag, set: the inherited one's lock may have been held by a parent thread at fork (its wait()
        # and set() take it), and that holder does not exist here: setting it would hang the child for ever.
        detached = threading.Event()
        detached.set()
        waiter._detached = detached
        close_quietly(fd)
    _waiters.clear()


_guard = ForkGuard(_close_in_child, "a standby's descriptor of a lock file")


def holding_off_fork() -> threading.RLock:
    """The lock fork() waits for: a waiter's descriptor is never in a child unless recorded where the
    child's hooks find it."""
    return _guard.lock


def waiting_pids(fd: int) -> list[int]:
    """The processes blocked in flock() for the lock file open as ``fd`` (standbys waiting for it), as this
    process's pid namespace sees them (0 from another)."""
    return [pid for blocked, pid in flock_entries(os.fstat(fd)) if blocked]
