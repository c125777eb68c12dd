"""The WSGI app: ``/metrics``, ``/healthz`` and a landing page at ``/``, for
both the in-process endpoint and ``gunicorn app:wsgi``.

Routing, method handling (404, 405 with Allow, HEAD) and header parsing are
werkzeug's, but for a GET or HEAD of ``/metrics``, a scraper's request, which is
answered without werkzeug's request and response objects (a third of a small
directory's scrape).  Content negotiation on /metrics:

* Format: the Prometheus text format 0.0.4 whenever the client accepts it
  (no Accept header, ``*/*``, ``text/*``, or ``text/plain`` without a version
  or with version 0.0.4, at any q above 0), which every Prometheus does: it
  is the only format the C++ plug-in serves, so the output is the same
  whoever owns the address, and it is valid where our OpenMetrics is not (the
  NIXL names give two families called ``agent_xfer_time``).  OpenMetrics 1.0.0
  only for a client that accepts OpenMetrics and not the text format; the
  text format, too, for a client that accepts neither.
* Encoding: gzip when ``Accept-Encoding`` lists gzip (or ``*``) with q above
  0; an explicit ``gzip;q=0`` refuses it whatever ``*`` says.

Both vary with the request, so /metrics answers say ``Vary: Accept,
Accept-Encoding`` (caches and proxies must not hand one client's format or
encoding to another).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST as CONTENT_TYPE_OPENMETRICS
from werkzeug.datastructures import Accept, MIMEAccept
from werkzeug.exceptions import HTTPException
from werkzeug.http import parse_accept_header, parse_options_header
from werkzeug.routing import Map, Rule
from werkzeug.wrappers import Response

from app.collector import Collection, Collector, RankView
from app.exposition import Body, EndpointState, Renderer, endpoint_lines
from app.health import WarningDoc
from store import native

log = logging.getLogger("nixl_prometheus_mp.web")

OwnerInfo = Callable[[], dict[str, Any]]
ExtraWarnings = Callable[[], list[WarningDoc]]
Draining = Callable[[], bool]  # whether the serving process, told to stop, publishes the departed ranks until their TTL

_METRICS_METHODS = ("GET", "HEAD")
_URLS = Map([
    Rule("/", endpoint="index", methods=["GET", "HEAD"]),
    Rule("/metrics", endpoint="metrics", methods=["GET", "HEAD"]),
    Rule("/healthz", endpoint="healthz", methods=["GET", "HEAD"]),
])

# Relative links, so that the page also works behind a proxy that mounts it under a path prefix.
_INDEX_HTML = b"""<!DOCTYPE html>
<html lang="en">
<head><meta charset="utf-8"><title>NIXL telemetry</title></head>
<body>
<h1>NIXL telemetry</h1>
<p>The NIXL telemetry of every process writing to this node's telemetry directory (NIXL's prometheus_mp exporter).</p>
<ul>
<li><a href="metrics">/metrics</a>: the Prometheus exposition, one series per process and metric</li>
<li><a href="healthz">/healthz</a>: which processes are live or departed, who serves this address, and warnings
(JSON)</li>
</ul>
</body>
</html>
"""


def wants_openmetrics(accept: MIMEAccept) -> bool:
    """Whether to answer OpenMetrics: only when the client accepts it and not the text format 0.0.4."""
    text = openmetrics = False
    for value, quality in accept:
        if quality <= 0:
            continue  # q=0: "not acceptable"
        mimetype, params = parse_options_header(value)
        mimetype = mimetype.lower()
        if mimetype in ("*/*", "text/*") or (mimetype == "text/plain" and params.get("version", "0.0.4") == "0.0.4"):
            text = True
        elif mimetype == "application/openmetrics-text":
            openmetrics = True
    return openmetrics and not text


def gzip_wanted(accept: Accept) -> bool:
    """Whether the client accepts gzip: an explicit gzip entry decides, else ``*``; q=0 means no."""
    explicit = [quality for value, quality in accept if value.lower() in ("gzip", "x-gzip")]
    if explicit:
        return max(explicit) > 0
    return any(quality > 0 for value, quality in accept if value == "*")


_NEGOTIATED_MAX = 32  # header pairs whose outcome is kept: a scraper sends the same ones every time
_NEGOTIATED_KEY_MAX = 1024  # longer headers are parsed every time, never kept
_negotiated_cache: dict[tuple[str | None, str | None], tuple[bool, bool]] = {}


def _negotiated(accept: str | None, accept_encoding: str | None) -> tuple[bool, bool]:
    """(OpenMetrics, gzip) for a request's Accept and Accept-Encoding headers.

    Parsing them (werkzeug's MIMEAccept) costs about a quarter of a small directory's scrape; a scraper sends the
    same two headers every time, so their outcome is kept, for a bounded number of bounded pairs.
    """
    key = (accept, accept_encoding)
    found = _negotiated_cache.get(key)
    if found is None:
        found = (wants_openmetrics(parse_accept_header(accept, MIMEAccept)),
                 gzip_wanted(parse_accept_header(accept_encoding)))
        if len(accept or "") + len(accept_encoding or "") <= _NEGOTIATED_KEY_MAX:
            if len(_negotiated_cache) >= _NEGOTIATED_MAX:
                _negotiated_cache.clear()
            _negotiated_cache[key] = found
    return found


def _from_this_host(peer: str | None) -> bool:
    """Whether a request comes from this host: a loopback peer (an IPv4-mapped IPv6 one included), or no network
    peer at all (a Unix socket's, which servers give as "" or a path; a WSGI call within the process)."""
    try:
        address = ipaddress.ip_address(peer or "")
    except ValueError:
        return True
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def _for_another_host(doc: dict[str, Any]) -> dict[str, Any]:
    """/healthz without what names the host's files: the directory, the stores, the log file, the texts."""
    reduced = {key: value for key, value in doc.items() if key != "directory"}
    reduced["owner"] = {key: value for key, value in doc["owner"].items() if key != "log_file"}
    for state in ("live", "stale"):
        reduced[state] = [{key: value for key, value in rank.items() if key != "store"} for rank in doc[state]]
    reduced["warnings"] = [dict(kind=warning["kind"]) for warning in doc["warnings"]]
    if "reason" in doc:
        reduced["reason"] = "the directory cannot be listed"
    reduced["detail"] = ("the directory, the store files, the log file and the warnings' texts are answered to "
                         "this host's own peers (127.0.0.1) only")
    return reduced


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


_Format = tuple[bool, bool]  # (OpenMetrics, gzip): what a /metrics body is, given the request's headers


def _gzipped(body: Body) -> Body:
    # Level 1: at 1024 ranks it compresses the 9 MB body in about a third of level 6's time, to a 16x smaller
    # body instead of 21x (docs/performance.md): the scrape is what waits.
    zipper = zlib.compressobj(1, zlib.DEFLATED, 16 + zlib.MAX_WBITS)  # (16+: the gzip container)
    out = [zipper.compress(piece) for piece in body]
    out.append(zipper.flush())
    return (b"".join(out),)


class _Flight:
    """The /metrics requests answered from one collection: each format they asked for is rendered (and
    compressed) once, and every one of them gets a reference to the same immutable pieces."""

    def __init__(self) -> None:
        self.formats: set[_Format] = set()
        self.bodies: dict[_Format, Body] = {}
        self.size = 0  # the bytes of its bodies, once rendered
        self.seq = 0  # once rendered: the how-manieth (the newest body is answered when too many are held)
        self.failed: BaseException | None = None
        self.done = threading.Event()
        self.holders = 0  # requests answering from it, until their answer is sent or cut (WSGI close)


class SharedScrapes:
    """/metrics bodies, one collection at a time, shared by the requests that waited for it (single flight).

    A body is held until its answer is sent, which a client that never reads stretches to the request's deadline
    (app.connections.REQUEST_TIMEOUT_S): were each request to render its own, 60 such clients of a 7 MB body
    would hold 60 bodies (and 60 collections while they render).  Here the requests that arrive while a
    collection runs wait for it to end and then share the next one, so the server holds at most the
    collection in progress and a body per collection being sent, however many clients ask.  A collection holds
    one batch of stores at a time (app.collector), and its body is never copied whole (app.exposition.Exposition).

    A request never gets a body whose collection began before it arrived: it joins only the flight that has not
    begun collecting yet, so what it is answered is as fresh as if it had been served alone (Prometheus's
    semantics: the sample is no older than the scrape).  Sharing saves the renders as well: N concurrent
    scrapes cost at most two collections, not N.

    But for one case: requests that arrive spread out (a loaded machine, clients one collection apart) would
    each start a flight of their own, and never-reading clients would hold a body each again.  So while the
    flights held by answers in flight are as many as the server keeps (MAX_HELD, and fewer for a large body: no
    more than HELD_BYTES of them, but always two, so that a body being sent never stops the next collection), a
    new request is answered from the newest body there is (its collection at most one behind the request),
    rather than holding a body more.  A 200 MB body is then held at most twice.
    """

    MAX_HELD = 4
    HELD_BYTES = 128 << 20

    def __init__(self, collector: Collector, renderer: Renderer, draining: Draining = lambda: False) -> None:
        self._collector = collector
        self._renderer = renderer
        self._draining = draining
        self._lock = threading.Lock()  # guards _waiting, _held, _flown and the flights' holders
        self._waiting: _Flight | None = None  # the flight requests join: its collection has not begun
        self._collecting = threading.Lock()  # held by the flight whose collection and renders are in progress
        self._held: set[_Flight] = set()  # flights with holders: their bodies are alive (and only theirs)
        self._flown = 0  # flights rendered so far

    def body(self, form: _Format) -> tuple[Body, Callable[[], None]]:
        """The body of ``form`` for a request arriving now, and what to call once its answer is sent (or cut)."""
        with self._lock:
            flight, lead, done = self._waiting, False, False
            if flight is None:  # (a waiting flight holds no body yet: joining it costs nothing)
                latest = max((held for held in self._held if form in held.bodies), key=lambda held: held.seq,
                             default=None)
                if (latest is not None
                        and len(self._held) >= max(2, min(self.MAX_HELD, self.HELD_BYTES // max(latest.size, 1)))):
                    flight, done = latest, True
                else:
                    flight = self._waiting = _Flight()
                    lead = True
            flight.formats.add(form)
            flight.holders += 1
            self._held.add(flight)
        released = False

        def release() -> None:
            nonlocal released
            with self._lock:
                if not released:
                    released = True
                    flight.holders -= 1
                    if flight.holders == 0:
                        self._held.discard(flight)

        try:
            if lead:
                self._fly(flight)
            elif not done:
                flight.done.wait()  # (no timeout: a collection always ends, and the leader's fails the flight)
            if flight.failed is not None:
                raise RuntimeError("the collection this scrape waited for failed") from flight.failed
            return flight.bodies[form], release
        except BaseException:
            release()
            raise

    def _fly(self, flight: _Flight) -> None:
        try:
            with self._collecting:
                with self._lock:
                    self._waiting = None  # who arrives from now on waits for the next collection, not this one
                flight.bodies = self._bodies(sorted(flight.formats))
                with self._lock:
                    flight.size = sum(len(piece) for body in flight.bodies.values() for piece in body)
                    flight.seq = self._flown = self._flown + 1
        except BaseException as exc:
            flight.failed = exc
            raise
        finally:
            flight.done.set()

    def _bodies(self, formats: list[_Format]) -> dict[_Format, Body]:
        """One collection, rendered in each of ``formats``."""
        expositions = {openmetrics: self._renderer.exposition(openmetrics) for openmetrics, _ in formats}
        live = departed = 0

        def publish(views: Sequence[RankView]) -> None:
            nonlocal live, departed
            alive = sum(view.alive for view in views)
            live, departed = live + alive, departed + len(views) - alive
            snapshots = [view.snapshot for view in views]
            for exposition in expositions.values():
                exposition.add(snapshots)

        scan_error = self._collector.collect(publish).scan_error
        state = EndpointState(live, departed, self._draining())
        rendered: dict[bool, Body] = {}
        for openmetrics, exposition in expositions.items():
            if scan_error is None:
                tail = endpoint_lines(state, openmetrics)
            else:
                # The directory could not be read (from the start, or midway): nothing, and nothing said of the
                # job either, since zero live ranks would read as a job that ended where the endpoint broke.
                exposition, tail = self._renderer.exposition(openmetrics), b""
            rendered[openmetrics] = exposition.finish(tail)
        return {(openmetrics, zipped): _gzipped(rendered[openmetrics]) if zipped else rendered[openmetrics]
                for openmetrics, zipped in formats}


class _Held(list[bytes]):
    """An answer's body, which the server holds until the answer is sent or cut: then it calls close() (WSGI),
    and the body's flight counts one holder less."""

    def __init__(self, body: Body, release: Callable[[], None]) -> None:
        super().__init__(body)
        self.close = release


class MetricsApp:
    """A WSGI application serving one directory of stores.

    ``draining``: whether the serving process, told to stop, is publishing the departed ranks' final values
    before it exits (the address server's, the aggregator's drain); /metrics says so in its own families.
    """

    def __init__(self, collector: Collector, owner: OwnerInfo, extra_warnings: ExtraWarnings | None = None,
                 on_scrape: Callable[[], None] | None = None, draining: Draining | None = None) -> None:
        self.collector = collector
        self._owner = owner
        self._extra_warnings = extra_warnings or (lambda: [])
        self._on_scrape = on_scrape or (lambda: None)  # e.g. the owner's periodic duplicate-owner check
        self._renderer = Renderer()
        self._scrapes = SharedScrapes(collector, self._renderer, draining or (lambda: False))

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") == "/metrics" and environ.get("REQUEST_METHOD") in _METRICS_METHODS:
            return self.metrics(environ, start_response)  # what a scraper asks for, without werkzeug's objects
        try:
            endpoint, _ = _URLS.bind_to_environ(environ).match()
            if endpoint == "metrics":
                return self.metrics(environ, start_response)
            elif endpoint == "healthz":
                response = self.healthz(environ)
            else:
                response = Response(_INDEX_HTML, mimetype="text/html")
        except HTTPException as exc:
            response = exc.get_response(environ)
        return response(environ, start_response)

    def metrics(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        """GET or HEAD /metrics, as a WSGI app."""
        openmetrics, zipped = _negotiated(environ.get("HTTP_ACCEPT"), environ.get("HTTP_ACCEPT_ENCODING"))
        self._on_scrape()
        body, release = self._scrapes.body((openmetrics, zipped))
        headers = [("Content-Type", CONTENT_TYPE_OPENMETRICS if openmetrics else CONTENT_TYPE_PLAIN_0_0_4),
                   ("Vary", "Accept, Accept-Encoding")]
        if zipped:
            headers.append(("Content-Encoding", "gzip"))
        headers.append(("Content-Length", str(sum(map(len, body)))))
        try:
            start_response("200 OK", headers)
        except BaseException:
            release()
            raise
        if environ["REQUEST_METHOD"] == "HEAD":
            release()
            return []  # no body: nothing was served
        return _Held(body, release)

    def healthz(self, environ: dict[str, Any]) -> Response:
        """/healthz: the whole document to the host's own peers (loopback), the rest of it to any other.

        The directory's path, its store files' names, the server's log file and the warnings' texts (which name
        paths) are the host's business: its users find them there (the address server keeps them out of ``ps``
        only to keep its command line short).  A peer on another host (a probe, a scraper through a Service)
        gets the status, who serves, the ranks as /metrics labels them, and the warnings' kinds.
        """
        collection: Collection = self.collector.census()
        warnings = self._extra_warnings() + collection.warnings
        doc: dict[str, Any] = {
            "status": "ok" if collection.scan_error is None else "unavailable",
            "owner": self._owner(),
            "directory": str(self.collector.directory),
            "stale_ttl_s": self.collector.stale_ttl_s,
            "live": [_rank_json(v) for v in collection.live],
            "stale": [_rank_json(v) for v in collection.stale],
            "warnings": warnings,
            "speedups": native.status(),  # the C or the pure-Python path, per hot path (store/native.py)
            "time": time.time(),
        }
        if collection.scan_error is not None:
            doc["reason"] = collection.scan_error
        if not _from_this_host(environ.get("REMOTE_ADDR")):
            doc = _for_another_host(doc)
        return Response(json.dumps(doc, indent=1) + "\n", status=200 if collection.scan_error is None else 503,
                        mimetype="application/json")
