"""The collector: scan the directory, probe, read, publish, reap.

Run on every scrape.  Nothing here may fail the scrape as a whole: one bad
file, a writer racing us, another scraper reaping the same store, or an
unreadable directory each cost at most that file (or an empty exposition),
and each is reported as a warning in /healthz.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from store.layout import STORE_PREFIX, STORE_SUFFIX
from store.reader import InvalidStore, Snapshot, Unreadable, open_store, probe_alive, read_fd, warn_foreign
from store.warnonce import OnceWarner

log = logging.getLogger("nixl_prometheus_mp.collector")
_warner = OnceWarner(log)


@dataclass(frozen=True, slots=True)
class RankView:
    snapshot: Snapshot
    alive: bool
    age_s: float  # since its last update
    reap_in_s: float | None  # departed ranks only: seconds until reaped


@dataclass
class Collection:
    live: list[RankView] = field(default_factory=list)
    stale: list[RankView] = field(default_factory=list)
    warnings: list[dict[str, object]] = field(default_factory=list)
    scan_error: str | None = None  # the directory itself could not be listed

    @property
    def published(self) -> list[Snapshot]:
        """Every store exposed on /metrics, live and departed, in file-name order."""
        ranks = self.live + self.stale
        ranks.sort(key=lambda r: r.snapshot.name)
        return [r.snapshot for r in ranks]


class Collector:
    """Reads a directory of stores into a Collection; reaps what is done."""

    def __init__(self, directory: str | os.PathLike[str], stale_ttl_s: float) -> None:
        self.directory = Path(directory)
        self.stale_ttl_s = stale_ttl_s
        self._ttl_ns = int(stale_ttl_s * 1e9)

    def collect(self) -> Collection:
        result = Collection()
        try:
            names = [e.name for e in os.scandir(self.directory)
                     if e.name.startswith(STORE_PREFIX) and e.name.endswith(STORE_SUFFIX)]
        except OSError as exc:
            result.scan_error = f"cannot list {self.directory}: {os.strerror(exc.errno or 0)}"
            _warner.warn(("scan", result.scan_error), "%s; /metrics is empty until it can be read again",
                         result.scan_error)
            return result
        now = time.monotonic_ns()
        for name in names:
            self._collect_one(self.directory / name, now, result)
        return result

    def _collect_one(self, path: Path, now: int, result: Collection) -> None:
        fd = open_store(path)
        if isinstance(fd, Unreadable):
            self._unreadable(fd, result)
            return
        try:
            # Probe before reading: a writer that dies in between then only
            # makes us publish values that were final anyway.
            alive = probe_alive(fd)
            content = read_fd(fd, path)
            if isinstance(content, Unreadable):
                self._unreadable(content, result)
            elif isinstance(content, InvalidStore):
                self._invalid(fd, content, alive, result)
            else:
                self._snapshot(fd, content, alive, now, result)
        finally:
            os.close(fd)

    def _snapshot(self, fd: int, snap: Snapshot, alive: bool, now: int, result: Collection) -> None:
        # A writer in another time namespace could be "in the future": age 0.
        age_ns = max(0, now - snap.last_update_ns)
        if alive:
            result.live.append(RankView(snap, True, age_ns / 1e9, None))
        elif age_ns > self._ttl_ns:
            if self._reap(fd, snap.path):
                log.info("reaped %s (agent %r, pid %d): departed and not updated for %.1f s, past the %.1f s TTL",
                         snap.path.name, snap.agent_name, snap.pid, age_ns / 1e9, self.stale_ttl_s)
            else:
                result.stale.append(RankView(snap, False, age_ns / 1e9, 0.0))
        else:
            result.stale.append(RankView(snap, False, age_ns / 1e9, (self._ttl_ns - age_ns) / 1e9))

    def _invalid(self, fd: int, bad: InvalidStore, alive: bool, result: Collection) -> None:
        if not alive and self._reap(fd, bad.path):
            log.warning("reaped %s: it is not a valid schema-1 store (%s) and no process holds it",
                        bad.path.name, bad.reason)
            return
        message = f"{bad.path.name} is not a valid store ({bad.reason}) but a live process holds it"
        _warner.warn(("invalid", str(bad.path)), "%s; it is skipped. Is a writer of another schema version "
                     "sharing the directory?", message)
        result.warnings.append({"kind": "invalid-store", "message": message, "details": {"file": str(bad.path)}})

    def _unreadable(self, bad: Unreadable, result: Collection) -> None:
        if bad.missing:
            return  # reaped by another scraper since we listed the directory
        if bad.foreign:
            warn_foreign(bad)
            kind = "foreign-store"
        else:
            _warner.warn(("unreadable", str(bad.path), bad.reason), "skipping %s in the telemetry directory: it "
                         "%s; it is never reaped. Remove it if it does not belong to the run.", bad.path, bad.reason)
            kind = "unreadable-store"
        result.warnings.append({"kind": kind, "message": f"{bad.path.name} {bad.reason}",
                                "details": {"file": str(bad.path)}})

    @staticmethod
    def _reap(fd: int, path: Path) -> bool:
        """Unlink a departed store while holding its lock, if it is still ours to reap.

        The exclusive lock keeps a concurrent scraper from reaping it at the
        same time; the inode check makes sure the name still points at the
        file we read, so a replaced file is never unlinked in its place.
        """
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # another reader is probing or reaping it right now: leave it to them
        try:
            if os.stat(path, follow_symlinks=False).st_ino != os.fstat(fd).st_ino:
                return False
            os.unlink(path)
            return True
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                log.warning("could not reap %s: %s", path, os.strerror(exc.errno or 0))
            return False
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
