"""The scrape's fast Renderer writes what prometheus_client's own generators write, with numbers spelt like the C++
plug-in.

``reference_render`` runs prometheus_client's ``generate_latest`` (text 0.0.4) and its OpenMetrics
``generate_latest`` over ordinary metric families built from the same snapshots; ``Renderer.render`` is the templated
fast path the scrape uses.  prometheus_client stays the oracle for structure (family order, HELP and TYPE lines,
sample names and order, label names, their order and escaping, ``# EOF``); the spelling of numbers follows
prometheus-cpp instead (the ``le`` strings, which reference_families already takes from ``format_bound``, and every
sample value), so that the C++ plug-in and we publish the same series (tests/test_cpp_format.py).
``cpp_reference`` (tests/support_forge.py) is prometheus_client's output with each sample value respelt that way
from the exact stored integer.  Any other difference, in either format, for any snapshot, is a bug.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support_forge import cpp_reference, store_bytes

from app.exposition import Renderer, reference_render
from store import layout as L
from store.metrics import DEFAULT_BUCKETS_US
from store.reader import Snapshot, decode

U64_MAX = (1 << 64) - 1
EDGE_VALUES = (0, 1, 9, 10, 999_999, 1_000_000, 1_000_001, 10_000_000, 123_456_789, 2**53 - 1, 2**53, 2**53 + 1,
               10**16 - 1, 10**16, 10**17 + 3, 2**63, U64_MAX - 1, U64_MAX)
EDGE_BOUNDS = (0.5, 2.5e-3, 1.0, 2.5, 10.0, 1e6, 1e6 + 0.5, 123456.789, 1e16, 1.5e300, 5e-324)
# Quotes, backslashes, newlines, % (the templates' own metacharacter), braces, UTF-8 of every width.
LABEL_ALPHABET = st.sampled_from([*list('ab_-.:0\\"\n%{}=, é€😀\t\r'), "\u2028", "Z"])



def u64s(count: int) -> st.SearchStrategy[list[int]]:
    """``count`` values, each an edge value, a small count or any 64-bit value, about a third of each.

    One draw of bytes per list, not one per value: a snapshot holds 756 values, and drawing them one by one was
    three quarters of the test's time. Nine bytes a value: the first picks the kind, the next eight are the value.
    Hypothesis shrinks bytes towards zero, so a failing list shrinks towards the first edge value, 0.
    """
    def decode_values(data: bytes) -> list[int]:
        values = []
        for at in range(0, 9 * count, 9):
            kind, value = data[at], int.from_bytes(data[at + 1:at + 9], "little")
            values.append(EDGE_VALUES[value % len(EDGE_VALUES)] if kind < 85
                          else value % 2001 if kind < 170 else value)
        return values
    return st.binary(min_size=9 * count, max_size=9 * count).map(decode_values)


def _fits(size: int) -> st.SearchStrategy[str]:
    """Label text that fits a NUL-terminated field of ``size`` bytes."""
    return st.text(LABEL_ALPHABET, max_size=size // 4).filter(lambda s: len(s.encode()) < size)


bounds_strategy = st.one_of(
    st.just(DEFAULT_BUCKETS_US),
    st.just(()),
    st.lists(st.one_of(st.sampled_from(EDGE_BOUNDS),
                       st.floats(min_value=1e-9, max_value=1e18, allow_nan=False, allow_infinity=False)),
             max_size=L.MAX_BUCKETS, unique=True).map(lambda b: tuple(sorted(b))),
)


@st.composite
def snapshots(draw: st.DrawFn, index: int) -> Snapshot:
    data = store_bytes(
        pid=draw(st.one_of(st.integers(1, 4_194_304), st.integers(-(2**63), 2**63 - 1))),
        instance=draw(st.one_of(st.integers(0, 3), st.integers(0, U64_MAX))),
        agent_name=draw(_fits(L.AGENT_NAME_SIZE)),
        hostname=draw(_fits(L.HOSTNAME_SIZE)),
        local_rank=draw(st.one_of(st.just(""), _fits(L.LOCAL_RANK_SIZE))),
        bounds=draw(bounds_strategy),
        counters=draw(u64s(L.SLOT_COUNT)),
        gauges=draw(u64s(L.SLOT_COUNT)),
        buckets=draw(u64s(L.SLOT_COUNT * L.BUCKET_SLOTS)),
        sums=draw(u64s(L.SLOT_COUNT)),
    )
    snap = decode(data, Path(f"/nowhere/nixl.{index}.1.0.mmap"))
    assert isinstance(snap, Snapshot), snap
    return snap


@st.composite
def snapshot_lists(draw: st.DrawFn) -> list[Snapshot]:
    count = draw(st.integers(0, 4))
    return [draw(snapshots(i)) for i in range(count)]


# One renderer across examples, as across scrapes: its per-store cache must never serve stale lines.
_SHARED = Renderer()


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(snapshot_lists(), st.booleans())
def test_renderer_equals_prometheus_client(snaps: list[Snapshot], openmetrics: bool) -> None:
    expected = cpp_reference(snaps, openmetrics)
    assert _SHARED.render(snaps, openmetrics) == expected
    assert Renderer().render(snaps, openmetrics) == expected


@pytest.mark.parametrize("openmetrics", [False, True], ids=["text-0.0.4", "openmetrics"])
def test_zero_ranks(openmetrics: bool) -> None:
    assert Renderer().render([], openmetrics) == reference_render([], openmetrics) == cpp_reference([], openmetrics)


def _edge_snapshot(index: int, value: int, bounds: tuple[float, ...], local_rank: str) -> Snapshot:
    slots = L.SLOT_COUNT
    data = store_bytes(1000 + index, index, f'agent "{index}"\\\n€', "host-é", local_rank, bounds,
                       [value] * slots, [value] * slots, [value] * (slots * L.BUCKET_SLOTS), [value] * slots)
    snap = decode(data, Path(f"/nowhere/nixl.{index}.1.0.mmap"))
    assert isinstance(snap, Snapshot)
    return snap


@pytest.mark.parametrize("openmetrics", [False, True], ids=["text-0.0.4", "openmetrics"])
@pytest.mark.parametrize("value", EDGE_VALUES)
def test_every_edge_value_in_every_family(value: int, openmetrics: bool) -> None:
    """Each edge value in every counter, gauge, bucket and sum (cumulative buckets beyond 2**64 too)."""
    snaps = [_edge_snapshot(0, value, DEFAULT_BUCKETS_US, "0"), _edge_snapshot(1, value, (0.5, 2.5e-3 * 1000), ""),
             _edge_snapshot(2, value, (), "7")]
    assert Renderer().render(snaps, openmetrics) == cpp_reference(snaps, openmetrics)


def test_cache_follows_departed_and_new_stores() -> None:
    renderer = Renderer()
    for start in range(0, 300, 30):
        snaps = [_edge_snapshot(i, i * 1_000_003, DEFAULT_BUCKETS_US, str(i)) for i in range(start, start + 40)]
        assert renderer.render(snaps) == cpp_reference(snaps)
        assert renderer.render(snaps, True) == cpp_reference(snaps, True)


@pytest.mark.parametrize("openmetrics", [False, True], ids=["text-0.0.4", "openmetrics"])
@pytest.mark.parametrize("c_fill", [True, False], ids=["c", "python"])
@pytest.mark.parametrize("stores", [0, 3])
def test_the_endpoints_own_families_follow_nixls(openmetrics: bool, c_fill: bool, stores: int,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The endpoint's own families (what it knows of the job) come after NIXL's, which stay byte for byte what
    prometheus_client's generators write, and before OpenMetrics' # EOF; they are written as those generators
    write two gauge families, and nothing of NIXL's is named like them."""
    from prometheus_client.core import GaugeMetricFamily
    from prometheus_client.exposition import generate_latest
    from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

    import app.exposition as X
    from store.metrics import FAMILIES

    if not c_fill:
        monkeypatch.setattr(X, "_native", None)
    snaps = [_edge_snapshot(i, 2**53 + i, DEFAULT_BUCKETS_US, str(i)) for i in range(stores)]
    state = X.EndpointState(live=2, departed=stores, draining=True)
    body = Renderer().render(snaps, openmetrics, X.endpoint_lines(state, openmetrics))

    ranks = GaugeMetricFamily(*X.ENDPOINT_FAMILIES[0], labels=["state"])
    ranks.add_metric(["live"], 2)
    ranks.add_metric(["departed"], stores)
    draining = GaugeMetricFamily(*X.ENDPOINT_FAMILIES[1], value=1)

    class Own:
        def collect(self) -> list[GaugeMetricFamily]:
            return [ranks, draining]

    nixl = cpp_reference(snaps, openmetrics).removesuffix(b"# EOF\n")
    if openmetrics:
        assert body == nixl + generate_openmetrics(Own()).replace(b".0\n", b"\n")  # (integers, as the plug-in)
    else:
        assert body == nixl + generate_latest(Own()).replace(b".0\n", b"\n")
    assert not any(fam.name.startswith(X.ENDPOINT_PREFIX) for fam in FAMILIES)
