"""deploy/: the Kubernetes manifests, the Prometheus configurations and rules, the Grafana dashboard.

Every *.yaml in deploy/ is a Kubernetes manifest, validated against the
newest Kubernetes schema kubernetes-validate ships (strict: unknown fields
are errors). The PodMonitor and PrometheusRule are CRDs that
kubernetes-validate cannot know; their structure is checked here against
what the Prometheus Operator requires. The *.yml files are Prometheus's:
configurations (promtool check config) and rules (promtool check rules,
and the unit tests of nixl.rules.test.yml with promtool test rules).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from support import Reaper, free_port, get_json, http_get, wait_until
from support_e2e import DEPLOY, REPO, procfile_web_command, rank_env

from app.config import DEFAULT_DRAIN_MAX_S, DRAIN_ENV, TTL_ENV
from app.exposition import ENDPOINT_FAMILIES
from store.metrics import FAMILIES

MOUNT = "/run/nixl_metrics"
DIR_ENV = "NIXL_TELEMETRY_MULTIPROC_DIR"
PORT_ENV = "NIXL_TELEMETRY_PROMETHEUS_PORT"
CRDS = {("monitoring.coreos.com/v1", "PodMonitor"), ("monitoring.coreos.com/v1", "PrometheusRule")}
DURATION = re.compile(r"^(\d+(ms|s|m|h))+$")


def manifests() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                docs.append((path.name, doc))
    return docs


def of_kind(kind: str) -> list[dict[str, Any]]:
    return [doc for _, doc in manifests() if doc["kind"] == kind]


def pod_specs() -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(workload name, pod template metadata, pod spec) of every workload in deploy/."""
    for _, doc in manifests():
        if doc["kind"] in {"Deployment", "StatefulSet", "DaemonSet", "Job"}:
            yield doc["metadata"]["name"], doc["spec"]["template"]["metadata"], doc["spec"]["template"]["spec"]
        elif doc["kind"] == "Pod":
            yield doc["metadata"]["name"], doc["metadata"], doc["spec"]


def containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return list(spec.get("initContainers", [])) + list(spec["containers"])


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def aggregator(spec: dict[str, Any]) -> dict[str, Any]:
    """The one container running the Procfile's web: command."""
    found = [c for c in containers(spec) if "app:wsgi" in c.get("command", []) + c.get("args", [])]
    assert len(found) == 1, [c["name"] for c in found]
    return found[0]


def metrics_port(container: dict[str, Any]) -> dict[str, Any]:
    ports = [p for p in container.get("ports", []) if p.get("name") == "metrics"]
    assert len(ports) == 1, container.get("ports")
    return ports[0]


def seconds(duration: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    assert DURATION.match(duration), duration
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+)(ms|s|m|h)", duration))


# -- the manifests ------------------------------------------------------------

def test_deploy_has_the_expected_files() -> None:
    kinds = sorted(doc["kind"] for _, doc in manifests())
    assert kinds == ["Deployment", "NetworkPolicy", "PodMonitor", "PrometheusRule", "Service"]
    for name in ("prometheus.yml", "prometheus-static.yml", "prometheus-global.yml", "nixl.rules.yml",
                 "nixl.rules.test.yml", "grafana-dashboard.json"):
        assert (DEPLOY / name).is_file(), name


@pytest.mark.parametrize("name,doc", [pytest.param(n, d, id=f"{n}:{d['kind']}") for n, d in manifests()])
def test_manifest_validates_against_kubernetes_schema(name: str, doc: dict[str, Any]) -> None:
    if (doc["apiVersion"], doc["kind"]) in CRDS:
        pytest.skip("a CRD: kubernetes-validate has no schema for it (test_podmonitor_structure and "
                    "test_prometheusrule_carries_the_rules_file check it)")
    version = kubernetes_validate.latest_version()
    kubernetes_validate.validate(doc, version, strict=True)  # raises ValidationError naming the field


def test_every_container_shares_the_directory_and_the_address() -> None:
    specs = list(pod_specs())
    assert specs
    for workload, _, spec in specs:
        volumes = {v["name"]: v for v in spec["volumes"]}
        shared = [name for name, v in volumes.items() if v.get("emptyDir", {}).get("medium") == "Memory"]
        assert len(shared) == 1, f"{workload}: one Memory emptyDir shared by the ranks"
        dirs, ports, locals_ = set(), set(), set()
        for c in containers(spec):
            env = env_of(c)
            assert env.get(DIR_ENV), f"{workload}/{c['name']}: {DIR_ENV} unset"
            mounts = [m for m in c.get("volumeMounts", []) if m["name"] == shared[0]]
            assert [m["mountPath"] for m in mounts] == [MOUNT], f"{workload}/{c['name']}: not mounted at {MOUNT}"
            assert not mounts[0].get("readOnly", False)
            assert env[DIR_ENV] == MOUNT or env[DIR_ENV].startswith(MOUNT + "/"), env[DIR_ENV]
            dirs.add(env[DIR_ENV])
            ports.add(env.get(PORT_ENV))
            locals_.add(env.get("NIXL_TELEMETRY_PROMETHEUS_LOCAL"))
        # One directory, one address: otherwise the ranks would not contend for the aggregator's election.
        assert len(dirs) == 1 and len(ports) == 1 and len(locals_) == 1, (dirs, ports, locals_)
        assert ports != {None}, f"every container sets {PORT_ENV}"


def test_pod_runs_as_one_non_root_user() -> None:
    for workload, _, spec in pod_specs():
        ctx = spec["securityContext"]
        assert ctx["runAsNonRoot"] is True, workload
        assert ctx["runAsUser"] > 0 and ctx["runAsGroup"] > 0 and ctx["fsGroup"] > 0, ctx
        for c in containers(spec):  # nobody overrides the user: the 0700 directory is the run's
            assert "runAsUser" not in c.get("securityContext", {}), c["name"]
            assert c.get("securityContext", {}).get("allowPrivilegeEscalation") is False, c["name"]


QUANTITY = re.compile(r"^(\d+(?:\.\d+)?)(m|k|M|G|Ki|Mi|Gi)?$")
UNITS = {None: 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}


def quantity(text: str | int) -> float:
    """A Kubernetes resource quantity (the forms these manifests use) as a number."""
    match = QUANTITY.match(str(text))
    assert match, text
    return float(match.group(1)) * UNITS[match.group(2)]


def test_quantity() -> None:
    assert (quantity("50m"), quantity(2), quantity("64Mi"), quantity("1Gi")) == (0.05, 2, 64 * 2**20, 2**30)


def test_every_container_has_resource_requests_and_limits() -> None:
    """Without them a namespace's LimitRange or quota policy refuses the pod, or it is first to be evicted."""
    for workload, _, spec in pod_specs():
        for c in containers(spec):
            resources = c.get("resources", {})
            for resource in ("cpu", "memory"):
                request = resources.get("requests", {}).get(resource)
                limit = resources.get("limits", {}).get(resource)
                assert request and limit, f"{workload}/{c['name']}: {resource} request and limit"
                assert quantity(request) <= quantity(limit), (workload, c["name"], resource)
        agg = aggregator(spec)["resources"]
        # At least the aggregator's measured PSS (51 MiB, the comment in nixl-ranks.yaml) and twice its peak RSS.
        assert quantity(agg["requests"]["memory"]) >= 51 * 2**20 and quantity(agg["limits"]["memory"]) >= 2 * 97 * 2**20


def test_every_container_has_a_read_only_root_and_the_aggregator_a_writable_tmp() -> None:
    """gunicorn found no usable temporary directory under readOnlyRootFilesystem: /dev/shm, else this /tmp."""
    for workload, _, spec in pod_specs():
        for c in containers(spec):
            assert c.get("securityContext", {}).get("readOnlyRootFilesystem") is True, f"{workload}/{c['name']}"
        volumes = {v["name"]: v for v in spec["volumes"]}
        (tmp,) = [m for m in aggregator(spec).get("volumeMounts", []) if m["mountPath"] == "/tmp"]
        assert "emptyDir" in volumes[tmp["name"]] and not tmp.get("readOnly", False), tmp


def test_aggregator_sidecar_runs_the_procfile_web_command() -> None:
    for _, _, spec in pod_specs():
        agg = aggregator(spec)
        assert agg.get("command", []) + agg.get("args", []) == procfile_web_command()
        if agg in spec.get("initContainers", []):
            assert agg.get("restartPolicy") == "Always", "an init container aggregator must be a native sidecar"


def test_the_pods_commands_run_as_given(tmp_path: Path) -> None:
    """Every container's args, run here with its own environment (only the directory and the port moved): the
    aggregator serves, and each rank container's command is a rank it publishes, under the container's name."""
    for workload, _, spec in pod_specs():
        run_pod(spec, tmp_path / workload / "mp", free_port())


def run_pod(spec: dict[str, Any], directory: Path, port: int) -> None:
    """The pod's containers as processes of this host, in the pod's order (the sidecar first), until the
    aggregator publishes every rank."""
    names = {c["args"][c["args"].index("--name") + 1] for c in containers(spec) if "--name" in c["args"]}
    assert len(names) == len(containers(spec)) - 1, names  # every container but the aggregator: a rank

    def published() -> set[str]:
        return {rank["agent_name"] for rank in get_json(f"http://127.0.0.1:{port}/healthz", timeout=2)["live"]}

    with Reaper() as r:
        for container in containers(spec):
            env = {**rank_env(directory, port), **env_of(container), DIR_ENV: str(directory), PORT_ENV: str(port)}
            if "NIXL_TELEMETRY_PROMETHEUS_LOCAL" not in env_of(container):
                del env["NIXL_TELEMETRY_PROMETHEUS_LOCAL"]  # as in the pod: every interface
            proc = r.spawn([sys.executable if arg == "python" else arg for arg in container["args"]], env)
            if container is aggregator(spec):
                wait_until(lambda: http_get(f"http://127.0.0.1:{port}/healthz", timeout=2).status == 200, 30,
                           lambda p=proc: f"the aggregator to serve:\n{p.output}")  # type: ignore[misc]
        wait_until(lambda: published() == names, 30, lambda: f"{names} on the aggregator's /healthz: {published()}")


def test_every_container_runs_under_the_images_init_and_the_grace_period_covers_the_drain() -> None:
    """A container's command: replaces the image's entrypoint (tini), and with it the reaping of the address
    servers that end in the container: deploy/ gives args only.  The grace period covers the ranks' shutdown
    (10 s) then the aggregator's drain (the TTL, at most the drain's maximum)."""
    for path, _, spec in pod_specs():
        for container in containers(spec):
            assert "command" not in container and container.get("args"), (path, container["name"])
        agg = env_of(aggregator(spec))
        drain_s = min(float(agg[TTL_ENV]), float(agg.get(DRAIN_ENV, DEFAULT_DRAIN_MAX_S)))
        assert spec["terminationGracePeriodSeconds"] >= 10 + drain_s + 5, path


def test_aggregator_probes_healthz_on_the_metrics_port() -> None:
    for _, _, spec in pod_specs():
        agg = aggregator(spec)
        port = metrics_port(agg)
        assert str(port["containerPort"]) == env_of(agg)[PORT_ENV]
        for probe in ("livenessProbe", "readinessProbe"):
            get = agg[probe]["httpGet"]
            assert get["path"] == "/healthz", probe
            assert get["port"] in (port["name"], port["containerPort"]), probe
            assert get.get("scheme", "HTTP") == "HTTP"
        if "startupProbe" in agg:
            assert agg["startupProbe"]["httpGet"]["path"] == "/healthz"
        # Only the aggregator declares the port: one scrape target per pod.
        others = [c["name"] for c in containers(spec) if c is not agg and c.get("ports")]
        assert others == []


def test_service_exposes_the_metrics_port() -> None:
    (service,) = of_kind("Service")
    for _, template, spec in pod_specs():
        labels = template["labels"]
        assert all(labels.get(k) == v for k, v in service["spec"]["selector"].items())
        port = metrics_port(aggregator(spec))
        (svc_port,) = [p for p in service["spec"]["ports"] if p["name"] == "metrics"]
        assert svc_port["targetPort"] in (port["name"], port["containerPort"])


def test_podmonitor_structure() -> None:
    (pm,) = of_kind("PodMonitor")
    assert pm["apiVersion"] == "monitoring.coreos.com/v1"
    assert pm["metadata"]["name"]
    assert set(pm) <= {"apiVersion", "kind", "metadata", "spec"}
    spec = pm["spec"]
    assert isinstance(spec["selector"], dict) and set(spec["selector"]) <= {"matchLabels", "matchExpressions"}
    assert spec["selector"], "an empty selector would select every pod of the namespace"
    endpoints = spec["podMetricsEndpoints"]
    assert isinstance(endpoints, list) and endpoints
    for _, template, pod_spec in pod_specs():
        labels = template["labels"]
        assert all(labels.get(k) == v for k, v in spec["selector"].get("matchLabels", {}).items())
        ttl = float(env_of(aggregator(pod_spec)).get("NIXL_TELEMETRY_MP_STALE_TTL") or 30)
        for ep in endpoints:
            assert ep["port"] == metrics_port(aggregator(pod_spec))["name"]
            assert ep["path"] == "/metrics"
            interval = seconds(ep["interval"])
            if "scrapeTimeout" in ep:
                assert seconds(ep["scrapeTimeout"]) < interval
            assert ttl >= interval, "keep the stale TTL at or above the scrape interval"


# What kube-prometheus-stack's Prometheus selects Operator objects by, unless its values say otherwise.
HELM_SELECTED = {"PodMonitor": "podMonitorSelectorNilUsesHelmValues", "PrometheusRule": "ruleSelectorNilUsesHelmValues"}


def test_operator_objects_carry_the_label_kube_prometheus_stack_selects() -> None:
    """Without ``release: <Helm release>`` its Prometheus ignored both: no target, no rule, no error."""
    kubernetes = (REPO / "docs" / "operations.md").read_text().split("\n## Kubernetes\n", 1)[1].split("\n## ", 1)[0]
    kubernetes = " ".join(kubernetes.split())
    for name, doc in manifests():
        if doc["kind"] not in HELM_SELECTED:
            continue
        release = doc["metadata"]["labels"].get("release")
        assert release, f"{name}: no release label"
        setting = f"prometheus.prometheusSpec.{HELM_SELECTED[doc['kind']]}=false"
        # Where to change it, or how to do without it: beside the label, and in the operations page.
        assert setting in (DEPLOY / name).read_text(), name
        assert f"`{name}`" in kubernetes and f"`release: {release}`" in kubernetes and f"`{setting}`" in kubernetes


# -- the plain Prometheus configuration -------------------------------------------

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (apt-get install "
                                    "prometheus; .ci/run does)")
NO_K8S_SD = "field kubernetes_sd_configs not found"


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60)


@needs_promtool
@pytest.mark.parametrize("name", ["prometheus.yml", "prometheus-static.yml", "prometheus-global.yml"])
def test_prometheus_config_passes_promtool(tmp_path: Path, name: str) -> None:
    config = DEPLOY / name
    done = promtool("check", "config", str(config))
    if done.returncode != 0 and NO_K8S_SD in done.stdout + done.stderr:
        # Debian's Prometheus is built without Kubernetes service discovery, so its promtool cannot
        # parse kubernetes_sd_configs at all. Check everything else promtool can: the same job with
        # the discovery swapped for file_sd_configs (relabelling, intervals, timeouts, rules all kept).
        doc = yaml.safe_load(config.read_text())
        for job in doc["scrape_configs"]:
            if job.pop("kubernetes_sd_configs", None) is not None:
                job["file_sd_configs"] = [{"files": [str(tmp_path / "targets.json")]}]
        doc["rule_files"] = [str(DEPLOY / f) for f in doc.get("rule_files", [])]
        (tmp_path / "targets.json").write_text("[]")
        (tmp_path / name).write_text(yaml.safe_dump(doc))
        done = promtool("check", "config", str(tmp_path / name))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout + done.stderr
    if name != "prometheus-global.yml":  # the rules are loaded, and checked with the configuration
        rules = sum(len(group["rules"]) for group in rules_file()["groups"])
        assert f"SUCCESS: {rules} rules found" in done.stdout + done.stderr, done.stdout + done.stderr


def test_global_prometheus_federates_the_recorded_series() -> None:
    doc = yaml.safe_load((DEPLOY / "prometheus-global.yml").read_text())
    (job,) = doc["scrape_configs"]
    assert job["metrics_path"] == "/federate" and job["honor_labels"] is True
    recorded = {r["record"] for g in rules_file()["groups"] for r in g["rules"] if "record" in r}
    matchers = job["params"]["match[]"]
    name_regex = re.fullmatch(r'\{__name__=~"(.+)"\}', matchers[0]).group(1)
    assert {r for r in recorded if re.fullmatch(name_regex, r)} == recorded
    assert matchers[1].startswith("up{")
    (write,) = doc["remote_write"]
    (keep,) = write["write_relabel_configs"]
    assert all(re.fullmatch(keep["regex"], r) for r in recorded | {"up"})
    local = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    assert local["global"]["external_labels"]["cluster"], "each cluster's series must say which cluster"


def test_prometheus_config_discovers_the_aggregator_port() -> None:
    doc = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    (job,) = [j for j in doc["scrape_configs"] if j["job_name"] == "nixl"]
    assert job["kubernetes_sd_configs"] == [{"role": "pod"}]
    assert seconds(job["scrape_timeout"]) < seconds(job["scrape_interval"])
    keeps = {tuple(r["source_labels"]): r["regex"] for r in job["relabel_configs"] if r.get("action") == "keep"}
    for _, template, spec in pod_specs():
        annotation = keeps[("__meta_kubernetes_pod_annotation_prometheus_io_scrape",)]
        assert re.fullmatch(annotation, template["annotations"]["prometheus.io/scrape"])
        port_name = keeps[("__meta_kubernetes_pod_container_port_name",)]
        assert re.fullmatch(port_name, metrics_port(aggregator(spec))["name"])
        ttl = float(env_of(aggregator(spec)).get("NIXL_TELEMETRY_MP_STALE_TTL") or 30)
        assert ttl >= seconds(job["scrape_interval"])


# -- rules --------------------------------------------------------------------------------

def rules_file() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "nixl.rules.yml").read_text())


def test_prometheusrule_carries_the_rules_file() -> None:
    (rule,) = of_kind("PrometheusRule")
    assert set(rule) == {"apiVersion", "kind", "metadata", "spec"} and rule["metadata"]["name"]
    assert rule["spec"] == rules_file()


def test_rules_cover_what_operators_alert_on() -> None:
    rules = [r for g in rules_file()["groups"] for r in g["rules"]]
    alerts = {r["alert"]: r for r in rules if "alert" in r}
    assert set(alerts) == {"NixlMetricsEndpointDown", "NixlRankDeparted", "NixlTransferErrors",
                           "NixlTelemetryEventsDropped"}
    recorded = {r["record"]: r["expr"] for r in rules if "record" in r}
    for name in ("pod:agent_xfer_time_us:p50_5m", "pod:agent_xfer_time_us:p90_5m", "pod:agent_xfer_time_us:p99_5m"):
        assert "sum by (job, namespace, pod, instance, le) (rate(agent_xfer_time_us_bucket" in recorded[name]
    referenced = set().union(*(metric_names(r["expr"]) for r in rules))
    assert referenced - known_metric_names() - set(recorded) == set()
    # An endpoint that stays down is 4+ scrape intervals (15 s), not a takeover's sub-second gap.
    assert seconds(alerts["NixlMetricsEndpointDown"]["for"]) >= 4 * 15


def test_every_alerts_text_reads_well_with_or_without_a_pod() -> None:
    """The unit tests render every alert where a scrape configuration gives no namespace or pod (a plain host's
    static target) and, for an alert whose text can name the pod, where it does (Kubernetes discovery); promtool
    checks each rendered text exactly, and none has an empty "()" or "(/)"."""
    tests = yaml.safe_load((DEPLOY / "nixl.rules.test.yml").read_text())["tests"]
    rendered = [(case["alertname"], alert["exp_labels"], alert["exp_annotations"])
                for test in tests for case in test.get("alert_rule_test", []) for alert in case["exp_alerts"]]
    alerts = {r["alert"]: r for g in rules_file()["groups"] for r in g["rules"] if "alert" in r}
    for name, rule in alerts.items():
        cases = [(labels, texts) for alert, labels, texts in rendered if alert == name]
        assert any("pod" not in labels and "namespace" not in labels for labels, _ in cases), f"{name}: no plain host"
        if any("$labels.pod" in text for text in rule["annotations"].values()):
            assert any("pod" in labels for labels, _ in cases), f"{name}: never rendered with a pod"
        for labels, texts in cases:
            assert set(texts) == set(rule["annotations"]), (name, labels)
            for key, text in texts.items():
                assert "()" not in text and "(/)" not in text and "{{" not in text, (name, labels, text)
                if "pod" in labels and "$labels.pod" in rule["annotations"][key]:
                    assert f"(pod {labels['namespace']}/{labels['pod']})" in text, (name, labels, text)


def test_the_endpoint_down_alert_tells_a_job_end_from_a_broken_endpoint() -> None:
    """NixlMetricsEndpointDown excuses a down target whose endpoint last said its job ended (no rank live, ranks
    departed), carried for as long as the target stays down, and not one whose scrapes time out."""
    rules = {r.get("alert") or r["record"]: r for g in rules_file()["groups"] for r in g["rules"]}
    down = " ".join(rules["NixlMetricsEndpointDown"]["expr"].split())
    assert "unless on (job, namespace, pod, instance) (pod:nixl_job_ended:last == 1)" in down
    assert "scrape_duration_seconds{" in down and "> 0.5" in down
    ended = " ".join(rules["pod:nixl_job_ended:last"]["expr"].split())
    assert 'nixl_prometheus_mp_ranks{state="live"}' in ended and 'nixl_prometheus_mp_ranks{state="departed"}' in ended
    assert "last_over_time(pod:nixl_job_ended:last[" in ended and "(up == 0)" in ended  # the carry, while down


@needs_promtool
def test_rules_pass_promtool_check_and_their_unit_tests() -> None:
    done = promtool("check", "rules", str(DEPLOY / "nixl.rules.yml"))
    assert done.returncode == 0, done.stdout + done.stderr
    done = promtool("test", "rules", str(DEPLOY / "nixl.rules.test.yml"))
    assert done.returncode == 0 and "SUCCESS" in done.stdout, done.stdout + done.stderr


# -- who may read it -------------------------------------------------------------------------

def covers(rule_port: dict[str, Any], port: int, protocol: str = "TCP") -> bool:
    if rule_port.get("protocol", "TCP") != protocol:
        return False
    return rule_port["port"] <= port <= rule_port.get("endPort", rule_port["port"])


def test_networkpolicy_admits_only_prometheus_to_the_metrics_port() -> None:
    (policy,) = of_kind("NetworkPolicy")
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"]
    for _, template, pod_spec in pod_specs():
        assert all(template["labels"].get(k) == v for k, v in spec["podSelector"]["matchLabels"].items())
        port = int(metrics_port(aggregator(pod_spec))["containerPort"])
        admitting = [rule for rule in spec["ingress"]
                     if "ports" not in rule or any(covers(p, port) for p in rule["ports"])]
        (rule,) = admitting  # one rule opens the metrics port ...
        assert [covers(p, port) for p in rule["ports"]] == [True]
        (peer,) = rule["from"]  # ... to Prometheus pods only (both selectors: AND)
        assert peer["podSelector"]["matchLabels"] and peer["namespaceSelector"]["matchLabels"]
        assert "ipBlock" not in peer
        # every other TCP port stays open (the ranks' own traffic), so the policy only closes the metrics port
        others = [p for r in spec["ingress"] if r is not rule for p in r["ports"]]
        assert all(any(covers(p, n) for p in others) for n in (1, port - 1, port + 1, 65535))


# -- the Grafana dashboard ------------------------------------------------------------

def dashboard() -> dict[str, Any]:
    return json.loads((DEPLOY / "grafana-dashboard.json").read_text())


def dashboard_exprs() -> list[str]:
    doc = dashboard()
    exprs = [t["expr"] for p in doc["panels"] for t in p.get("targets", [])]
    for var in doc["templating"]["list"]:
        if var["type"] == "query":
            exprs.append(var["query"]["query"] if isinstance(var["query"], dict) else var["query"])
    return exprs


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression (or label_values() query) references."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range selectors
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)  # label lists
    expr = re.sub(r"label_values\(\s*([a-zA-Z_:][\w:]*)\s*,\s*\w+\s*\)", r"\1", expr)
    names = set()
    for match in re.finditer(r"[a-zA-Z_:][\w:]*", expr):
        word, rest = match.group(), expr[match.end():].lstrip()
        if rest.startswith("(") or word in {"and", "or", "unless", "bool", "offset", "group_left", "group_right"}:
            continue  # a function or an operator
        names.add(word)
    return names


def known_metric_names() -> set[str]:
    # Prometheus's own series of every scrape, and the endpoint's own families (what it knows of the job)
    names = {"up", "scrape_duration_seconds", *(name for name, _ in ENDPOINT_FAMILIES)}
    for fam in FAMILIES:
        if fam.kind == "histogram":
            names |= {f"{fam.name}_bucket", f"{fam.name}_sum", f"{fam.name}_count"}
        else:
            names.add(fam.name)
    return names


def test_metric_name_extraction() -> None:
    assert metric_names('histogram_quantile(0.9, sum by (le, local_rank) (rate(agent_xfer_time_us_bucket'
                        '{job=~"$job",agent_name="x"}[$__rate_interval])))') == {"agent_xfer_time_us_bucket"}
    assert metric_names("sum(up{job=~\"$job\"}) / count(agent_tx_bytes_total)") == {"up", "agent_tx_bytes_total"}
    assert metric_names("label_values(agent_rx_bytes_total, job)") == {"agent_rx_bytes_total"}


def test_dashboard_uses_only_exported_metric_names() -> None:
    referenced = set().union(*(metric_names(e) for e in dashboard_exprs()))
    assert referenced - known_metric_names() == set()
    # the panels the operators asked for
    assert {"agent_tx_bytes_total", "agent_rx_bytes_total", "agent_xfer_time_us_bucket", "agent_errors_total",
            "up"} <= referenced


def test_dashboard_panels() -> None:
    doc = dashboard()
    assert doc["uid"] and doc["title"] and isinstance(doc["schemaVersion"], int)
    exprs = dashboard_exprs()
    assert any("histogram_quantile(" in e and "rate(agent_xfer_time_us_bucket" in e for e in exprs)
    assert any(re.search(r"by \([^)]*\) \(rate\(agent_tx_bytes_total", e) for e in exprs)
    assert any(re.search(r"by \([^)]*\) \(rate\(agent_rx_bytes_total", e) for e in exprs)
    assert any(re.search(r"by \(status\) \(rate\(agent_errors_total", e) for e in exprs)
    assert any(e.startswith("count(agent_") for e in exprs) and any("up{" in e for e in exprs)
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    for p in doc["panels"]:
        for t in p.get("targets", []):
            assert t["datasource"]["uid"] == "${datasource}"


RANK_KEY = {"instance", "hostname", "agent_name", "agent_instance", "local_rank"}


def test_per_rank_panels_group_by_what_identifies_a_rank_across_pods() -> None:
    """Not by local_rank alone: that merges rank N of every pod, and every rank without LOCAL_RANK."""
    per_rank = [(p["title"], t) for p in dashboard()["panels"] if re.search(r"\b(per|by) rank\b", p["title"])
                for t in p.get("targets", [])]
    assert len(per_rank) >= 8
    for title, target in per_rank:
        clauses = [set(c.replace(" ", "").split(",")) - {"le"}
                   for c in re.findall(r"\bby \(([^)]*)\)", target["expr"])]
        assert clauses and all(c == RANK_KEY for c in clauses), (title, target["expr"])
        # The legend names the rank with labels every series has (no {{pod}}: empty with a static scrape config).
        legend = set(re.findall(r"\{\{(\w+)\}\}", target["legendFormat"]))
        assert {"hostname", "agent_name"} <= legend <= RANK_KEY, (title, target["legendFormat"])
    for panel in dashboard()["panels"]:
        for target in panel.get("targets", []):
            for label in re.findall(r"\{\{(\w+)\}\}", target.get("legendFormat", "")):
                if label == "pod":  # only beside a label every target has
                    assert "{{instance}}" in target["legendFormat"], target["legendFormat"]


@needs_promtool
def test_dashboard_queries_parse(tmp_path: Path) -> None:
    """promtool check rules parses every panel query as PromQL."""
    rules = [{"record": f"nixl:dashboard:{i}", "expr": expand_grafana(e)}
             for i, e in enumerate(dashboard_exprs()) if not e.startswith("label_values(")]
    (tmp_path / "rules.yml").write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    done = promtool("check", "rules", str(tmp_path / "rules.yml"))
    assert done.returncode == 0, done.stdout + done.stderr


def job_variable() -> dict[str, Any]:
    (var,) = [v for v in dashboard()["templating"]["list"] if v["name"] == "job"]
    return var


def grafana_all(var: dict[str, Any], values: list[str]) -> str:
    """What Grafana's Prometheus data source puts for a multi-value variable set to All, in a regex matcher.

    Its custom all value if it has one, else the values its query found,
    regex-escaped inside a PromQL string and joined as an alternation (one
    value stands alone).
    """
    if var.get("allValue"):
        return str(var["allValue"])
    escaped = [re.sub(r"[$^*{}\[\]'+?.()|]", lambda m: "\\\\" + m.group(), v.replace("\\", "\\\\\\\\"))
               for v in values]
    return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"


def expand_grafana(expr: str, jobs: tuple[str, ...] = ("nixl",), rate_interval: str = "1m") -> str:
    """A dashboard query as Grafana sends it with the job variable at its default, All (of ``jobs``)."""
    return expr.replace("$__rate_interval", rate_interval).replace("$job", grafana_all(job_variable(), list(jobs)))


def test_grafana_all_matches_only_the_jobs_found() -> None:
    var = {"name": "job", "includeAll": True, "multi": True, "allValue": None}
    assert grafana_all(var, ["nixl"]) == "nixl"
    assert grafana_all(var, ["nixl", "ml/nixl-ranks", "a.b"]) == "(nixl|ml/nixl-ranks|a\\\\.b)"
    assert grafana_all({**var, "allValue": ".+"}, ["nixl"]) == ".+"


def test_job_variable_defaults_to_the_nixl_jobs_only() -> None:
    """All once sent ".+", so "Scrape targets up" counted every target of the Prometheus (3 where NIXL had 1)."""
    var = job_variable()
    assert var["includeAll"] is True and var["current"] in ({}, {"text": "All", "value": "$__all"})
    assert not var.get("allValue"), "a custom all value matches jobs the variable's query never found"
    match = re.fullmatch(r"label_values\((\w+), job\)", var["query"]["query"])
    assert match and match.group(1) in known_metric_names() - {"up"}, var["query"]  # a metric only NIXL exports
    ups = [e for e in dashboard_exprs() if "up" in metric_names(e)]
    assert ups and all(re.findall(r"\bup\{([^}]*)\}", e) == ['job=~"$job"'] for e in ups), ups
