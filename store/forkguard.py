"""A lock that fork() waits for: descriptors made and recorded under it reach a child recorded, or not at all.

A child forked without exec inherits every descriptor of its parent.  Where a descriptor must not survive in a
child (a listener would keep the port bound, an election lock would keep the address held), the child's hook
closes it, which needs the descriptor to be recorded where the hook looks.  Opening and recording it under
the guard's lock, which the fork hooks hold across fork(), leaves no instant at which a child could inherit
the descriptor unrecorded, whatever another thread was doing when the host forked.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

# A fork from a signal handler that interrupted the holder must not hang: it goes ahead after this long.
_FORK_LOCK_WAIT_S = 1.0


class ForkGuard:
    """``lock`` (reentrant) is held by fork(); ``in_child`` runs in every forked child, then a fresh lock."""

    def __init__(self, in_child: Callable[[], None]) -> None:
        self.lock = threading.RLock()
        self._in_child = in_child
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

    def _after_in_child(self) -> None:
        # The parent's other threads do not exist here: nobody else can be holding what the hook touches.
        self._in_child()
        self.lock = threading.RLock()
        self._held.locked = False
