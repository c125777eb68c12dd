"""Numbers in the exposition are spelt exactly as the C++ plug-in (prometheus-cpp) spells them.

Prometheus 2.x keys a series by the raw text of its labels, so ``le="10.0"`` from one owner and ``le="10"`` from the
other are two series, and every histogram splits whenever ownership of the address moves between a C++ and a Python
process.  prometheus-cpp's text serializer (core/src/text_serializer.cc, since v0.13) writes a double with
``std::ostream <<`` at precision ``max_digits10 - 1`` = 16 in the classic locale, which libstdc++ implements as
``snprintf("%.16g")``; the plug-in (mp_collector.cpp) hands it counters, gauges and histogram sums as
``static_cast<double>(u64)``, and histogram buckets and counts as u64s, written as integers (``%llu``).

The oracle here is the C library's own ``snprintf``, called through ctypes, on the same conversions
(tests/support_forge.py); and, when the ``nixl-cu12`` wheel is installed, the real plug-in serving the same
directory.
"""

from __future__ import annotations

import math
import os
import textwrap
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from support import START_DEADLINE_S, free_port, http_get, metrics_url, reaper_fixture, start_rank, wait_until  # noqa: F401
from support_forge import cpp_double, cpp_u64, cpp_u64_as_double, forge_store, raw_samples

from app.collector import Collector
from app.exposition import Renderer, format_bound, format_value
from store.metrics import DEFAULT_BUCKETS_US

U64_MAX = (1 << 64) - 1
EDGE_VALUES = (0, 1, 9, 10, 999_999, 1_000_000, 1_000_001, 123_456_789, 2**53 - 1, 2**53, 2**53 + 1, 2**53 + 3,
               10**16 - 1, 10**16, 10**16 + 1, 12_345_678_901_234_567, 10**17 + 3, 2**63, U64_MAX - 1, U64_MAX)
EDGE_BOUNDS = (1e-3, 2.5e-3, 0.1, 1 / 3, 0.5, 1.0, 2.5, 10.0, 100.0, 1e6, 1e6 + 0.5, 123456.789, 2.0**53 + 2,
               1e15, 1e16, 1.5e300, 5e-324, 1234567890123456.5)

def test_the_plugins_own_spellings() -> None:
    """What the issue measured against the plug-in, and the cases the brief names."""
    assert [format_bound(b) for b in (10.0, 1e6, 2.5, 1e-3, 0.5)] == ["10", "1000000", "2.5", "0.001", "0.5"]
    assert [format_value(v) for v in (0, 10**6, 2**53 + 1, U64_MAX)] == [
        "0", "1000000", "9007199254740992", "1.844674407370955e+19"]


@pytest.mark.parametrize("bound", EDGE_BOUNDS)
def test_bounds_are_spelt_like_prometheus_cpp(bound: float) -> None:
    assert format_bound(bound) == cpp_double(bound)


@given(st.floats(min_value=5e-324, max_value=1.7e308, allow_nan=False, allow_infinity=False))
def test_any_bound_is_spelt_like_prometheus_cpp(bound: float) -> None:
    assert format_bound(bound) == cpp_double(bound)


@pytest.mark.parametrize("value", EDGE_VALUES)
def test_values_are_spelt_like_prometheus_cpp(value: int) -> None:
    assert format_value(value) == cpp_u64_as_double(value)
    assert math.isclose(float(format_value(value)), value, rel_tol=1e-15)


@given(st.one_of(st.integers(0, U64_MAX), st.integers(2**53 - 10, 2**53 + 10), st.integers(0, 10**17)))
def test_any_value_is_spelt_like_prometheus_cpp(value: int) -> None:
    assert format_value(value) == cpp_u64_as_double(value)


def test_rendered_lines_use_those_spellings(tmp_dir: Path) -> None:
    """Every sample line of a rendered store: the ``le`` strings, bucket counts as integers, the rest as doubles."""
    bounds = (1e-3, 2.5, 10.0, 1e6)
    for i, value in enumerate(EDGE_VALUES):
        # cumulative bucket counts stay within a u64, as they do for any real store
        forge_store(tmp_dir, pid=100 + i, bounds=bounds, value=value // 8)
    text = Renderer().render(Collector(tmp_dir, 1e9).collect().published).decode()
    samples, _ = raw_samples(text)
    assert len(samples) > 100
    seen_le = set()
    for (name, labels), spelt in samples.items():
        per_slot = int(next(v for k, v in labels if k == "pid")) - 100
        value = EDGE_VALUES[per_slot] // 8
        le = dict(labels).get("le")
        if le is not None:
            seen_le.add(le)
            cumulative = value * (1 + [*map(format_bound, bounds), "+Inf"].index(le))
            assert spelt == cpp_u64(cumulative), (name, labels)
        elif name.endswith("_count"):
            assert spelt == cpp_u64(value * (len(bounds) + 1)), (name, labels)
        else:
            assert spelt == cpp_u64_as_double(value), (name, labels)
    assert seen_le == {"0.001", "2.5", "10", "1000000", "+Inf"}


# -- against the real plug-in ---------------------------------------------------------------------------------

CPP_OWNER = textwrap.dedent("""
    import sys
    from nixl_cu12 import nixl_agent, nixl_agent_config
    agent = nixl_agent("cpp-owner", nixl_agent_config(backends=[]))
    print("ready", flush=True)
    sys.stdin.read()  # serve until stdin closes or the test kills us
""")


def _plugin_missing() -> str | None:
    try:
        import nixl_cu12  # noqa: F401
    except ImportError as exc:
        return f"the real C++ plug-in is not installed (pip install --no-deps nixl-cu12==1.5.1 numpy): {exc}"
    return None


@pytest.mark.skipif(_plugin_missing() is not None, reason=str(_plugin_missing()))
def test_same_directory_same_samples_as_the_plugin(tmp_dir: Path, reaper) -> None:
    """The C++ plug-in and our renderer over one directory: the same samples, spelt the same, the same headers."""
    odd = ('quo"te\\back\nnew €', "host-é", "7")
    forge_store(tmp_dir, pid=4242, instance=3, agent_name=odd[0], hostname=odd[1], local_rank=odd[2],
                bounds=(1e-3, 2.5e-3, 0.5, 2.5, 10.0, 1e6, 1e6 + 0.5, 123456.789 * 1e3, 1e16), value=3)
    forge_store(tmp_dir, pid=4243, bounds=DEFAULT_BUCKETS_US, value=(2**53 + 1) // 34)
    for i, value in enumerate((0, 1_000_000, 2**53 + 1, 10**17 + 3, U64_MAX // 34, U64_MAX)):
        # U64_MAX in every bucket would overflow the cumulative counts (prometheus-cpp wraps them modulo 2**64,
        # we do not); no real store gets there, so only the last store has buckets that large.
        forge_store(tmp_dir, pid=5000 + i, bounds=() if value == U64_MAX else (2.5, 10.0), value=value,
                    local_rank="" if i % 2 else str(i))
    port = free_port()
    owner = start_rank(reaper, CPP_OWNER, {
        "NIXL_TELEMETRY_ENABLE": "y", "NIXL_TELEMETRY_EXPORTER": "prometheus_mp",
        "NIXL_TELEMETRY_MULTIPROC_DIR": str(tmp_dir), "NIXL_TELEMETRY_PROMETHEUS_PORT": str(port),
        "NIXL_TELEMETRY_PROMETHEUS_LOCAL": "y", "NIXL_TELEMETRY_MP_STALE_TTL": "3600"})
    wait_until(lambda: owner.readline(START_DEADLINE_S) == "ready", START_DEADLINE_S, "the C++ agent to start",
               interval=0)  # NIXL logs to stdout before
    cpp_text = wait_until(lambda: http_get(metrics_url(port)).text, START_DEADLINE_S, message="the plug-in to serve")
    ours_text = Renderer().render(Collector(tmp_dir, 3600).collect().published).decode()

    # exposer_*: prometheus-cpp's own HTTP statistics, not telemetry from the directory
    cpp, cpp_headers = raw_samples(cpp_text, skip_prefix="exposer_")
    ours, our_headers = raw_samples(ours_text)
    assert len(os.listdir(tmp_dir)) == 10  # 8 forged stores, the plug-in's own store and its election lock
    assert {dict(labels)["pid"] for _, labels in cpp} == {"4242", "4243", *map(str, range(5000, 5006)),
                                                          str(owner.pid)}
    assert ours == cpp
    assert our_headers == cpp_headers
