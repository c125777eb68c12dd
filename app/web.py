"""The WSGI app: ``/metrics`` and ``/healthz``, for both the in-process
endpoint and ``gunicorn app:wsgi``.

Routing, method handling (404, 405 with Allow, HEAD) and responses are
werkzeug's; content negotiation and gzip follow prometheus_client's own
``choose_encoder`` and ``gzip_accepted``, so a scraper sees exactly what a
prometheus_client endpoint would send it.
"""

from __future__ import annotations

import datetime
import gzip
import json
import logging
import socket
import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client.exposition import choose_encoder, gzip_accepted
from werkzeug.exceptions import HTTPException
from werkzeug.routing import Map, Rule
from werkzeug.wrappers import Request, Response

from app.collector import Collection, Collector, RankView
from app.exposition import Renderer

log = logging.getLogger("nixl_prometheus_mp.web")

WarningDoc = dict[str, Any]
OwnerInfo = Callable[[], dict[str, Any]]
ExtraWarnings = Callable[[], list[WarningDoc]]

_URLS = Map([
    Rule("/metrics", endpoint="metrics", methods=["GET", "HEAD"]),
    Rule("/healthz", endpoint="healthz", methods=["GET", "HEAD"]),
])


def _rank_json(view: RankView) -> dict[str, Any]:
    snap = view.snapshot
    out: dict[str, Any] = {
        "agent_name": snap.agent_name,
        "pid": snap.pid,
        "agent_instance": snap.instance,
        "local_rank": snap.local_rank or None,
        "hostname": snap.hostname,
        "store": snap.path.name,
        "seconds_since_update": round(view.age_s, 3),
    }
    if view.reap_in_s is not None:
        out["seconds_until_reaped"] = round(view.reap_in_s, 3)
    return out


def owner_doc(*, pid: int, agent_name: str | None, address: str, mode: str, flock: bool,
              since: float | None) -> dict[str, Any]:
    """/healthz's ``owner``: who serves this address, how it was elected, since when."""
    return {
        "pid": pid,
        "hostname": socket.gethostname(),
        "agent_name": agent_name,
        "address": address,
        "mode": mode,
        "election": "flock" if flock else "bind-fallback",
        "serving_since": None if since is None else datetime.datetime.fromtimestamp(
            since, datetime.timezone.utc).isoformat(),
    }


class MetricsApp:
    """A WSGI application serving one directory of stores."""

    def __init__(self, collector: Collector, owner: OwnerInfo, extra_warnings: ExtraWarnings | None = None,
                 on_scrape: Callable[[], None] | None = None) -> None:
        self.collector = collector
        self._owner = owner
        self._extra_warnings = extra_warnings or (lambda: [])
        self._on_scrape = on_scrape or (lambda: None)  # e.g. the owner's periodic duplicate-owner check
        self._renderer = Renderer()

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        request = Request(environ)
        try:
            endpoint, _ = _URLS.bind_to_environ(environ).match()
            response = self.metrics(request) if endpoint == "metrics" else self.healthz()
        except HTTPException as exc:
            response = exc.get_response(environ)
        return response(environ, start_response)

    def metrics(self, request: Request) -> Response:
        _, content_type = choose_encoder(request.headers.get("Accept", ""))
        openmetrics = content_type.startswith("application/openmetrics-text")
        self._on_scrape()
        body = self._renderer.render(self.collector.collect().published, openmetrics)
        headers = {"Content-Type": content_type}
        if gzip_accepted(request.headers.get("Accept-Encoding", "")):
            body = gzip.compress(body, compresslevel=6)  # most of level 9's ratio for much less CPU
            headers["Content-Encoding"] = "gzip"
        return Response(body, headers=headers)

    def healthz(self) -> Response:
        collection: Collection = self.collector.collect()
        warnings = self._extra_warnings() + collection.warnings
        doc: dict[str, Any] = {
            "status": "ok" if collection.scan_error is None else "unavailable",
            "owner": self._owner(),
            "directory": str(self.collector.directory),
            "stale_ttl_s": self.collector.stale_ttl_s,
            "live": [_rank_json(v) for v in collection.live],
            "stale": [_rank_json(v) for v in collection.stale],
            "warnings": warnings,
            "time": time.time(),
        }
        if collection.scan_error is not None:
            doc["reason"] = collection.scan_error
        return Response(json.dumps(doc, indent=1) + "\n", status=200 if collection.scan_error is None else 503,
                        mimetype="application/json")
