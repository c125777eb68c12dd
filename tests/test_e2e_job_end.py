"""The demo, scraped as shipped: deploy/prometheus-static.yml on a plain host, and a job's final values.

An HA pair of real Prometheus servers (Debian's prometheus; .ci/run installs it), each configured by
deploy/prometheus-static.yml with the project's rules beside it (only the target and a 1 s pace changed), scrapes
the demo. The demo's ranks record for a few seconds and end; the address server publishes their final values until
the TTL after their last update, and the demo waits for it before it prints its totals. Both Prometheus servers
then saw the endpoint up and every rank's series, and hold, for every rank, the final value the demo counted.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from support import PROJECT_ROOT, Reaper, child_env, free_port
from test_e2e_prometheus import PROMETHEUS, Prometheus, shipped_static_config

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
