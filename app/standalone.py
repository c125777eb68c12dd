"""The standalone aggregator: ``gunicorn app:wsgi`` (or ``python -m app serve``).

The gunicorn master holds the address's owner election for as long as it
runs (hooks in gunicorn.conf.py), exactly as an in-process owner would: the
ranks of the pod stay quiet writers, and if the aggregator dies the kernel
drops its lock and a rank takes the address over in-process.  Workers serve
the same directory; concurrent scrapes and reaping are safe because every
reader only probes, and reaping re-checks under an exclusive lock.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import time
from collections.abc import Mapping
from typing import Any

from app.collector import Collector
from app.config import Config, ConfigError, prepare_directory
from app.endpoint import RETRY_NS
from app.exporter import OwnerWatch, health_warnings
from app.web import MetricsApp, owner_doc
from election import Outcome, OwnerElection

try:
    from gunicorn.errors import AppImportError as _AppLoadError
except ImportError:  # gunicorn is a run-time dependency, but the app must not need it to import
    class _AppLoadError(Exception):  # type: ignore[no-redef]
        pass

log = logging.getLogger("nixl_prometheus_mp.standalone")
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class AggregatorConfigError(ConfigError, _AppLoadError):
    """A ConfigError that gunicorn reports as one line (it is an AppImportError), not a traceback."""


class _MasterState:
    """Set in the process that holds the election; inherited by forked workers."""

    election: OwnerElection | None = None
    pid: int | None = None
    since: float | None = None


_master = _MasterState()
_app: MetricsApp | None = None


def prepare_standalone(environ: Mapping[str, str] | None = None) -> Config:
    """The aggregator's configuration, with the directory created 0700 if missing.

    The master elects before any rank may have created the directory (a
    sidecar usually starts first): without it, the lock file could not be
    opened and the election would fall back to the bind.
    """
    config = Config.from_env(environ)
    for problem in prepare_directory(config.directory):
        log.warning("%s", problem)
    return config


def hold_election(config: Config) -> Outcome:
    """Block until this process owns ``config.address`` (or the lock is unusable).

    While a rank serves the address in-process, the aggregator waits rather
    than fight it for the port.
    """
    election = OwnerElection(config.directory, config.address)
    waiting_logged = False
    while (outcome := election.try_win()) is Outcome.LOST:
        if not waiting_logged:
            waiting_logged = True
            log.warning("a rank already serves %s in-process; the aggregator waits for the address", config.address)
        time.sleep(RETRY_NS / 1e9)
    _master.election, _master.pid, _master.since = election, os.getpid(), time.time()
    return outcome


def release_election() -> None:
    if _master.election is not None and _master.pid == os.getpid():
        _master.election.release()


def worker_forked() -> None:
    """In a gunicorn worker: drop the inherited election descriptor, never unlocking it.

    And die with the master: gunicorn's workers only notice a dead master
    about a second later, and until they exit they keep listening on the
    address, so the rank that wins the released election could not bind it
    and would back off for seconds.
    """
    if _master.election is not None and _master.pid != os.getpid():
        _master.election.forget_after_fork()
        _die_with(_master.pid)


def _die_with(master_pid: int | None) -> None:
    """PR_SET_PDEATHSIG: SIGKILL this process when its parent dies (Linux; elsewhere nothing)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):
        return
    if master_pid is not None and os.getppid() != master_pid:  # it died before prctl took effect
        os.kill(os.getpid(), signal.SIGKILL)


def _owner_info(config: Config) -> dict[str, Any]:
    election = _master.election
    return owner_doc(pid=_master.pid if _master.pid is not None else os.getpid(), agent_name=None,
                     address=config.address, mode="standalone", flock=election is not None and not election.problem,
                     since=_master.since)


def _warnings(config: Config, owners: OwnerWatch) -> list[dict[str, Any]]:
    election = _master.election or OwnerElection(config.directory, config.address)
    warnings = health_warnings(owners, election)
    if _master.election is None:
        warnings.append({"kind": "unusable-lock", "message": (
            "this aggregator holds no owner election (gunicorn was started without the project's "
            "gunicorn.conf.py): ranks configured for the same address would fight it for the port"),
            "details": {"address": config.address}})
    return warnings


def build_app(config: Config) -> MetricsApp:
    owners = OwnerWatch(config.directory, config.address)
    return MetricsApp(Collector(config.directory, config.stale_ttl_s), lambda: _owner_info(config),
                      lambda: _warnings(config, owners), on_scrape=owners.poll)


def standalone_app() -> MetricsApp:
    """``app.wsgi``: one app per process, configured from the environment."""
    global _app
    if _app is None:
        try:
            config = Config.from_env()
        except ConfigError as exc:
            raise AggregatorConfigError(str(exc)) from None
        _app = build_app(config)
    return _app
