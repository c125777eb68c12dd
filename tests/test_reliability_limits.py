"""The documented limits (README "Guarantees and limits"), each shown to behave as documented."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import signal
import textwrap
import types

import pytest
from support import (
    exporter_env,
    free_port,
    healthz,
    lock_is_free,
    parse_exposition,
    reaper_fixture,  # noqa: F401  (a fixture)
    scrape,
    start_rank,
    wait_until,
)

import election.lock
import store.writer
from app import Exporter
from app.collector import Collector
from app.exposition import Renderer
from election import lock_file_name
from store import EventType, writer_alive

pytestmark = pytest.mark.reliability


FORKING_RANK = textwrap.dedent("""
    import json, os, sys, time
    from app import Exporter
    exp = Exporter("parent")
    exp.export_event(0, 5)
    child = os.fork()
    if child == 0:  # a child that forks without exec and never exports: it just lives on
        time.sleep(60)
        os._exit(0)
    print(json.dumps({"pid": os.getpid(), "child": child, "serving": exp.serving, "store": str(exp.store_path)}),
          flush=True)
    sys.stdin.read()
""")


@pytest.mark.timeout(60)
def test_forked_child_does_not_keep_a_dead_parents_store_nor_election(tmp_dir, reaper, serve_mode):
    """Our fork handling closes the inherited store and lock descriptors in the child, so (unlike the C++
    plug-in's wording) a child that only forks does NOT keep its parent's store looking live: once the parent
    dies its store is departed and its address free, while the child still runs.  (With an address server the
    address is the server's, which outlives the parent: once that server goes too, the election is free.)"""
    # The orphaned child is ours to reap: every pytest worker is a child subreaper (conftest), for good (this
    # test once switched that off at its end, and the address servers of the worker's later tests went to init).
    port = free_port()
    child = None
    try:
        rank = start_rank(reaper, FORKING_RANK, exporter_env(tmp_dir, port))
        info = json.loads(rank.readline(20))
        child = info["child"]
        assert info["serving"]
        lock = tmp_dir / lock_file_name(f"127.0.0.1:{port}")
        assert writer_alive(info["store"]) and not lock_is_free(lock)
        server = healthz(port)["owner"]["server_pid"]
        rank.kill()
        assert os.path.exists(f"/proc/{child}")  # the child lives on...
        # ... without holding the parent's store (bounded waits, not at once: a server still being launched when
        # the parent died shares the parent's memory, store mapping included, until its exec) ...
        wait_until(lambda: not writer_alive(info["store"]), message="the dead parent's store released")
        if serve_mode == "helper":
            # ... nor its election: the address server the parent started holds it (the job's: the parent's death
            # moves nothing) until it goes; an operator's SIGINT makes it go at once.
            assert server != rank.pid and not lock_is_free(lock)
            assert [r["pid"] for r in healthz(port)["stale"]] == [info["pid"]]
            os.kill(server, signal.SIGINT)
        wait_until(lambda: lock_is_free(lock), message="the dead parent's election released")
        with Exporter("next", exporter_env(tmp_dir, port, NIXL_TELEMETRY_MP_STALE_TTL="3600")) as nxt:
            assert nxt.serving
            stale = healthz(port)["stale"]
            assert [r["pid"] for r in stale] == [info["pid"]]  # published as departed, with its values
    finally:
        if child is not None:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)


def test_ranks_split_across_directories_detected_only_from_the_abandoned_side(tmp_path, caplog):
    port = free_port()
    served, abandoned = tmp_path / "served", tmp_path / "abandoned"
    caplog.set_level(logging.WARNING)
    with Exporter("served", exporter_env(served, port)) as a:
        assert a.serving
        with Exporter("elsewhere", exporter_env(abandoned, port)) as b:
            assert not b.serving  # won its own directory's election, cannot bind the port
            b.export_event(EventType.AGENT_TX_BYTES, 1)
            assert any("cannot bind" in r.getMessage() and str(abandoned) in r.getMessage()
                       for r in caplog.records)
            doc = healthz(port)
            assert doc["warnings"] == []  # the directory that elected an owner looks healthy...
            names = {v for _, labels in parse_exposition(scrape(port)) for k, v in labels if k == "agent_name"}
            assert names == {"served"}  # ... and aggregates a subset


def test_different_bucket_bounds_across_ranks_give_different_le_sets(make_writer, tmp_dir):
    a = make_writer(agent_name="a", bounds=(10.0, 100.0))
    b = make_writer(agent_name="b", instance=1, bounds=(5.0, 50.0, 500.0))
    for writer in (a, b):
        writer.record(EventType.AGENT_XFER_TIME, 42)
    samples = parse_exposition(Renderer().render(Collector(tmp_dir, 30).collect().published).decode())
    les = {}
    for (name, labels), value in samples.items():
        if name == "agent_xfer_time_us_bucket":
            d = dict(labels)
            les.setdefault(d["agent_name"], {})[d["le"]] = value
    assert les == {"a": {"10": 0, "100": 1, "+Inf": 1}, "b": {"5": 0, "50": 1, "500": 1, "+Inf": 1}}


def _no_flock(*_args):
    raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))


def test_filesystem_without_flock(tmp_dir, monkeypatch, caplog):
    """Where flock fails: every rank warns; the port bind elects (one owner still); an idle writer's store
    looks departed and is reaped while it runs -- and it keeps recording without failing, its store recreated
    with its values at its next re-election deadline."""
    fake = types.SimpleNamespace(flock=_no_flock, LOCK_EX=fcntl.LOCK_EX, LOCK_NB=fcntl.LOCK_NB,
                                 LOCK_SH=fcntl.LOCK_SH, LOCK_UN=fcntl.LOCK_UN)
    monkeypatch.setattr(store.writer, "fcntl", fake)
    monkeypatch.setattr(election.lock, "fcntl", fake)
    caplog.set_level(logging.WARNING)
    port = free_port()
    # Served from a thread of this process: flock fails only where it is patched, in this process.
    env = exporter_env(tmp_dir, port, NIXL_TELEMETRY_MP_STALE_TTL="0.5", NIXL_PROMETHEUS_MP_SERVE="thread")

    def agents() -> set[str]:
        return {v for _, labels in parse_exposition(scrape(port)) for k, v in labels if k == "agent_name"}

    with Exporter("first", env) as first, Exporter("second", env) as second:
        assert [first.serving, second.serving] == [True, False]  # the bind decided
        assert healthz(port)["owner"]["election"] == "bind-fallback"
        messages = " ".join(r.getMessage() for r in caplog.records)
        assert "could not flock the telemetry store" in messages and "bind decides" in messages
        second.export_event(EventType.AGENT_RX_BYTES, 7)
        assert "second" in agents()
        # Idle past the TTL: nothing tells the collector that this writer still runs.
        wait_until(lambda: "second" not in agents(), message="the idle writer's store reaped after the TTL")
        assert not second.store_path.exists()
        # Past its re-election deadline, the writer notices its store was unlinked and recreates it, values
        # included: no error, and the rank is published again (the reaping cost a gap, not the data).
        second.export_event(EventType.AGENT_RX_BYTES, 7)
        assert "second" in agents() and second.store_path.exists()
        rx = {labels: v for (name, labels), v in parse_exposition(scrape(port)).items()
              if name == "agent_rx_bytes_total" and ("agent_name", "second") in labels}
        assert list(rx.values()) == [14]
