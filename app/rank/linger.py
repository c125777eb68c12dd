"""A serving helper whose rank is gone serves the job's last values before it goes.

When the serving rank dies or closes, its helper (app.rank.helper) still holds the address: the port and the
election.  If a live writer remains in the directory, the helper goes at once and that writer's standby
takes the address over (app.rank.standby).  If none remains (the job ended: every rank closed, or all were
killed at once), nobody else would ever serve the departed stores, and each one's last half second of
telemetry and its final values would never reach Prometheus.  So the helper serves on ("lingers") until
each departed store has been served once since its writer was gone, or its stale TTL has passed, whichever
comes first, and goes at once when a live writer appears (a new run in the same directory, a late rank).

A writer being killed holds its store's lock until the kernel has torn its memory down, which can take a
while for a large process: one with SIGKILL pending or already exiting counts as departed, so that killing
every rank at once still leaves their values served (judged by /proc where the writer's pid is visible).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

from app.collector import Collection, Collector, RankView

log = logging.getLogger("nixl_prometheus_mp.helper")

POLL_S = 0.05  # how soon a lingering helper sees a new writer (and its standby takes the address over)
# A live writer is looked at twice, this far apart, before the address goes to it: ranks killed together die
# one by one, and the first look can come before the last kill.
CONFIRM_S = 0.01
YIELD_AFTER_S = 0.1  # how long a live writer that does not stand by (see Linger.run) waits for the address
_PF_EXITING = 0x4  # include/linux/sched.h: the task is in do_exit()
_SIGKILL_BIT = 1 << (signal.SIGKILL - 1)


def dying(pid: int) -> bool:
    """Whether process ``pid`` (as this process's /proc sees it) is on its way out: SIGKILL pending, exiting.

    False where it cannot be told (no such pid here, another pid namespace): the writer counts as live.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    fields = stat.rpartition(")")[2].split()  # after the command name: state, ppid, ..., flags (6th)
    if fields[0] in ("Z", "X") or int(fields[6]) & _PF_EXITING:
        return True
    for line in status.splitlines():
        name, _, value = line.partition(":")
        if name in ("SigPnd", "ShdPnd") and int(value.strip(), 16) & _SIGKILL_BIT:
            return True
    return False


def _key(view: RankView) -> tuple[str, int]:
    return view.snapshot.name, view.snapshot.last_update_ns


class _Onlooker(Collector):
    """A collector that changes nothing and says nothing: a directory that cannot be listed (the job's own,
    removed once it ended) only ends the lingering, which the helper's log says."""

    def scan_failed(self, exc: OSError, result: Collection) -> None:
        result.scan_error = f"cannot list {self.directory}: {os.strerror(exc.errno or 0)}"


class Linger:
    """What a helper serves on for once its rank is gone: the departed stores not yet served since."""

    def __init__(self, directory: Path, stale_ttl_s: float, waiting: Callable[[], list[int]]) -> None:
        # An onlooker's collector: the serving app's own collector reaps, as on any scrape.
        self._collector = _Onlooker(directory, stale_ttl_s, reap=False)
        self._ttl_s = stale_ttl_s
        self._waiting = waiting  # the pids blocked in flock() on the lock we hold
        self._served: set[tuple[str, int]] = set()
        self._lock = threading.Lock()
        self._scraped = threading.Event()
        self.since: float | None = None  # wall-clock times, for /healthz
        self.until: float | None = None
        self.departed = 0

    def served(self, collection: Collection) -> None:
        """(MetricsApp's on_served, after every /metrics) A departed store read then holds its final values."""
        with self._lock:
            self._served.update(_key(view) for view in collection.stale)
        self._scraped.set()

    def doc(self) -> dict[str, object] | None:
        """/healthz's ``owner.lingering``: None unless lingering."""
        if self.since is None or self.until is None:
            return None
        return {"since": self.since, "until": self.until, "departed": self.departed}

    def run(self) -> str:
        """Serve on (the caller's server does) until done; returns why it is over, for the log.  Returns at
        once when a live writer remains."""
        live_since: float | None = None
        while True:
            collection = self._collector.collect()
            if collection.scan_error is not None:
                return collection.scan_error
            going = [view for view in collection.live if dying(view.snapshot.pid)]  # final once they are gone
            live = [view for view in collection.live if view not in going]
            now = time.monotonic()
            if live:
                # A live rank's standby blocked on our lock takes the address over the moment we go: go now
                # (after a second look).  Only a live rank's: a rank that closed its Exporter leaves its standby
                # thread parked in flock() until it wins, and would let the address go.  A live writer that
                # does not wait (a C++ rank, which re-elects as it records; a rank closing) is given
                # YIELD_AFTER_S, so that ranks closing together do not each hand the address on to the next.
                live_since = now if live_since is None else live_since
                waiting = set(self._waiting()) & {view.snapshot.pid for view in live}
                if waiting and now - live_since >= CONFIRM_S:
                    return f"a standby waits for the address (pid {min(waiting)})"
                if now - live_since >= YIELD_AFTER_S:
                    return f"{live[0].snapshot.name} is live"
                self._scraped.wait(CONFIRM_S)
                continue
            live_since = None
            with self._lock:
                pending = going + [view for view in collection.stale
                                   if _key(view) not in self._served and (view.reap_in_s or 0.0) > 0]
            if not pending:
                return "every departed rank was served since its last update, or is past its TTL"
            now = time.time()
            if self.since is None:
                self.since = now
                log.info("the rank is gone and no live writer remains: serving the last values of %d departed "
                         "rank(s) until each is scraped once (at most %.0f s)", len(pending),
                         max(self._ttl_s if view.alive else view.reap_in_s or 0.0 for view in pending))
            self.departed = len(pending)
            self.until = now + max(self._ttl_s if view.alive else view.reap_in_s or 0.0 for view in pending)
            self._scraped.wait(POLL_S)
            self._scraped.clear()
