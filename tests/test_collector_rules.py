"""The collector's rules, through files on disk, other processes' locks and the WSGI app.

Which names are stores; departed stores stamped ahead of the reader's clock; one published series per label set;
what happens to files that are not stores, that another process holds, that another user owns or that we may not
read; and running out of descriptors while scraping.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import DEADLINE_S, child_env, hold_flock, reaper_fixture  # noqa: F401  (pytest fixture)
from support_forge import forge_store, raw_samples, stamp
from werkzeug.test import Client

from app.collector import Collector
from app.web import MetricsApp
from store.layout import STORE_SIZE

HOUR_NS = 3600 * 10**9
NOBODY = 65534

# Names a reader must never open, publish nor reap, whatever they contain: only nixl.<pid>.<run_marker>.<instance>.mmap
# with ASCII decimal numbers is a store (what both the C++ plug-in and our writer name their stores).
STRAY_NAMES = ["nixl.mmap", "nixl..mmap", "nixl...mmap", "nixl.1.2.mmap", "nixl.1.2.3.4.mmap", "nixl.a.2.3.mmap",
               "nixl.-1.2.3.mmap", "nixl.+1.2.3.mmap", "nixl. 1.2.3.mmap", "nixl.1..3.mmap", "nixl.0x1.2.3.mmap",
               "nixl.\u0661.2.3.mmap", "nixl.1.2.3.mmap~", "nixl.1.2.3.mmap.staging", "nixl.1.2.3.MMAP",
               ".nixl.1.2.3.mmap", "nixl.1.2.3.mmap\n", "nixl.1.2.3.mmap.mmap"]


def app_for(directory: Path, ttl: float) -> Client:
    return Client(MetricsApp(Collector(directory, ttl), lambda: {"pid": os.getpid()}))


def metrics(client: Client) -> dict:
    response = client.get("/metrics")
    assert response.status_code == 200
    samples, _ = raw_samples(response.get_data(as_text=True))  # fails on a series written twice
    return samples


def tx_bytes(samples: dict) -> dict[tuple[str, str], str]:
    """agent_tx_bytes_total by (pid, agent_instance)."""
    out = {}
    for (name, labels), value in samples.items():
        if name == "agent_tx_bytes_total":
            d = dict(labels)
            out[(d["pid"], d["agent_instance"])] = value
    return out


def healthz(client: Client) -> dict:
    response = client.get("/healthz")
    assert response.status_code == 200
    return response.get_json()


# -- names ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("content", ["valid-departed", "garbage"])
def test_stray_names_are_never_read_published_nor_reaped(tmp_dir: Path, make_writer, content: str) -> None:
    live = make_writer(agent_name="live")
    template = forge_store(tmp_dir, pid=9, last_update=1)  # departed for ages: reaped at once if it were a store
    data = template.read_bytes() if content == "valid-departed" else b"\x01" * STORE_SIZE
    template.unlink()
    for name in STRAY_NAMES:
        (tmp_dir / name).write_bytes(data)

    client = app_for(tmp_dir, ttl=0)
    assert tx_bytes(metrics(client)) == {(str(os.getpid()), "0"): "0"}
    doc = healthz(client)
    assert [r["store"] for r in doc["live"]] == [live.path.name]
    assert doc["stale"] == [] and doc["warnings"] == []
    assert sorted(os.listdir(tmp_dir)) == sorted([*STRAY_NAMES, live.path.name])
    for name in STRAY_NAMES:
        assert (tmp_dir / name).read_bytes() == data, name


# -- clocks ---------------------------------------------------------------------------------------------------


def test_departed_store_stamped_in_the_future_is_reaped_at_once(tmp_dir: Path, caplog) -> None:
    """A persistent directory after a reboot: the stamp is ahead of this boot's monotonic clock; its age is unknown."""
    future = forge_store(tmp_dir, pid=11, last_update=time.monotonic_ns() + HOUR_NS, value=5)
    present = forge_store(tmp_dir, pid=12, value=6)
    with caplog.at_level(logging.INFO, logger="nixl_prometheus_mp.collector"):
        result = Collector(tmp_dir, stale_ttl_s=10 * 3600).collect()  # a TTL far longer than the lead
    assert [v.snapshot.name for v in result.stale] == [present.name]
    assert not future.exists() and present.exists()
    assert any(future.name in r.getMessage() and "ahead of this host's monotonic clock" in r.getMessage()
               for r in caplog.records)


def test_live_store_stamped_in_the_future_is_published_with_age_zero(tmp_dir: Path, reaper) -> None:
    """A writer in another time namespace is alive: published, never reaped, its age clamped to 0."""
    future = forge_store(tmp_dir, pid=13, last_update=time.monotonic_ns() + HOUR_NS, value=7)
    hold_flock(reaper, future)
    client = app_for(tmp_dir, ttl=0)
    assert tx_bytes(metrics(client)) == {("13", "0"): "7"}
    doc = healthz(client)
    assert [(r["store"], r["seconds_since_update"]) for r in doc["live"]] == [(future.name, 0)]
    assert doc["stale"] == [] and doc["warnings"] == []
    assert future.exists()


# -- one series per label set ---------------------------------------------------------------------------------


def duplicate_warnings(doc: dict) -> list[dict]:
    return [w for w in doc["warnings"] if w["kind"] == "duplicate-labels"]


def test_a_restarted_rank_with_its_predecessors_labels_is_published_once(tmp_dir: Path, reaper) -> None:
    """A container restart: same pid in a fresh pid namespace, same agent, same instance.  The live store wins, even
    over a departed one that was updated later and started later; the loser stays on disk until its TTL."""
    now = time.monotonic_ns()
    labels = {"pid": 1, "agent_name": "rank-0", "hostname": "pod-a", "local_rank": "0"}
    successor = forge_store(tmp_dir, run_marker=100, value=7, last_update=now - 10 * 10**9, **labels)
    hold_flock(reaper, successor)
    predecessor = forge_store(tmp_dir, run_marker=200, value=500, last_update=now, **labels)
    other_instance = forge_store(tmp_dir, run_marker=100, instance=1, value=9, **labels)  # other labels: published

    client = app_for(tmp_dir, ttl=60)
    assert tx_bytes(metrics(client)) == {("1", "0"): "7", ("1", "1"): "9"}
    doc = healthz(client)
    assert [r["store"] for r in doc["live"]] == [successor.name]
    assert [r["store"] for r in doc["stale"]] == [other_instance.name]
    [warning] = duplicate_warnings(doc)
    assert warning["details"] == {"file": str(predecessor), "published": str(successor), "alive": False}
    assert predecessor.name in warning["message"] and successor.name in warning["message"]
    assert predecessor.exists()

    # past its TTL the loser is reaped as any departed store, and the warning goes with it
    stamp(predecessor, now - 120 * 10**9)
    assert tx_bytes(metrics(client)) == {("1", "0"): "7", ("1", "1"): "9"}
    assert not predecessor.exists()
    assert duplicate_warnings(healthz(client)) == []


def test_among_departed_duplicates_the_last_updated_is_published(tmp_dir: Path) -> None:
    now = time.monotonic_ns()
    labels = {"pid": 1, "agent_name": "rank-0", "hostname": "pod-a"}
    newer = forge_store(tmp_dir, run_marker=1, value=2, last_update=now - 1 * 10**9, **labels)  # sorts first
    older = forge_store(tmp_dir, run_marker=2, value=1, last_update=now - 5 * 10**9, **labels)
    client = app_for(tmp_dir, ttl=60)
    assert tx_bytes(metrics(client)) == {("1", "0"): "2"}
    doc = healthz(client)
    assert [r["store"] for r in doc["stale"]] == [newer.name]
    assert [w["details"]["file"] for w in duplicate_warnings(doc)] == [str(older)]


def test_between_live_duplicates_the_later_started_is_published_every_time(tmp_dir: Path, reaper) -> None:
    """Two live containers sharing a hostname, both pid 1: the one started later (its run marker) is published,
    and stays so whichever of the two updates last (no flip-flopping between scrapes)."""
    labels = {"pid": 1, "agent_name": "rank-0", "hostname": "pod-a"}
    first = forge_store(tmp_dir, run_marker=1_000, value=1, **labels)
    second = forge_store(tmp_dir, run_marker=2_000, value=2, **labels)
    for path in (first, second):
        hold_flock(reaper, path)
    client = app_for(tmp_dir, ttl=0)
    for touched in (first, second, first):
        stamp(touched, time.monotonic_ns())
        assert tx_bytes(metrics(client)) == {("1", "0"): "2"}
        doc = healthz(client)
        assert [r["store"] for r in doc["live"]] == [second.name]
        [warning] = duplicate_warnings(doc)
        assert warning["details"] == {"file": str(first), "published": str(second), "alive": True}


# -- files that are not stores, or not ours -------------------------------------------------------------------


def test_invalid_store_nobody_holds_is_reaped_with_a_warning(tmp_dir: Path, caplog) -> None:
    bad = tmp_dir / "nixl.1.1.0.mmap"
    bad.write_bytes(b"\x01" * STORE_SIZE)
    with caplog.at_level(logging.WARNING, logger="nixl_prometheus_mp.collector"):
        doc = healthz(app_for(tmp_dir, ttl=3600))
    assert not bad.exists()
    assert doc["warnings"] == []  # gone, so nothing left to list
    assert [r.levelname for r in caplog.records if bad.name in r.getMessage()] == ["WARNING"]


# Imports first (the interpreter lives under root's home), then drops to nobody for good, then scans.
UNPRIVILEGED_SCAN = textwrap.dedent("""
    import json, os, sys
    from app.collector import Collector
    os.setgroups([])
    os.setgid(int(sys.argv[2]))
    os.setuid(int(sys.argv[2]))
    result = Collector(sys.argv[1], 3600).collect()
    print(json.dumps({"published": [s.name for s in result.published], "warnings": result.warnings}))
""")


@pytest.fixture
def nobodys_dir() -> Iterator[Path]:
    """A 0700 directory owned by the unprivileged user ``nobody``, outside root's private pytest tree."""
    path = Path(tempfile.mkdtemp(prefix="nixl-nobody-"))
    try:
        os.chown(path, NOBODY, NOBODY)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a scan as another user")
def test_unprivileged_reader_sorts_unreadable_files_correctly(nobodys_dir: Path) -> None:
    """Run as ``nobody``: its unreadable (mode 000) store and root's store are listed and never reaped, its invalid
    store is reaped, its valid departed store is published."""
    directory = nobodys_dir
    mine_unreadable = directory / "nixl.1.1.0.mmap"
    mine_unreadable.write_bytes(b"\x01" * STORE_SIZE)
    roots = forge_store(directory, pid=2, value=3)
    roots.chmod(0o600)
    mine_invalid = directory / "nixl.3.3.0.mmap"
    mine_invalid.write_bytes(b"\x02" * STORE_SIZE)
    mine_valid = forge_store(directory, pid=4, value=5)
    for path in (mine_unreadable, mine_invalid, mine_valid):
        os.chown(path, NOBODY, NOBODY)
    mine_unreadable.chmod(0o000)

    done = subprocess.run([sys.executable, "-c", UNPRIVILEGED_SCAN, str(directory), str(NOBODY)], env=child_env(),
                          capture_output=True, text=True, timeout=DEADLINE_S * 3)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["published"] == [mine_valid.name]
    kinds = {Path(w["details"]["file"]).name: (w["kind"], w["message"]) for w in result["warnings"]}
    assert set(kinds) == {mine_unreadable.name, roots.name}
    assert kinds[mine_unreadable.name][0] == "unreadable-store" and "not readable" in kinds[mine_unreadable.name][1]
    assert kinds[roots.name][0] == "foreign-store" and "uid 0" in kinds[roots.name][1]
    assert "owned by uid 0" in kinds[roots.name][1]
    assert mine_unreadable.exists() and roots.exists() and mine_valid.exists()
    assert not mine_invalid.exists()


# -- out of descriptors ---------------------------------------------------------------------------------------

# Scans a directory while the process is out of descriptors: first with exactly one left (enough to list the
# directory, none to open a store in it), then with none (not even the listing), then with them back.  The
# warning's rate limit is set to 0 so that "said again while it lasts" is visible.
EMFILE_SCAN = textwrap.dedent("""
    import json, logging, os, sys
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="LOG %(levelname)s %(message)s")
    import app.collector
    from app.collector import Collector

    app.collector._TransientLog.INTERVAL_S = 0.0
    hoard = []

    def starve(left):
        while True:
            try:
                hoard.append(os.open("/dev/null", os.O_RDONLY))
            except OSError:
                break
        for _ in range(left):
            os.close(hoard.pop())

    def summary(collection):
        return {"warnings": collection.warnings, "published": [s.name for s in collection.published],
                "scan_error": collection.scan_error}

    collector = Collector(sys.argv[1], 3600)
    starve(1)
    files_starved = summary(collector.collect())
    starve(0)
    listing_starved = summary(collector.collect())
    for fd in hoard:
        os.close(fd)
    fed = summary(collector.collect())
    print(json.dumps([files_starved, listing_starved, fed]))
""")


def test_running_out_of_descriptors_is_not_blamed_on_the_files(tmp_dir: Path) -> None:
    stores = sorted(forge_store(tmp_dir, pid=20 + i, value=i).name for i in range(3))
    done = subprocess.run([sys.executable, "-c", EMFILE_SCAN, str(tmp_dir)], env=child_env(), capture_output=True,
                          text=True, timeout=DEADLINE_S * 3)
    assert done.returncode == 0, done.stderr
    files_starved, listing_starved, fed = json.loads(done.stdout)

    assert files_starved["published"] == [] and files_starved["scan_error"] is None
    assert {w["kind"] for w in files_starved["warnings"]} == {"transient-read-error"}
    assert sorted(Path(w["details"]["file"]).name for w in files_starved["warnings"]) == stores
    assert all("Too many open files" in w["message"] for w in files_starved["warnings"])

    assert listing_starved["published"] == [] and listing_starved["warnings"] == []
    assert str(tmp_dir) in listing_starved["scan_error"] and "Too many open files" in listing_starved["scan_error"]

    assert fed == {"warnings": [], "published": stores, "scan_error": None}
    assert sorted(os.listdir(tmp_dir)) == stores  # nothing reaped

    logged = [line for line in done.stderr.splitlines() if line.startswith("LOG ")]
    assert len(logged) == 2, done.stderr  # said for each starved scrape (rate limit 0 here), not once fed
    assert "skipped 3 store(s)" in logged[0] and f"cannot list {tmp_dir}" in logged[1]
    for line in logged:
        assert line.startswith("LOG WARNING") and "nothing is wrong with the files" in line and "ulimit -n" in line
        assert "Remove" not in line
