"""A lock that fork() waits for: descriptors made and recorded under it reach a child recorded, or not at all.

A child forked without exec inherits every descriptor of its parent.  Where a descriptor must not survive in a
child (a listener would keep the port bound, an election lock would keep the address held), the child's hook
closes it, which needs the descriptor to be recorded where the hook looks.  Opening and recording it under
the guard's lock, which the fork hooks hold across fork(), leaves no instant at which a child could inherit
the descriptor unrecorded, whatever another thread was doing when the host forked.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

log = logging.getLogger("nixl_prometheus_mp.store")

# How long fork() waits for another thread's hold: a registration takes microseconds, a starved machine may
# stretch one to a fraction of a second; only a hang of ours would reach this, and the fork then goes ahead
# rather than hang the host (said in a warning).  A fork from a signal handler that interrupted the holder's
# own thread never waits: the lock is reentrant.
_FORK_LOCK_WAIT_S = 10.0


class ForkGuard:
    """``lock`` (reentrant) is held by fork(); ``in_child`` runs in every forked child, then a fresh lock.

    ``guarding`` names what the lock records, for the warning of a fork that could not wait.
    """

    def __init__(self, in_child: Callable[[], None], guarding: str) -> None:
        self.lock = threading.RLock()
        self._in_child = in_child
        self._guarding = guarding
        self._held = threading.local()
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(before=self._before, after_in_parent=self._after_in_parent,
                                after_in_child=self._after_in_child)

    def _before(self) -> None:
        self._held.locked = self.lock.acquire(timeout=_FORK_LOCK_WAIT_S)

    def _after_in_parent(self) -> None:
        if getattr(self._held, "locked", False):
            self._held.locked = False
            self.lock.release()
        else:  # (logging's own fork lock is released by now: its hook was registered before ours)
            log.warning("a fork went ahead after waiting %.0f s for another thread to record %s: the child may "
                        "hold a copy, which would keep the address from the other ranks for as long as it "
                        "lives once the address server is gone; please report this with the threads' stacks",
                        _FORK_LOCK_WAIT_S, self._guarding)

    def _after_in_child(self) -> None:
        # The parent's other threads do not exist here: nobody else can be holding what the hook touches.
        self._in_child()
        self.lock = threading.RLock()
        self._held.locked = False
