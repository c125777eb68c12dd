"""The aggregator's WSGI application: ``app.wsgi`` for ``gunicorn app:wsgi``, and ``python -m app serve``'s.

One app per worker, configured from the environment, serving the directory with the owner the master's
election (app.aggregator.hooks) says.  Workers serve the same directory; concurrent scrapes and reaping are
safe because every reader only probes, and reaping re-checks under an exclusive lock.
"""

from __future__ import annotations

import os
from typing import Any

from app.aggregator.hooks import master
from app.collector import Collector
from app.config import Config, ConfigError
from app.health import OwnerWatch, draining_warning, health_warnings, owner_doc
from app.malloc import give_large_frees_back
from app.web import MetricsApp
from election import OwnerElection

try:
    from gunicorn.errors import AppImportError as _AppLoadError
except ImportError:  # gunicorn is a run-time dependency, but the app must not need it to import
    class _AppLoadError(Exception):  # type: ignore[no-redef]
        pass

_app: MetricsApp | None = None


class AggregatorConfigError(ConfigError, _AppLoadError):
    """A ConfigError that gunicorn reports as one line (it is an AppImportError), not a traceback."""


def _owner_info(config: Config, serving: str) -> dict[str, Any]:
    election = master.election
    return owner_doc(pid=master.pid if master.pid is not None else os.getpid(), agent_name=None,
                     address=config.address, mode="standalone", flock=election is not None and not election.problem,
                     since=master.since, server_pid=os.getpid(), serving=serving)


def _warnings(config: Config, owners: OwnerWatch) -> list[dict[str, Any]]:
    election = master.election or OwnerElection(config.directory, config.address)
    warnings = health_warnings(owners, election)
    if master.election is None:
        warnings.append({"kind": "unusable-lock", "message": (
            "this aggregator holds no owner election (gunicorn was started without "
            "-c python:app.gunicorn_conf): ranks configured for the same address would fight it for the port"),
            "details": {"address": config.address}})
    until = master.draining_until
    return warnings if until is None else [draining_warning(until), *warnings]


def build_app(config: Config, serving: str = "gunicorn") -> MetricsApp:
    """The aggregator's app; ``serving``: the server it runs on, as /healthz says ("gunicorn", "werkzeug")."""
    give_large_frees_back()  # (a gunicorn worker, or ``serve``: a process of ours)
    owners = OwnerWatch(config.directory, config.address)
    return MetricsApp(Collector(config.directory, config.stale_ttl_s), lambda: _owner_info(config, serving),
                      lambda: _warnings(config, owners), on_scrape=owners.poll,
                      draining=lambda: master.draining_until is not None)


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
