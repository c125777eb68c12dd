"""``python -m bench --check``: an unmet target is a failing exit status, not only a table row.

The bench's measurements take seconds to minutes and depend on the machine's
load, so the takeover scenario is replaced here by one that reports fixed
figures in both serving modes (a takeover of two seconds where the target is
under half a second, or of 0.1 s); the rest is the real ``python -m bench``
entry point, its report and its exit status.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from support_e2e import REPO

SCRIPT = """
import sys
import bench.__main__ as bench_main
from bench import scenarios
from app.config import SERVE_MODES

def takeover(settings, results):
    for mode in SERVE_MODES:
        results.takeover[mode] = [float(sys.argv[1])] * settings.takeover_repeats

scenarios.takeover = takeover
sys.exit(bench_main.main(sys.argv[2:]))
"""

TAKEOVER_ROW = "takeover < 0.5 s (median; max in brackets)"


def _bench(seconds: float, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", SCRIPT, str(seconds), "--scenarios", "takeover", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(("seconds", "args", "unmet"), [
    (2.0, ("--check",), TAKEOVER_ROW),
    (2.0, (), None),  # without --check the report is the whole answer
    (0.1, ("--check",), None),
], ids=["slow-checked", "unmet-unchecked", "met-checked"])
def test_check_fails_the_run_on_an_unmet_target(seconds: float, args: tuple[str, ...], unmet: str | None) -> None:
    done = _bench(seconds, *args)
    assert done.returncode == (1 if unmet else 0), done.stderr
    rows = {cells[0]: cells[1:] for cells in ([c.strip() for c in line.strip("|").split("|")]
                                              for line in done.stdout.splitlines() if line.startswith("| "))}
    # Both serving modes are reported; the default (helper) mode is judged, the thread mode's verdict is beside it.
    ms = f"{seconds * 1e3:.0f} ms"
    assert rows[TAKEOVER_ROW] == [f"helper {ms} ({ms}); thread {ms} ({ms})",
                                  "NOT met (thread mode: not met)" if seconds >= 0.5 else "met (thread mode: met)"]
    named = [line.partition("] ")[2] for line in done.stderr.splitlines() if "--check:" in line]
    assert named == ([f"--check: 1 target(s) NOT met: {unmet}"] if unmet and "--check" in args else []), done.stderr


# The plug-in scenario replaced by fixed figures: at every size ours takes 1.5 ms where the plug-in takes 1 ms (the
# 8-rank miss of docs/performance.md, 0.7x where the target is 1.5x).
PLUGIN_SCRIPT = """
import sys
import bench.__main__ as bench_main
from bench import scenarios

def plugin(settings, results):
    for count in settings.ranks:
        results.plugin[count] = dict(prom_ours=[1.5e-3], prom_cpp=[1e-3], plain_ours=[1e-3], plain_cpp=[1e-3],
                                     wire_ours=10, wire_cpp=100, gzip_cpp=False, bytes_ours=100, bytes_cpp=100,
                                     samples_ours=count, samples_cpp=count + 7)

scenarios.plugin = plugin
sys.exit(bench_main.main(sys.argv[1:]))
"""


def plugin_rows(*args: str) -> tuple[dict[str, list[str]], str]:
    done = subprocess.run([sys.executable, "-c", PLUGIN_SCRIPT, "--scenarios", "plugin", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == (1 if "--check" in args else 0), done.stderr
    rows = {cells[0]: cells[1:] for cells in ([c.strip() for c in line.strip("|").split("|")]
                                              for line in done.stdout.splitlines() if line.startswith("| "))}
    return rows, done.stdout


PLUGIN_ROW = "scrape of {} ranks >= 1.5x faster than the C++ plug-in (Prometheus's GET, a fresh connection each)"


def test_quick_run_says_what_it_measured_and_that_the_full_run_judges() -> None:
    rows, text = plugin_rows("--quick", "--check")
    assert rows[PLUGIN_ROW.format(8)] == ["0.7x", "NOT met (quick run)"]  # still a miss, and --check still fails
    assert PLUGIN_ROW.format(64) not in rows
    prose = " ".join(text.split())
    assert "A quick run (`--quick`): 8 ranks only," in prose
    assert "The targets are judged by the full run (`python -m bench --check`: 8, 64, 256, 1024 ranks" in prose
    assert "Quick run: 8 ranks only, few repeats; the targets are judged by the full run" in prose


def test_full_run_judges_every_size_without_the_quick_runs_words() -> None:
    rows, text = plugin_rows()
    assert {size: rows[PLUGIN_ROW.format(size)] for size in (8, 64, 256, 1024)} == \
        {size: ["0.7x", "NOT met"] for size in (8, 64, 256, 1024)}
    assert "quick run" not in text.lower()


# Both serving modes and the persistent-connection figures: the helper's scrape 2x the plug-in's speed on a fresh
# connection and on a persistent one, the thread's 1.2x; the helper closes 0.2 ms after the body, the thread 3 ms;
# both answer 20 GETs on one connection, the plug-in 1.
MODES_SCRIPT = """
import sys
import bench.__main__ as bench_main
from bench import scenarios

def plugin(settings, results):
    for count in settings.ranks:
        e = {}
        for side, ms, eof, kept in (("ours", 1.0, 0.2, 20), ("thread", 2 / 1.2, 3.0, 20), ("cpp", 2.0, 0.01, 1)):
            e.update({f"prom_{side}": [ms / 1e3], f"kept_{side}": [ms / 1e3], f"plain_{side}": [ms / 1e3],
                      f"eof_{side}": [eof / 1e3], f"one_connection_{side}": kept, f"wire_{side}": 10,
                      f"bytes_{side}": 100, f"gzip_{side}": side != "cpp", f"samples_{side}": count})
        results.plugin[count] = e

scenarios.plugin = plugin
sys.exit(bench_main.main(sys.argv[1:]))
"""


def test_the_plugin_rows_judge_each_serving_mode_and_the_connections() -> None:
    done = subprocess.run([sys.executable, "-c", MODES_SCRIPT, "--scenarios", "plugin", "--ranks", "8"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    rows = {cells[0]: cells[1:] for cells in ([c.strip() for c in line.strip("|").split("|")]
                                              for line in done.stdout.splitlines() if line.startswith("| "))}
    assert rows[PLUGIN_ROW.format(8)] == ["helper 2.00x; thread 1.20x", "met (thread mode: not met)"]
    persistent = "scrape of 8 ranks >= 1.5x faster than the C++ plug-in (Prometheus's GET, one persistent " \
                 "connection per server)"
    assert rows[persistent] == ["helper 2.00x; thread 1.20x", "met (thread mode: not met)"]
    assert rows["the server closes <= 1 ms after the body (Connection: close; median, worst size)"] == [
        "helper 0.200 ms; thread 3.00 ms (plug-in 0.010 ms)", "met (thread mode: not met)"]
    assert rows["20 of 20 GETs answered on one persistent connection (fewest, over the sizes)"] == [
        "helper 20; thread 20 (plug-in 1)", "met (thread mode: met)"]
    # The servers' own rows: each server's figures, and the plug-in's ratio to it.
    assert "| 8 | ours: helper (its own process) | 1.00 | 2.0x | 1.00 | 2.0x | 1.00 | 2.0x | 10 | 100 | 8 |" in \
        done.stdout
    assert "| 8 | C++ plug-in | 2.00 | - | 2.00 | - | 2.00 | - | 10 (no gzip) | 100 | 8 |" in done.stdout
    assert "| 8 | ours: thread (in the rank) | 20 of 20 | 3.00 |" in done.stdout
    assert "| 8 | C++ plug-in | 1 of 20 | 0.010 |" in done.stdout


# The succession scenario (who serves the address), with fixed figures: server deaths with idle ranks (none
# failed, the spare answering in 10 ms, a new spare within 200 ms) and recording ranks (one failed request, a
# miss), a stopped server replaced in 1.5 s, thread mode and a C++ owner, the waiting CPU, one failed request of
# 600 at a rank's death (a miss), the job's end without loss and with one, the idle server's cost and a new run.
SUCCESSION_SCRIPT = """
import sys
import bench.__main__ as bench_main
from bench import succession

def scenario(settings, results):
    results.succession.update({
        "rank_death": [[1, 600]],
        "server_death": {
            "idle": {"failed": [0, 0], "sent": [100, 90], "spare_s": [0.01, 0.012], "new_spare_s": [0.2, 0.15]},
            "recording": {"failed": [1, 0], "sent": [100, 90], "spare_s": [0.01, 0.02], "new_spare_s": [0.2, 0.3]}},
        "stopped": [{"replaced_s": 1.5, "failed": 0, "sent": 300}],
        "thread": [0.25], "cpp_owner": [0.3],
        "cpu": {"rank": 0.0, "spare": 0.01},
        "end": {"closed at once": [0, 0], "SIGKILLed at once": [0, 1]},
        "idle": {"cpu_per_s": 0.001, "free_after_ttl_s": 0.3},
        "new_run": {"same_failed": 0, "other_s": 0.04}})

succession.succession = scenario
sys.exit(bench_main.main(sys.argv[1:]))
"""


def test_the_succession_rows_judge_each_figure() -> None:
    done = subprocess.run([sys.executable, "-c", SUCCESSION_SCRIPT, "--scenarios", "succession", "--check"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0, done.stdout  # --check: a server death's failed request, a rank death, a job end
    rows = {cells[0]: cells[1:] for cells in (
        [c.strip() for c in line.strip().strip("|").split("|")] for line in done.stdout.splitlines()
        if line.startswith("|"))}
    assert rows["rank death, the starting rank's included: no failed request (polled every 5 ms)"] == \
        ["1 of 600", "NOT met"]
    assert rows["server death, ranks idle: no failed request (polled every 5 ms)"] == ["0 of 190", "met"]
    assert rows["server death, ranks recording: no failed request (polled every 5 ms)"] == ["1 of 190", "NOT met"]
    assert rows["server death, ranks idle: the spare answers within 500 ms"] == ["11 ms median", "met"]
    assert rows["server death, ranks recording: a new spare within 1 s of each"] == ["300 ms at most", "met"]
    assert rows["a stopped server replaced within 4 s"] == ["1.50 s at most", "met"]
    assert rows["thread mode, the serving rank SIGKILLed, ranks recording 10/s: served again within 500 ms"] == \
        ["250 ms median", "met"]
    assert rows["a waiting spare's CPU per 5 s: under 0.05 s"] == ["0.010 s", "met"]
    assert rows["job end, ranks closed at once: every final value at both scrapers of an HA pair"] == \
        ["0 of 2 trials lost some", "met"]
    assert rows["job end, ranks SIGKILLed at once: every final value at both scrapers of an HA pair"] == \
        ["1 of 2 trials lost some", "NOT met"]
    assert rows["idle server with 200 departed stores: at most 0.05 CPU s per s"] == ["0.0010 s", "met"]
    assert rows["the address free within 1 s after the TTL"] == ["0.30 s", "met"]
    assert rows["a new run of another directory on the same port: served within 1 s"] == ["40 ms", "met"]
