"""Warnings that are said once per subject, with a bound on how many subjects.

A scrape runs every few seconds; a problem that persists (a foreign-owned
file, an unusable lock) must be reported, but not every scrape, and a hostile
directory with thousands of planted files must not turn the log into a flood
or grow memory without bound.
"""

from __future__ import annotations

import logging
import threading


class OnceWarner:
    """Log each distinct key once; after ``limit`` keys, say so once and go quiet."""

    def __init__(self, logger: logging.Logger, limit: int = 64) -> None:
        self._logger = logger
        self._limit = limit
        self._seen: set[object] = set()
        self._overflowed = False
        self._lock = threading.Lock()

    def warn(self, key: object, message: str, *args: object) -> bool:
        """Warn unless ``key`` was warned about already; True if it was logged."""
        with self._lock:
            if key in self._seen:
                return False
            if len(self._seen) >= self._limit:
                if not self._overflowed:
                    self._overflowed = True
                    self._logger.warning(
                        "more than %d distinct problems of this kind were reported; further ones "
                        "are not logged (see /healthz for the current list)", self._limit)
                return False
            self._seen.add(key)
        self._logger.warning(message, *args)
        return True

    def reset_after_fork(self) -> None:
        self._lock = threading.Lock()
