"""A job's final values reach Prometheus: the demo, scraped by an HA pair of real Prometheus servers.

The demo's ranks record for a few seconds and end; the address server publishes their final values until the
TTL after their last update, and the demo waits for it before it prints its totals.  Both Prometheus servers
then hold, for every rank, the final value the demo counted (Debian's prometheus; .ci/run installs it).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from support import PROJECT_ROOT, child_env, free_port
from support_e2e import reaper
from test_e2e_prometheus import PROMETHEUS, Prometheus

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(PROMETHEUS is None, reason="needs Debian's prometheus")]


def test_the_demos_final_values_reach_both_prometheus_servers_of_an_ha_pair(tmp_path: Path) -> None:
    port = free_port()
    with reaper() as r:
        pair = [Prometheus(r, tmp_path / f"prometheus-{i}", f"127.0.0.1:{port}") for i in range(2)]
        done = subprocess.run(
            [sys.executable, "-m", "app", "demo", "--ranks", "3", "--duration", "4", "--rate", "50", "--port",
             str(port), "--dir", str(tmp_path / "mp")], cwd=PROJECT_ROOT, capture_output=True, text=True,
            env=child_env({"NIXL_TELEMETRY_MP_STALE_TTL": "4"}), timeout=120)
        assert done.returncode == 0, done.stderr
        last = done.stdout.strip().splitlines()[-1]
        counted = int(re.search(r"transfers (\d+)", last).group(1))  # type: ignore[union-attr]
        assert counted > 0 and "departed 3" in last, last
        for prometheus in pair:
            # Each rank's last sample, summed over the ranks: every transfer the demo counted, none missing.
            result = prometheus.query('sum(last_over_time(agent_tx_requests_num_total{job="nixl"}[5m]) '
                                      '+ last_over_time(agent_rx_requests_num_total{job="nixl"}[5m]))')
            assert result and float(result[0]["value"][1]) == counted, (result, last)
