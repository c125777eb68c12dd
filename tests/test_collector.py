"""The collector (app/collector.py): scan, liveness by flock, TTL, reaping, hostile files."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from support import hold_flock, reaper_fixture  # noqa: F401  (pytest fixture)
from support_forge import store_bytes
from werkzeug.test import Client

import app.collector
from app.collector import Collector
from app.web import MetricsApp
from store import EventType, StoreWriter
from store import layout as L
from store.layout import LAST_UPDATE_FIELD, STORE_SIZE

E = EventType
FOREIGN_UID = 12345


def set_last_update(path: Path, monotonic_ns: int) -> None:
    """Forge a store's last-update stamp (flock is advisory: this works on a live writer's store too)."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, monotonic_ns.to_bytes(8, "little"), LAST_UPDATE_FIELD[0])
    finally:
        os.close(fd)


def age_store(path: Path, seconds: float) -> None:
    now = time.monotonic_ns()
    assert now > seconds * 1e9, "the monotonic clock is younger than the age to forge"
    set_last_update(path, now - int(seconds * 1e9))


def departed(make_writer, **identity) -> Path:
    """A store whose writer recorded something and closed (file left, lock released)."""
    writer: StoreWriter = make_writer(**identity)
    writer.record(E.AGENT_TX_BYTES, 4096)
    writer.record(E.AGENT_XFER_TIME, 120)
    writer.close()
    return writer.path


def names(snapshots) -> list[str]:
    return [s.path.name for s in snapshots]


def test_scans_only_store_files(tmp_dir: Path, make_writer) -> None:
    live = make_writer(agent_name="live")
    dead = departed(make_writer, agent_name="dead", instance=1)
    age_store(dead, 100)
    # The same (valid, departed, stale) bytes under names the collector must not look at.
    others = ["other.mmap", "nixl.1.2.0.mmap.staging", "nixl.9.9.0.mmap.bak", "xnixl.1.1.0.mmap",
              "nixl-owner.127.0.0.1:9090.lock", "NIXL.1.1.0.mmap"]
    for name in others:
        shutil.copyfile(dead, tmp_dir / name)
    dead.unlink()
    result = Collector(tmp_dir, stale_ttl_s=0).collect()
    assert names(result.published) == [live.path.name]
    assert result.warnings == [] and result.scan_error is None
    for name in others:
        assert (tmp_dir / name).exists(), f"{name} was reaped"


def test_live_store_is_published_regardless_of_age(tmp_dir: Path, make_writer) -> None:
    writer = make_writer(agent_name="idle")
    writer.record(E.AGENT_RX_BYTES, 7)
    set_last_update(writer.path, 1)  # "updated" at boot: older than any TTL
    result = Collector(tmp_dir, stale_ttl_s=0).collect()
    assert [v.snapshot.path for v in result.live] == [writer.path]
    assert result.stale == []
    view = result.live[0]
    assert view.alive and view.reap_in_s is None and view.age_s > 1
    assert view.snapshot.counters[E.AGENT_RX_BYTES] == 7
    assert writer.path.exists()


def test_departed_store_published_until_past_ttl_then_reaped(tmp_dir: Path, make_writer) -> None:
    path = departed(make_writer, agent_name="gone")
    fresh = Collector(tmp_dir, stale_ttl_s=30).collect()
    assert fresh.live == [] and [v.snapshot.path for v in fresh.stale] == [path]
    assert 0 < fresh.stale[0].reap_in_s <= 30

    age_store(path, 100)
    within = Collector(tmp_dir, stale_ttl_s=1000).collect()
    assert [v.snapshot.path for v in within.stale] == [path]
    view = within.stale[0]
    assert not view.alive
    assert 99 < view.age_s < 200 and 800 < view.reap_in_s < 901
    assert view.snapshot.counters[E.AGENT_TX_BYTES] == 4096  # the last values are kept
    assert names(within.published) == [path.name]
    assert path.exists()

    past = Collector(tmp_dir, stale_ttl_s=50).collect()
    assert past.published == [] and past.stale == [] and past.warnings == []
    assert not path.exists()


def test_ttl_zero_reaps_a_departed_store_on_the_next_collection(tmp_dir: Path, make_writer) -> None:
    path = departed(make_writer)
    time.sleep(0.001)  # the monotonic clock must have moved past the last update
    assert Collector(tmp_dir, stale_ttl_s=0).collect().published == []
    assert not path.exists()


def test_invalid_content_nobody_holds_is_reaped(tmp_dir: Path) -> None:
    bad = {
        "nixl.1.1.0.mmap": b"\x01" * STORE_SIZE,  # wrong magic
        "nixl.2.2.0.mmap": bytes(STORE_SIZE),  # magic 0: never initialised
        "nixl.3.3.0.mmap": b"NIXLMPS1",  # too short
        "nixl.4.4.0.mmap": b"",
    }
    for name, data in bad.items():
        (tmp_dir / name).write_bytes(data)
    result = Collector(tmp_dir, stale_ttl_s=30).collect()
    assert result.published == [] and result.warnings == []
    assert sorted(os.listdir(tmp_dir)) == []


def test_invalid_content_held_by_a_live_process_is_kept_and_warned(tmp_dir: Path, reaper) -> None:
    path = tmp_dir / "nixl.5.5.0.mmap"
    path.write_bytes(b"\x02" * STORE_SIZE)
    hold_flock(reaper, path)  # e.g. a writer of another schema version sharing the directory
    result = Collector(tmp_dir, stale_ttl_s=0).collect()
    assert result.published == []
    assert path.exists()
    assert [w["kind"] for w in result.warnings] == ["invalid-store"]
    warning = result.warnings[0]
    assert warning["details"] == {"file": str(path)} and path.name in warning["message"]


def test_foreign_owned_store_is_never_read_nor_reaped(tmp_dir: Path, make_writer) -> None:
    valid = departed(make_writer, agent_name="planted")
    age_store(valid, 100)  # would be reaped at once if it were ours
    garbage = tmp_dir / "nixl.6.6.0.mmap"
    garbage.write_bytes(b"\x03" * STORE_SIZE)  # would be reaped as invalid if it were read
    for path in (valid, garbage):
        os.chown(path, FOREIGN_UID, FOREIGN_UID)
    result = Collector(tmp_dir, stale_ttl_s=0).collect()
    assert result.published == []
    assert valid.exists() and garbage.exists()
    assert sorted((w["kind"], w["details"]["file"]) for w in result.warnings) == sorted(
        [("foreign-store", str(valid)), ("foreign-store", str(garbage))])
    assert all(str(FOREIGN_UID) in w["message"] for w in result.warnings)


def test_one_bad_file_does_not_fail_the_scrape(tmp_dir: Path, tmp_path: Path, make_writer) -> None:
    good = [make_writer(agent_name=f"good-{i}", instance=i) for i in range(2)]
    for i, writer in enumerate(good):
        writer.record(E.AGENT_TX_BYTES, 100 + i)
    target = tmp_path / "target.mmap"
    shutil.copyfile(good[0].path, target)
    (tmp_dir / "nixl.7.7.0.mmap").symlink_to(target)
    os.mkfifo(tmp_dir / "nixl.8.8.0.mmap")  # must not hang the scrape
    (tmp_dir / "nixl.9.9.0.mmap").mkdir()
    foreign = tmp_dir / "nixl.10.10.0.mmap"
    foreign.write_bytes(b"\x04" * STORE_SIZE)
    os.chown(foreign, FOREIGN_UID, FOREIGN_UID)

    result = Collector(tmp_dir, stale_ttl_s=0).collect()
    assert names(result.published) == sorted(w.path.name for w in good)
    assert result.scan_error is None
    kinds = {Path(w["details"]["file"]).name: w["kind"] for w in result.warnings}
    assert kinds == {"nixl.7.7.0.mmap": "unreadable-store", "nixl.8.8.0.mmap": "unreadable-store",
                     "nixl.9.9.0.mmap": "unreadable-store", "nixl.10.10.0.mmap": "foreign-store"}
    for name in kinds:  # never reaped
        assert os.path.lexists(tmp_dir / name)
    assert target.exists()

    # and the same directory behind the WSGI app: /metrics answers with the good ranks
    app = MetricsApp(Collector(tmp_dir, 0), lambda: {"pid": os.getpid()})
    response = Client(app).get("/metrics")
    assert response.status_code == 200
    body = response.get_data(as_text=True)
    assert 'agent_name="good-0"' in body and 'agent_name="good-1"' in body
    assert "agent_tx_bytes_total{" in body


def test_published_is_live_and_departed_in_file_name_order(tmp_dir: Path, make_writer) -> None:
    writers = [make_writer(agent_name=f"a{i}", instance=i) for i in range(3)]
    writers[1].close()
    result = Collector(tmp_dir, stale_ttl_s=30).collect()
    assert len(result.live) == 2 and len(result.stale) == 1
    assert names(result.published) == sorted(w.path.name for w in writers)


def test_unlistable_directory_is_an_empty_collection_with_the_reason(tmp_path: Path) -> None:
    missing = tmp_path / "gone"
    result = Collector(missing, stale_ttl_s=30).collect()
    assert result.published == [] and result.scan_error and str(missing) in result.scan_error
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    assert Collector(not_a_dir, 30).collect().scan_error


def _forged_store(directory: Path, name_pid: int, content_pid: int, marker: int, last_update: int) -> Path:
    slots = L.SLOT_COUNT
    path = directory / L.store_file_name(name_pid, marker, 0)
    path.write_bytes(store_bytes(content_pid, 0, "agent", "host", "", (1.0, 2.0), [marker] * slots, [0] * slots,
                                 [0] * (slots * L.BUCKET_SLOTS), [0] * slots, last_update))
    return path


def test_a_scrape_publishes_batch_by_batch_what_one_collection_decides(tmp_dir: Path, monkeypatch) -> None:
    """A scrape reads, decides and publishes a few stores at a time (never holding every store's bytes); with
    batches of 3 it publishes the stores, in the order, with the duplicates decided, that a collection of the
    whole directory does: duplicates (one pid, several run markers) share a batch whatever its size."""
    now = time.monotonic_ns()
    for pid in range(100, 112):
        _forged_store(tmp_dir, pid, pid, 1, now - 10**9)
    for marker in (2, 3, 4):  # three restarts of pid 105 in a container: the last updated is published
        _forged_store(tmp_dir, 105, 105, marker, now - 10**9 + marker)
    whole = Collector(tmp_dir, 3600).collect()
    monkeypatch.setattr(app.collector, "BATCH_STORES", 3)
    read, read_stores = [], app.collector.read_stores
    monkeypatch.setattr(app.collector, "read_stores", lambda d, names: read.append(names) or read_stores(d, names))
    batches: list[list[str]] = []
    batched = Collector(tmp_dir, 3600).collect(lambda views: batches.append([v.snapshot.name for v in views]))
    assert [name for batch in batches for name in batch] == names(whole.published)
    assert "nixl.105.4.0.mmap" in names(whole.published)
    assert batched.warnings == whole.warnings and len(whole.warnings) == 3
    assert [len(names) for names in read] == [6, 3, 3]  # (after the first 3, read with the listing) pid 105's
    # four stores were read together
    assert batched.live == batched.stale == []  # the batches had them


def test_a_forged_store_naming_another_pid_never_duplicates_a_published_series(tmp_dir: Path,
                                                                                monkeypatch) -> None:
    """Stores that can share a label set share a batch because a writer names its store with its own pid; a
    store whose bytes name another pid than its file (no writer of ours makes one) may meet its twin in a later
    batch: it is not published then, whatever its age, so the exposition never has two series with one label
    set."""
    now = time.monotonic_ns()
    for pid in range(100, 106):
        _forged_store(tmp_dir, pid, pid, 1, now - 10**9)
    _forged_store(tmp_dir, 200, 101, 1, now)  # nixl.200.* holding pid 101's labels, updated last
    monkeypatch.setattr(app.collector, "BATCH_STORES", 2)
    published: list[str] = []
    result = Collector(tmp_dir, 3600).collect(lambda views: published.extend(v.snapshot.name for v in views))
    assert published == [f"nixl.{pid}.1.0.mmap" for pid in range(100, 106)]
    [warning] = result.warnings
    assert warning["kind"] == "duplicate-labels" and warning["details"] == {
        "file": str(tmp_dir / "nixl.200.1.0.mmap"), "published": str(tmp_dir / "nixl.101.1.0.mmap"), "alive": False}


def test_a_census_lists_every_rank_without_its_values(tmp_dir: Path, make_writer) -> None:
    live = make_writer(agent_name="live")
    live.record(EventType.AGENT_TX_BYTES, 4096)
    gone = departed(make_writer, agent_name="gone", instance=1)
    census = Collector(tmp_dir, 3600).census()
    assert [v.snapshot.name for v in census.live] == [live.path.name]
    assert [v.snapshot.name for v in census.stale] == [gone.name]
    assert [v.snapshot.agent_name for v in census.live + census.stale] == ["live", "gone"]
    assert all(len(v.snapshot.words) == 0 for v in census.live + census.stale)
