"""The standalone aggregator: ``gunicorn app:wsgi`` (or ``python -m app serve``).

The gunicorn master holds the address's owner election for as long as it
runs (hooks in gunicorn.conf.py), exactly as an in-process owner would: the
ranks of the pod stay quiet writers, and if the aggregator dies the kernel
drops its lock and a rank takes the address over in-process.  Workers serve
the same directory; concurrent scrapes and reaping are safe because every
reader only probes, and reaping re-checks under an exclusive lock.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import time
from collections.abc import Mapping
from typing import Any

from app.collector import Collector
from app.config import DIR_ENV, Config, ConfigError
from app.endpoint import RETRY_NS
from app.exporter import health_warnings
from app.web import MetricsApp
from election import Outcome, OwnerElection

log = logging.getLogger("nixl_prometheus_mp.standalone")


class _MasterState:
    """Set in the process that holds the election; inherited by forked workers."""

    election: OwnerElection | None = None
    pid: int | None = None
    since: float | None = None


_master = _MasterState()
_app: MetricsApp | None = None


def standalone_config(environ: Mapping[str, str] | None = None) -> Config:
    env = os.environ if environ is None else environ
    if not env.get(DIR_ENV, "").strip():
        raise ConfigError(f"{DIR_ENV} is required: the aggregator serves the stores of the ranks that share it "
                          "(set it to the same directory as the ranks, e.g. /run/nixl_metrics)")
    return Config.from_env(env)


def hold_election(config: Config, stop_after_s: float | None = None) -> Outcome:
    """Block until this process owns ``config.address`` (or the lock is unusable).

    While a rank serves the address in-process, the aggregator waits rather
    than fight it for the port.
    """
    election = OwnerElection(config.directory, config.address)
    deadline = None if stop_after_s is None else time.monotonic() + stop_after_s
    waiting_logged = False
    while (outcome := election.try_win()) is Outcome.LOST:
        if not waiting_logged:
            waiting_logged = True
            log.warning("a rank already serves %s in-process; the aggregator waits for the address", config.address)
        if deadline is not None and time.monotonic() > deadline:
            return outcome
        time.sleep(RETRY_NS / 1e9)
    _master.election, _master.pid, _master.since = election, os.getpid(), time.time()
    return outcome


def release_election() -> None:
    if _master.election is not None and _master.pid == os.getpid():
        _master.election.release()


def worker_forked() -> None:
    """In a gunicorn worker: drop the inherited election descriptor, never unlocking it."""
    if _master.election is not None and _master.pid != os.getpid():
        _master.election.forget_after_fork()


def _owner_info(config: Config) -> dict[str, Any]:
    since = _master.since
    return {
        "pid": _master.pid if _master.pid is not None else os.getpid(),
        "hostname": socket.gethostname(),
        "agent_name": None,
        "address": config.address,
        "mode": "standalone",
        "election": "flock" if _master.election is not None and not _master.election.problem else "bind-fallback",
        "serving_since": None if since is None else datetime.datetime.fromtimestamp(
            since, datetime.timezone.utc).isoformat(),
    }


def _warnings(config: Config) -> list[dict[str, Any]]:
    election = _master.election or OwnerElection(config.directory, config.address)
    warnings = health_warnings(config.directory, election)
    if _master.election is None:
        warnings.append({"kind": "unusable-lock", "message": (
            "this aggregator holds no owner election (gunicorn was started without the project's "
            "gunicorn.conf.py): ranks configured for the same address would fight it for the port"),
            "details": {"address": config.address}})
    return warnings


def build_app(config: Config) -> MetricsApp:
    return MetricsApp(Collector(config.directory, config.stale_ttl_s), lambda: _owner_info(config),
                      lambda: _warnings(config))


def standalone_app() -> MetricsApp:
    """``app.wsgi``: one app per process, configured from the environment."""
    global _app
    if _app is None:
        _app = build_app(standalone_config())
    return _app
