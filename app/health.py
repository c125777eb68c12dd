"""The /healthz contract, one for the three ways an address is served (a rank's thread, an address server,
the gunicorn aggregator): the ``owner`` document, the warnings and the duplicate-owner watch.

Only documents are built here; who serves them is the caller's business (app.web's MetricsApp answers them).
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

from app.config import ConfigError, directory_warnings
from election import OwnerElection, address_is_held, held_addresses_except
from store.warnonce import OnceWarner

log = logging.getLogger("nixl_prometheus_mp")

WarningDoc = dict[str, Any]


def _iso(timestamp: float) -> str:
    return datetime.datetime.fromtimestamp(timestamp, datetime.timezone.utc).isoformat()


def owner_doc(*, pid: int, agent_name: str | None, address: str, mode: str, flock: bool,
              since: float | None, server_pid: int, serving: str, started_by: int | None = None,
              log_file: str | None = None) -> dict[str, Any]:
    """/healthz's ``owner``: who holds this address's election, how it was elected, since when, and which
    process answers (``server_pid``) how (``serving``: "helper" for a rank's address server, "thread" or,
    standalone, "gunicorn").

    ``started_by``: the rank that started the address server (it may be gone: the server is the job's);
    ``log_file``: the address server's log file (None where records go to the serving process's own logging,
    or nowhere).
    """
    return {
        "pid": pid,
        "hostname": socket.gethostname(),
        "agent_name": agent_name,
        "address": address,
        "mode": mode,
        "election": "flock" if flock else "bind-fallback",
        "serving_since": None if since is None else _iso(since),
        "server_pid": server_pid,
        "serving": serving,
        "started_by": started_by,
        "log_file": log_file,
    }


def replaced_warning(directory: Path, detected_at: float) -> WarningDoc:
    """The /healthz warning of an owner whose directory was removed or replaced while it served."""
    return {"kind": "directory-replaced",
            "message": f"{directory} was removed or replaced while this process served it; ranks that started "
                       "before are missing until they record again",
            "details": {"directory": str(directory), "detected_at": _iso(detected_at)}}


def draining_warning(until: float) -> WarningDoc:
    """/healthz's word from a server (or aggregator) told to stop: it publishes the job's final values until
    ``until`` (the last departed rank's TTL, or the drain's maximum), then exits."""
    return {"kind": "draining",
            "message": f"told to stop (SIGTERM): publishing the departed ranks' final values until {_iso(until)}, "
                       "then exiting; a second SIGTERM, or SIGINT, ends it at once",
            "details": {"until": _iso(until)}}


# The initial PID namespace's inode (PROC_PID_INIT_INO, <linux/proc_ns.h>): the same on every Linux host.  A
# container's /proc shows its own namespace only (NSpid has one level inside it): the inode is what tells.
_HOST_PID_NAMESPACE = "pid:[4026531836]"


def pid_namespace_warning() -> WarningDoc | None:
    """/healthz's word from an address server in a PID namespace of its own (a container), None on the host's.

    When a PID namespace's first process (the container's main process) exits, the kernel kills every other
    process in it: the server too, and with it the job's final values, which on a host it would publish until
    their TTL.
    """
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        return None
    if namespace == _HOST_PID_NAMESPACE:
        return None
    return {"kind": "pid-namespace",
            "message": "this address server runs in a PID namespace of its own (a container): it ends with that "
                       "namespace's first process (the container's main process), and the job's final values with "
                       "it, where on a host it would publish them until their TTL. To keep them, run the aggregator "
                       "as a sidecar container of the pod (deploy/nixl-ranks.yaml): it holds the address instead",
            "details": {"namespace": namespace}}


class OwnerWatch:
    """Other live owners of the directory, each warned about once.

    Checked when an Exporter starts, then at most every WATCH_INTERVAL_NS from
    the scrapes of whoever serves: the owner that elected first also learns of
    a second owner that appeared after it.
    """

    WATCH_INTERVAL_NS = 10_000_000_000

    def __init__(self, directory: Path, address: str) -> None:
        self.directory, self.address = directory, address
        self._warner = OnceWarner(log)
        self._next_ns = 0

    def check(self) -> list[WarningDoc]:
        """The duplicate-owners warning for /healthz (logged once per other address)."""
        others = held_addresses_except(self.directory, self.address)
        if not others or not address_is_held(self.directory, self.address):
            return []  # (ours not served: a rank that cannot bind says why itself, see ScrapeEndpoint)
        message = (f"{self.directory} is also served on {', '.join(others)}: every such address exports every "
                   "rank, so a Prometheus scraping more than one sees each series twice. Give every rank the same "
                   "NIXL_TELEMETRY_PROMETHEUS_PORT and NIXL_TELEMETRY_PROMETHEUS_LOCAL.")
        for other in others:
            self._warner.warn(other, "%s", message)
        return [{"kind": "duplicate-owners", "message": message, "details": {"addresses": [self.address, *others]}}]

    def poll(self) -> None:
        """check(), at most once per WATCH_INTERVAL_NS."""
        now = time.monotonic_ns()
        if now >= self._next_ns:
            self._next_ns = now + self.WATCH_INTERVAL_NS
            self.check()


def health_warnings(owners: OwnerWatch, election: OwnerElection) -> list[WarningDoc]:
    """The run-level problems /healthz reports besides the collector's."""
    directory = owners.directory
    warnings = owners.check()
    if election.problem:
        warnings.append({"kind": "unusable-lock", "message": election.problem,
                         "details": {"lock_file": str(election.path)}})
    try:
        for problem in directory_warnings(directory):
            warnings.append({"kind": "directory-permissions", "message": problem,
                             "details": {"directory": str(directory)}})
    except ConfigError as exc:
        warnings.append({"kind": "directory-permissions", "message": str(exc),
                         "details": {"directory": str(directory)}})
    return warnings
