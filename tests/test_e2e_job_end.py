"""The demo, scraped as shipped: deploy/prometheus-static.yml on a plain host, and a job's final values.

An HA pair of real Prometheus servers (Debian's prometheus; .ci/run installs it), each configured by
deploy/prometheus-static.yml with the project's rules beside it (only the target and a 1 s pace changed), scrapes
the demo. The demo's ranks record for a few seconds and end; the address server publishes their final values until
the TTL after their last update, and the demo waits for it before it prints its totals. Both Prometheus servers
then saw the endpoint up and every rank's series, and hold, for every rank, the final value the demo counted.

Then the same with nothing changed: the file as shipped (15 s scrapes of 127.0.0.1:9111) against the demo as a
user starts it (its port, its default TTL), which must agree for the final values to be scraped at all.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support import PROJECT_ROOT, Reaper, can_bind, child_env, free_port, http_get, wait_until
from support_e2e import DEPLOY, by_rank, parse_text
from test_e2e_prometheus import PROMETHEUS, Prometheus, QueryApi, shipped_static_config

from app.cli.demo import DEMO_PORT
from app.config import DEFAULT_TTL_S

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(PROMETHEUS is None, reason="needs Debian's prometheus")]


def test_the_shipped_static_config_scrapes_the_demo_and_both_servers_of_an_ha_pair_get_its_final_values(
        tmp_path: Path) -> None:
    port, ranks = free_port(), 3
    target = f"127.0.0.1:{port}"
    with Reaper() as r:
        pair = [Prometheus(r, tmp_path / f"prometheus-{i}", target, config=shipped_static_config([target]))
                for i in range(2)]
        done = subprocess.run(
            [sys.executable, "-m", "app", "demo", "--ranks", str(ranks), "--duration", "4", "--rate", "50", "--port",
             str(port), "--dir", str(tmp_path / "mp")], cwd=PROJECT_ROOT, capture_output=True, text=True,
            env=child_env({"NIXL_TELEMETRY_MP_STALE_TTL": "4"}), timeout=120)
        assert done.returncode == 0, done.stderr
        last = done.stdout.strip().splitlines()[-1]
        counted = int(re.search(r"transfers (\d+)", last).group(1))  # type: ignore[union-attr]
        assert counted > 0 and f"departed {ranks}" in last, last
        for prometheus in pair:
            # The shipped job, its rules loaded: the endpoint was up, and every rank had its series.
            assert prometheus.query('max_over_time(up{job="nixl"}[5m])')[0]["value"][1] == "1"
            assert prometheus.query('count(last_over_time(agent_tx_bytes_total{job="nixl"}[5m]))')[0]["value"][1] \
                == str(ranks)
            assert {group["name"] for group in prometheus.get_rules()["groups"]} == {"nixl-recording", "nixl-alerts"}
            # Each rank's last sample, summed over the ranks: every transfer the demo counted, none missing.
            result = prometheus.query('sum(last_over_time(agent_tx_requests_num_total{job="nixl"}[5m]) '
                                      '+ last_over_time(agent_rx_requests_num_total{job="nixl"}[5m]))')
            assert result and float(result[0]["value"][1]) == counted, (result, last)


FAMILIES = ("agent_tx_bytes_total", "agent_rx_bytes_total", "agent_tx_requests_num_total",
            "agent_rx_requests_num_total")


def shipped_prometheus(r: Reaper, tmp: Path) -> QueryApi:
    """A Prometheus run as deploy/prometheus-static.yml says, on a copy of the file left byte for byte as shipped
    (its rule files beside it, as it names them), listening on a free port."""
    tmp.mkdir(parents=True)
    shutil.copyfile(DEPLOY / "prometheus-static.yml", tmp / "prometheus-static.yml")
    for rules in yaml.safe_load((DEPLOY / "prometheus-static.yml").read_text())["rule_files"]:
        shutil.copyfile(DEPLOY / rules, tmp / rules)
    port = free_port()
    assert PROMETHEUS is not None
    proc = r.spawn([PROMETHEUS, f"--config.file={tmp / 'prometheus-static.yml'}",
                    f"--web.listen-address=127.0.0.1:{port}", f"--storage.tsdb.path={tmp / 'data'}",
                    "--log.level=warn"], dict(os.environ), cwd=tmp)
    api = QueryApi(f"http://127.0.0.1:{port}")
    wait_until(lambda: http_get(f"{api.url}/-/ready", timeout=1).status == 200, 30,
               lambda: f"Prometheus to be ready; its output:\n{proc.output[-2000:]}")
    return api


def test_the_shipped_static_config_unchanged_stores_every_final_value_of_the_demo_with_its_defaults(
        tmp_path: Path) -> None:
    """No pace changed, no TTL given: the file scrapes 127.0.0.1:9111 every 15 s, the demo serves there and keeps
    a departed rank 30 s (the library's default).  With the demo's former 10 s TTL its server had left before the
    next scrape, and both servers of an HA pair kept short values for every rank."""
    shipped = yaml.safe_load((DEPLOY / "prometheus-static.yml").read_text())
    (job,) = shipped["scrape_configs"]
    assert job["static_configs"][0]["targets"] == [f"127.0.0.1:{DEMO_PORT}"], job
    interval = float(job["scrape_interval"].removesuffix("s"))
    assert interval < DEFAULT_TTL_S, (interval, DEFAULT_TTL_S)  # what the rest of this test shows holds
    if not can_bind(DEMO_PORT):
        pytest.skip(f"port {DEMO_PORT}, the shipped file's target, is in use on this host")
    ranks = 3
    with Reaper() as r:
        pair = [shipped_prometheus(r, tmp_path / f"prometheus-{i}") for i in range(2)]
        demo = r.spawn([sys.executable, "-m", "app", "demo", "--ranks", str(ranks), "--duration", "4", "--rate", "50",
                        "--dir", str(tmp_path / "mp")], child_env(), cwd=PROJECT_ROOT)
        first = demo.wait_line(lambda line: "ranks recording into" in line, 30)
        assert f"stays published {DEFAULT_TTL_S:g} s" in first, first
        # The ranks are done: what their stores hold now is every rank's final value.
        demo.wait_line(lambda line: line.startswith("the ranks are done"), 30)
        body = http_get(f"http://127.0.0.1:{DEMO_PORT}/metrics", timeout=5).body
        final = {name: by_rank(parse_text(body), name) for name in FAMILIES}
        assert all(len(values) == ranks for values in final.values()), final
        assert demo.popen.wait(timeout=DEFAULT_TTL_S + 30) == 0, demo.output  # once the server left, at the TTL
        counted = int(re.search(r"transfers (\d+)", demo.lines[-1]).group(1))  # type: ignore[union-attr]
        assert counted == sum(final["agent_tx_requests_num_total"].values()) \
            + sum(final["agent_rx_requests_num_total"].values()), (counted, final)
        for prometheus in pair:
            stored = {name: prometheus.by_rank(f'last_over_time({name}{{job="nixl"}}[5m])') for name in FAMILIES}
            assert stored == final, (prometheus.url, stored, final)
