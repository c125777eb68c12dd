"""Nothing recorded is lost: N processes x M threads x K events, the owner SIGKILLed mid-run, a takeover and a
forked child recording on its own; the scrape publishes exactly what each process recorded.

Both ways of serving.  From a thread, the owner is the serving rank, and its death is the takeover.  With an
address server, the rank that started it is killed (its death moves nothing: its values stay published as
departed), and so are its server and the server's spare: the next rank to record starts another."""

from __future__ import annotations

import os
import signal

import pytest
from support import (
    START_DEADLINE_S,
    free_port,
    healthz,
    kill_server_and_spare,
    parse_exposition,
    reaper_fixture,  # noqa: F401  (a fixture)
    scrape,
    wait_until,
)
from support_reliability import diff, expected_series, project, start_workload_ranks

from store import DEFAULT_BUCKETS_US

pytestmark = pytest.mark.reliability

RANKS, THREADS, K = 4, 4, 2000  # two phases of K: 4 x 4 x 4000 iterations (each iteration 4-9 events)


@pytest.mark.timeout(180)
def test_scrape_totals_equal_recorded_totals_across_owner_kill_and_fork(tmp_dir, reaper, serve_mode):
    port = free_port()
    ranks = start_workload_ranks(reaper, RANKS, tmp_dir, port, {"NIXL_TELEMETRY_MP_STALE_TTL": "3600"})
    owners = [r for r in ranks if r.serving_at_start]
    assert len(owners) == 1, [(r.pid, r.serving_at_start) for r in ranks]
    owner = owners[0]
    others = [r for r in ranks if r is not owner]
    server = healthz(port)["owner"]["server_pid"]  # (thread mode: the owner itself)

    # Phase 1: everyone, the owner included, records K iterations per thread.
    for n, rank in enumerate(ranks):
        rank.send("run", threads=THREADS, k=K, seed=n, tag=10 + n)
    recorded = {rank.pid: rank.answer()["tally"] for rank in ranks}
    published = parse_exposition(scrape(port))
    for rank in ranks:
        assert not diff(expected_series(recorded[rank.pid], DEFAULT_BUCKETS_US), project(published, rank.pid))

    # Phase 2: the others record at full speed (one of them forks while its threads record) and the owner,
    # whose every value was reported above, is SIGKILLed meanwhile.
    for n, rank in enumerate(others):
        rank.send("run", threads=THREADS, k=K, seed=100 + n, tag=20 + n, fork_k=K if n == 0 else 0)
    os.kill(owner.pid, signal.SIGKILL)
    owner.process.proc.wait(timeout=10)
    if serve_mode == "helper":
        assert server != owner.pid
        assert server in kill_server_and_spare(port)
    child = None
    for n, rank in enumerate(others):
        answer = rank.answer()
        if n == 0:  # the child's line comes first: the parent answers after waiting for it
            child, answer = answer, rank.answer()
            assert answer["child_status"] == 0 and answer["child_pid"] == child["child"], answer
        assert answer["done"], answer
        recorded[rank.pid] = answer["tally"]
    assert child is not None
    recorded[child["child"]] = child["tally"]

    # The next writer to export takes the address over.
    for rank in others:
        rank.send("trickle", hz=100)
    for rank in others:
        assert rank.answer()["trickling"]
    new_owner = wait_until(lambda: (doc := healthz(port, timeout=2)["owner"])["server_pid"] != server and doc,
                           timeout=START_DEADLINE_S, message="a surviving rank serving the address")
    assert new_owner["started_by"] in {r.pid for r in others} | {child["child"]}, new_owner  # (the child records too)
    for rank in others:
        rank.send("untrickle")
    for rank in others:
        recorded[rank.pid] = rank.answer()["tally"]

    # Everything is quiet now: the scrape must account for every value, per process and per series.
    published = parse_exposition(scrape(port))
    assert {int(v) for _, labels in published for k, v in labels if k == "pid"} == set(recorded)
    for pid, tally in recorded.items():
        problems = diff(expected_series(tally, DEFAULT_BUCKETS_US), project(published, pid))
        assert not problems, f"pid {pid} ({'killed owner' if pid == owner.pid else 'survivor or child'}): " + \
            "; ".join(problems)
    # The child was a separate series (its own store); the parent never wrote into the child's and vice versa.
    assert len(list(tmp_dir.glob("nixl.*.mmap"))) == RANKS + 1
    for rank in others:
        assert rank.command("exit")["exited"]
