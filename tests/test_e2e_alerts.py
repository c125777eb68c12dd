"""The shipped alerts, end to end: a real Prometheus and Alertmanager notify a crash, and only that.

A real Prometheus (deploy/prometheus-static.yml, adapted only for the test's target, a 1 s pace and an
Alertmanager) evaluates deploy/nixl.rules.yml scaled down in time by one factor, and a real Alertmanager
notifies a webhook served by this test. Over three events:

1. rank 2 of job A (3 ranks) is SIGKILLed while ranks 0 and 1 go on: ``NixlRankDeparted`` for its pid;
2. job A ends normally (the remaining ranks' stdin closed): its ranks leave within a moment of each other and the
   address server leaves after the TTL; that is no departure;
3. job B (2 ranks) starts on the same port right after Prometheus saw the endpoint down: A's ranks are not B's
   departures, and the gap is shorter than ``NixlMetricsEndpointDown``'s ``for``;
4. job B ends normally too, and nothing serves the port afterwards (a plain host between jobs) for longer than
   ``NixlMetricsEndpointDown``'s ``for`` and every window of the rules: its endpoint's last answers said no rank
   was live, so that is a job's end, not an outage,

the webhook gets exactly one notification: the crashed rank's departure. That the pipe works is proven by that
notification itself; that nothing else fired is checked in Prometheus's own ``ALERTS`` history too.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.parse
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from support import Reaper, free_port, get_json, http_get, wait_until
from support_e2e import DEPLOY, spawn_rank, wait_ready
from test_e2e_prometheus import PROMETHEUS, PROMTOOL, Prometheus, scrape_health, shipped_static_config

ALERTMANAGER = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(PROMETHEUS is None or PROMTOOL is None or ALERTMANAGER is None,
                       reason="needs prometheus, promtool and alertmanager "
                              "(apt-get install prometheus prometheus-alertmanager; .ci/run installs them)"),
]

# Production scrapes every 15 s with a 30 s TTL; this test scrapes every 1 s with a 2 s TTL. Every duration of the
# rules is divided by the same 15, so each keeps its ratio to the scrape interval and to the TTL (a `for: 1m` is
# 4 scrapes and 2 TTLs in both, a `[10m:]` window 40 scrapes): the rules decide exactly as in production, in 1/15
# of the time. Each replacement is counted, so that a change of the rules file fails here loudly instead of
# quietly testing something else.
WHOLE_RUN = "1h"  # a range reaching back before the test's Prometheus started
TTL_S = 2
FOR_S = 4  # the scaled `for` of both NixlRankDeparted and NixlMetricsEndpointDown (1m / 15)
SCALINGS: tuple[tuple[str, str, int], ...] = (
    (r"(?m)^(\s+)interval: 30s$", r"\g<1>interval: 2s", 1),  # the recording group
    (r"(?m)^(\s+)for: 1m$", rf"\g<1>for: {FOR_S}s", 2),  # NixlMetricsEndpointDown, NixlRankDeparted
    (r"(?m)^(\s+)keep_firing_for: 1m$", r"\g<1>keep_firing_for: 4s", 1),  # NixlRankDeparted
    (r"(?m)^(\s+)for: 5m$", r"\g<1>for: 20s", 1),  # NixlTransferErrors
    (r"\[10m:\]", "[40s:]", 2),  # NixlRankDeparted's windows
    (r"\[5m\]", "[20s]", 10),  # the recording rules' rates, pod:nixl_job_ended:last's departures
    (r"\[10m\]", "[40s]", 2),  # NixlTelemetryEventsDropped, pod:nixl_job_ended:last's carry
    (r"\[2m\]", "[8s]", 1),  # pod:nixl_job_ended:last's last answer
)
# (NixlMetricsEndpointDown's 0.5 s is no duration of the rules but what tells a scrape timing out from one refused:
# it stays, below the test's 1 s timeout as below production's 10 s.)


def scale_rules(text: str) -> str:
    """deploy/nixl.rules.yml with every duration divided by 15 (see SCALINGS); fails if any is left unscaled."""
    for pattern, replacement, count in SCALINGS:
        text, done = re.subn(pattern, replacement, text)
        assert done == count, f"{pattern!r} matched {done} times, not {count}: deploy/nixl.rules.yml changed"
    for group in yaml.safe_load(text)["groups"]:
        durations = [str(group.get("interval", "0s"))]
        for rule in group["rules"]:
            durations += [str(rule[key]) for key in ("for", "keep_firing_for") if key in rule]
            durations += [d for window in re.findall(r"\[(\w+):?(\w*)\]", rule["expr"]) for d in window if d]
        unscaled = [d for d in durations if not re.fullmatch(r"\d+s", d)]
        assert unscaled == [], f"durations of group {group['name']} not scaled: {unscaled}"
    return text


class Webhook:
    """Alertmanager's webhook receiver on 127.0.0.1: keeps every notification (a JSON document) it is sent."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._received: list[dict[str, Any]] = []
        hook = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                with hook._lock:
                    hook._received.append(json.loads(body))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass  # quiet: a failing test shows what was received instead

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"
        self._thread = threading.Thread(target=self.server.serve_forever, name="webhook", daemon=True)
        self._thread.start()

    def received(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._received)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=10)


@pytest.fixture
def webhook() -> Iterator[Webhook]:
    hook = Webhook()
    try:
        yield hook
    finally:
        hook.close()


def start_alertmanager(r: Reaper, tmp: Path, webhook_url: str) -> str:
    """A real Alertmanager on 127.0.0.1, clustering off, every alert a group of its own (so notifications count
    alerts), sent at once, never repeated during the test, resolutions not sent; its host:port."""
    assert ALERTMANAGER is not None
    tmp.mkdir(parents=True)
    config = tmp / "alertmanager.yml"
    config.write_text(yaml.safe_dump({
        "route": {"receiver": "webhook", "group_by": ["..."], "group_wait": "0s", "group_interval": "1s",
                  "repeat_interval": "1h"},
        "receivers": [{"name": "webhook", "webhook_configs": [{"url": webhook_url, "send_resolved": False}]}],
    }))
    address = f"127.0.0.1:{free_port()}"
    proc = r.spawn([ALERTMANAGER, f"--config.file={config}", f"--storage.path={tmp / 'data'}",
                    f"--web.listen-address={address}", "--cluster.listen-address=", "--log.level=warn"],
                   dict(os.environ), cwd=tmp)
    wait_until(lambda: http_get(f"http://{address}/-/ready", timeout=1).status == 200, 30,
               lambda: f"Alertmanager to be ready; its output:\n{proc.output}")
    return address


class AlertingPrometheus(Prometheus):
    """A real Prometheus that evaluates alerts: what the rule manager holds, and the alerts' history."""

    def alerts(self) -> list[dict[str, Any]]:
        """The alerts the rule manager holds now, pending or firing (/api/v1/alerts)."""
        return list(get_json(f"{self.url}/api/v1/alerts")["data"]["alerts"])

    def last_evaluation(self, group: str) -> float:
        """When the rule group ``group`` was last evaluated (Unix time; /api/v1/rules gives RFC 3339, nanoseconds)."""
        (stamp,) = [g["lastEvaluation"] for g in self.get_rules()["groups"] if g["name"] == group]
        found = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)", stamp)
        assert found, stamp
        zone = "+00:00" if found[3] == "Z" else found[3]
        return datetime.fromisoformat(found[1] + zone).timestamp() + float(f"0.{found[2] or 0}")

    def scrapes(self, selector: str) -> dict[str, int]:
        """{pid: how many scrapes of the last minute had its ``selector`` series}."""
        return {s["metric"]["pid"]: int(s["value"][1]) for s in self.query(f"count_over_time({selector}[1m])")}

    def history(self, since: float) -> str:
        """Every ALERTS series (pending and firing) and up, each with its sample times in s after ``since``."""
        lines = []
        for expr in (f"ALERTS[{WHOLE_RUN}]", f'up{{job="nixl"}}[{WHOLE_RUN}]'):
            doc = get_json(f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}")
            for s in doc["data"]["result"]:
                labels = {k: v for k, v in s["metric"].items() if k in ("__name__", "alertname", "alertstate", "pid")}
                values = " ".join(f"{float(t) - since:.1f}={v}" for t, v in s["values"])
                lines.append(f"{labels}: {values}")
        return "\n".join(lines)


def port_closed(port: int) -> bool:
    """Whether nothing listens on 127.0.0.1:port (a connection is refused)."""
    with socket.socket() as s:
        s.settimeout(5)
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_a_crashed_rank_notifies_once_and_a_job_end_or_restart_not_at_all(tmp_path: Path, webhook: Webhook) -> None:
    scaled = scale_rules((DEPLOY / "nixl.rules.yml").read_text())
    rules = tmp_path / "nixl.rules.yml"
    rules.write_text(scaled)
    assert PROMTOOL is not None
    done = subprocess.run([PROMTOOL, "check", "rules", str(rules)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr

    port = free_port()
    target = f"127.0.0.1:{port}"
    ttl = {"NIXL_TELEMETRY_MP_STALE_TTL": str(TTL_S)}
    with Reaper() as r:
        alertmanager = start_alertmanager(r, tmp_path / "alertmanager", webhook.url)
        config = shipped_static_config([target])
        assert config["rule_files"] == ["nixl.rules.yml"] and "alerting" not in config, config
        config["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [alertmanager]}]}]}

        # Job A, every rank ready before Prometheus starts (so no scrape can catch a rank between its store's
        # creation and its first values).
        job_a = [spawn_rank(r, tmp_path / "a", port, 0, **ttl)]
        assert wait_ready(job_a[0]) is True  # rank 0 started the address server
        job_a += [spawn_rank(r, tmp_path / "a", port, rank, **ttl) for rank in (1, 2)]
        assert [wait_ready(p) for p in job_a[1:]] == [False, False]
        pids_a = {str(p.pid) for p in job_a}
        prom = AlertingPrometheus(r, tmp_path / "prometheus", config=config, files={"nixl.rules.yml": scaled})
        started = time.time()
        timeline: dict[str, float] = {}

        def evidence() -> str:
            times = ", ".join(f"{event} {at - started:.1f}" for event, at in timeline.items())
            return (f"events (s after Prometheus started): {times}\nnotifications: {webhook.received()}\n"
                    f"series:\n{prom.history(started)}")

        wait_until(lambda: get_json(f"{prom.url}/api/v1/alertmanagers")["data"]["activeAlertmanagers"], 30,
                   "Prometheus to discover its Alertmanager")

        def established() -> bool:
            """Each of A's ranks seen in more scrapes than the scaled `for` lasts."""
            seen = prom.scrapes('agent_tx_bytes_total{job="nixl"}')
            return set(seen) == pids_a and min(seen.values()) > FOR_S + 1

        wait_until(established, 30,
                   lambda: f"Prometheus to scrape job A's 3 ranks for > {FOR_S} s ({scrape_health(prom)})")

        # (1) Rank 2 crashes; ranks 0 and 1 go on.
        crashed = str(job_a[2].pid)
        job_a[2].killpg(signal.SIGKILL)
        job_a[2].popen.wait(timeout=10)
        timeline["rank 2 killed"] = time.time()

        def departure_notified() -> bool:
            return any(alert["labels"].get("alertname") == "NixlRankDeparted" and alert["labels"].get("pid") == crashed
                       and alert["status"] == "firing" for n in webhook.received() for alert in n["alerts"])

        wait_until(departure_notified, 60, lambda: f"the crashed rank's NixlRankDeparted notification\n{evidence()}")
        timeline["departure notified"] = time.time()

        # Job B's ranks, started now but recording only once released: the gap between the jobs is then the
        # library's start, not an interpreter's, which a loaded machine can stretch past the scaled `for` of
        # NixlMetricsEndpointDown (4 s).
        job_b = [spawn_rank(r, tmp_path / "b", port, rank, gated=True, **ttl) for rank in (0, 1)]

        # (2) Job A ends normally: its ranks exit, and the address server leaves after the TTL.
        for proc in job_a[:2]:
            assert proc.popen.stdin is not None
            proc.popen.stdin.close()
        wait_until(lambda: all(p.popen.poll() is not None for p in job_a[:2]), 30, "job A's ranks to exit")
        timeline["job A ended"] = time.time()
        # (The port closed too: a scrape timing out on a loaded machine is no sign that A's server left.)
        wait_until(lambda: port_closed(port) and prom.query('up{job="nixl"} == 0'), 30,
                   lambda: f"A's address server to leave, and Prometheus to see the endpoint down\n{evidence()}")
        timeline["down seen"] = time.time()

        # (3) Job B starts on the same port at once, in a directory of its own.
        job_b[0].release()
        assert wait_ready(job_b[0]) is True  # A's address server had left: B's rank 0 starts its own
        job_b[1].release()
        assert wait_ready(job_b[1]) is False
        timeline["job B ready"] = time.time()
        pids_b = {str(p.pid) for p in job_b}

        selector_b = f'agent_tx_bytes_total{{job="nixl", pid=~"{"|".join(pids_b)}"}}'

        def settled() -> bool:
            """B scraped for over 3 times the scaled `for`, the alerts evaluated after that, and the rule manager
            holding no departure or endpoint alert: whatever A's end or B's start would have fired has fired by
            then (and was notified: Alertmanager waits 0 s), and none is left pending."""
            seen = prom.scrapes(selector_b)
            if set(seen) != pids_b or min(seen.values()) <= 3 * FOR_S + 1:
                return False
            latest = max(float(s["value"][1]) for s in prom.query(f"timestamp({selector_b})"))
            return (prom.last_evaluation("nixl-alerts") > latest
                    and not [a for a in prom.alerts()
                             if a["labels"]["alertname"] in ("NixlRankDeparted", "NixlMetricsEndpointDown")])

        wait_until(settled, 60, lambda: f"job B scraped for > {3 * FOR_S} s and no alert pending\n{evidence()}")
        timeline["settled"] = time.time()

        # (4) Job B ends normally too, and nothing serves the port afterwards: a plain host between jobs.
        for proc in job_b:
            assert proc.popen.stdin is not None
            proc.popen.stdin.close()
        wait_until(lambda: all(p.popen.poll() is not None for p in job_b), 30, "job B's ranks to exit")
        timeline["job B ended"] = time.time()
        wait_until(lambda: port_closed(port) and prom.query('up{job="nixl"} == 0'), 30,
                   lambda: f"B's address server to leave, and Prometheus to see the endpoint down\n{evidence()}")
        down_at = timeline["B down seen"] = time.time()
        # Down for longer than the scaled `for` after the last answer left the scaled 8 s window of the rules: what
        # that answer said is then carried, and anything that would fire has fired (and was notified).
        quiet_s = 8 + 3 * FOR_S
        wait_until(lambda: time.time() - down_at > quiet_s and prom.last_evaluation("nixl-alerts") > down_at + quiet_s
                   and prom.last_evaluation("nixl-recording") > down_at + quiet_s, quiet_s + 30,
                   lambda: f"{quiet_s} s of B's endpoint down, evaluated\n{evidence()}")
        assert prom.query('up{job="nixl"} == 0'), evidence()  # (still down: nothing served the port meanwhile)
        assert [a for a in prom.alerts() if a["labels"]["alertname"] == "NixlMetricsEndpointDown"] == [], evidence()
        assert prom.query('pod:nixl_job_ended:last{job="nixl"} == 1'), evidence()
        timeline["B's end settled"] = time.time()

        # Exactly one notification: the crashed rank's departure.
        notifications = webhook.received()
        assert len(notifications) == 1, evidence()
        (notification,) = notifications
        assert notification["status"] == "firing", evidence()
        assert [(a["labels"]["alertname"], a["labels"]["pid"], a["status"]) for a in notification["alerts"]] == [
            ("NixlRankDeparted", crashed, "firing")], evidence()
        for text in notification["alerts"][0]["annotations"].values():  # a plain host: no namespace, no pod
            assert "()" not in text and "(/)" not in text, text
        # Prometheus agrees: of every alert, only that departure ever fired (the endpoint's gap never did).
        assert prom.query('count_over_time(ALERTS{alertname="NixlMetricsEndpointDown", alertstate="firing"}'
                          f'[{WHOLE_RUN}])') == [], evidence()
        fired = {(s["metric"]["alertname"], s["metric"].get("pid")) for s in
                 prom.query(f'count_over_time(ALERTS{{alertstate="firing"}}[{WHOLE_RUN}])')}
        assert fired == {("NixlRankDeparted", crashed)}, evidence()
        # The endpoint was seen down between the jobs (so B is the new job after a gap that this test meant).
        assert prom.query(f'min_over_time(up{{job="nixl"}}[{WHOLE_RUN}]) == 0'), evidence()
