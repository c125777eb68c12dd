"""The collector: scan the directory, probe, read, publish, reap.

Run on every scrape.  Nothing here may fail the scrape as a whole: one bad
file, a writer racing us, another scraper reaping the same store, or an
unreadable directory each cost at most that file (or an empty exposition),
and each is reported as a warning in /healthz.

The rules, each in its own function so that every scan path applies them the
same way:

* ``is_store_name``: only ``nixl.<pid>.<run_marker>.<instance>.mmap`` (ASCII
  decimal numbers) is a store; nothing else is ever opened, published or
  reaped.
* ``Collector.place``: a store whose writer holds its lock is live and always
  published.  A departed store is published until it has not been updated for
  the stale TTL, then reaped.  Ages are measured on this host's
  CLOCK_MONOTONIC, the clock writers stamp their stores with, so they are only
  meaningful between processes of one boot and one time namespace; a departed
  store stamped *ahead* of our clock (a persistent directory after a reboot, a
  writer in another time namespace) has an age nobody can know, so it is
  reaped at once, as the C++ plug-in does; a live one is published with age 0.
* ``Collector.invalid``: a store-named file whose bytes are not a store is
  reaped (with a warning) once no process holds it; held, it is skipped and
  listed in /healthz.  ``Collector.unreadable``: a file that cannot be read
  (another user's, a symlink, a FIFO, a directory, unreadable mode) is never
  reaped and is listed; running out of descriptors is the reader's problem, not
  the file's, and is reported as such.
* ``_Dedupe``: no two published stores ever carry the same label set.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import threading
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from store.layout import is_store_name, parse_store_name
from store.reader import (
    TRANSIENT_ERRNOS,
    InvalidStore,
    Snapshot,
    Unreadable,
    decode_named,
    open_store,
    warn_foreign,
)
from store.scan import Entry, batch_end, read_stores, scan, unreadable
from store.warnonce import OnceWarner

log = logging.getLogger("nixl_prometheus_mp.collector")
_warner = OnceWarner(log)

__all__ = ["Collection", "Collector", "Publish", "RankView", "drain_s", "is_store_name", "label_key"]


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


def drain_s(collection: Collection, max_s: float) -> float | None:
    """After a SIGTERM: how long to go on serving (the last departed store's TTL, at most ``max_s``), or None to go
    at once.  A live store means the job still runs, and its ranks take the address over (or find the sidecar
    gone) by themselves; nothing departed means nothing is left to publish."""
    if collection.live or collection.scan_error is not None or max_s <= 0:
        return None
    pending = [view.reap_in_s for view in collection.stale if view.reap_in_s is not None and view.reap_in_s > 0]
    return min(max(pending), max_s) if pending else None


def label_key(snap: Snapshot) -> tuple[str, str, int, int, str]:
    """The label set every series of a store carries (hostname, agent_name, pid, agent_instance, local_rank)."""
    return snap.hostname, snap.agent_name, snap.pid, snap.instance, snap.local_rank


def _precedence(view: RankView) -> tuple[bool, int, str]:
    """Which of two stores with one label set is published: the greater.

    A live store beats a departed one (it is the process that still counts).
    Between two live ones (two pid namespaces sharing a hostname can both run
    pid 1 with the same agent name) the one started last wins, by the
    CLOCK_REALTIME run marker in its name, so the choice does not flip from
    scrape to scrape.  Between departed ones the last updated wins.  The file
    name breaks the remaining ties, so every reader chooses the same store.
    """
    snap = view.snapshot
    if view.alive:
        parsed = parse_store_name(snap.name)
        return True, parsed[1] if parsed else 0, snap.name
    return False, snap.last_update_ns, snap.name


class _Dedupe:
    """Which of the stores sharing a label set is published, batch by batch.

    A restarted rank in its own pid namespace (a container) often gets the
    same pid, agent name and instance as the predecessor it replaces; both
    stores then describe the same series.  Publishing both is an invalid
    exposition and leaves Prometheus with whichever sample it read last, so
    only the preferred one (see ``_precedence``) is published; Prometheus sees
    a counter reset.  The others stay on disk, are reaped by the usual rules,
    and are listed in /healthz as "duplicate-labels" warnings meanwhile.

    A scrape publishes its stores a batch at a time, and a batch never splits
    the stores of one pid (``store.scan.batch_end``): a writer names its store with its
    own pid, so every store that can share a label set is in the batch that
    decides between them.  A store whose bytes name another pid than its file
    name (no writer of ours makes one) can only lose to a store already
    published: the exposition stays valid.
    """

    def __init__(self, directory: Path, warnings: list[dict[str, object]]) -> None:
        self._directory = directory
        self._warnings = warnings
        self._published: dict[tuple[str, str, int, int, str], str] = {}  # label set -> the file published with it

    def __call__(self, views: list[RankView]) -> list[RankView]:
        """This batch's views to publish, in order."""
        winners: dict[tuple[str, str, int, int, str], RankView] = {}
        losers: list[RankView] = []
        for view in views:
            key = label_key(view.snapshot)
            best = winners.get(key)
            if key in self._published:
                losers.append(view)
            elif best is None:
                winners[key] = view
            elif _precedence(view) > _precedence(best):
                winners[key] = view
                losers.append(best)
            else:
                losers.append(view)
        for key, view in winners.items():
            self._published[key] = view.snapshot.name
        if not losers:
            return views
        for view in sorted(losers, key=lambda v: v.snapshot.name):
            self._warn(view, self._published[label_key(view.snapshot)])
        gone = {id(view) for view in losers}
        return [view for view in views if id(view) not in gone]

    def _warn(self, view: RankView, winner: str) -> None:
        snap = view.snapshot
        message = (f"{snap.name} ({'live' if view.alive else 'departed'}) has the same labels as {winner} "
                   f"(agent_name={snap.agent_name!r}, pid={snap.pid}, agent_instance={snap.instance}, "
                   f"hostname={snap.hostname!r}, local_rank={snap.local_rank!r}) and is not published; "
                   "ranks in separate pid namespaces (containers) can reuse a pid: give their agents "
                   "distinct names or NIXL_TELEMETRY_RANK_ENV values")
        self._warnings.append({"kind": "duplicate-labels", "message": message,
                               "details": {"file": str(snap.path), "published": str(self._directory / winner),
                                           "alive": view.alive}})
        _warner.warn(("duplicate", snap.name), "%s", message)


BATCH_STORES = 256  # stores read, decided and published at a time: what a scrape holds of their bytes


_NO_VALUES = array("Q")


def _without_values(snap: Snapshot) -> Snapshot:
    """A store as a census keeps it: who it is, not its values (nor the bytes its templates are cached by)."""
    return replace(snap, words=_NO_VALUES, bounds=(), identity_key=b"")


Publish = Callable[[Sequence[RankView]], None]


class _TransientLog:
    """Says, at most once a minute, that a scrape ran short of resources (descriptors, memory).

    Unlike a property of a file, which is said once, this is said again while
    it lasts (and stops by itself when it does), but never at scrape rate.
    """

    INTERVAL_S = 60.0

    def __init__(self) -> None:
        self._next = 0.0
        self._lock = threading.Lock()

    def warn(self, what: str) -> None:
        with self._lock:
            now = time.monotonic()
            if now < self._next:
                return
            self._next = now + self.INTERVAL_S
        log.warning("%s: the serving process ran short of resources, nothing is wrong with the files; the next "
                    "scrape tries again. If this repeats, raise the descriptor limit (ulimit -n) of the serving "
                    "process", what)


_transient_log = _TransientLog()


class Collector:
    """Reads a directory of stores into a Collection; reaps what is done."""

    def __init__(self, directory: str | os.PathLike[str], stale_ttl_s: float, reap: bool = True) -> None:
        self.directory = Path(directory)
        self.stale_ttl_s = stale_ttl_s
        self._ttl_ns = int(stale_ttl_s * 1e9)
        # An onlooker (``python -m app top``) applies the same rules but changes nothing: what it would
        # reap it lists as departed with no time left, for the owner to reap.
        self.reap = reap

    def collect(self, publish: Publish | None = None) -> Collection:
        """Every store of the directory, placed; departed ones past their TTL reaped.

        With ``publish``, the collection lists no rank: each batch of published stores (in file-name order,
        duplicates decided) is handed to it as soon as it is read, so that a scrape of any number of stores
        holds one batch's values at a time.
        """
        result = Collection()
        try:
            # The listing and the first batch in one call: with the C scanner, one GIL release for a directory of
            # one batch, and one per batch after, so a busy thread in this process cannot make each store's system
            # calls wait for it.
            names, entries = scan(self.directory, BATCH_STORES)
        except OSError as exc:
            self.scan_failed(exc, result)
            return result
        dedupe = _Dedupe(self.directory, result.warnings)
        skipped: list[Unreadable] = []
        start = 0
        while True:
            # Read *after* every store's bytes were: see place().
            now = time.monotonic_ns()
            views: list[RankView] = []
            for entry in entries:
                outcome = self._collect_one(entry, now, result, views)
                if outcome is not None:
                    skipped.append(outcome)
            if publish is not None:
                publish(dedupe(views))
            else:
                for view in dedupe(views):
                    (result.live if view.alive else result.stale).append(view)
            start += len(entries)
            if start >= len(names):
                break
            try:
                entries = read_stores(self.directory, names[start:batch_end(names, start, BATCH_STORES)])
            except OSError as exc:
                self.scan_failed(exc, result)
                return result
        if skipped:
            _transient_log.warn(f"this scrape skipped {len(skipped)} store(s) ({skipped[0].path.name}: "
                                f"{skipped[0].reason})")
        return result

    def census(self) -> Collection:
        """Who is live and who departed, without their values: what /healthz and the serving process's own
        decisions need, at a few hundred bytes per store rather than several kilobytes."""
        kept: list[RankView] = []
        result = self.collect(lambda views: kept.extend(replace(view, snapshot=_without_values(view.snapshot))
                                                        for view in views))
        for view in kept:
            (result.live if view.alive else result.stale).append(view)
        return result

    def scan_failed(self, exc: OSError, result: Collection) -> None:
        """The directory could not be listed: an empty collection that says why."""
        result.scan_error = f"cannot list {self.directory}: {os.strerror(exc.errno or 0)}"
        if exc.errno in TRANSIENT_ERRNOS:
            _transient_log.warn(f"{result.scan_error}; /metrics is empty for this scrape")
        else:
            _warner.warn(("scan", result.scan_error), "%s; /metrics is empty until it can be read again",
                         result.scan_error)

    def _collect_one(self, entry: Entry, now: int, result: Collection, views: list[RankView]) -> Unreadable | None:
        """Place one scanned store in ``views`` (its warnings in ``result``); a transient failure is returned for
        the scrape's summary."""
        if entry.data is None:
            return self.unreadable(unreadable(entry, self.directory / entry.name), result)
        content = decode_named(entry.data, self.directory, entry.name)
        if isinstance(content, InvalidStore):
            self.invalid(entry.ino, content, entry.alive, result)
        else:
            view = self.place(entry.ino, content, entry.alive, now)
            if view is not None:
                views.append(view)
        return None

    def place(self, ino: int, snap: Snapshot, alive: bool, now: int) -> RankView | None:
        """A valid store's view, live or departed, or None once reaped (``ino``: the inode the scan read, for the
        reap).

        ``now`` is CLOCK_MONOTONIC read *after* the store's bytes were read:
        a stamp written before our read can then never be ahead of it, so a
        writer that updated and exited while we were scanning is not taken
        for a store from another boot.
        """
        if alive:
            # A writer in another time namespace can be "in the future": age 0.
            return RankView(snap, True, max(0, now - snap.last_update_ns) / 1e9, None)
        if snap.last_update_ns > now:
            if self._reap(snap.path, ino):
                log.info("reaped %s (agent %r, pid %d): departed, and stamped %.1f s ahead of this host's "
                         "monotonic clock (written before a reboot, or in another time namespace), so its age "
                         "cannot be known", snap.name, snap.agent_name, snap.pid, (snap.last_update_ns - now) / 1e9)
                return None
            return RankView(snap, False, 0.0, 0.0)
        age_ns = now - snap.last_update_ns
        if age_ns > self._ttl_ns:
            if self._reap(snap.path, ino):
                log.info("reaped %s (agent %r, pid %d): departed and not updated for %.1f s, past the %.1f s TTL",
                         snap.name, snap.agent_name, snap.pid, age_ns / 1e9, self.stale_ttl_s)
                return None
            return RankView(snap, False, age_ns / 1e9, 0.0)
        return RankView(snap, False, age_ns / 1e9, (self._ttl_ns - age_ns) / 1e9)

    def invalid(self, ino: int, bad: InvalidStore, alive: bool, result: Collection) -> None:
        """A store-named file of ours whose bytes are not a store: reaped once nobody holds it."""
        if not alive and self._reap(bad.path, ino):
            log.warning("reaped %s: it is not a valid schema-1 store (%s) and no process holds it",
                        bad.path.name, bad.reason)
            return
        held = " but a live process holds it" if alive else ""
        message = f"{bad.path.name} is not a valid store ({bad.reason}){held}"
        _warner.warn(("invalid", str(bad.path)), "%s; it is skipped. Is a writer of another schema version "
                     "sharing the directory?", message)
        result.warnings.append({"kind": "invalid-store", "message": message, "details": {"file": str(bad.path)}})

    @staticmethod
    def unreadable(bad: Unreadable, result: Collection) -> Unreadable | None:
        """A store-named file we could not read: never reaped; listed in /healthz unless it is simply gone.

        Returns ``bad`` when the failure was the reader's (out of descriptors
        or memory), for ``collect`` to summarise once per scrape.
        """
        if bad.missing:
            return None  # reaped by another scraper since we listed the directory
        if bad.transient:
            result.warnings.append({"kind": "transient-read-error",
                                    "message": f"{bad.path.name} could not be opened: {bad.reason}; nothing is "
                                               "wrong with the file, it is read again on the next scrape",
                                    "details": {"file": str(bad.path)}})
            return bad
        if bad.foreign:
            warn_foreign(bad)
            kind = "foreign-store"
        else:
            _warner.warn(("unreadable", str(bad.path), bad.reason), "skipping %s in the telemetry directory: it "
                         "%s; it is never reaped. Remove it if it does not belong to the run.", bad.path, bad.reason)
            kind = "unreadable-store"
        result.warnings.append({"kind": kind, "message": f"{bad.path.name} {bad.reason}",
                                "details": {"file": str(bad.path)}})
        return None

    def _reap(self, path: Path, ino: int) -> bool:
        """Unlink a departed store while holding its lock, if it is still ours to reap.

        The scan closed the store, so it is opened again: it must still be
        the file the scan read (same inode), and the exclusive lock keeps a
        writer that reopened it or a concurrent scraper out; the name must
        still point at that file, so a replaced file is never unlinked in its
        place.  Rare (once per departed store), so the system calls here are
        not worth the scanner's care about the GIL.
        """
        if not self.reap:
            return False
        fd = open_store(path)
        if isinstance(fd, Unreadable):
            return False  # gone, or replaced by something that is not ours: nothing to reap
        try:
            if os.fstat(fd).st_ino != ino:
                return False  # replaced since the scan: the next scrape judges the new file
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return False  # another reader is probing or reaping it right now: leave it to them
            try:
                if os.stat(path, follow_symlinks=False).st_ino != ino:
                    return False
                os.unlink(path)
                return True
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                log.warning("could not reap %s: %s", path, os.strerror(exc.errno or 0))
            return False
        finally:
            os.close(fd)
