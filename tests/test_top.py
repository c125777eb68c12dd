"""``python -m app top``: the figures of real ranks recording at known rates, the directory left as it was, bad
input as one line, and the live view under a real terminal (tmux).

Rates are checked with a tolerance derived from the interval: a rank paced at R transfers/s may run up to
SLIP_S behind its schedule at either end of the interval (it catches up afterwards), so over an interval of I
seconds its measured rate is R * (1 +- SLIP_S / I).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support import (
    DEADLINE_S,
    PROJECT_ROOT,
    START_DEADLINE_S,
    RankProcess,
    Reaper,
    child_env,
    free_port,
    reaper_fixture,  # noqa: F401  (pytest fixture)
    start_exporter_rank,
    start_rank,
    wait_until,
    wait_until_settled,
)
from support_forge import forge_store, store_bytes
from support_nixl import nixl_required_fixture, start_cpp_ranks  # noqa: F401  (pytest fixture)
from test_cli_input import one_line_error, run_module_as_nobody

from app.cli.table import HEADER, Layout, fit_columns, shorten
from app.cli.top import Frame, Row, histogram_quantile, make_row, render, totals
from app.collector import RankView
from store import DEFAULT_BUCKETS_US, EventType
from store import layout as L
from store.reader import Snapshot, decode

INTERVAL_S = 2.0
SLIP_S = 0.5
TTL_S = 600  # longer than any test: a departed rank keeps its TTL for the whole test

# A rank paced at argv[1] transfers/s of argv[2] bytes, TX when argv[3] == "tx" else RX; nine in ten transfers
# take 30 us (the 25..50 bucket), one in ten 3000 us (2500..5000); every argv[4]-th transfer also records a
# "backend" error (0: none). With argv[5] > 0 it records that many transfers, closes its Exporter and says "done"
# (a departed rank); otherwise it records until killed.
RANK_SCRIPT = textwrap.dedent("""
    import os, sys, time
    from app import Exporter

    rate, nbytes, tx, error_every, limit = (float(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "tx",
                                            int(sys.argv[4]), int(sys.argv[5]))
    with Exporter(os.environ["RANK_AGENT"]) as exp:
        print("ready", flush=True)
        start, i = time.monotonic(), 0
        while not limit or i < limit:
            i += 1
            exp.record_transfer(3000 if i % 10 == 0 else 30, 5, nbytes, is_write=tx)
            if error_every and i % error_every == 0:
                exp.record_error("backend")
            delay = start + i / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
    print("done", flush=True)
""")


def start_paced_rank(reaper: Reaper, directory: Path, port: int, agent: str, local_rank: str, rate: float,
                     nbytes: int, direction: str, error_every: int = 0, limit: int = 0) -> RankProcess:
    env = {"NIXL_TELEMETRY_MULTIPROC_DIR": str(directory), "NIXL_TELEMETRY_PROMETHEUS_PORT": str(port),
           "NIXL_TELEMETRY_PROMETHEUS_LOCAL": "y", "NIXL_PROMETHEUS_MP_SERVE": "thread", "RANK_AGENT": agent,
           "LOCAL_RANK": local_rank}
    rank = start_rank(reaper, RANK_SCRIPT, env, (str(rate), str(nbytes), direction, str(error_every), str(limit)))
    assert rank.readline(START_DEADLINE_S) == "ready"
    return rank


def top(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "app", "top", *args], cwd=PROJECT_ROOT, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                          env=child_env({"NIXL_TELEMETRY_MP_STALE_TTL": str(TTL_S), **(env or {})}))


def top_json(directory: Path, interval: float = INTERVAL_S, **env: str) -> dict[str, dict[str, Any]]:
    """One ``top --once --json`` snapshot, by agent name."""
    done = top(str(directory), "--once", "--json", "--interval", str(interval), env=env)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    rows = json.loads(done.stdout)
    return {row["agent_name"]: row for row in rows}


def near(value: float, expected: float, interval: float = INTERVAL_S) -> bool:
    return abs(value - expected) <= expected * SLIP_S / interval


# -- the figures of real ranks ------------------------------------------------------------------------------


def test_json_figures_of_ranks_recording_at_known_rates(tmp_dir: Path, reaper: Reaper) -> None:
    port = free_port()
    start_paced_rank(reaper, tmp_dir, port, "sender", "0", 50, 4096, "tx", error_every=5)
    start_paced_rank(reaper, tmp_dir, port, "receiver", "1", 20, 1 << 20, "rx")
    gone = start_paced_rank(reaper, tmp_dir, port, "gone", "2", 1000, 64, "tx", limit=5)
    assert gone.readline(DEADLINE_S) == "done"
    gone.proc.wait(timeout=DEADLINE_S)

    rows = top_json(tmp_dir)
    assert set(rows) == {"sender", "receiver", "gone"}
    sender, receiver, departed = rows["sender"], rows["receiver"], rows["gone"]
    required = {"pid", "agent_name", "agent_instance", "local_rank", "state", "seconds_since_update",
                "tx_bytes_per_s", "rx_bytes_per_s", "tx_requests_per_s", "rx_requests_per_s", "xfer_time_p50_us",
                "xfer_time_p99_us", "errors"}
    assert all(required <= set(row) for row in rows.values())

    assert (sender["state"], sender["local_rank"], sender["agent_instance"], sender["ttl_left_s"]) == \
        ("live", "0", 0, None)
    assert near(sender["tx_bytes_per_s"], 50 * 4096), sender
    assert near(sender["tx_requests_per_s"], 50), sender
    assert sender["rx_bytes_per_s"] == sender["rx_requests_per_s"] == 0
    assert 25 < sender["xfer_time_p50_us"] <= 50 and 2500 < sender["xfer_time_p99_us"] <= 5000, sender
    assert near(sender["errors"], 50 / 5 * INTERVAL_S), sender

    assert receiver["local_rank"] == "1" and receiver["state"] == "live"
    assert near(receiver["rx_bytes_per_s"], 20 * (1 << 20)), receiver
    assert near(receiver["rx_requests_per_s"], 20), receiver
    assert receiver["tx_bytes_per_s"] == 0 and receiver["errors"] == 0
    assert 25 < receiver["xfer_time_p50_us"] <= 50 and 2500 < receiver["xfer_time_p99_us"] <= 5000, receiver

    assert departed["state"] == "departed" and departed["pid"] == gone.pid
    assert 0 < departed["ttl_left_s"] <= TTL_S and departed["seconds_since_update"] >= 0
    assert departed["tx_bytes_per_s"] == departed["tx_requests_per_s"] == departed["errors"] == 0
    assert departed["xfer_time_p50_us"] is None and departed["xfer_time_p99_us"] is None  # nothing observed


def test_table_shows_every_rank_and_a_totals_line(tmp_dir: Path, reaper: Reaper) -> None:
    port = free_port()
    start_paced_rank(reaper, tmp_dir, port, "sender", "0", 50, 4096, "tx", error_every=5)
    gone = start_paced_rank(reaper, tmp_dir, port, "gone", "1", 1000, 64, "tx", limit=3)
    assert gone.readline(DEADLINE_S) == "done"
    done = top(str(tmp_dir), "--once", "--interval", "1", "--ttl", "45")
    assert done.returncode == 0 and not done.stderr, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"{tmp_dir}: 1 live, 1 departed; over ")
    assert lines[1].split()[:6] == ["AGENT", "PID", "INST", "RANK", "STATE", "AGE(s)"]
    sender = next(line for line in lines if line.startswith("sender"))
    assert sender.split()[4] == "live"
    departed = next(line for line in lines if line.startswith("gone")).split()
    assert departed[4] == "departed" and 0 < int(departed[5].rstrip("s")) <= 45  # --ttl, not the variable's 600
    assert lines[-1].startswith("TOTAL") and "1 live" in lines[-1]


@pytest.mark.usefixtures("nixl_required")
def test_the_ttl_is_the_owners_when_none_is_given(tmp_dir: Path, reaper: Reaper) -> None:
    """Without --ttl or the variable, top counts the departed ranks' time with the TTL the owner applies (the
    address server a rank started: it answers /healthz once its interpreter has started)."""
    port = free_port()
    start_exporter_rank(reaper, tmp_dir, port, agent="owner", extra_env={"NIXL_TELEMETRY_MP_STALE_TTL": "10"})
    gone = start_exporter_rank(reaper, tmp_dir, port, agent="gone", extra_env={"NIXL_TELEMETRY_MP_STALE_TTL": "10"})
    gone.kill()
    wait_until_settled(port)  # (whichever rank started it: a rank's death moves nothing)
    done = top(str(tmp_dir), "--once", "--interval", "0.5", env={"NIXL_TELEMETRY_MP_STALE_TTL": ""})
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].endswith(f"; TTL 10 s (the owner's, on 127.0.0.1:{port})"), lines[0]
    departed = next(line.split() for line in lines if line.startswith("gone "))
    assert departed[4] == "departed" and 0 < int(departed[5].rstrip("s")) <= 10, departed


def test_reads_the_cpp_plugins_stores(tmp_dir: Path, reaper: Reaper) -> None:
    (rank,) = start_cpp_ranks(reaper, tmp_dir, free_port(), ["cpp"], [{"LOCAL_RANK": "3"}])
    rank.pump(size=4096, interval=0.05)
    rows = top_json(tmp_dir)
    tx, rx = rows["cpp-tx"], rows["cpp-rx"]
    assert tx["state"] == rx["state"] == "live" and tx["pid"] == rank.pid and tx["local_rank"] == "3"
    assert tx["tx_requests_per_s"] > 0 and tx["xfer_time_p50_us"] is not None
    # Each transfer moves 4096 bytes; the two counters are read a few words apart, at most one transfer apart.
    assert abs(tx["tx_bytes_per_s"] - 4096 * tx["tx_requests_per_s"]) <= 4096 / INTERVAL_S, tx
    rank.kill()
    rows = top_json(tmp_dir, interval=0.5)
    assert rows["cpp-tx"]["state"] == "departed" and rows["cpp-tx"]["tx_requests_per_s"] == 0


# -- the figures, from store contents ------------------------------------------------------------------------


def snapshot(counters: dict[int, int], xfer_buckets: dict[int, int], bounds: tuple[float, ...] = DEFAULT_BUCKETS_US,
             name: str = "nixl.1.1.0.mmap") -> Snapshot:
    c = [counters.get(slot, 0) for slot in range(L.SLOT_COUNT)]
    b = [0] * (L.SLOT_COUNT * L.BUCKET_SLOTS)
    for bucket, count in xfer_buckets.items():
        b[EventType.AGENT_XFER_TIME * L.BUCKET_SLOTS + bucket] = count
    snap = decode(store_bytes(1, 0, "a", "h", "0", bounds, c, [0] * L.SLOT_COUNT, b, [0] * L.SLOT_COUNT),
                  Path("/d") / name)
    assert isinstance(snap, Snapshot)
    return snap


def test_histogram_quantile_interpolates_as_prometheus() -> None:
    bounds = (10.0, 100.0, 1000.0)
    assert histogram_quantile(0.5, bounds, (0, 4, 0, 0)) == 55.0  # halfway through (10, 100]
    assert histogram_quantile(0.5, bounds, (2, 0, 0, 0)) == 5.0  # the first bucket starts at 0
    assert histogram_quantile(0.99, bounds, (1, 0, 0, 9)) == 1000.0  # in +Inf: the highest finite bound
    assert histogram_quantile(0.25, bounds, (1, 1, 1, 1)) == 10.0
    assert histogram_quantile(0.5, bounds, (0, 0, 0, 0)) is None  # nothing observed
    assert histogram_quantile(0.5, (), (3,)) is None  # no finite bucket


def test_interval_figures_wrap_modulo_2_64_and_sum_every_error_status() -> None:
    errors = {ev: 1 for ev in EventType if ev.name.startswith("AGENT_ERR_")}
    before = snapshot({EventType.AGENT_TX_BYTES: 2**64 - 100, EventType.AGENT_ERR_BACKEND: 2**64 - 1},
                      {3: 2**64 - 1})
    after = snapshot({EventType.AGENT_TX_BYTES: 300, EventType.AGENT_TX_REQUESTS_NUM: 8, **errors,
                      EventType.AGENT_ERR_BACKEND: 1}, {3: 3, 4: 1})
    row = make_row(RankView(after, True, 0.0, None), before, 2.0)
    assert row.tx_bytes_per_s == 200.0 and row.tx_requests_per_s == 4.0 and row.rx_bytes_per_s == 0.0
    assert row.errors == 11 + 2  # eleven statuses once, and backend across its wrap
    assert row.xfer_counts is not None and row.xfer_counts[3:5] == (4, 1)
    assert 50 < (row.xfer_time_p50_us or 0) <= 100 and 100 < (row.xfer_time_p99_us or 0) <= 250


def test_a_store_that_appeared_during_the_interval_has_counts_but_no_rates() -> None:
    new = snapshot({EventType.AGENT_RX_BYTES: 500, EventType.AGENT_ERR_CANCELED: 2}, {0: 2})
    row = make_row(RankView(new, True, 0.0, None), None, 1.0)
    assert row.rx_bytes_per_s is None and row.tx_requests_per_s is None  # how long it existed is unknown
    assert row.errors == 2 and row.xfer_time_p50_us == 5.0  # it started at zero: all it holds is new
    first_look = make_row(RankView(new, True, 0.0, None), None, None)
    assert first_look.errors is None and first_look.xfer_time_p99_us is None


def test_totals_merge_histograms_only_across_one_set_of_bounds() -> None:
    a = make_row(RankView(snapshot({EventType.AGENT_TX_BYTES: 10}, {0: 1}), True, 0.0, None),
                 snapshot({}, {}), 1.0)
    b = make_row(RankView(snapshot({EventType.AGENT_TX_BYTES: 30}, {1: 1}, name="nixl.2.1.0.mmap"), False, 1.0,
                          5.0), snapshot({}, {}, name="nixl.2.1.0.mmap"), 1.0)
    doc = totals([a, b])
    assert (doc["live"], doc["departed"], doc["tx_bytes_per_s"], doc["errors"]) == (1, 1, 40.0, 0)
    assert doc["xfer_time_p50_us"] == 10.0
    other = make_row(RankView(snapshot({}, {0: 1}, bounds=(7.0,)), True, 0.0, None), snapshot({}, {}, (7.0,)), 1.0)
    assert totals([a, other])["xfer_time_p99_us"] is None


# -- the table at any width ----------------------------------------------------------------------------------

KEY_COLUMNS = ("AGENT", "PID", "P50", "P99", "ERRORS")
MAX_PID = 4194303  # pid_max's ceiling on Linux: the widest a PID cell gets


def layout_row(agent: str, pid: int, departed: bool = False) -> Row:
    return Row("s", agent, pid, 0, "12", "h", "departed" if departed else "live", 600.0 if departed else None, 0.0,
               1.07e9, 9.91e8, 105.0, 90.0, 91.0, 6750.0, 12, None, DEFAULT_BUCKETS_US)


def fitted_columns(text: str) -> list[str]:
    """A header line's column names (two of them hold a space)."""
    return re.findall(r"AGE\(s\)|[TR]X B/s|[TR]X REQ/s|\S+", text)


def test_fit_columns_hides_the_least_important_first_then_shortens_agent() -> None:
    # The widths of a typical table: a 16-character agent name, a 7-digit pid, "departed 600s", figures.
    widths = [16, 7, 4, 4, 13, 6, 6, 6, 8, 8, 4, 6, 6]
    full = fit_columns(widths, None)
    assert full.hidden == [] and full.width(widths) == sum(widths) + 2 * 12
    assert fit_columns(widths, full.width(widths)) == full
    previous: list[str] = []
    for width in range(full.width(widths), 34, -1):
        layout = fit_columns(widths, width)
        shown = [HEADER[i] for i in layout.columns]
        assert layout.width(widths) <= width and set(KEY_COLUMNS) <= set(shown), (width, layout)
        assert shown == [name for name in HEADER if name not in layout.hidden]  # in the table's order
        assert layout.hidden[:len(previous)] == previous, width  # once hidden, hidden at every narrower width
        previous = layout.hidden
        if layout.agent_width < 16:  # the last resort: every other column has gone, and the gaps narrowed
            assert shown == list(KEY_COLUMNS) and layout.gap == 1, width
    assert fit_columns(widths, 79).hidden == ["INST", "AGE(s)", "RX REQ/s", "TX REQ/s", "RANK"]
    assert [HEADER[i] for i in fit_columns(widths, 62).columns] == [*KEY_COLUMNS[:2], "STATE", *KEY_COLUMNS[2:]]
    assert fit_columns(widths, 61).columns == tuple(HEADER.index(name) for name in KEY_COLUMNS)
    # 40 columns: the key columns one space apart, and what is left for the agent's name.
    assert fit_columns(widths, 39) == Layout(tuple(HEADER.index(name) for name in KEY_COLUMNS), 39 - 23 - 4, 1)
    narrowest = fit_columns(widths, 10)  # too narrow for the key columns: AGENT stops at its heading's width
    assert narrowest.agent_width == len("AGENT") and [HEADER[i] for i in narrowest.columns] == list(KEY_COLUMNS)


def test_shorten_keeps_both_ends_of_a_name() -> None:
    assert shorten("prefill-worker-07", 17) == "prefill-worker-07"
    assert shorten("prefill-worker-07", 9) == "pref~r-07"
    assert shorten("prefill-worker-07", 6) == "pre~07"
    assert len(shorten("prefill-worker-07", 5)) == 5 and shorten("ab", 1) == "a"


def test_render_keeps_the_key_columns_at_every_width_from_40() -> None:
    names = ("demo-agent-0", "prefill-worker-node-07-rank-12", "d")
    rows = [layout_row(names[0], 2097), layout_row(names[1], MAX_PID, departed=True), layout_row(names[2], 7)]
    frame = Frame(Path("/run/nixl_metrics"), rows, 1.0, ["a warning that is longer than the narrowest view"], None,
                  ttl="TTL 600 s (the owner's, on 0.0.0.0:9090)")
    for width in range(39, 180):  # 40 columns and up: the live view leaves the last one blank
        lines = [text for text, _ in render(frame, width=width)]
        assert all(len(line) <= width for line in lines), (width, lines)
        header = next(line for line in lines if line.startswith("AGENT"))
        shown = fitted_columns(header)
        assert shown[:2] == ["AGENT", "PID"] and shown[-3:] == ["P50", "P99", "ERRORS"], (width, header)
        hidden = [name for name in HEADER if name not in shown]
        assert (" ".join(" ".join(lines).split()).count("hidden at this width: " + ", ".join(
            name for name in ("INST", "AGE(s)", "RX REQ/s", "TX REQ/s", "RANK", "RX B/s", "TX B/s", "STATE")
            if name in hidden)) == 1) == bool(hidden), (width, lines)
        for row in rows:
            cells = next(line for line in lines if line.split()[1:2] == [str(row.pid)]).split()
            assert cells[-3:] == ["91us", "6.75ms", "12"], (width, cells)
            assert cells[0] == shorten(row.agent_name, len(cells[0])), (width, cells)
            assert len(cells[0]) >= min(len(row.agent_name), len("AGENT")), (width, cells)
    assert "STATE" in next(text for text, _ in render(frame, width=79) if text.startswith("AGENT"))
    wide = [text for text, _ in render(frame, width=None)]
    assert fitted_columns(wide[1]) == list(HEADER) and not any(line.startswith("hidden") for line in wide)


# -- an onlooker: the directory is left as it was ----------------------------------------------------------


def directory_state(directory: Path) -> dict[str, Any]:
    st = directory.stat()
    files = {}
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        s = entry.stat(follow_symlinks=False)
        files[entry.name] = (s.st_ino, s.st_mode, s.st_size, s.st_mtime_ns, s.st_ctime_ns,
                             Path(entry.path).read_bytes() if entry.is_file(follow_symlinks=False) else None)
    return {"dir": (st.st_mtime_ns, st.st_ctime_ns, st.st_mode), "files": files}


def test_leaves_the_directory_unchanged_even_what_an_owner_would_reap(tmp_dir: Path, reaper: Reaper) -> None:
    port = free_port()
    gone = start_paced_rank(reaper, tmp_dir, port, "gone", "0", 1000, 64, "tx", limit=3)
    assert gone.readline(DEADLINE_S) == "done"
    gone.proc.wait(timeout=DEADLINE_S)
    forge_store(tmp_dir, pid=11, agent_name="past-ttl", last_update=1)  # departed long ago
    forge_store(tmp_dir, pid=12, agent_name="from-another-boot", last_update=2**63)  # stamped ahead of our clock
    (tmp_dir / L.store_file_name(13, 1, 0)).write_bytes(b"\0" * 100)  # not a store, and nobody holds it
    (tmp_dir / "notes.txt").write_text("junk")
    before = directory_state(tmp_dir)

    done = top(str(tmp_dir), "--once", "--json", "--interval", "0.5", env={"NIXL_TELEMETRY_MP_STALE_TTL": "0"})
    assert done.returncode == 0, done.stderr
    rows = {row["agent_name"]: row for row in json.loads(done.stdout)}
    assert set(rows) == {"gone", "past-ttl", "from-another-boot"}
    assert all(row["state"] == "departed" and row["ttl_left_s"] == 0 for row in rows.values())
    assert "nixl.13.1.0.mmap is not a valid store" in done.stderr and "Traceback" not in done.stderr
    assert top(str(tmp_dir), "--once", "--interval", "0.5", env={"NIXL_TELEMETRY_MP_STALE_TTL": "0"}).returncode == 0

    assert directory_state(tmp_dir) == before  # nothing reaped, created (no owner lock file), or written


# -- bad input: one line, never a traceback -----------------------------------------------------------------


def test_a_missing_directory_is_one_line(tmp_path: Path) -> None:
    one_line_error(top(str(tmp_path / "nope"), "--once"), 1, "cannot list", str(tmp_path / "nope"),
                   "No such file or directory")
    (tmp_path / "file").write_text("")
    one_line_error(top(str(tmp_path / "file"), "--json"), 1, "cannot list", "Not a directory")


def test_no_directory_given_nor_set_is_one_line() -> None:
    one_line_error(top("--once"), 1, "NIXL_TELEMETRY_MULTIPROC_DIR")


def test_the_directory_defaults_to_the_variable(tmp_dir: Path) -> None:
    forge_store(tmp_dir, pid=21, agent_name="from-env")
    done = top("--json", "--interval", "0.2", env={"NIXL_TELEMETRY_MULTIPROC_DIR": str(tmp_dir)})
    assert done.returncode == 0 and [r["agent_name"] for r in json.loads(done.stdout)] == ["from-env"], done.stderr


def test_an_empty_directory_or_one_of_junk_says_why(tmp_dir: Path) -> None:
    one_line_error(top(str(tmp_dir), "--once", "--interval", "0.1"), 1, f"no stores in {tmp_dir}")
    (tmp_dir / "nixl.mmap").write_text("x")
    (tmp_dir / "core").write_bytes(os.urandom(64))
    one_line_error(top(str(tmp_dir), "--json", "--interval", "0.1"), 1, "2 other files",
                   "nixl.<pid>.<run_marker>.<instance>.mmap")
    (tmp_dir / L.store_file_name(5, 5, 0)).write_bytes(b"junk")
    one_line_error(top(str(tmp_dir), "--once", "--interval", "0.1"), 1, "no readable store",
                   "nixl.5.5.0.mmap is not a valid store")


@pytest.mark.parametrize("args", [("--interval", "0"), ("--interval", "nan"), ("--ttl", "-1"), ("--ttl", "x")])
def test_bad_flags_are_one_line(tmp_dir: Path, args: tuple[str, ...]) -> None:
    one_line_error(top(str(tmp_dir), "--once", *args), 2, args[0])


def test_a_bad_ttl_variable_is_one_line(tmp_dir: Path) -> None:
    one_line_error(top(str(tmp_dir), "--once", env={"NIXL_TELEMETRY_MP_STALE_TTL": "soon"}), 2,
                   "NIXL_TELEMETRY_MP_STALE_TTL", "soon")


def test_a_directory_this_user_cannot_read_is_one_line(root_owned_dir: Path, tmp_path: Path) -> None:
    private = root_owned_dir / "private"
    private.mkdir(mode=0o700)
    forge_store(private, pid=31)
    done = run_module_as_nobody("top", str(private), "--once", "--interval", "0.1", env=child_env(),
                                tmp_path=tmp_path)
    one_line_error(done, 1, "cannot list", str(private), "Permission denied")


def test_the_live_view_needs_a_terminal(tmp_dir: Path) -> None:
    forge_store(tmp_dir, pid=41)
    one_line_error(top(str(tmp_dir)), 1, "needs a terminal", "--once")


# -- the live view, under a real terminal -------------------------------------------------------------------


class Tmux:
    """A private tmux server (its own socket) running one window; killed, with what runs in it, on close."""

    def __init__(self, command: str, width: int, height: int) -> None:
        self.socket = f"nixl-top-{uuid.uuid4().hex[:12]}"
        self.tmux("new-session", "-d", "-s", "top", "-x", str(width), "-y", str(height), command)

    def tmux(self, *args: str) -> str:
        done = subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True, text=True, timeout=DEADLINE_S)
        assert done.returncode == 0, done.stderr
        return done.stdout

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", "top")

    def wait_for(self, condition: Callable[[str], bool], what: str) -> str:
        try:
            return wait_until(lambda: (lambda text: text if condition(text) else None)(self.screen()),
                              timeout=START_DEADLINE_S, interval=0.1)
        except AssertionError:
            raise AssertionError(f"{what}; the screen:\n{self.screen()}") from None

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True, timeout=DEADLINE_S)


@pytest.fixture
def tmux_window(tmp_path: Path) -> Iterator[Callable[[str, int, int], Tmux]]:
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (.ci/run installs it)")
    windows: list[Tmux] = []

    def start(script: str, width: int = 140, height: int = 30) -> Tmux:
        path = tmp_path / f"window{len(windows)}.sh"
        env = child_env({"NIXL_TELEMETRY_MP_STALE_TTL": str(TTL_S)})
        exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items()
                          if k.isidentifier() and k not in ("TERM", "TMUX", "TMUX_PANE"))
        # A size exported once by a shell, and stale: the view must follow the window's real size.
        exports += "export COLUMNS=80 LINES=24\n"
        # As an interactive shell does, the script outlives a Ctrl-C meant for the program it runs (a trap with a
        # command, not '': an ignored SIGINT would be inherited by the program).
        path.write_text(f"{exports}trap : INT\ncd {shlex.quote(str(PROJECT_ROOT))}\n{script}\nsleep 600\n")
        windows.append(Tmux(f"sh {shlex.quote(str(path))}", width, height))
        return windows[-1]

    yield start
    for window in windows:
        window.close()


def stty_shown(screen: str, marker: str) -> bool:
    """The shell printed ``marker`` and then all of ``stty -a`` (its local modes line, last but one, included):
    a capture taken between the two would find no terminal modes to check."""
    return marker in screen and "isig" in screen.split(marker, 1)[1]


def terminal_restored(screen: str, marker: str) -> bool:
    """The program is gone from the screen, and the terminal is back in its usual cooked, echoing mode."""
    stty = screen.split(marker, 1)[1].split()
    return "AGENT" not in screen and "icanon" in stty and "echo" in stty


def test_live_view_draws_the_ranks_sorts_survives_resizes_and_quits(tmp_dir: Path, reaper: Reaper,
                                                                    tmux_window: Callable[..., Tmux]) -> None:
    port = free_port()
    start_paced_rank(reaper, tmp_dir, port, "sender", "0", 50, 4096, "tx", error_every=5)
    start_paced_rank(reaper, tmp_dir, port, "receiver", "1", 20, 1 << 20, "rx")
    command = f"{shlex.quote(sys.executable)} -m app top {shlex.quote(str(tmp_dir))} --interval 0.5"
    # The second view waits for a line from the test: started at once, it would take the screen (the alternate
    # one) before a capture could see what the shell printed after the first.
    window = tmux_window(f"echo BEFORE\n{command}\necho QUIT=$?; stty -a; read again\n{command}\n"
                         "echo INTERRUPTED=$?; stty -a")

    def rows_with_rates(screen: str) -> bool:
        lines = screen.splitlines()
        sender = [line for line in lines if line.startswith("sender ")]
        receiver = [line for line in lines if line.startswith("receiver ")]
        wide = any(line.startswith("AGENT") and line.endswith("ERRORS") for line in lines)  # past column 80
        return wide and bool(sender and receiver) and "k" in sender[0] and "M" in receiver[0] and \
            "waiting" not in lines[0]

    screen = window.wait_for(rows_with_rates, "the ranks' rows with their rates were never drawn")
    assert "AGENT" in screen and "TOTAL" in screen and "sort: rank" in screen
    window.tmux("send-keys", "-t", "top", "s")
    window.wait_for(lambda s: "sort: tx" in s, "s did not change the sort")
    window.tmux("resize-window", "-t", "top", "-x", "20", "-y", "4")  # too small for anything: must not crash
    window.wait_for(lambda s: "more line" in s or s.strip().startswith(str(tmp_dir)[:10]), "narrow view not drawn")
    window.tmux("resize-window", "-t", "top", "-x", "140", "-y", "30")
    window.wait_for(rows_with_rates, "the view was not redrawn after growing back")
    window.tmux("resize-window", "-t", "top", "-x", "80", "-y", "24")  # the figures stay, the rest is named

    def fits_80_columns(screen: str) -> bool:
        lines = screen.splitlines()
        header = [line for line in lines if line.startswith("AGENT")]
        return bool(header) and header[0].split()[-3:] == ["P50", "P99", "ERRORS"] and any(
            line.startswith("hidden at this width: INST") for line in lines)

    screen = window.wait_for(fits_80_columns, "at 80 columns, P50, P99 and ERRORS were cut or the hidden ones "
                                              "not named")
    # The title, the keys and the note on hidden columns wrap between words: none is cut at the edge.
    above, _, below = screen.partition("\nAGENT")
    words = re.sub(r"over [0-9.]+ s", "over S s", " ".join(above.split()))  # the interval as measured
    assert f"{tmp_dir}:" in above.replace("\n", "") and "2 live, 0 departed; over S s; " \
        f"TTL {TTL_S} s ($NIXL_TELEMETRY_MP_STALE_TTL) sort: tx (s: next, r: reverse) q: quit" in words, screen
    assert "(widen the terminal to see them)" in " ".join(below.split()), screen
    window.tmux("resize-window", "-t", "top", "-x", "140", "-y", "30")
    window.wait_for(rows_with_rates, "the view was not redrawn after growing back")

    window.tmux("send-keys", "-t", "top", "q")
    screen = window.wait_for(lambda s: stty_shown(s, "QUIT="), "q did not quit")
    assert "QUIT=0" in screen and "BEFORE" in screen and "Traceback" not in screen
    assert terminal_restored(screen, "QUIT=0"), screen

    window.tmux("send-keys", "-t", "top", "Enter")
    window.wait_for(rows_with_rates, "the second view never drew the ranks")
    window.tmux("send-keys", "-t", "top", "C-c")
    screen = window.wait_for(lambda s: stty_shown(s, "INTERRUPTED="), "Ctrl-C did not stop the view")
    assert "INTERRUPTED=130" in screen and "Traceback" not in screen
    assert terminal_restored(screen, "INTERRUPTED=130"), screen


def test_live_view_of_an_empty_directory_says_why(tmp_dir: Path, tmux_window: Callable[..., Tmux]) -> None:
    window = tmux_window(f"{shlex.quote(sys.executable)} -m app top {shlex.quote(str(tmp_dir))}\necho QUIT=$?")
    window.wait_for(lambda s: f"no stores in {tmp_dir}" in s.replace("\n", ""), "the empty view does not say why")
    window.tmux("send-keys", "-t", "top", "q")
    window.wait_for(lambda s: "QUIT=0" in s, "q did not quit")
    assert os.listdir(tmp_dir) == []  # looking never creates anything (no owner lock file)


@pytest.mark.parametrize("columns", [40, 60, 80])
def test_live_view_keeps_the_key_columns_in_a_narrow_terminal(columns: int, tmp_dir: Path, reaper: Reaper,
                                                              tmux_window: Callable[..., Tmux]) -> None:
    live = start_paced_rank(reaper, tmp_dir, free_port(), "prefill-worker-07", "0", 50, 4096, "tx", error_every=5)
    # The widest cells a row has: a 7-digit pid, and a departed rank's state with its time left.
    forge_store(tmp_dir, pid=MAX_PID, agent_name="decode-worker-3", local_rank="3")
    window = tmux_window(f"{shlex.quote(sys.executable)} -m app top {shlex.quote(str(tmp_dir))} --interval 0.5",
                         columns, 30)

    def row_of(lines: list[str], pid: int) -> list[str]:
        return next((line.split() for line in lines if line.split()[1:2] == [str(pid)]), [])

    def figures_drawn(screen: str) -> bool:
        lines = screen.splitlines()
        cells = row_of(lines, live.pid)
        # (the title of the first frame, read once, wraps at these widths: no word of it may be left) ... and the
        # same screen captured again: tmux may be captured in the middle of curses' redraw of a new layout.
        return "waiting for a" not in " ".join(screen.split()) and len(cells) > 2 and cells[-2] != "-" and \
            bool(row_of(lines, MAX_PID)) and window.screen() == screen

    screen = window.wait_for(figures_drawn, f"at {columns} columns, the ranks' figures were never drawn")
    lines = screen.splitlines()
    assert all(len(line) <= columns for line in lines), screen
    header = fitted_columns(next(line for line in lines if line.startswith("AGENT")))
    assert header[:2] == ["AGENT", "PID"] and header[-3:] == ["P50", "P99", "ERRORS"], screen
    for pid, agent in ((live.pid, "prefill-worker-07"), (MAX_PID, "decode-worker-3")):
        cells = row_of(lines, pid)  # one line each, whole: its agent first, its errors last
        assert cells[0] == shorten(agent, len(cells[0])) and len(cells[0]) >= len("AGENT"), screen
        assert cells[-1].isdigit() and len(cells) == len(header) + ("departed" in cells), screen
    assert "Traceback" not in screen
    words = " ".join(screen.split())
    if columns == 80:  # the state and both byte rates fit beside the key columns (the rank would need 6 more)
        assert header == ["AGENT", "PID", "STATE", "TX B/s", "RX B/s", "P50", "P99", "ERRORS"], screen
        assert "hidden at this width: INST, AGE(s), RX REQ/s, TX REQ/s, RANK (widen the terminal" in words, screen
    else:
        assert header == list(KEY_COLUMNS), screen
        assert "hidden at this width: INST, AGE(s), RX REQ/s, TX REQ/s, RANK, RX B/s, TX B/s, STATE" in words, screen
    if columns == 40:
        assert row_of(lines, live.pid)[0] != "prefill-worker-07", screen  # shortened rather than a column dropped
