"""The HTTP side: /metrics negotiation and gzip, methods and paths, the landing page, /healthz's fields, 503 on a
lost directory.

Served for real: an in-process Exporter binds a free port on 127.0.0.1 and hands it to its address server (or, in
the tests that take the serve_mode fixture, also serves it from a thread of its own); the tests talk to it with
urllib.
"""

from __future__ import annotations

import datetime
import os
import shutil
import socket
import urllib.parse
from pathlib import Path

import pytest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from support import (  # noqa: F401  (pytest fixtures)
    exporter_env,
    free_port,
    gunzip,
    http_get,
    http_request,
    make_exporter_fixture,
    metrics_url,
    parse_exposition,
    series,
)
from support_forge import cpp_reference
from werkzeug.test import Client

from app.aggregator.wsgi import build_app
from app.collector import Collector
from app.config import Config
from app.exposition import EndpointState, endpoint_lines
from app.web import MetricsApp
from store import EventType, StoreIdentity, StoreWriter

E = EventType
# The Accept headers Prometheus sends, by version (scrape_protocols at their defaults; the protobuf entry leads when
# native histograms are on).  Every one of them accepts the text format 0.0.4.
PROMETHEUS_ACCEPT = {
    "2.0-2.48": "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                "text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
    "2.49+": "application/openmetrics-text;version=1.0.0;q=0.5,application/openmetrics-text;version=0.0.1;q=0.4,"
             "text/plain;version=0.0.4;q=0.3,*/*;q=0.2",
    "2.x-native-histograms": "application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;"
                             "encoding=delimited;q=0.6,application/openmetrics-text;version=1.0.0;q=0.5,"
                             "application/openmetrics-text;version=0.0.1;q=0.4,text/plain;version=0.0.4;q=0.3,"
                             "*/*;q=0.2",
    "3.x": "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.5,"
           "application/openmetrics-text;version=0.0.1;q=0.4,text/plain;version=1.0.0;escaping=allow-utf-8;q=0.3,"
           "text/plain;version=0.0.4;q=0.2,*/*;q=0.1",
    "3.x-text-first": "text/plain;version=1.0.0;escaping=allow-utf-8;q=0.6,text/plain;version=0.0.4;q=0.5,"
                      "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.4,*/*;q=0.3",
}
OPENMETRICS_ONLY = "application/openmetrics-text;version=1.0.0"


@pytest.fixture
def served(tmp_dir: Path, make_exporter):
    """An in-process owner with a few recorded events; (exporter, port)."""
    port = free_port()
    exp = make_exporter("http-agent", exporter_env(tmp_dir, port, LOCAL_RANK="3"))
    assert exp.serving
    exp.export_event(E.AGENT_TX_BYTES, 4096)
    exp.record_transfer(850, 12, 1 << 20, is_write=False)
    exp.record_error("backend")
    return exp, port


def test_default_is_prometheus_text_0_0_4(served) -> None:
    exp, port = served
    response = http_get(metrics_url(port))
    assert response.status == 200
    assert response.headers["content-type"] == CONTENT_TYPE_PLAIN_0_0_4
    assert "content-encoding" not in response.headers
    samples = parse_exposition(response.text)
    labels = {"hostname": socket.gethostname(), "agent_name": "http-agent", "pid": os.getpid(),
              "agent_instance": exp._writer.identity.instance, "local_rank": "3"}
    assert samples[series("agent_tx_bytes_total", **labels)] == 4096
    assert samples[series("agent_rx_bytes_total", **labels)] == 1 << 20
    assert samples[series("agent_errors_total", status="backend", **labels)] == 1
    # prometheus_client's text over the same stores, numbers spelt as the C++ plug-in spells them, then the
    # endpoint's own families: this rank live, nothing departed, no drain
    assert response.body == (cpp_reference(Collector(exp.config.directory, 30).collect().published)
                             + endpoint_lines(EndpointState(live=1, departed=0, draining=False)))
    assert parse_exposition(response.text, own=True)[series("nixl_prometheus_mp_ranks", state="live")] == 1


@pytest.mark.parametrize("version", sorted(PROMETHEUS_ACCEPT))
def test_prometheus_always_gets_the_text_format(served, version: str) -> None:
    """The format the C++ plug-in serves: the same bytes whoever owns the address, and valid (our OpenMetrics is
    not: two families named agent_xfer_time)."""
    _, port = served
    plain = http_get(metrics_url(port))
    response = http_get(metrics_url(port), headers={"Accept": PROMETHEUS_ACCEPT[version], "Accept-Encoding": "gzip"})
    assert response.status == 200
    assert response.headers["content-type"] == CONTENT_TYPE_PLAIN_0_0_4
    assert response.headers["content-encoding"] == "gzip"
    assert gunzip(response.body) == plain.body and b"# EOF" not in plain.body
    assert vary(response) == {"accept", "accept-encoding"}


@pytest.mark.parametrize("accept", [
    OPENMETRICS_ONLY,
    "application/openmetrics-text",
    "application/openmetrics-text;version=0.0.1;q=0.2, text/plain;version=0.0.4;q=0, */*;q=0",
    "application/openmetrics-text;version=1.0.0, text/plain;version=1.0.0",  # no 0.0.4: our text would not do
])
def test_openmetrics_only_for_a_client_that_accepts_nothing_else(served, accept: str) -> None:
    exp, port = served
    response = http_get(metrics_url(port), headers={"Accept": accept})
    assert response.status == 200
    assert response.headers["content-type"].startswith("application/openmetrics-text; version=1.0.0")
    text = response.text
    assert text.endswith("# EOF\n") and text.count("# EOF") == 1
    # counters' families are named without _total, their samples with it
    assert "# TYPE agent_tx_bytes counter\n" in text
    assert "# TYPE agent_errors counter\n" in text
    assert "# TYPE agent_tx_bytes_total" not in text
    assert "\nagent_tx_bytes_total{" in text
    assert "# TYPE agent_xfer_time_us histogram\n" in text
    reference = cpp_reference(Collector(exp.config.directory, 30).collect().published, openmetrics=True)
    own = endpoint_lines(EndpointState(live=1, departed=0, draining=False), openmetrics=True)
    assert response.body == reference.removesuffix(b"# EOF\n") + own + b"# EOF\n"
    assert vary(response) == {"accept", "accept-encoding"}


@pytest.mark.parametrize("accept", ["text/plain", "text/plain;version=0.0.4", "text/*", "*/*", "application/json",
                                    "TEXT/PLAIN", "application/openmetrics-text;q=0.9, text/plain;q=0.1"])
def test_text_for_every_other_client(served, accept: str) -> None:
    _, port = served
    response = http_get(metrics_url(port), headers={"Accept": accept})
    assert response.headers["content-type"] == CONTENT_TYPE_PLAIN_0_0_4
    assert "# EOF" not in response.text and "agent_tx_bytes_total{" in response.text
    assert vary(response) == {"accept", "accept-encoding"}


def vary(response) -> set[str]:
    return {v.strip().lower() for v in response.headers.get("vary", "").split(",") if v.strip()}


@pytest.mark.parametrize(("accept_encoding", "zipped"), [
    ("gzip", True), ("GZIP", True), ("gzip;q=0.5", True), ("deflate, gzip;q=0.1, br", True), ("*", True),
    ("x-gzip", True), ("identity, *;q=0.5", True),
    (None, False), ("", False), ("identity", False), ("deflate, br", False),
    ("gzip;q=0", False), ("gzip; q=0.0", False), ("gzip;q=0, *", False), ("*;q=0", False),
])
@pytest.mark.parametrize("accept", [None, OPENMETRICS_ONLY])
def test_gzip_exactly_when_acceptable(served, accept, accept_encoding, zipped: bool) -> None:
    _, port = served
    base = {"Accept": accept} if accept else {}
    plain = http_get(metrics_url(port), headers=base)
    answer = http_get(metrics_url(port), headers={**base, **({"Accept-Encoding": accept_encoding}
                                                               if accept_encoding is not None else {})})
    assert answer.status == 200
    assert answer.headers["content-type"] == plain.headers["content-type"]
    assert vary(answer) == {"accept", "accept-encoding"}
    if zipped:
        assert answer.headers["content-encoding"] == "gzip"
        assert gunzip(answer.body) == plain.body
        assert len(answer.body) < len(plain.body)
    else:
        assert "content-encoding" not in answer.headers
        assert answer.body == plain.body


def test_landing_page_links_metrics_and_healthz(served) -> None:
    _, port = served
    page = http_get(metrics_url(port, "/"))
    assert page.status == 200
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    assert page.text.startswith("<!DOCTYPE html>")
    # relative links: they resolve against the page's own URL, behind a path-prefix proxy too
    for target in ("metrics", "healthz"):
        assert f'<a href="{target}">' in page.text
        assert http_get(urllib.parse.urljoin(metrics_url(port, "/"), target)).status == 200
    head = http_request(metrics_url(port, "/"), method="HEAD")
    assert head.status == 200 and head.body == b""
    assert head.headers["content-length"] == page.headers["content-length"] == str(len(page.body))
    assert http_request(metrics_url(port, "/"), method="POST", data=b"x").status == 405


@pytest.mark.parametrize("path", ["/metric", "/metrics/x", "/healthz/", "/favicon.ico", "/index.html"])
def test_other_paths_are_404(served, path) -> None:
    _, port = served
    assert http_get(metrics_url(port, path)).status == 404


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE"])
@pytest.mark.parametrize("path", ["/metrics", "/healthz"])
def test_other_methods_are_405_with_allow(served, method, path) -> None:
    _, port = served
    response = http_request(metrics_url(port, path), method=method, data=b"x" if method != "DELETE" else None)
    assert response.status == 405
    allowed = {m.strip() for m in response.headers["allow"].split(",")}
    assert {"GET", "HEAD"} <= allowed and method not in allowed


@pytest.mark.parametrize("path", ["/metrics", "/healthz"])
def test_head_answers_like_get_without_a_body(served, path) -> None:
    _, port = served
    get = http_get(metrics_url(port, path))
    head = http_request(metrics_url(port, path), method="HEAD")
    assert head.status == get.status == 200
    assert head.body == b""
    assert set(head.headers) == set(get.headers)  # the same headers (Date, Server, Content-*, ...)
    assert head.headers["content-type"] == get.headers["content-type"]
    if path == "/metrics":  # nothing records meanwhile, so the exposition (and its length) is the same
        assert head.headers["content-length"] == get.headers["content-length"] == str(len(get.body))
        zipped = http_request(metrics_url(port, path), method="HEAD", headers={"Accept-Encoding": "gzip"})
        assert zipped.status == 200 and zipped.body == b"" and zipped.headers["content-encoding"] == "gzip"


def test_healthz_reports_every_field(tmp_dir: Path, make_exporter, make_identity, serve_mode: str) -> None:
    tmp_dir.chmod(0o770)  # -> a directory-permissions warning
    departed = StoreWriter(tmp_dir, make_identity(agent_name="gone", instance=77, hostname="host-b"))
    departed.record(E.AGENT_TX_BYTES, 1)
    departed.close()
    planted = tmp_dir / "nixl.1.1.1.mmap"
    planted.write_bytes(b"x")
    os.chown(planted, 12345, 12345)  # -> a foreign-store warning
    port = free_port()
    before = datetime.datetime.now(datetime.timezone.utc)
    exp = make_exporter("owner-agent", exporter_env(tmp_dir, port, LOCAL_RANK="3", NIXL_TELEMETRY_MP_STALE_TTL="30"))
    assert exp.serving

    response = http_get(metrics_url(port, "/healthz"))
    assert response.status == 200
    assert response.headers["content-type"].startswith("application/json")
    doc = response.json()
    assert doc["status"] == "ok" and "reason" not in doc

    owner = doc["owner"]
    assert set(owner) == {"pid", "hostname", "agent_name", "address", "mode", "election", "serving_since",
                          "server_pid", "serving", "started_by", "log_file"}, owner
    if serve_mode == "helper":  # the address server this rank started answers, and names it
        assert owner["pid"] == owner["server_pid"] != os.getpid()
        assert owner["serving"] == "helper"
    else:
        assert owner["pid"] == owner["server_pid"] == os.getpid()
        assert owner["serving"] == "thread"
    assert owner["started_by"] == os.getpid()
    # (an address server's records go to its file in the directory; thread mode's, to the rank's own logging)
    assert owner["log_file"] == (str(tmp_dir / f"nixl-server.127.0.0.1:{port}.log") if serve_mode == "helper" else None)
    assert owner["hostname"] == socket.gethostname()
    assert owner["agent_name"] == "owner-agent"
    assert owner["address"] == f"127.0.0.1:{port}"
    assert owner["mode"] == "in-process"
    assert owner["election"] == "flock"
    since = datetime.datetime.fromisoformat(owner["serving_since"])
    assert since.tzinfo is not None
    assert before - datetime.timedelta(seconds=1) <= since <= datetime.datetime.now(datetime.timezone.utc)

    assert doc["directory"] == str(tmp_dir)
    assert doc["stale_ttl_s"] == 30

    rank_fields = {"agent_name", "pid", "agent_instance", "local_rank", "hostname", "store", "seconds_since_update"}
    assert len(doc["live"]) == 1
    live = doc["live"][0]
    assert set(live) == rank_fields
    assert live == {**live, "agent_name": "owner-agent", "pid": os.getpid(),
                    "agent_instance": exp._writer.identity.instance, "local_rank": "3",
                    "hostname": socket.gethostname(), "store": exp.store_path.name}
    assert live["seconds_since_update"] >= 0

    assert len(doc["stale"]) == 1
    stale = doc["stale"][0]
    assert set(stale) == rank_fields | {"seconds_until_reaped"}
    assert stale == {**stale, "agent_name": "gone", "pid": os.getpid(), "agent_instance": 77, "local_rank": None,
                     "hostname": "host-b", "store": departed.path.name}
    assert 0 < stale["seconds_until_reaped"] <= 30
    assert stale["seconds_since_update"] >= 0

    for warning in doc["warnings"]:
        assert set(warning) == {"kind", "message", "details"}, warning
        assert isinstance(warning["message"], str) and warning["message"]
        assert isinstance(warning["details"], dict)
    kinds = {w["kind"]: w for w in doc["warnings"]}
    assert set(kinds) == {"directory-permissions", "foreign-store"}
    assert kinds["directory-permissions"]["details"] == {"directory": str(tmp_dir)}
    assert "0770" in kinds["directory-permissions"]["message"]
    assert kinds["foreign-store"]["details"] == {"file": str(planted)}


def test_healthz_503_over_http_when_the_directory_is_gone(tmp_path: Path, make_exporter, serve_mode: str) -> None:
    directory = tmp_path / "run"
    port = free_port()
    exp = make_exporter("lost", exporter_env(directory, port))
    assert exp.serving
    shutil.rmtree(directory)
    response = http_get(metrics_url(port, "/healthz"))
    assert response.status == 503
    doc = response.json()
    assert doc["status"] == "unavailable" and str(directory) in doc["reason"]
    assert doc["owner"]["started_by"] == os.getpid() and doc["owner"]["serving"] == serve_mode
    assert doc["live"] == [] and doc["stale"] == []
    metrics = http_get(metrics_url(port))
    assert metrics.status == 200 and metrics.body == b""  # an empty exposition, not an error


@pytest.mark.parametrize("how", ["removed", "replaced-by-a-file"])
def test_healthz_503_with_reason_from_the_wsgi_app(tmp_path: Path, how: str) -> None:
    directory = tmp_path / "run"
    directory.mkdir(mode=0o700)
    writer = StoreWriter(directory, StoreIdentity("w", "h", "", 0, (10.0,)))
    writer.close()
    app = build_app(Config(directory=directory, port=free_port(), local=True, buckets=(10.0,)))
    client = Client(app)
    assert client.get("/healthz").status_code == 200
    shutil.rmtree(directory)
    if how == "replaced-by-a-file":
        directory.write_text("not a directory")
    response = client.get("/healthz")
    assert response.status_code == 503
    doc = response.get_json()
    assert doc["reason"] and str(directory) in doc["reason"]
    assert doc["owner"]["mode"] == "standalone"
    assert client.head("/healthz").status_code == 503
    metrics = client.get("/metrics")
    assert metrics.status_code == 200 and metrics.data == b""


def test_wsgi_app_routes_without_a_server(tmp_dir: Path) -> None:
    app = MetricsApp(Collector(tmp_dir, 30), lambda: {"pid": 1})
    client = Client(app)
    assert client.get("/metrics").status_code == 200
    # no store: no NIXL series, and the endpoint's own families saying so
    nothing = EndpointState(live=0, departed=0, draining=False)
    assert client.get("/metrics").data == endpoint_lines(nothing)
    assert client.get("/metrics", headers={"Accept": OPENMETRICS_ONLY}).data == endpoint_lines(nothing, True) + \
        b"# EOF\n"
    assert client.get("/nope").status_code == 404
    response = client.post("/healthz")
    assert response.status_code == 405 and "GET" in response.headers["Allow"]


def test_healthz_to_another_host_names_no_file_of_this_one(tmp_path: Path) -> None:
    """The directory, its store files, the log file and the warnings' texts are the host's business: answered to
    its loopback peers, never to a peer on another host (a probe, a scraper through a Service)."""
    directory = tmp_path / "private-run-dir"
    directory.mkdir(mode=0o700)
    live = StoreWriter(directory, StoreIdentity("live", "h", "", 0, (10.0,)))
    StoreWriter(directory, StoreIdentity("gone", "h", "", 1, (10.0,))).close()
    planted = directory / "nixl.1.7.0.mmap"  # a store-named file of another user's: a warning naming its path
    planted.touch()
    os.chown(planted, 12345, 12345)
    try:
        client = Client(build_app(Config(directory=directory, port=free_port(), buckets=(10.0,))))
        for peer in ("127.0.0.1", "127.0.0.2", "::1", "::ffff:127.0.0.1", "", "/run/gunicorn.sock"):
            doc = client.get("/healthz", environ_overrides={"REMOTE_ADDR": peer}).get_json()
            assert doc["directory"] == str(directory) and doc["live"][0]["store"].endswith(".mmap"), peer
        for peer in ("10.1.2.3", "::ffff:10.1.2.3", "2001:db8::1"):
            response = client.get("/healthz", environ_overrides={"REMOTE_ADDR": peer})
            text = response.get_data(as_text=True)
            assert response.status_code == 200 and str(directory) not in text and ".mmap" not in text, text
            doc = response.get_json()
            assert "directory" not in doc and "log_file" not in doc["owner"] and "127.0.0.1" in doc["detail"]
            # The ranks as /metrics labels them, and the warnings' kinds: enough to tell what is wrong, from afar.
            assert [rank["agent_name"] for rank in doc["live"]] == ["live"]
            assert [rank["agent_name"] for rank in doc["stale"]] == ["gone"]
            assert {"kind": "foreign-store"} in doc["warnings"], doc  # (its text names the planted file)
        shutil.rmtree(directory)
        gone = client.get("/healthz", environ_overrides={"REMOTE_ADDR": "10.1.2.3"})
        assert gone.status_code == 503 and str(directory) not in gone.get_data(as_text=True)
    finally:
        live.close()
