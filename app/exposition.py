"""Exposition: one series per process per metric, in Prometheus text 0.0.4
or OpenMetrics 1.0.0.

Two paths produce the same bytes.  ``reference_families`` builds ordinary
prometheus_client metric families (``RegistryCollector`` lets users register
a directory in their own registry).  ``Renderer`` is the scrape's fast path:
a store's labels never change, so each store's sample-line prefixes are
rendered once and cached, and a scrape only formats numbers.  The family
headers are produced by prometheus_client's own generators.  The tests prove
both paths byte-identical to prometheus_client's output, in both formats.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from prometheus_client.exposition import generate_latest as generate_text
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.utils import floatToGoString

from store import Snapshot
from store.metrics import FAMILIES, Family, error_status


def label_pairs(snap: Snapshot) -> dict[str, str]:
    """Every series' labels: local_rank only when the rank set one."""
    labels = {"hostname": snap.hostname, "agent_name": snap.agent_name, "pid": str(snap.pid),
              "agent_instance": str(snap.instance)}
    if snap.local_rank:
        labels["local_rank"] = snap.local_rank
    return labels


def _family_metric(fam: Family) -> Metric:
    # Metric keeps a counter's name without _total, as prometheus_client's
    # generators expect (they add it back).
    return Metric(fam.name.removesuffix("_total") if fam.kind == "counter" else fam.name, fam.help, fam.kind)


def reference_families(snapshots: Sequence[Snapshot]) -> list[Metric]:
    """The exposition as prometheus_client metric families; none when no store."""
    if not snapshots:
        return []
    metrics = []
    for fam in FAMILIES:
        metric = _family_metric(fam)
        slot = fam.events[0]
        for snap in snapshots:
            labels = label_pairs(snap)
            if fam.kind == "histogram":
                total = 0
                les = [floatToGoString(b) for b in snap.bounds] + ["+Inf"]
                for le, count in zip(les, snap.histogram(slot), strict=True):
                    total += count
                    metric.add_sample(f"{fam.name}_bucket", {**labels, "le": le}, total)
                metric.add_sample(f"{fam.name}_count", labels, total)
                metric.add_sample(f"{fam.name}_sum", labels, snap.sums[slot])
            elif fam.kind == "gauge":
                metric.add_sample(fam.name, labels, snap.gauges[slot])
            elif len(fam.events) == 1:
                metric.add_sample(fam.name, labels, snap.counters[slot])
            else:
                for ev in fam.events:
                    metric.add_sample(fam.name, {**labels, "status": error_status(ev)}, snap.counters[ev])
        metrics.append(metric)
    return metrics


class _Families:
    """The minimal 'registry' prometheus_client's generators accept."""

    def __init__(self, metrics: Iterable[Metric]) -> None:
        self._metrics = list(metrics)

    def collect(self) -> Iterable[Metric]:
        return self._metrics


class RegistryCollector:
    """A prometheus_client collector over a snapshot source (e.g. a Collector).

    ``REGISTRY.register(RegistryCollector(lambda: collector.collect().published))``
    exposes a directory through any prometheus_client endpoint.
    """

    def __init__(self, snapshots: Callable[[], Sequence[Snapshot]]) -> None:
        self._snapshots = snapshots

    def collect(self) -> Iterable[Metric]:
        return reference_families(self._snapshots())


def _headers(openmetrics: bool) -> tuple[str, ...]:
    """Each family's HELP/TYPE lines, as prometheus_client writes them."""
    out = []
    for fam in FAMILIES:
        if openmetrics:
            out.append(generate_openmetrics(_Families([_family_metric(fam)])).decode().removesuffix("# EOF\n"))
        else:
            out.append(generate_text(_Families([_family_metric(fam)])).decode())
    return tuple(out)


_TEXT_HEADERS = _headers(openmetrics=False)
_OM_HEADERS = _headers(openmetrics=True)
_OM_EOF = "# EOF\n"


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def format_value(value: int) -> str:
    """floatToGoString for a u64 sample, with the common small case inlined."""
    if value < 1_000_000:  # repr(float(v)) is "<v>.0" here, and Go agrees
        return f"{value}.0"
    return floatToGoString(value)


class _RankLines:
    """One store's sample-line prefixes ("name{labels} "), per family."""

    __slots__ = ("prefixes",)

    def __init__(self, snap: Snapshot) -> None:
        # prometheus_client sorts label names: agent_instance, agent_name,
        # hostname, [le], [local_rank], pid, [status].
        labels = label_pairs(snap)
        head = ",".join(f'{k}="{_escape(labels[k])}"' for k in ("agent_instance", "agent_name", "hostname"))
        tail = ",".join(f'{k}="{_escape(labels[k])}"' for k in ("local_rank", "pid") if k in labels)
        base = f"{head},{tail}"
        les = [floatToGoString(b) for b in snap.bounds] + ["+Inf"]
        prefixes: list[tuple[str, ...]] = []
        for fam in FAMILIES:
            if fam.kind == "histogram":
                buckets = tuple(f'{fam.name}_bucket{{{head},le="{le}",{tail}}} ' for le in les)
                prefixes.append((*buckets, f"{fam.name}_count{{{base}}} ", f"{fam.name}_sum{{{base}}} "))
            elif len(fam.events) > 1:
                prefixes.append(tuple(f'{fam.name}{{{base},status="{error_status(ev)}"}} ' for ev in fam.events))
            else:
                prefixes.append((f"{fam.name}{{{base}}} ",))
        self.prefixes = tuple(prefixes)


class Renderer:
    """Renders snapshots to exposition bytes, caching each store's labels."""

    def __init__(self) -> None:
        self._cache: dict[bytes, _RankLines] = {}

    def render(self, snapshots: Sequence[Snapshot], openmetrics: bool = False) -> bytes:
        if not snapshots:
            return _OM_EOF.encode() if openmetrics else b""
        cache = self._cache
        ranks = []
        for snap in snapshots:
            lines = cache.get(snap.identity_key)
            if lines is None:
                lines = cache[snap.identity_key] = _RankLines(snap)
            ranks.append((snap, lines.prefixes))
        if len(cache) > 2 * len(ranks) + 64:  # departed stores: keep the cache bounded
            keep = {snap.identity_key for snap in snapshots}
            self._cache = {k: v for k, v in cache.items() if k in keep}
        fmt = format_value
        parts: list[str] = []
        append = parts.append
        for i, (fam, header) in enumerate(zip(FAMILIES, _OM_HEADERS if openmetrics else _TEXT_HEADERS,
                                              strict=True)):
            append(header)
            slot = fam.events[0]
            if fam.kind == "histogram":
                for snap, prefixes in ranks:
                    pre = prefixes[i]
                    total = 0
                    for j, count in enumerate(snap.histogram(slot)):
                        total += count
                        append(f"{pre[j]}{fmt(total)}\n")
                    append(f"{pre[-2]}{fmt(total)}\n{pre[-1]}{fmt(snap.sums[slot])}\n")
            elif fam.kind == "gauge":
                for snap, prefixes in ranks:
                    append(f"{prefixes[i][0]}{fmt(snap.gauges[slot])}\n")
            elif len(fam.events) == 1:
                for snap, prefixes in ranks:
                    append(f"{prefixes[i][0]}{fmt(snap.counters[slot])}\n")
            else:
                for snap, prefixes in ranks:
                    counters = snap.counters
                    for pre, ev in zip(prefixes[i], fam.events, strict=True):
                        append(f"{pre}{fmt(counters[ev])}\n")
        if openmetrics:
            append(_OM_EOF)
        return "".join(parts).encode()


def reference_render(snapshots: Sequence[Snapshot], openmetrics: bool = False) -> bytes:
    """prometheus_client's own generator over reference_families (the oracle)."""
    families = _Families(reference_families(snapshots))
    return generate_openmetrics(families) if openmetrics else generate_text(families)
