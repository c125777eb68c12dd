"""The fleet path on real engines: pods -> cluster Prometheus (with the rules) -> global Prometheus -> VictoriaMetrics.

Three pods on loopback, each a run directory of its own with its own ranks (3, 2 and 1) and its own endpoint,
are scraped by a cluster Prometheus configured from deploy/prometheus-static.yml with deploy/nixl.rules.yml. A
global Prometheus configured from deploy/prometheus-global.yml federates the recorded pod series and `up` from it
and remote-writes them to VictoriaMetrics. Only intervals, targets, the rules' path and the remote-write URL are
adapted (1 s scrapes and evaluations instead of 15-30 s, so that the whole file runs in well under 90 s).

What it proves:

* the global Prometheus and VictoriaMetrics hold every pod's recorded series, one per pod (told apart by
  ``instance``), each carrying the cluster's ``cluster`` external label;
* the per-pod sums and rank counts are exactly what the pods' ranks recorded, in all three engines;
* every panel of deploy/grafana-dashboard.json returns data from the fleet's (cluster) Prometheus;
* a rank SIGKILLed on one pod changes that pod's series only, once its TTL has passed: its count drops by one
  and its sums by the rank's values in all three engines, while the other pods keep exactly their values.

Debian's ``prometheus`` 2.42 and ``victoria-metrics`` 1.79 (``apt-get install prometheus victoria-metrics``).
"""

from __future__ import annotations

import math
import os
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from support import Proc, Reaper, free_port, get_json, http_get, wait_until
from support_e2e import DEPLOY, expected, spawn_rank, wait_ready
from test_deploy import dashboard, expand_grafana, job_variable
from test_e2e_prometheus import PROMETHEUS, Prometheus, QueryApi, binary, shipped_static_config

VICTORIA_METRICS = binary("victoria-metrics")
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(PROMETHEUS is None or VICTORIA_METRICS is None,
                       reason="needs the prometheus and victoria-metrics binaries (apt-get install prometheus "
                              "victoria-metrics)"),
]

RANKS = {"a": 3, "b": 2, "c": 1}  # pod -> its ranks (local ranks 0..n-1)
KILLED = ("a", 1)  # pod A loses rank 1: 4000/40 left, unlike any other pod's values (rank 2 would leave B's)
TTL_S = "2"  # a departed rank's store is reaped 2 s after its last update
RECORDED = ("pod:nixl_ranks:count", "pod:agent_tx_bytes:sum", "pod:agent_rx_bytes:sum")
# One instant query for a pod's whole state, so that one answer is one evaluation time (the engine's own `up`
# of the federation job is left out by job="nixl": the federated `up` keeps the pods' job through honor_labels).
FLEET_SELECTOR = '{__name__=~"' + "|".join((*RECORDED, "up")) + '",job="nixl"}'
BOUND_S = 60  # every wait's bound: only a hang reaches it

View = dict[str, dict[str, float]]  # pod address (instance) -> {series name: value}


class Engine(QueryApi):
    """One of the fleet's three engines (Prometheus or VictoriaMetrics), named for failure messages."""

    def __init__(self, name: str, url: str) -> None:
        super().__init__(url)
        self.name = name

    def fleet(self) -> list[dict[str, Any]]:
        return self.query(FLEET_SELECTOR)


@dataclass
class Pod:
    name: str
    directory: Path
    port: int
    ranks: list[Proc]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def want(self, gone: tuple[int, ...] = ()) -> dict[str, float]:
        """What the cluster's rules record for this pod, its ranks ``gone`` reaped; and `up`."""
        left = [i for i in range(len(self.ranks)) if i not in gone]
        return {"pod:nixl_ranks:count": float(len(left)), "up": 1.0,
                "pod:agent_tx_bytes:sum": sum(expected(i)["agent_tx_bytes_total"] for i in left),
                "pod:agent_rx_bytes:sum": sum(expected(i)["agent_rx_bytes_total"] for i in left)}


@dataclass
class Fleet:
    pods: dict[str, Pod]
    cluster: Engine
    global_: Engine
    victoria: Engine
    cluster_label: str  # the static config's external label, as shipped

    @property
    def engines(self) -> list[Engine]:
        return [self.cluster, self.global_, self.victoria]

    def want(self) -> View:
        return {pod.address: pod.want() for pod in self.pods.values()}


def view(series: list[dict[str, Any]]) -> View:
    """{instance: {name: value}} of a FLEET_SELECTOR answer."""
    out: View = {}
    for s in series:
        out.setdefault(s["metric"]["instance"], {})[s["metric"]["__name__"]] = float(s["value"][1])
    return out


def complete(values: dict[str, float] | None) -> bool:
    """A pod's state as of a successful scrape: every series there, finite, `up` 1 (a failed scrape marks the
    pod's series stale for a moment; VictoriaMetrics may show a staleness marker as NaN)."""
    return (values is not None and set(values) == {*RECORDED, "up"} and values["up"] == 1.0
            and all(math.isfinite(v) for v in values.values()))


def cluster_rules() -> str:
    """deploy/nixl.rules.yml with its recording group evaluated every second, as the test's scrapes."""
    rules = yaml.safe_load((DEPLOY / "nixl.rules.yml").read_text())
    (recording,) = [g for g in rules["groups"] if g["name"] == "nixl-recording"]
    assert recording["interval"] == "30s", "the shipped recording interval changed: adapt the copy"
    recording["interval"] = "1s"
    return yaml.safe_dump(rules, sort_keys=False)


def global_config(cluster: str, write_url: str) -> dict[str, Any]:
    """deploy/prometheus-global.yml: federating the one cluster Prometheus, remote-writing to ``write_url``."""
    doc = yaml.safe_load((DEPLOY / "prometheus-global.yml").read_text())
    doc["global"].update(scrape_interval="1s", scrape_timeout="800ms", evaluation_interval="1s")
    (job,) = doc["scrape_configs"]
    (static,) = job["static_configs"]
    static["targets"] = [cluster]
    (write,) = doc["remote_write"]
    write["url"] = write_url  # match[], honor_labels, write_relabel_configs and queue_config as shipped
    return doc


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """The three pods, the cluster and global Prometheus servers and VictoriaMetrics, all running."""
    tmp = tmp_path_factory.mktemp("fleet")
    pods = {name: Pod(name, tmp / f"pod-{name}", free_port(), []) for name in RANKS}
    vm_port = free_port()
    with Reaper() as r:
        # Each pod's rank 0 first (it starts the pod's address server); the engines start while they boot.
        for pod in pods.values():
            pod.ranks.append(spawn_rank(r, pod.directory, pod.port, 0, name=f"pod-{pod.name}-0",
                                    NIXL_TELEMETRY_MP_STALE_TTL=TTL_S))
        assert VICTORIA_METRICS is not None
        (tmp / "vm").mkdir()
        # -search.latencyOffset=0s: VictoriaMetrics hides the last 30 s of samples by default.
        vm_proc = r.spawn([VICTORIA_METRICS, f"-storageDataPath={tmp / 'vm'}", f"-httpListenAddr=127.0.0.1:{vm_port}",
                           "-search.latencyOffset=0s", "-loggerLevel=WARN"], dict(os.environ), cwd=tmp)
        cluster = Prometheus(r, tmp / "cluster", config=shipped_static_config([p.address for p in pods.values()]),
                             files={"nixl.rules.yml": cluster_rules()})
        global_ = Prometheus(r, tmp / "global", config=global_config(
            f"127.0.0.1:{cluster.port}", f"http://127.0.0.1:{vm_port}/api/v1/write"))
        wait_until(lambda: http_get(f"http://127.0.0.1:{vm_port}/health", timeout=1).status == 200, BOUND_S,
                   lambda: f"VictoriaMetrics to be ready; output:\n{vm_proc.output[-2000:]}")

        for pod in pods.values():
            assert wait_ready(pod.ranks[0], timeout=BOUND_S) is True, f"pod {pod.name}: rank 0 serves"
        for pod in pods.values():
            pod.ranks += [spawn_rank(r, pod.directory, pod.port, i, name=f"pod-{pod.name}-{i}",
                                 NIXL_TELEMETRY_MP_STALE_TTL=TTL_S) for i in range(1, RANKS[pod.name])]
        for pod in pods.values():
            assert [wait_ready(p, timeout=BOUND_S) for p in pod.ranks[1:]] == [False] * (len(pod.ranks) - 1)

        shipped = yaml.safe_load((DEPLOY / "prometheus-static.yml").read_text())["global"]["external_labels"]
        yield Fleet(pods, Engine("cluster Prometheus", cluster.url), Engine("global Prometheus", global_.url),
                    Engine("VictoriaMetrics", f"http://127.0.0.1:{vm_port}"), shipped["cluster"])


def describe(fleet: Fleet) -> str:
    """Each engine's view and the cluster's targets, for a failed wait."""
    lines = []
    for engine in fleet.engines:
        try:
            lines.append(f"{engine.name}: {view(engine.fleet())}")
        except (OSError, AssertionError, ValueError) as exc:
            lines.append(f"{engine.name}: {exc!r}")
    targets = get_json(f"{fleet.cluster.url}/api/v1/targets")["data"]["activeTargets"]
    lines += [f"target {t['labels']['instance']}: {t['health']} {t['lastError']!r}" for t in targets]
    return "\n".join(lines)


def answer_when(fleet: Fleet, engine: Engine, holds: Callable[[View], bool], what: str) -> list[dict[str, Any]]:
    """The engine's first FLEET_SELECTOR answer whose view ``holds``."""

    def probe() -> list[dict[str, Any]] | None:
        series = engine.fleet()
        return series if holds(view(series)) else None

    return wait_until(probe, BOUND_S, lambda: f"{what} in {engine.name}:\n{describe(fleet)}")


def test_global_and_victoriametrics_hold_each_pods_series_with_its_cluster_label(fleet: Fleet) -> None:
    addresses = {pod.address for pod in fleet.pods.values()}
    for engine in (fleet.global_, fleet.victoria):
        series = answer_when(fleet, engine, lambda v: all(complete(v.get(a)) for a in addresses), "every pod's series")
        # One series per name and pod, told apart by instance alone, each labelled with the cluster it came from.
        keys = sorted((s["metric"]["__name__"], s["metric"]["instance"]) for s in series)
        assert keys == sorted((n, a) for n in (*RECORDED, "up") for a in addresses), (engine.name, series)
        for s in series:
            labels = dict(s["metric"])
            assert labels.pop("cluster", None) == fleet.cluster_label, (engine.name, s)
            if engine is fleet.victoria:  # written by the global Prometheus: its own external label too
                assert labels.pop("federation", None) == "global", s
            assert set(labels) == {"__name__", "job", "instance"} and labels["job"] == "nixl", (engine.name, s)


def test_pod_sums_and_counts_equal_what_each_pods_ranks_recorded(fleet: Fleet) -> None:
    want = fleet.want()
    for engine in fleet.engines:  # exact equality, once propagated: scrape, rules, federation, remote write
        answer_when(fleet, engine, lambda v: v == want, f"the values {want}")
    # Each pod's endpoint serves its own ranks, and only them (distinct agent names per pod): a wait, as a failed
    # scrape hides a pod's series for a moment; a rank served by the wrong pod would never match.
    agents = {pod.address: {f"pod-{pod.name}-{i}" for i in range(RANKS[pod.name])} for pod in fleet.pods.values()}

    def served() -> dict[str, set[str]]:
        names: dict[str, set[str]] = {}
        for s in fleet.cluster.query('agent_tx_bytes_total{job="nixl"}'):
            names.setdefault(s["metric"]["instance"], set()).add(s["metric"]["agent_name"])
        return names

    wait_until(lambda: served() == agents, BOUND_S, lambda: f"the cluster's raw series of {agents}: {served()}")


def test_every_dashboard_panel_returns_data_from_the_fleets_prometheus(fleet: Fleet) -> None:
    """deploy/grafana-dashboard.json against the cluster Prometheus that scrapes the fleet and records the rules."""
    prom = fleet.cluster
    ranks = sum(RANKS.values())
    # A 10 s rate needs two samples of every series inside its window (1 s scrapes).
    wait_until(lambda: len(prom.query("rate(agent_xfer_time_us_count[10s])")) == ranks, BOUND_S,
               lambda: f"two samples of each of the {ranks} ranks:\n{describe(fleet)}")
    jobs = prom.label_values(job_variable()["query"]["query"])
    assert jobs == ["nixl"]
    empty = []
    for panel in dashboard()["panels"]:
        for target in panel.get("targets", []):
            expr = expand_grafana(target["expr"], tuple(jobs), rate_interval="10s")
            if not prom.query(expr):
                empty.append(f"{panel['title']}: {expr}")
    assert empty == [], "panels without data:\n" + "\n".join(empty)


def test_a_rank_killed_on_one_pod_changes_only_that_pods_series_everywhere(fleet: Fleet) -> None:
    """Last: it changes the fleet. The killed rank's store is reaped after its TTL; in each engine, pod A's count
    drops by one and its sums by the rank's values, and pods B and C keep exactly theirs throughout."""
    before = fleet.want()
    for engine in fleet.engines:
        answer_when(fleet, engine, lambda v: v == before, f"the values before the kill {before}")
    pod_name, rank = KILLED
    pod = fleet.pods[pod_name]
    others = [p.address for p in fleet.pods.values() if p is not pod]
    after = pod.want(gone=(rank,))
    assert after != before[pod.address] and all(after != before[a] for a in others)

    victim = pod.ranks[rank]
    victim.killpg(signal.SIGKILL)
    victim.popen.wait(timeout=10)

    seen: dict[str, View] = {}  # engine -> its first answer with pod A's new values
    off: list[str] = []  # any answer in which pod B or C, scraped, had other values than before

    def changed() -> bool:
        for engine in fleet.engines:
            if engine.name in seen:
                continue
            now = view(engine.fleet())
            off.extend(f"{engine.name}: {a} {now[a]}" for a in others if complete(now.get(a)) and now[a] != before[a])
            if now.get(pod.address) == after and all(complete(now.get(a)) for a in others):
                seen[engine.name] = now
        return len(seen) == len(fleet.engines)

    wait_until(changed, BOUND_S, lambda: f"pod {pod_name}'s new values {after} in every engine (seen in "
               f"{sorted(seen)}):\n{describe(fleet)}")
    assert off == []
    for name, now in seen.items():
        assert {a: now[a] for a in others} == {a: before[a] for a in others}, name
    # The raw series agree: the killed rank's series is gone from the cluster (for good: its store was reaped),
    # every other rank's is there.
    survivors = {f"pod-{p.name}-{i}" for p in fleet.pods.values() for i in range(RANKS[p.name])} - {
        f"pod-{pod_name}-{rank}"}
    wait_until(lambda: {s["metric"]["agent_name"] for s in fleet.cluster.query('agent_tx_bytes_total{job="nixl"}')}
               == survivors, BOUND_S, lambda: f"the cluster's raw series of {sorted(survivors)}:\n{describe(fleet)}")
