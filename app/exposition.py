"""Exposition: one series per process per metric, in Prometheus text 0.0.4
or OpenMetrics 1.0.0.

Numbers are spelt exactly as the C++ plug-in's prometheus-cpp text
serializer spells them, so that whichever process (C++ or Python) owns the
address, every series keeps its name, labels and ``le`` strings (Prometheus
2.x keys a series by the raw ``le`` text: "10" and "10.0" would be two
series).  prometheus-cpp writes a double with ``std::ostream <<`` at
precision 16, i.e. printf's ``%.16g`` (``format_bound``); counters, gauges
and histogram sums are u64s converted to double first (``format_value``);
bucket and ``_count`` values are u64s written as integers.

Besides NIXL's families, the endpoint publishes what it knows of the job in
families of its own, ``nixl_prometheus_mp_*`` (``ENDPOINT_FAMILIES``,
``endpoint_lines``): the count of live and departed ranks, and whether it is
draining.  They come after NIXL's, only from a serving endpoint (never from
``reference_families``), so that NIXL's families stay exactly the C++
plug-in's, as prometheus-cpp's own ``exposer_*`` families are the plug-in's
own.

Two paths produce the same bytes.  ``reference_families`` builds ordinary
prometheus_client metric families (``RegistryCollector`` lets users register
a directory in their own registry; through prometheus_client's own
generators its values are spelt the Go way, "1e+06").  ``Renderer`` is the
scrape's fast path: a store's labels never change, so each store's sample
lines become UTF-8 %-templates once, cached, and a scrape only formats
numbers into them.  The family headers are produced by prometheus_client's
own generators.  The tests (tests/test_exposition_equivalence.py) prove the
fast path line for line identical to prometheus_client's output in
structure, with the values spelt as prometheus-cpp spells them.
"""

from __future__ import annotations

import threading
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import accumulate
from operator import itemgetter
from typing import Any

from prometheus_client.exposition import generate_latest as generate_text
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

from store import Snapshot, native
from store.layout import BUCKET_SLOTS, W_BUCKETS, W_COUNTERS, W_GAUGES, W_SUMS
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
                les = [format_bound(b) for b in snap.bounds] + ["+Inf"]
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


_TEXT_HEADERS = tuple(h.encode("utf-8") for h in _headers(openmetrics=False))
_OM_HEADERS = tuple(h.encode("utf-8") for h in _headers(openmetrics=True))
_OM_EOF_BYTES = b"# EOF\n"


# -- the endpoint's own families ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EndpointState:
    """What a serving endpoint knows of its job at a scrape: ``live`` ranks (their writer holds its store),
    ``departed`` ones (published with their final values until their TTL), and whether it is ``draining`` (told
    to stop, SIGTERM, with no rank live: it publishes the departed ranks until their TTL, then exits)."""

    live: int
    departed: int
    draining: bool


# (name, HELP) of each of the endpoint's own families, all gauges.  The prefix is this exporter's name
# (nixl-prometheus-mp), as prometheus-cpp's own series are exposer_*: none can clash with a NIXL family (agent_*),
# and a filter on it keeps the comparison with the C++ plug-in's exposition whole (docs/format.md).
ENDPOINT_PREFIX = "nixl_prometheus_mp_"
ENDPOINT_FAMILIES: tuple[tuple[str, str], ...] = (
    ("nixl_prometheus_mp_ranks",
     "Ranks this endpoint publishes, by state: live (the rank runs) or departed (its final values, until its TTL)"),
    ("nixl_prometheus_mp_draining",
     "1 while this endpoint, told to stop with no rank live, publishes the departed ranks until their TTL"),
)


def _endpoint_headers(openmetrics: bool) -> tuple[bytes, ...]:
    """Each own family's HELP/TYPE lines, as prometheus_client writes them (as NIXL's headers are)."""
    out = []
    for name, doc in ENDPOINT_FAMILIES:
        families = _Families([Metric(name, doc, "gauge")])
        text = (generate_openmetrics(families).decode().removesuffix("# EOF\n") if openmetrics
                else generate_text(families).decode())
        out.append(text.encode("utf-8"))
    return tuple(out)


_ENDPOINT_TEXT_HEADERS = _endpoint_headers(openmetrics=False)
_ENDPOINT_OM_HEADERS = _endpoint_headers(openmetrics=True)


def endpoint_lines(state: EndpointState, openmetrics: bool = False) -> bytes:
    """The endpoint's own families for one scrape, to follow NIXL's (before OpenMetrics' ``# EOF``)."""
    ranks_header, draining_header = _ENDPOINT_OM_HEADERS if openmetrics else _ENDPOINT_TEXT_HEADERS
    return b"".join((ranks_header,
                     b'nixl_prometheus_mp_ranks{state="live"} %d\n' % state.live,
                     b'nixl_prometheus_mp_ranks{state="departed"} %d\n' % state.departed,
                     draining_header,
                     b"nixl_prometheus_mp_draining %d\n" % state.draining))


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def format_bound(bound: float) -> str:
    """A bucket bound as an ``le`` label value, as prometheus-cpp writes it: ``%.16g`` ("10", "1000000", "0.001")."""
    return f"{bound:.16g}"


_EXACT_FLOAT_LIMIT = 1 << 53  # every u64 up to here is exactly a double, and has at most 16 digits


def format_value(value: int) -> str:
    """A counter's, gauge's or histogram sum's u64 as prometheus-cpp writes it.

    The plug-in converts the u64 to a double (round to nearest) and writes it
    with ``%.16g``: up to 2**53 that is the integer itself; beyond, the
    rounded double's 16 significant digits ("9.007199254740992e+15").
    """
    return str(value) if value <= _EXACT_FLOAT_LIMIT else f"{float(value):.16g}"


def _format_bytes(value: int) -> bytes:
    return format_value(value).encode("ascii")


def _template(prefixes: Sequence[str], placeholders: Sequence[str]) -> bytes:
    """``prefix value\n`` lines as one UTF-8 %-template (a label value's own % doubled)."""
    return "".join(f"{pre.replace('%', '%%')}{ph}\n"
                   for pre, ph in zip(prefixes, placeholders, strict=True)).encode("utf-8")


def _prefixes(fam: Family, head: str, tail: str, les: Sequence[str]) -> list[str]:
    """Every sample line of one family for one store, up to its value ("name{labels} ")."""
    base = f"{head},{tail}"
    if fam.kind == "histogram":
        return [*(f'{fam.name}_bucket{{{head},le="{le}",{tail}}} ' for le in les),
                f"{fam.name}_count{{{base}}} ", f"{fam.name}_sum{{{base}}} "]
    if len(fam.events) > 1:
        return [f'{fam.name}{{{base},status="{error_status(ev)}"}} ' for ev in fam.events]
    return [f"{fam.name}{{{base}}} "]


class _RankLines:
    """One store's sample lines as %-templates, one per family.

    ``small[i]`` formats family i with integers (``%d``, formatted in C):
    always right for histogram buckets and counts, and for counters and
    gauges up to 2**53; a histogram's sum is always passed formatted
    (``%s``).  ``big(i)`` takes every value already formatted, and is only
    built for the counter and gauge families that ever exceed 2**53, so that
    the templates a scrape streams through stay compact.
    """

    __slots__ = ("_big", "_labels", "seen", "small")

    def __init__(self, snap: Snapshot) -> None:
        self.seen = 0  # the last exposition that used it (Renderer's cache keeps what the last scrape saw)
        # prometheus_client sorts label names: agent_instance, agent_name,
        # hostname, [le], [local_rank], pid, [status].
        labels = label_pairs(snap)
        head = ",".join(f'{k}="{_escape(labels[k])}"' for k in ("agent_instance", "agent_name", "hostname"))
        tail = ",".join(f'{k}="{_escape(labels[k])}"' for k in ("local_rank", "pid") if k in labels)
        les = [format_bound(b) for b in snap.bounds] + ["+Inf"]
        self._labels = (head, tail, les)
        small = []
        for fam in FAMILIES:
            prefixes = _prefixes(fam, head, tail, les)
            placeholders = ["%d"] * len(prefixes)
            if fam.kind == "histogram":
                placeholders[-1] = "%s"
            small.append(_template(prefixes, placeholders))
        self.small = tuple(small)
        self._big: list[bytes | None] = [None] * len(FAMILIES)

    def big(self, i: int) -> bytes:
        template = self._big[i]
        if template is None:
            prefixes = _prefixes(FAMILIES[i], *self._labels)
            template = self._big[i] = _template(prefixes, ["%s"] * len(prefixes))
        return template


def _plan(fam: Family) -> tuple[int, tuple[int, ...]]:
    """What store._render fills family ``fam``'s template with: (1, (first bucket word, sum word)) for a
    histogram, else (0, the word of each line)."""
    slot = fam.events[0]
    if fam.kind == "histogram":
        return 1, (W_BUCKETS + slot * BUCKET_SLOTS, W_SUMS + slot)
    if fam.kind == "gauge":
        return 0, (W_GAUGES + slot,)
    return 0, tuple(W_COUNTERS + ev for ev in fam.events)


_PLAN = tuple(_plan(fam) for fam in FAMILIES)
_native = native.load("_render")


Body = tuple[bytes, ...]  # an exposition in pieces, in order: what a WSGI answer iterates over


class Renderer:
    """Renders snapshots to exposition bytes, caching each store's templates.

    A store's labels never change, so its sample lines are turned into
    %-templates once; a scrape then costs one C-level format per store and
    family, plus one Python-level number format per histogram sum and per
    value above 2**53.  The cache keeps the stores the last scrape saw, at
    most CACHE_MAX of them (beyond, a store's templates are made for the scrape
    and dropped with it: a directory of 50 000 departed stores must not hold
    their templates, a body's worth, between scrapes).  Concurrent scrapes
    share one renderer: the cache is only read, filled and trimmed under a
    lock.
    """

    CACHE_MAX = 2048

    def __init__(self) -> None:
        self._cache: dict[bytes, _RankLines] = {}
        self._lock = threading.Lock()
        self._generation = 0

    def exposition(self, openmetrics: bool = False) -> Exposition:
        """A body to add stores to, a batch at a time."""
        with self._lock:
            self._generation += 1
            return Exposition(self, self._generation, openmetrics)

    def render(self, snapshots: Sequence[Snapshot], openmetrics: bool = False, tail: bytes = b"") -> bytes:
        """NIXL's families over ``snapshots``, then ``tail`` (the endpoint's own families: ``endpoint_lines``),
        then OpenMetrics' ``# EOF``, in one piece."""
        body = self.exposition(openmetrics)
        body.add(snapshots)
        return b"".join(body.finish(tail))

    def lines(self, snapshots: Sequence[Snapshot], generation: int) -> list[_RankLines]:
        """Each store's templates, from the cache where it has them."""
        out = []
        with self._lock:
            cache = self._cache
            for snap in snapshots:
                lines = cache.get(snap.identity_key)
                if lines is None:
                    lines = _RankLines(snap)
                    if len(cache) < self.CACHE_MAX:
                        cache[snap.identity_key] = lines
                lines.seen = max(lines.seen, generation)
                out.append(lines)
        return out

    def trim(self, generation: int) -> None:
        """Forget the stores the exposition ``generation`` did not see (departed and reaped since), unless a
        later one did.  (A new dict rather than deletions: another scrape may be iterating the old one.)"""
        with self._lock:
            if any(lines.seen < generation for lines in self._cache.values()):
                self._cache = {k: v for k, v in self._cache.items() if v.seen >= generation}


class Exposition:
    """One body in the making: NIXL's families over stores added a batch at a time, in order, then ``finish``.

    Each family's lines come together in an exposition, while a scrape reads its stores a batch at a time so that
    it never holds every store's values at once (app.collector): each batch is rendered into one piece per
    family, and the body is every family's header and pieces in turn.  It is never joined: the HTTP servers send
    the pieces as they are (app.http: one sendmsg of many), so a large body is held once, not twice.  A family's
    small pieces are joined as they add up to PIECE_BYTES: a body is then a few large blocks, each of which
    malloc maps apart and gives back to the system when the body is freed (app.malloc), rather than thousands
    of small ones scattered over the heap.
    """

    PIECE_BYTES = 256 << 10

    def __init__(self, renderer: Renderer, generation: int, openmetrics: bool) -> None:
        self._renderer = renderer
        self._generation = generation
        self.openmetrics = openmetrics
        self._families: list[list[bytes]] = [[header] for header in (_OM_HEADERS if openmetrics else _TEXT_HEADERS)]
        self._pending: list[list[bytes]] = [[] for _ in FAMILIES]  # each family's pieces yet to be joined
        self._pending_bytes = [0] * len(FAMILIES)
        self.stores = 0

    def add(self, snapshots: Sequence[Snapshot]) -> None:
        if not snapshots:
            return
        lines_of = self._renderer.lines(snapshots, self._generation)
        words_of = [snap.words for snap in snapshots]
        buckets_of = [len(snap.bounds) + 1 for snap in snapshots]
        pieces = None
        if _native is not None:
            # The same fill in C, without the GIL; None leaves it to the loop below (a forged store whose
            # cumulative bucket counts pass 2**64).
            pieces = _native.render(_PLAN, words_of, buckets_of, [lines.small for lines in lines_of])
        for i, piece in enumerate(pieces or _render_python(words_of, buckets_of, lines_of)):
            pending = self._pending[i]
            pending.append(piece)
            self._pending_bytes[i] += len(piece)
            if self._pending_bytes[i] >= self.PIECE_BYTES:
                self._families[i].append(piece if len(pending) == 1 else b"".join(pending))
                pending.clear()
                self._pending_bytes[i] = 0
        self.stores += len(snapshots)

    def finish(self, tail: bytes = b"") -> Body:
        """The body: NIXL's families (none without a store), ``tail``, and OpenMetrics' ``# EOF``."""
        self._renderer.trim(self._generation)
        pieces: list[bytes] = []
        if self.stores:
            for family, pending in zip(self._families, self._pending, strict=True):
                pieces += family
                if pending:
                    pieces.append(pending[0] if len(pending) == 1 else b"".join(pending))
        pieces.append(tail)
        if self.openmetrics:
            pieces.append(_OM_EOF_BYTES)
        return tuple(pieces)


def _render_python(words_of: list[array[int]], buckets_of: list[int], lines_of: list[_RankLines]) -> list[bytes]:
    """store._render's fill, in Python: each family's lines for these stores."""
    fmt, exact = _format_bytes, _EXACT_FLOAT_LIMIT
    out = []
    for i, fam in enumerate(FAMILIES):
        parts: list[bytes] = []
        append = parts.append
        smalls = [lines.small[i] for lines in lines_of]
        slot = fam.events[0]
        if fam.kind == "histogram":
            first, total_at = W_BUCKETS + slot * BUCKET_SLOTS, W_SUMS + slot
            for words, nb, small in zip(words_of, buckets_of, smalls, strict=True):
                cumulative: list[Any] = list(accumulate(words[first:first + nb]))  # buckets, count, sum
                cumulative.append(cumulative[-1])
                value = words[total_at]
                cumulative.append(b"%d" % value if value <= exact else fmt(value))
                append(small % tuple(cumulative))
        elif len(fam.events) == 1:
            at = (W_GAUGES if fam.kind == "gauge" else W_COUNTERS) + slot
            for words, small, lines in zip(words_of, smalls, lines_of, strict=True):
                value = words[at]
                append(small % value if value <= exact else lines.big(i) % fmt(value))
        else:
            pick = itemgetter(*(W_COUNTERS + ev for ev in fam.events))
            for words, small, lines in zip(words_of, smalls, lines_of, strict=True):
                values = pick(words)
                append(small % values if max(values) <= exact else lines.big(i) % tuple(map(fmt, values)))
        out.append(b"".join(parts))
    return out


def reference_render(snapshots: Sequence[Snapshot], openmetrics: bool = False) -> bytes:
    """prometheus_client's own generator over reference_families (the oracle)."""
    families = _Families(reference_families(snapshots))
    return generate_openmetrics(families) if openmetrics else generate_text(families)
