"""What the operator reads about a rank's claims on its scrape address.

app.rank.endpoint decides, under its lock, and reports each claim's outcome as a ``TakeOver`` value; the
log lines are written here, after the lock is released, each kind once until the rank serves again.
"""

from __future__ import annotations

import errno
import logging
import os
from dataclasses import dataclass
from enum import Enum

from election import OwnerElection, held_addresses_except
from store.warnonce import OnceWarner

log = logging.getLogger("nixl_prometheus_mp.endpoint")
_warner = OnceWarner(log)

RETRY_NS = 200_000_000  # a writer re-runs the election at most every 200 ms
BACKOFF_NS = 5_000_000_000  # ... but every 5 s once a won election failed to bind
NEVER = 1 << 63


class Claim(Enum):
    """How one attempt to take the address over ended."""

    SERVING = "serving"  # won and bound: this process serves the address now, from a thread
    STARTED = "started"  # won and bound: an address server was started and holds the address now
    LOST = "lost"  # another process holds the election
    SHORT = "short"  # out of descriptors, threads or memory (or the election was): conceded, retried later
    UNBOUND = "unbound"  # won, but the bind failed (the port is held, or not ours to bind): conceded
    ASKED = "asked"  # won, but another run's address server holds the port: asked to give it up, tried again soon
    CLOSED = "closed"  # close() ran (in a signal handler) during the takeover, which undid it


@dataclass(frozen=True)
class TakeOver:
    """The outcome of one takeover, with what the operator needs to be told about it."""

    claim: Claim
    reason: str | None = None  # SHORT: why
    bind_error: OSError | None = None  # UNBOUND: the bind's error
    no_helper: str | None = None  # SERVING: why the address is served from a thread, not an address server

    def next_claim_ns(self, now_ns: int) -> int:
        """When to try again: soon after a loss or a start (the server and its spare may both go some day),
        later after a concession, never once serving from a thread (or closed)."""
        if self.claim in (Claim.LOST, Claim.STARTED, Claim.ASKED):
            return now_ns + RETRY_NS
        if self.claim in (Claim.SHORT, Claim.UNBOUND):
            return now_ns + BACKOFF_NS
        return NEVER


class ClaimLog:
    """The log lines of one endpoint's takeovers: each kind of failure once, and the takeover that ends them."""

    def __init__(self, election: OwnerElection, port: int) -> None:
        self.election, self.port = election, port
        self._bind_warned = False
        self._lost_logged = False
        self._shortage_logged = False

    @property
    def address(self) -> str:
        return self.election.address

    def report(self, outcome: TakeOver) -> None:
        if outcome.claim is Claim.LOST:
            if not self._lost_logged:
                self._lost_logged = True
                log.info("another process serves %s; this one records its telemetry for it, and takes the "
                         "address over as it records if that process (and its spare) are gone", self.address)
        elif outcome.claim is Claim.SHORT:
            self.shortage(outcome.reason or "unknown")
        elif outcome.claim is Claim.UNBOUND:
            assert outcome.bind_error is not None
            self._concede(outcome.bind_error)
        elif outcome.claim is Claim.SERVING:
            if outcome.no_helper is not None:
                self._no_helper(outcome.no_helper)
            if self._bind_warned or self._lost_logged or self._shortage_logged:
                log.info("took over %s: this process now serves the run's telemetry", self.address)
            self._bind_warned = self._lost_logged = self._shortage_logged = False
        elif outcome.claim is Claim.STARTED:
            # Whether the server starts is heard later (app.rank.endpoint); from now on, this rank loses every
            # election to its own server: nothing to say about that.
            self._lost_logged = True

    def shortage(self, reason: str) -> None:
        if not self._shortage_logged:
            self._shortage_logged = True
            log.warning("cannot serve %s right now (%s): the election is left for another rank to win. This "
                        "process retries every %d s and serves once it can; recording is not affected.",
                        self.address, reason, BACKOFF_NS // 1_000_000_000)

    def _no_helper(self, reason: str) -> None:
        _warner.warn(("no-helper", reason), "%s cannot be served from an address server (%s); this process serves "
                     "it from a thread instead, which a busy or stopped process holds up (set "
                     "NIXL_PROMETHEUS_MP_SERVE=thread to choose that and silence this warning)", self.address, reason)

    def _concede(self, exc: OSError) -> None:
        reason = os.strerror(exc.errno or 0)
        if self.election.problem:
            # Without a usable lock every rank counts itself elected and the
            # bind decides: losing it most likely means a sibling serves.
            log.info("cannot bind %s (%s); with the owner lock unusable, another rank of the run probably "
                     "serves it", self.address, reason)
            return
        if self._bind_warned:
            return
        self._bind_warned = True
        if exc.errno == errno.EADDRINUSE:
            sibling = [a for a in held_addresses_except(self.election.directory, self.address)
                       if a.rpartition(":")[2] == str(self.port)]
            if sibling:
                log.warning(
                    "cannot serve %s: %s of this run already serves port %d, and one port cannot be bound on "
                    "both addresses. The ranks disagree on NIXL_TELEMETRY_PROMETHEUS_LOCAL: set it the same "
                    "for every rank of the run (scrape %s meanwhile; it aggregates every rank). Retrying "
                    "every %d s.", self.address, " and ".join(sibling), self.port, sibling[0],
                    BACKOFF_NS // 1_000_000_000)
                return
            cause = "the port is in use by another program"
        elif exc.errno == errno.EACCES:
            # Not a service in the way: this process may not bind it, and freeing the port changes nothing.
            log.warning(
                "won the election for %s but cannot bind it: permission denied: ports below 1024 need root or "
                "CAP_NET_BIND_SERVICE (or a lower net.ipv4.ip_unprivileged_port_start); grant one, or set "
                "NIXL_TELEMETRY_PROMETHEUS_PORT to 1024 or above for every rank. The election is left for another "
                "rank; retrying every %d s.", self.address, BACKOFF_NS // 1_000_000_000)
            return
        else:
            cause = reason
        log.warning(
            "won the election for %s but cannot bind it: %s. No rank of this run can be serving it, so "
            "nothing aggregates %s on that address (a foreign service, a rank using another "
            "NIXL_TELEMETRY_MULTIPROC_DIR, or the same port on another address?). Retrying every %d s; the "
            "first rank to win once the port is free takes the address over.",
            self.address, cause, self.election.directory, BACKOFF_NS // 1_000_000_000)
