"""Interoperability with the real NIXL C++ plug-in (``prometheus_mp`` from the ``nixl-cu12`` wheel).

C++ ranks (real agents doing real UCX transfers, recorded by the plug-in), Python ranks (``Exporter``) and the
gunicorn aggregator share one directory and one address: whoever owns the address publishes every rank with
the values the plug-in recorded, ownership moves both ways without a counter going backwards, both owners
publish the same samples, and one environment means the same thing to both implementations.

Skipped, saying why, without the wheel; ``NIXL_INTEROP_REQUIRED=1`` (CI) turns the skip into a failure.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest
import support_e2e
from prometheus_client.parser import text_string_to_metric_families
from support import (
    DEADLINE_S,
    START_DEADLINE_S,
    ExporterRank,
    Reaper,
    SeriesKey,
    free_port,
    healthz,
    kill_server_and_spare,
    listening_socket,
    parse_exposition,
    reaper_fixture,  # noqa: F401  (pytest fixture)
    scrape,
    start_exporter_rank,
    wait_until,
)
from support_nixl import (
    STALE_TTL_S,
    CppEnvProbe,
    CppRank,
    Totals,
    listens,
    nixl_required_fixture,  # noqa: F401  (pytest fixture)
    parse_raw,
    samples_of,
    start_aggregator,
    start_cpp_ranks,
    wait_for_owner,
)

from app.config import ConfigError
from app.exposition import ENDPOINT_FAMILIES, ENDPOINT_PREFIX
from app.rank.exporter import create_exporter
from election import lock_file_name
from store import DEFAULT_BUCKETS_US, EventType, read_snapshot

# The tests where our ranks serve the address run both ways (through an address server, and from a thread of the
# rank: the `serve_mode` fixture); the environment and recording tables decide what a rank records and where,
# which does not depend on how it is then served, so they run once, in the default mode.
SERVED_BOTH_WAYS = pytest.mark.usefixtures("serve_mode")

PY_ENV = {"NIXL_TELEMETRY_MP_STALE_TTL": str(STALE_TTL_S)}
# The Python rank's events, and what they must show as (one agent, by sample name).
PY_EVENTS: list[tuple[int, int]] = [
    (EventType.AGENT_TX_BYTES, 777), (EventType.AGENT_TX_REQUESTS_NUM, 1), (EventType.AGENT_XFER_TIME, 40),
    (EventType.AGENT_XFER_TIME, 4000), (EventType.AGENT_ERR_BACKEND, 1)]
PY_EXPECTED = {"agent_tx_bytes_total": 777.0, "agent_tx_requests_num_total": 1.0, "agent_xfer_time_total": 4040.0,
               "agent_xfer_time": 4000.0, "agent_xfer_time_us_count": 2.0, "agent_xfer_time_us_sum": 4040.0,
               "agent_errors_total{status=backend}": 1.0}
# The families prometheus-cpp's Exposer adds about itself (scrape counts, bytes served, latency): they describe
# the serving process, not a rank, so our owner does not publish them (docs/cpp-interop.md).
EXPOSER_FAMILIES = {"exposer_transferred_bytes_total", "exposer_scrapes_total", "exposer_request_latencies"}
COUNTER_SUFFIXES = ("_total", "_count", "_sum", "_bucket")


# -- checks -----------------------------------------------------------------------------------------------------


def cpp_mismatches(samples: Mapping[SeriesKey, float], totals: Totals) -> list[str]:
    """How the published series of a C++ rank differ from what the plug-in recorded for its transfers."""
    problems = []
    for (agent, name), value in totals.expected().items():
        shown = samples_of(samples, totals.pid, agent).get(name)
        if shown != value:
            problems.append(f"pid {totals.pid} {agent} {name}: published {shown}, recorded {value}")
    for agent in totals.agents:
        got = samples_of(samples, totals.pid, agent)
        for histogram in ("agent_xfer_time_us", "agent_xfer_post_time_us"):
            buckets = sorted((float(k.split("{le=")[1][:-1]), v) for k, v in got.items()
                             if k.startswith(histogram + "_bucket"))
            if not buckets or buckets[-1] != (math.inf, got[histogram + "_count"]) or any(
                    a[1] > b[1] for a, b in itertools.pairwise(buckets)):
                problems.append(f"{agent} {histogram}: buckets {buckets} vs count {got.get(histogram + '_count')}")
            if got.get(histogram + "_sum") != got.get(histogram.removesuffix("_us") + "_total"):
                problems.append(f"{agent} {histogram}_sum differs from its _total counter")
    return problems


def assert_cpp_rank(samples: Mapping[SeriesKey, float], totals: Totals) -> None:
    """Every value the plug-in recorded for the rank's transfers is published exactly."""
    problems = cpp_mismatches(samples, totals)
    assert not problems, problems


def published(port: int, *ranks: Totals) -> dict[SeriesKey, float]:
    """The scrape once it shows every rank's transfers (bounded wait): the plug-in stages events and writes
    its store every 100 ms (NIXL_TELEMETRY_RUN_INTERVAL), so a transfer that just completed may not be in it."""
    def current() -> dict[SeriesKey, float]:
        samples = parse_exposition(scrape(port))
        return {} if any(cpp_mismatches(samples, totals) for totals in ranks) else samples

    return wait_until(current, message=f"port {port} to publish {ranks}")


def assert_python_rank(samples: Mapping[SeriesKey, float], pid: int, agent: str) -> None:
    got = samples_of(samples, pid, agent)
    assert {k: got.get(k) for k in PY_EXPECTED} == PY_EXPECTED


def assert_not_backwards(before: Mapping[SeriesKey, float], after: Mapping[SeriesKey, float],
                         active: set[int]) -> None:
    """Across an ownership change: every series is still there, no counter went down, and the series of
    processes that did nothing meanwhile (everyone but ``active``) kept their exact values."""
    problems = []
    for key, old in before.items():
        name, labels = key
        if name.split("_")[0] == "exposer":
            continue
        new = after.get(key)
        if new is None:
            problems.append(f"{key} vanished")
        elif name.endswith(COUNTER_SUFFIXES) and new < old:
            problems.append(f"{key} went backwards: {old} -> {new}")
        elif int(dict(labels)["pid"]) not in active and new != old:
            problems.append(f"{key} of an idle process changed: {old} -> {new}")
    assert not problems, f"{len(problems)} problems, first ones: {problems[:8]}"


def stores_in(doc_list: list[dict[str, object]]) -> set[tuple[object, object]]:
    return {(entry["pid"], entry["agent_instance"]) for entry in doc_list}


def cpp_stores(*ranks: CppRank) -> set[tuple[object, object]]:
    """(pid, agent_instance) of each rank's two agents (instances 0 and 1 of the process)."""
    return {(rank.pid, instance) for rank in ranks for instance in (0, 1)}


# -- mixed directory, the aggregator, takeovers -----------------------------------------------------------------


def wait_for_python_owner(port: int, rank_pid: int, since: float) -> tuple[float, int]:
    """Seconds from ``since`` until the Python rank ``rank_pid`` serves the port, and the pid that holds it: the
    address server that rank started (helper mode), or the rank itself (thread mode)."""
    if os.environ.get("NIXL_PROMETHEUS_MP_SERVE") == "thread":
        return wait_for_owner(port, rank_pid, since=since), rank_pid

    def server() -> int | None:
        owner = healthz(port, timeout=2)["owner"]
        return owner["server_pid"] if owner["started_by"] == rank_pid and owner["serving"] == "helper" else None

    # A fresh interpreter starts the server: a bound only a hang reaches (bench has the figures).
    holder = wait_until(server, START_DEADLINE_S, message=f"an address server started by pid {rank_pid}")
    return wait_for_owner(port, holder, since=since), holder


def end_python_owner(port: int, rank: ExporterRank, holder: int) -> None:
    """End the Python rank that serves: in helper mode its address server (the job's) serves on after the rank's
    death, so it is SIGKILLed too, after the rank, its spare first: the address then moves to whoever wins next."""
    rank.kill()
    if holder != rank.pid:
        assert healthz(port)["owner"]["server_pid"] == holder  # a rank's death moves nothing
        assert holder in kill_server_and_spare(port)


@SERVED_BOTH_WAYS
@pytest.mark.usefixtures("nixl_required")
def test_aggregator_serves_cpp_ranks_and_hands_over_to_them(tmp_dir: Path, reaper: Reaper) -> None:
    """The aggregator pod: C++ and Python ranks write, gunicorn serves; exact values, live/stale per process;
    killing the aggregator hands the address to the recording Python rank, killing that one (and its address
    server) to a C++ rank, and a new aggregator takes it back."""
    port = free_port()
    with Reaper() as group:
        aggregator = start_aggregator(group, tmp_dir, port)
        c0, c1 = start_cpp_ranks(reaper, tmp_dir, port, ["cpp0", "cpp1"], [{"LOCAL_RANK": "0"}, {"LOCAL_RANK": "1"}])
        py = start_exporter_rank(reaper, tmp_dir, port, agent="py2", extra_env={"LOCAL_RANK": "2", **PY_ENV},
                                 tick_hz=50)
        c0.write(*[4096] * 5)
        c1.write(1000, 1000, 1000, 65536, 65536)
        py.events(PY_EVENTS)
        assert not any(listens(rank.pid, port) for rank in (c0, c1)), "a C++ rank serves beside the aggregator"

        samples = published(port, c0.totals, c1.totals)
        assert_python_rank(samples, py.pid, "py2")
        assert {dict(labels).get("local_rank") for _, labels in samples} == {"0", "1", "2"}
        doc = healthz(port)
        assert stores_in(doc["live"]) == cpp_stores(c0, c1) | {(py.pid, 0)} and doc["stale"] == []

        c1.kill()
        doc = healthz(port)
        assert stores_in(doc["live"]) == cpp_stores(c0) | {(py.pid, 0)}
        assert stores_in(doc["stale"]) == cpp_stores(c1)
        before = parse_exposition(scrape(port))
        assert_cpp_rank(before, c1.totals)  # a departed rank keeps its last values until the TTL

        # The aggregator goes away: the Python rank, recording, serves at its next claim (helper mode: through
        # the address server it starts; the C++ rank, idle for now, claims nothing).  Then it goes too (with its
        # server), and the C++ rank that transfers from then on re-runs its election (as it exports) and serves.
        killed = time.monotonic()
        aggregator.killpg(signal.SIGKILL)
        aggregator.popen.wait(DEADLINE_S)
        python_took_s, holder = wait_for_python_owner(port, py.pid, since=killed)
        c0.pump()
        assert_not_backwards(before, parse_exposition(scrape(port)), active={c0.pid, py.pid})
        killed = time.monotonic()
        end_python_owner(port, py, holder)
        cpp_took_s = wait_for_owner(port, c0.pid, since=killed)
        assert_not_backwards(before, parse_exposition(scrape(port)), active={c0.pid, py.pid})  # (py recorded)

        # A new aggregator waits for the address, and gets it when the C++ owner dies.
        second = start_aggregator(group, tmp_dir, port, wait=False)
        second.wait_line(lambda line: "the aggregator waits for the address" in line, START_DEADLINE_S)
        totals = c0.unpump()
        before = published(port, totals)
        killed = time.monotonic()
        c0.kill()
        aggregator_took_s = wait_for_owner(port, second.pid, since=killed)
        after = parse_exposition(scrape(port))
        assert_not_backwards(before, after, active=set())
        assert_cpp_rank(after, totals)
        assert_cpp_rank(after, c1.totals)
        assert_python_rank(after, py.pid, "py2")
        doc = healthz(port)
        assert stores_in(doc["live"]) == set() and stores_in(doc["stale"]) == cpp_stores(c0, c1) | {(py.pid, 0)}
    print(f"\ntakeover aggregator->Python {python_took_s:.3f} s, Python->C++ {cpp_took_s:.3f} s, "
          f"C++->aggregator {aggregator_took_s:.3f} s "
          f"(C++ agent pair created in {c0.create_s:.3f} s)")


@SERVED_BOTH_WAYS
@pytest.mark.usefixtures("nixl_required")
def test_takeover_between_cpp_and_python_ranks(tmp_dir: Path, reaper: Reaper) -> None:
    """C++ owner killed -> a Python rank serves; Python owner killed (helper mode: with its address server) -> a
    C++ rank serves; nothing goes back."""
    port = free_port()
    (first,) = start_cpp_ranks(reaper, tmp_dir, port, ["cppA"])
    wait_for_owner(port, first.pid)
    first.write(2048, 2048, 2048)
    py = start_exporter_rank(reaper, tmp_dir, port, agent="pyB", tick_hz=50, extra_env=PY_ENV)
    assert not py.serving_at_start
    py.events(PY_EVENTS)

    before = published(port, first.totals)
    killed = time.monotonic()
    first.kill()
    python_took_s, holder = wait_for_python_owner(port, py.pid, since=killed)
    after = parse_exposition(scrape(port))
    assert_not_backwards(before, after, active={py.pid})
    assert_cpp_rank(after, first.totals)
    doc = healthz(port)
    assert stores_in(doc["stale"]) == cpp_stores(first) and stores_in(doc["live"]) == {(py.pid, 0)}

    (second,) = start_cpp_ranks(reaper, tmp_dir, port, ["cppC"])
    second.write(100, 200)
    second.pump()
    before = parse_exposition(scrape(port))
    killed = time.monotonic()
    end_python_owner(port, py, holder)
    cpp_took_s = wait_for_owner(port, second.pid, since=killed)
    totals = second.unpump()
    after = published(port, first.totals, totals)
    assert_not_backwards(before, after, active={second.pid, py.pid})
    print(f"\ntakeover C++->Python {python_took_s:.3f} s (Python rank exporting at 50 Hz), "
          f"Python->C++ {cpp_took_s:.3f} s (C++ rank transferring at 50 Hz)")


# -- the same samples as the plug-in's own exposition -----------------------------------------------------------


@SERVED_BOTH_WAYS
@pytest.mark.usefixtures("nixl_required")
def test_our_exposition_is_the_plugins_sample_for_sample(tmp_dir: Path, reaper: Reaper) -> None:
    """Over one directory (live and departed C++ stores, Python stores with default and custom buckets), our
    owner and the plug-in's owner publish the same families, HELP, TYPE, label sets, label strings and values."""
    cpp_port, py_port = free_port(), free_port()
    (live,) = start_cpp_ranks(reaper, tmp_dir, cpp_port, ["cpp-live"], [{"LOCAL_RANK": "0"}])
    wait_for_owner(cpp_port, live.pid)  # the plug-in serving: the rank that stays
    (departed,) = start_cpp_ranks(reaper, tmp_dir, cpp_port, ["cpp-gone"], [{"LOCAL_RANK": "1"}])
    live.write(100, 5000, 70000, 1 << 20)
    departed.write(10, 20)
    # Our owner serves the same directory on another address (elections are per address).
    py = start_exporter_rank(reaper, tmp_dir, py_port, agent="py-owner", extra_env={"LOCAL_RANK": "2", **PY_ENV})
    custom = start_exporter_rank(reaper, tmp_dir, py_port, agent="py-buckets", extra_env={
        "NIXL_TELEMETRY_HISTOGRAM_BUCKETS_US": "0.5,2.5,1000,1e6,1.5e7", **PY_ENV})
    assert py.serving_at_start
    py.events(PY_EVENTS)
    custom.events([(EventType.AGENT_XFER_TIME, 2), (EventType.AGENT_XFER_TIME, 999_999),
                   (EventType.AGENT_XFER_POST_TIME, 20_000_000), (EventType.AGENT_RX_BYTES, 2**53 + 1)])
    published(cpp_port, live.totals, departed.totals)  # in the stores before the departing rank dies
    departed.kill()

    ours_text, theirs_text = scrape(py_port), scrape(cpp_port)
    ours, theirs = parse_raw(ours_text), parse_raw(theirs_text)

    assert set(theirs.types) - set(ours.types) == EXPOSER_FAMILIES
    theirs.samples = {k: v for k, v in theirs.samples.items() if k[0].split("_")[0] != "exposer"}
    for family in EXPOSER_FAMILIES:
        del theirs.types[family], theirs.help[family]
    # Ours, likewise, publishes what it knows of the job in families of its own (docs/format.md), and only those.
    assert set(ours.types) - set(theirs.types) == {name for name, _ in ENDPOINT_FAMILIES}
    ours.samples = {k: v for k, v in ours.samples.items() if not k[0].startswith(ENDPOINT_PREFIX)}
    for name, _ in ENDPOINT_FAMILIES:
        del ours.types[name], ours.help[name]
    assert ours.types == theirs.types
    assert ours.help == theirs.help
    only_ours, only_theirs = set(ours.samples) - set(theirs.samples), set(theirs.samples) - set(ours.samples)
    assert not only_ours and not only_theirs, (
        f"{len(only_ours)} series only in ours, {len(only_theirs)} only in the plug-in's; first ones:\n"
        f"ours:   {sorted(only_ours, key=str)[:4]}\ntheirs: {sorted(only_theirs, key=str)[:4]}")
    differing = {k: (ours.samples[k], theirs.samples[k]) for k in ours.samples
                 if float(ours.samples[k]) != float(theirs.samples[k])}
    assert not differing, f"{len(differing)} values differ (ours, theirs): {list(differing.items())[:6]}"
    spelled = {k: (ours.samples[k], theirs.samples[k]) for k in ours.samples if ours.samples[k] != theirs.samples[k]}
    assert not spelled, f"{len(spelled)} values spelt differently (ours, theirs): {list(spelled.items())[:6]}"
    assert len(ours.samples) > 300  # five stores of every family: the comparison covered them all

    # And as prometheus_client's parser reads them (names, documentation, types, samples).
    def families(text: str) -> dict[str, tuple[str, str, set[tuple[str, tuple[tuple[str, str], ...], float]]]]:
        return {f.name: (f.documentation, f.type, {(s.name, tuple(sorted(s.labels.items())), s.value)
                                                   for s in f.samples})
                for f in text_string_to_metric_families(text)
                if f.name.split("_")[0] != "exposer" and not f.name.startswith(ENDPOINT_PREFIX)}

    assert families(ours_text) == families(theirs_text)


# -- the same environment, the same behaviour ---------------------------------------------------------------------

RANK = "LOCAL_RANK"
CASES: list[tuple[str, dict[str, str], str | None, str]] = [
    # (id, environment, bound host or None when refused, local_rank label)
    ("local-unset", {}, "0.0.0.0", ""),
    *[(f"local={w}", {"NIXL_TELEMETRY_PROMETHEUS_LOCAL": w}, "127.0.0.1", "")
      for w in ("y", "Y", "yes", "on", "1", "true", "TRUE", "enable", "Enable")],
    *[(f"local={w}", {"NIXL_TELEMETRY_PROMETHEUS_LOCAL": w}, "0.0.0.0", "")
      for w in ("n", "no", "OFF", "0", "false", "disable", "DISABLE")],
    *[(f"local={w!r}", {"NIXL_TELEMETRY_PROMETHEUS_LOCAL": w}, None, "") for w in ("", " y", "yes ", "2", "maybe")],
    ("rank-default", {RANK: "3"}, "0.0.0.0", "3"),
    ("rank-env-empty", {"NIXL_TELEMETRY_RANK_ENV": "", RANK: "3"}, "0.0.0.0", ""),
    ("rank-env-named", {"NIXL_TELEMETRY_RANK_ENV": "MY_RANK", "MY_RANK": "5", RANK: "3"}, "0.0.0.0", "5"),
    ("rank-env-named-unset", {"NIXL_TELEMETRY_RANK_ENV": "MY_RANK", RANK: "3"}, "0.0.0.0", ""),
    ("rank-env-padded", {"NIXL_TELEMETRY_RANK_ENV": " LOCAL_RANK", RANK: "3"}, "0.0.0.0", ""),
    ("rank-empty", {RANK: ""}, "0.0.0.0", ""),
    ("enable=enable", {"NIXL_TELEMETRY_ENABLE": "enable"}, "0.0.0.0", ""),
    ("enable=''", {"NIXL_TELEMETRY_ENABLE": ""}, None, ""),
]
BUCKETS = "NIXL_TELEMETRY_HISTOGRAM_BUCKETS_US"
# (id, value, the bounds both store, or None when both refuse it)
BUCKET_CASES: list[tuple[str, str, tuple[float, ...] | None]] = [
    ("buckets-empty", "", DEFAULT_BUCKETS_US),
    ("buckets-plain", "10,100,1000", (10.0, 100.0, 1000.0)),
    ("buckets-spaced", " 0.5 , 2.5,1e3 ", (0.5, 2.5, 1000.0)),
    ("buckets-signed", "+5,1e7", (5.0, 1e7)),
    ("buckets-32", ",".join(str(n) for n in range(1, 33)), tuple(float(n) for n in range(1, 33))),
    ("buckets-33", ",".join(str(n) for n in range(1, 34)), None),
    ("buckets-decreasing", "10,5", None),
    ("buckets-zero", "0,5", None),
    ("buckets-word", "ten", None),
    ("buckets-trailing-comma", "5,", None),
    ("buckets-infinite", "5,inf", None),
]
# Cases where the agent exists but records nothing (no store, no lock file) in both implementations.
DISABLED = [("enable=disable", {"NIXL_TELEMETRY_ENABLE": "disable"}), ("enable=0", {"NIXL_TELEMETRY_ENABLE": "0"}),
            ("enable=No", {"NIXL_TELEMETRY_ENABLE": "No"})]
OTHER_VARIABLES = [RANK, "MY_RANK"]  # unset before each C++ agent, with every NIXL_TELEMETRY_* variable


@pytest.fixture(scope="module")
def cpp_probe(nixl_required: None) -> Iterator[CppEnvProbe]:
    with Reaper() as reaper:
        yield CppEnvProbe(reaper)


Outcome = tuple[set[str], set[tuple[str, str, str, tuple[float, ...]]]]


def outcome(directory: Path) -> Outcome:
    """(lock file names, {(agent_name, hostname, local_rank, bucket bounds)} of the stores) left in ``directory``."""
    names = set(os.listdir(directory)) if directory.exists() else set()
    stores = [read_snapshot(directory / n) for n in names if n.endswith(".mmap")]
    return ({n for n in names if n.endswith(".lock")},
            {(s.agent_name, s.hostname, s.local_rank, s.bounds) for s in stores})  # type: ignore[union-attr]


def run_both(cpp_probe: CppEnvProbe | None, tmp_path: Path,
             extra: Mapping[str, str] | Callable[[int], dict[str, str]]
             ) -> tuple[tuple[bool, Outcome] | None, tuple[bool, Outcome], int]:
    """Create a C++ agent (unless ``cpp_probe`` is None) and our exporter under the same environment, the port
    held by a loopback listener (so neither binds anything, yet each names the address it resolved in its
    election's lock file). Each result is (created, what it left in its directory).

    ``extra`` is the environment, or a function of the port returning it."""
    port = free_port()
    if callable(extra):
        extra = extra(port)

    def env(side: str) -> dict[str, str]:
        return {"NIXL_TELEMETRY_ENABLE": "y", "NIXL_TELEMETRY_EXPORTER": "prometheus_mp",
                "NIXL_TELEMETRY_MULTIPROC_DIR": str(tmp_path / side), "NIXL_TELEMETRY_PROMETHEUS_PORT": str(port),
                **extra}

    theirs = None
    with listening_socket(port):
        if cpp_probe is not None:
            theirs = (cpp_probe.create("agent", env("cpp"), OTHER_VARIABLES)["created"], outcome(tmp_path / "cpp"))
        try:
            create_exporter("agent", env("ours")).close()
            created = True
        except ConfigError:
            created = False
    return theirs, (created, outcome(tmp_path / "ours")), port


def expected_outcome(host: str | None, local_rank: str, port: int,
                     bounds: tuple[float, ...] = DEFAULT_BUCKETS_US) -> tuple[bool, Outcome]:
    """Refused (nothing on disk), or an election for host:port and a store with these labels and buckets."""
    if host is None:
        return False, (set(), set())
    return True, ({lock_file_name(f"{host}:{port}")}, {("agent", socket.gethostname(), local_rank, bounds)})


@pytest.mark.parametrize(("env", "host", "local_rank"), [pytest.param(*c[1:], id=c[0]) for c in CASES])
def test_same_environment_same_address_and_labels(cpp_probe: CppEnvProbe, tmp_path: Path, env: dict[str, str],
                                                  host: str | None, local_rank: str) -> None:
    theirs, ours, port = run_both(cpp_probe, tmp_path, env)
    assert theirs == ours == expected_outcome(host, local_rank, port)


@pytest.mark.parametrize(("env", "host", "local_rank"), [pytest.param(*c[1:], id=c[0]) for c in CASES])
def test_our_reading_of_the_environment(tmp_path: Path, env: dict[str, str], host: str | None,
                                        local_rank: str) -> None:
    """The same table without the plug-in (runs where the wheel is not installed)."""
    _, ours, port = run_both(None, tmp_path, env)
    assert ours == expected_outcome(host, local_rank, port)


@pytest.mark.parametrize(("value", "bounds"), [pytest.param(*c[1:], id=c[0]) for c in BUCKET_CASES])
def test_same_histogram_buckets(cpp_probe: CppEnvProbe, tmp_path: Path, value: str,
                                bounds: tuple[float, ...] | None) -> None:
    theirs, ours, port = run_both(cpp_probe, tmp_path, {"NIXL_TELEMETRY_PROMETHEUS_LOCAL": "y", BUCKETS: value})
    assert theirs == ours == expected_outcome(None if bounds is None else "127.0.0.1", "", port, bounds or ())


@pytest.mark.parametrize("env", [pytest.param(c[1], id=c[0]) for c in DISABLED])
def test_same_environment_same_choice_not_to_record(cpp_probe: CppEnvProbe, tmp_path: Path,
                                                    env: dict[str, str]) -> None:
    theirs, ours, _ = run_both(cpp_probe, tmp_path, env)
    assert ours == theirs == (True, (set(), set()))


ENABLED = "NIXL_TELEMETRY_ENABLED_METRICS"
E = EventType
# What a C++ rank's transfer makes its plug-in record (examples/cpp_agents.py): the events both sides are compared on.
TRANSFER_EVENTS = frozenset({E.AGENT_TX_BYTES, E.AGENT_TX_REQUESTS_NUM, E.AGENT_XFER_TIME, E.AGENT_XFER_POST_TIME,
                             E.AGENT_MEMORY_REGISTERED})
# (id, NIXL_TELEMETRY_ENABLED_METRICS or None for unset, the transfer events both record). The plug-in splits on
# commas, trims ASCII whitespace, drops empty entries (none left: everything), and matches each entry with C's
# fnmatch, case-sensitively, against the lower-case event names.
ENABLED_CASES: list[tuple[str, str | None, frozenset[EventType]]] = [
    ("unset", None, TRANSFER_EVENTS),
    ("empty", "", TRANSFER_EVENTS),
    ("only-blank-entries", " , ,\t", TRANSFER_EVENTS),
    ("star", "*", TRANSFER_EVENTS),
    ("prefix-glob", "agent_tx_*", frozenset({E.AGENT_TX_BYTES, E.AGENT_TX_REQUESTS_NUM})),
    ("padded", " agent_tx_bytes\t", frozenset({E.AGENT_TX_BYTES})),
    ("empty-entry", "agent_tx_bytes,,agent_xfer_time", frozenset({E.AGENT_TX_BYTES, E.AGENT_XFER_TIME})),
    ("question-mark", "agent_?x_*", frozenset({E.AGENT_TX_BYTES, E.AGENT_TX_REQUESTS_NUM})),
    ("bang-class", "agent_[!r]x_bytes", frozenset({E.AGENT_TX_BYTES})),
    ("caret-class", "agent_[^r]x_bytes", frozenset({E.AGENT_TX_BYTES})),
    ("posix-class", "agent_[[:alpha:]]x_bytes", frozenset({E.AGENT_TX_BYTES})),
    ("escaped", "agent\\_tx_bytes", frozenset({E.AGENT_TX_BYTES})),
    ("one-entry-unmatched", "agent_xfer_*,nope", frozenset({E.AGENT_XFER_TIME, E.AGENT_XFER_POST_TIME})),
    ("without-prefix", "xfer_*,tx_bytes", frozenset()),
    ("upper-case", "AGENT_TX_*", frozenset()),
    ("series-name", "agent_tx_bytes_total", frozenset()),
    ("trailing-backslash", "agent_tx_bytes\\", frozenset()),
    ("unclosed-bracket", "agent_[tx_bytes", frozenset()),
    ("non-ascii-space", "\u00a0agent_tx_bytes", frozenset()),
]
# A disabled event is dropped before it is staged, and the plug-in writes what is staged every 100 ms: when
# nothing may appear, this long (ten intervals) shows that nothing does.
NOTHING_SETTLE_S = 1.0


def recorded_events(directory: Path) -> set[EventType]:
    """The events with a non-zero counter or gauge in any store in ``directory``."""
    snaps = [read_snapshot(directory / n) for n in os.listdir(directory) if n.endswith(".mmap")]
    return {e for s in snaps for e in EventType if s.counters[e] or s.gauges[e]}  # type: ignore[union-attr]


def ours_recorded(directory: Path, value: str | None) -> set[EventType]:
    """The events our exporter records, under ``value``, when every event type is exported once."""
    env = {"NIXL_TELEMETRY_ENABLE": "y", "NIXL_TELEMETRY_EXPORTER": "prometheus_mp",
           "NIXL_TELEMETRY_MULTIPROC_DIR": str(directory), "NIXL_TELEMETRY_PROMETHEUS_PORT": str(free_port()),
           "NIXL_TELEMETRY_PROMETHEUS_LOCAL": "y", **({} if value is None else {ENABLED: value})}
    with create_exporter("agent", env) as exp:
        for event in EventType:
            exp.export_event(event, 1)
    return recorded_events(directory)


@pytest.mark.usefixtures("nixl_required")
@pytest.mark.parametrize(("value", "expected"), [pytest.param(*c[1:], id=c[0]) for c in ENABLED_CASES])
def test_same_enabled_metrics_same_events_recorded(tmp_path: Path, reaper: Reaper, value: str | None,
                                                   expected: frozenset[EventType]) -> None:
    cpp_dir = tmp_path / "cpp"
    cpp_dir.mkdir()
    [rank] = start_cpp_ranks(reaper, cpp_dir, free_port(), ["p"], [{} if value is None else {ENABLED: value}])
    rank.write(4096)
    if expected:
        wait_until(lambda: recorded_events(cpp_dir) == expected, message=f"the plug-in to record {expected}")
    else:
        time.sleep(NOTHING_SETTLE_S)
    assert recorded_events(cpp_dir) == expected
    assert ours_recorded(tmp_path / "ours", value) & TRANSFER_EVENTS == expected


@pytest.mark.parametrize(("value", "expected"), [pytest.param(*c[1:], id=c[0]) for c in ENABLED_CASES])
def test_our_reading_of_enabled_metrics(tmp_path: Path, value: str | None, expected: frozenset[EventType]) -> None:
    """The same table without the plug-in (runs where the wheel is not installed)."""
    assert ours_recorded(tmp_path, value) & TRANSFER_EVENTS == expected


# Where we are stricter or looser than the plug-in (docs/cpp-interop.md lists these): (id, variable, value with
# {port} and {hex} filled in, the implementation that accepts it; the other refuses it).
DIFFERENCES = [
    ("port-hex", "NIXL_TELEMETRY_PROMETHEUS_PORT", "{hex}", "cpp"),
    ("port-padded", "NIXL_TELEMETRY_PROMETHEUS_PORT", " {port}", "ours"),
    ("ttl-empty", "NIXL_TELEMETRY_MP_STALE_TTL", "", "ours"),
    ("ttl-fraction", "NIXL_TELEMETRY_MP_STALE_TTL", "1.5", "ours"),
    ("ttl-hex", "NIXL_TELEMETRY_MP_STALE_TTL", "0x10", "cpp"),
    ("buckets-blank", BUCKETS, " ", "ours"),
    ("buckets-underscore", BUCKETS, "1_000", "ours"),
    ("exporter-padded", "NIXL_TELEMETRY_EXPORTER", " prometheus_mp", "ours"),
]


@pytest.mark.parametrize(("variable", "value", "accepts"), [pytest.param(*c[1:], id=c[0]) for c in DIFFERENCES])
def test_documented_differences(cpp_probe: CppEnvProbe, tmp_path: Path, variable: str, value: str,
                                accepts: str) -> None:
    theirs, ours, port = run_both(cpp_probe, tmp_path, lambda p: {
        "NIXL_TELEMETRY_PROMETHEUS_LOCAL": "y", variable: value.format(port=p, hex=hex(p))})
    accepted: tuple[bool, set[str]] = (True, {lock_file_name(f"127.0.0.1:{port}")})
    refused: tuple[bool, set[str]] = (False, set())
    assert theirs is not None and (theirs[0], theirs[1][0]) == (accepted if accepts == "cpp" else refused)
    assert (ours[0], ours[1][0]) == (refused if accepts == "cpp" else accepted)


# -- the example ------------------------------------------------------------------------------------------------


@SERVED_BOTH_WAYS
@pytest.mark.usefixtures("nixl_required")
def test_example_script_is_served_with_the_totals_it_prints(tmp_dir: Path, reaper: Reaper) -> None:
    """examples/cpp_agents.py as docs/cpp-interop.md runs it: each JSON line it prints is what /metrics shows
    for its tx agent, whoever serves (here a Python rank); SIGTERM stops it cleanly."""
    port = free_port()
    owner = start_exporter_rank(reaper, tmp_dir, port, agent="py-owner", extra_env=PY_ENV)
    assert owner.serving_at_start
    with Reaper() as group:
        env = support_e2e.rank_env(tmp_dir, port, LOCAL_RANK="4", UCX_NET_DEVICES="lo")
        example = group.spawn([sys.executable, str(support_e2e.REPO / "examples" / "cpp_agents.py"), "--size",
                               "3000", "--count", "2", "--interval", "0.05"], env)
        example.wait_line(lambda line: '"transfers": 6' in line, START_DEADLINE_S)
        example.popen.send_signal(signal.SIGTERM)
        assert example.popen.wait(DEADLINE_S) == 0
    last = Totals.from_answer(json.loads([line for line in example.lines if line.startswith("{")][-1]))
    assert last.agents == ("rank4-tx", "rank4-rx") and last.bytes == 3000 * last.transfers
    samples = published(port, last)
    assert {dict(labels).get("local_rank") for _, labels in samples} == {None, "4"}


# -- pid namespaces ---------------------------------------------------------------------------------------------


def can_unshare_pid_namespace() -> bool:
    try:
        return subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@SERVED_BOTH_WAYS
@pytest.mark.usefixtures("nixl_required")
@pytest.mark.skipif(not can_unshare_pid_namespace(), reason="creating a pid namespace needs root and unshare(1)")
def test_restarted_rank_in_its_own_pid_namespace_is_published_once(tmp_dir: Path, reaper: Reaper) -> None:
    """A rank container restarted: predecessor and successor are both pid 1 with the same agent name and rank,
    so their stores carry the same label set. The plug-in publishes both (duplicate series); we publish the
    live successor only and say why in /healthz."""
    cpp_port, py_port = free_port(), free_port()
    (owner,) = start_cpp_ranks(reaper, tmp_dir, cpp_port, ["cpp-owner"])
    wait_for_owner(cpp_port, owner.pid)
    py = start_exporter_rank(reaper, tmp_dir, py_port, agent="py-owner", extra_env=PY_ENV)
    assert py.serving_at_start
    rank0 = {"LOCAL_RANK": "0"}
    (predecessor,) = start_cpp_ranks(reaper, tmp_dir, cpp_port, ["rank"], [rank0], own_pid_namespace=True)
    predecessor.write(1000)
    published(cpp_port, predecessor.totals)
    predecessor.kill()
    (successor,) = start_cpp_ranks(reaper, tmp_dir, cpp_port, ["rank"], [rank0], own_pid_namespace=True)
    successor.write(500, 500, 500)
    assert predecessor.totals.pid == successor.totals.pid == 1

    def tx_bytes(port: int) -> tuple[list[float], str]:
        """The values of the successor's and predecessor's agent_tx_bytes_total series, and the scrape."""
        text = scrape(port)
        return sorted(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                      if line.startswith("agent_tx_bytes_total{") and 'pid="1"' in line and '"rank-tx"' in line), text

    wait_until(lambda: tx_bytes(cpp_port)[0] == [1000.0, 1500.0], message="the plug-in to publish both stores")
    def successor_only() -> str:  # (and all of it: the plug-in writes each agent's store every 100 ms)
        values, text = tx_bytes(py_port)
        return text if values == [1500.0] and not cpp_mismatches(parse_exposition(text), successor.totals) else ""

    ours = wait_until(successor_only, message="our owner to publish the successor only")
    assert_cpp_rank(parse_exposition(ours), successor.totals)
    warnings = [w for w in healthz(py_port)["warnings"] if w["kind"] == "duplicate-labels"]
    assert len(warnings) == 2, warnings  # the predecessor's two agents, each shadowed by its successor
