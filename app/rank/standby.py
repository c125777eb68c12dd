"""A rank's standbys: one waiter per process and address, shared by the process's endpoints that lost.

An endpoint that lost the election for an address with a usable lock stands by (app.rank.endpoint): the
process's one :class:`election.standby.LockWaiter` for that lock file blocks in the kernel until the holder
is gone, then offers the win to each endpoint standing by for it, in the order they stood by, until one
takes it over.  Nobody standing by any more: the waiter is detached (bounded, from anywhere: see
election.standby), so ``close()`` never waits for the owner to die.

A standby exists for the address server's death only (a crash, an OOM kill, an operator's kill): a rank's
own death or close() never moves the address.  A stopped server is the carrier's to replace (app.rank.carrier).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Protocol

from election.standby import LockWaiter, holding_off_fork
from store.fds import close_quietly

log = logging.getLogger("nixl_prometheus_mp.endpoint")

# How long a waiter pauses after every endpoint turned a win down (the port is held from outside the run,
# say) before it contends again: the export path's back-off, so that neither path loops on a busy port.
CONCEDE_BACKOFF_S = 5.0
# A waiter that could not even open the lock file (out of descriptors) is not restarted before this.
RESTART_AFTER_S = 5.0
# Like every lock of the rank's side, taken with a timeout: close() may run in a signal handler that
# interrupted this very thread while it held it.
_LOCK_WAIT_S = 1.0


class Standing(Protocol):
    """What a waiter asks of an endpoint standing by."""

    @property
    def lock_path(self) -> Path:
        """The lock file it lost on."""

    @property
    def closed(self) -> bool:
        """Whether it was closed (it is never offered the lock then)."""

    @property
    def stands_by_after_takeover(self) -> bool:
        """Whether it stands by again once it took the address over (it handed the lock to a server)."""

    def take_over_from(self, waiter: LockWaiter) -> bool:
        """Serve with the lock ``waiter`` holds; False to turn it down (closed, already serving, cannot bind)."""

    def take_server_lock(self) -> int | None:
        """A description of the lock file it just handed to its server, to wait on (once; None: the path's)."""


_lock = threading.RLock()
_standing: list[Standing] = []
_waiters: dict[Path, LockWaiter] = {}
_failed_at: dict[Path, float] = {}


def stand_by(endpoint: Standing) -> None:
    """Have ``endpoint`` offered the lock the moment its holder is gone (idempotent, cheap when standing)."""
    if endpoint.closed:  # (a close() in a signal handler during this endpoint's claim, or another agent's)
        return
    if not _lock.acquire(timeout=_LOCK_WAIT_S):
        return  # the export path's election still runs: the next one stands by
    # fork() waits while the lock file's description an endpoint hands us is ours alone, until a waiter records
    # it: a child's copy would share the lock once the waiter wins it, and keep it held after the server's death.
    fork_guard = holding_off_fork()
    try:
        if fork_guard.acquire(timeout=_LOCK_WAIT_S):
            try:
                _stand_by(endpoint)
            finally:
                fork_guard.release()
    finally:
        _lock.release()


def _stand_by(endpoint: Standing) -> None:
    # An endpoint that just handed its lock to a server waits for that server's death: on the file the server
    # locks, which the path may no longer name once the waiter's thread runs (the directory replaced).
    first = endpoint.take_server_lock()
    try:
        if not any(e is endpoint for e in _standing):
            _standing.append(endpoint)
        path = endpoint.lock_path
        waiter = _waiters.get(path)
        if waiter is not None and waiter.waiting:
            return  # (another endpoint of ours waits already, on the file the path named then)
        if waiter is not None and waiter.attach(first):
            first = None
            return  # the thread parked since the last one stood down waits for us instead
        now = time.monotonic()
        if waiter is not None and waiter.problem is not None:
            _failed_at.setdefault(path, now)  # it could not open the lock file: not again at every export
        if now - _failed_at.get(path, now - RESTART_AFTER_S) < RESTART_AFTER_S:
            return
        _failed_at.pop(path, None)
        waiter = LockWaiter(path, _offer, name=f"nixl-standby-{path.name}", backoff_s=CONCEDE_BACKOFF_S,
                            first=first)
        first = None  # the waiter's now (it closes it if it cannot start)
        try:
            waiter.start()
        except RuntimeError as exc:  # out of threads: the export path's election covers this process
            _failed_at[path] = now
            log.info("cannot stand by for %s (%s); this process re-runs the election as it records instead",
                     path.name, exc)
            return
        _waiters[path] = waiter
    finally:
        close_quietly(first)


def stand_down(endpoint: Standing) -> None:
    """``endpoint`` no longer wants the lock (it serves, or closes); the last one out detaches the waiter."""
    if not _lock.acquire(timeout=_LOCK_WAIT_S):
        return
    try:
        _standing[:] = [e for e in _standing if e is not endpoint]
        path = endpoint.lock_path
        if not any(e.lock_path == path for e in _standing):
            waiter = _waiters.get(path)  # kept: the next to stand by reuses its thread (attach)
            if waiter is not None:
                waiter.detach()
    finally:
        _lock.release()


def _offer(waiter: LockWaiter) -> None:
    """(On the waiter's thread, the lock held.)  Each endpoint standing by for it, until one takes it."""
    with _lock:
        _standing[:] = [e for e in _standing if not e.closed]  # closed since they stood by: never offered it
        candidates = [e for e in _standing if e.lock_path == waiter.path]
    for endpoint in candidates:
        if waiter.detached:
            return
        if endpoint.take_over_from(waiter):
            with _lock:
                _standing[:] = [e for e in _standing if e is not endpoint]
                if _waiters.get(waiter.path) is waiter:
                    del _waiters[waiter.path]  # it ends with its hand-over
                others = [e for e in _standing if e.lock_path == waiter.path]
            if endpoint.stands_by_after_takeover:  # for the death of the server it just started
                stand_by(endpoint)
            elif others:  # another agent of this process on the same address: it loses to us now
                stand_by(others[0])
            return
    if not candidates:  # (stood down meanwhile) the lock goes back at once: see LockWaiter.detach
        with _lock:
            if _waiters.get(waiter.path) is waiter:
                del _waiters[waiter.path]
        waiter.detach()


def _after_fork_in_child() -> None:
    # election.standby's own hook has closed the waiters' descriptors; their threads do not exist here.
    global _lock
    _lock = threading.RLock()
    _standing.clear()
    _waiters.clear()
    _failed_at.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
