"""Hostile and broken input: fuzzed stores, special files named like stores or locks, files of another uid,
a world-writable directory and planted symlinks.  Each case checks what the user sees: the scrape still
serves the good ranks, /healthz names the problem, and nothing outside the directory is ever touched."""

from __future__ import annotations

import itertools
import logging
import math
import os
import socket
import struct
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families as parse_text
from support import exporter_env, free_port, healthz, http_get, metrics_url, parse_exposition, scrape
from support_forge import cpp_reference
from werkzeug.test import Client

import app.collector
import store.reader
import store.writer
from app import Exporter
from app.collector import Collector
from app.exposition import Renderer
from app.web import MetricsApp
from store import DEFAULT_BUCKETS_US, EventType, StoreIdentity, StoreWriter
from store import layout as L
from store.reader import InvalidStore, Snapshot, decode
from store.warnonce import OnceWarner

pytestmark = pytest.mark.reliability

FOREIGN_UID = 12345
U64_MAX = (1 << 64) - 1


# -- building and checking store bytes -----------------------------------------------------------------------


def store_bytes(magic: int = L.MAGIC, version: int = L.SCHEMA_VERSION, slot_count: int = L.SLOT_COUNT,
                pid: int = 4242, last_update: int = 1, instance: int = 0,
                bounds: tuple[float, ...] = DEFAULT_BUCKETS_US, bucket_count: int | None = None,
                name: bytes = b"fuzz", hostname: bytes = b"host", local_rank: bytes = b"",
                fill: int = 0) -> bytes:
    """A schema-1 store's bytes, any field overridable (also to invalid values)."""
    padded = tuple(bounds) + (0.0,) * (L.MAX_BUCKETS - len(bounds))
    values = [fill] * L.SLOT_COUNT
    return L.STORE_STRUCT.pack(
        magic, version, slot_count, pid, last_update, instance, len(bounds) if bucket_count is None else bucket_count,
        name, hostname, local_rank, *padded[:L.MAX_BUCKETS], *values, *values,
        *([fill] * (L.SLOT_COUNT * L.BUCKET_SLOTS)), *values)


VALID = store_bytes(fill=3)


def assert_contract(snap: Snapshot) -> None:
    """What every published snapshot promises, and that both exposition paths render and parse it."""
    assert len(snap.bounds) <= L.MAX_BUCKETS
    assert all(math.isfinite(b) and b > 0 for b in snap.bounds), snap.bounds
    assert all(a < b for a, b in itertools.pairwise(snap.bounds)), snap.bounds
    assert len(snap.counters) == len(snap.gauges) == len(snap.sums) == L.SLOT_COUNT
    assert len(snap.buckets) == L.SLOT_COUNT * L.BUCKET_SLOTS
    assert all(0 <= v <= U64_MAX for v in snap.counters + snap.gauges + snap.buckets + snap.sums)
    for text in (snap.agent_name, snap.hostname, snap.local_rank):
        assert isinstance(text, str) and "\0" not in text
    openmetrics = Renderer().render([snap], openmetrics=True)
    assert openmetrics == cpp_reference([snap], openmetrics=True) and openmetrics.endswith(b"# EOF\n")
    # (prometheus_client's OpenMetrics parser refuses every exposition of this metric set -- the counter
    # agent_xfer_time_total and the gauge agent_xfer_time are both family "agent_xfer_time" there -- so only
    # the text format is parsed here.)
    body = Renderer().render([snap])
    assert body == cpp_reference([snap])
    families = list(parse_text(body.decode()))
    assert families
    for fam in families:
        if fam.type != "histogram":
            continue
        buckets = [s.value for s in fam.samples if s.name.endswith("_bucket")]
        count = [s.value for s in fam.samples if s.name.endswith("_count")]
        assert buckets == sorted(buckets) and count == [buckets[-1]]


def check_decoded(data: bytes) -> Snapshot | InvalidStore:
    result = decode(data, Path("nixl.1.2.0.mmap"))
    assert isinstance(result, Snapshot | InvalidStore), result
    if isinstance(result, Snapshot):
        assert_contract(result)
    return result


def check_collected(data: bytes) -> None:
    """The collector and the WSGI app over a directory holding ``data`` as a store: never an exception."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "nixl.1.2.0.mmap"
        path.write_bytes(data)
        before = time.monotonic_ns()
        collection = Collector(tmp, stale_ttl_s=1e9).collect()
        after = time.monotonic_ns()
        for snap in collection.published:
            assert_contract(snap)
        decoded = decode(data, path)
        # A departed store stamped ahead of the monotonic clock (any stamp past this machine's uptime) is
        # reaped at once; one stamped between the two readings may go either way.
        if isinstance(decoded, Snapshot) and decoded.last_update_ns <= before:
            assert [s.path for s in collection.published] == [path]
        elif not isinstance(decoded, Snapshot) or decoded.last_update_ns > after:
            # invalid content or a future stamp, and no writer holds it: reaped, never published
            assert collection.published == [] and not path.exists()
        client = Client(MetricsApp(Collector(tmp, 1e9), lambda: {"pid": 0}))
        assert client.get("/metrics").status_code == 200
        assert client.get("/healthz").status_code == 200


FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
floats = st.floats(allow_nan=True, allow_infinity=True, width=64)
u64 = st.integers(0, U64_MAX)


@FUZZ
@given(st.binary(max_size=L.STORE_SIZE + 64))
def test_fuzz_random_bytes(data):
    check_decoded(data)
    check_collected(data)


@FUZZ
@given(st.lists(st.tuples(st.integers(0, L.STORE_SIZE - 1), st.integers(0, 255)), min_size=1, max_size=16))
def test_fuzz_flipped_bytes_of_a_valid_store(flips):
    data = bytearray(VALID)
    for index, byte in flips:
        data[index] = byte
    check_decoded(bytes(data))
    check_collected(bytes(data))


@FUZZ
@given(magic=st.one_of(st.just(L.MAGIC), u64), version=st.one_of(st.just(1), st.integers(0, 2**32 - 1)),
       slot_count=st.one_of(st.just(L.SLOT_COUNT), st.integers(0, 2**32 - 1)),
       pid=st.integers(-(2**63), 2**63 - 1), last_update=u64, instance=u64,
       bounds=st.lists(floats, max_size=L.MAX_BUCKETS), bucket_count=st.one_of(st.none(), u64),
       name=st.binary(max_size=L.AGENT_NAME_SIZE), hostname=st.binary(max_size=L.HOSTNAME_SIZE),
       local_rank=st.binary(max_size=L.LOCAL_RANK_SIZE), fill=st.one_of(st.just(0), u64))
def test_fuzz_every_header_field_out_of_range(magic, version, slot_count, pid, last_update, instance, bounds,
                                              bucket_count, name, hostname, local_rank, fill):
    data = store_bytes(magic, version, slot_count, pid, last_update, instance, tuple(bounds), bucket_count, name,
                       hostname, local_rank, fill)
    result = check_decoded(data)
    expect_valid = (magic == L.MAGIC and version == 1 and slot_count == L.SLOT_COUNT
                    and (bucket_count is None or bucket_count <= L.MAX_BUCKETS))
    if not expect_valid:
        assert isinstance(result, InvalidStore)
    check_collected(data)


@pytest.mark.parametrize("bounds", [
    (float("nan"),), (float("inf"),), (10.0, float("nan"), 30.0), (10.0, float("inf")), (-1.0, 10.0), (0.0, 1.0),
    (10.0, 5.0), (10.0, 10.0), (float("-inf"), 1.0), (5e-324, 1e308), tuple(float(i) for i in range(1, 33)),
])
def test_bad_bounds_are_refused_and_good_extremes_published(bounds):
    result = check_decoded(store_bytes(bounds=bounds))
    good = all(math.isfinite(b) and b > 0 for b in bounds) and all(a < b for a, b in itertools.pairwise(bounds))
    assert isinstance(result, Snapshot) == good, result
    check_collected(store_bytes(bounds=bounds))


@pytest.mark.parametrize("size", [0, 1, 8, 48, L.STORE_SIZE - 8, L.STORE_SIZE - 1])
def test_truncated_store_is_invalid(size):
    assert isinstance(check_decoded(VALID[:size]), InvalidStore)
    check_collected(VALID[:size])


@pytest.mark.parametrize("extra", [1, 8, 4096, 1 << 20])
def test_oversized_store_reads_only_the_layout(extra):
    snap = check_decoded(VALID + b"\xff" * extra)
    assert isinstance(snap, Snapshot) and snap.counters[0] == 3
    check_collected(VALID + b"\xff" * extra)


# -- special files and foreign files in a served directory ----------------------------------------------------


def make_special(path: Path, kind: str, target: Path | None = None) -> socket.socket | None:
    """Create a symlink, FIFO, directory or bound unix socket at ``path``; the socket is returned to close."""
    if kind == "symlink":
        path.symlink_to(target if target is not None else path.with_name("dangling"))
    elif kind == "fifo":
        os.mkfifo(path, 0o600)
    elif kind == "directory":
        path.mkdir(mode=0o700)
    elif kind == "socket":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(path))
        return sock
    else:
        raise ValueError(kind)
    return None


def fingerprint(path: Path) -> tuple[bytes, int, int]:
    st = os.stat(path, follow_symlinks=False)
    return path.read_bytes(), st.st_mtime_ns, st.st_size


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A file outside the telemetry directory that nothing may truncate, write or unlink: a valid store of a
    departed writer, so that following a link to it would publish (and then reap) it."""
    target = tmp_path / "outside" / "precious.mmap"
    target.parent.mkdir()
    target.write_bytes(store_bytes(name=b"outside", last_update=1))
    os.utime(target, ns=(1_000_000_000, 1_000_000_000))
    return target


@pytest.fixture
def fresh_warners(monkeypatch):
    """Fresh once-warners, so that other tests' warnings (same process) cannot hide ours."""
    monkeypatch.setattr(store.reader, "foreign_warner", OnceWarner(store.reader.log))
    monkeypatch.setattr(app.collector, "_warner", OnceWarner(app.collector.log))


def test_special_files_named_like_stores_and_locks_are_skipped_and_named(tmp_dir, outside, fresh_warners):
    port, other_port = free_port(), free_port()
    with Exporter("good", exporter_env(tmp_dir, port, NIXL_TELEMETRY_MP_STALE_TTL="0")) as exp:
        exp.export_event(EventType.AGENT_TX_BYTES, 123)
        before = fingerprint(outside)
        sockets = []
        bad = {}
        for n, kind in enumerate(["symlink", "fifo", "directory", "socket"]):
            store_name = tmp_dir / f"nixl.{n + 1}.2.0.mmap"
            lock_name = tmp_dir / f"nixl-owner.127.0.0.{n + 2}:{other_port}.lock"
            for path in (store_name, lock_name):
                sock = make_special(path, kind, outside)
                if sock is not None:
                    sockets.append(sock)
            bad[store_name.name] = kind
        try:
            for _ in range(3):  # repeated scrapes: never reaped, never hanging (a FIFO is opened O_NONBLOCK)
                samples = parse_exposition(scrape(port, timeout=5))
                pids = {v for _, labels in samples for k, v in labels if k == "pid"}
                names = {v for _, labels in samples for k, v in labels if k == "agent_name"}
                assert pids == {str(os.getpid())} and names == {"good"}
                assert samples[("agent_tx_bytes_total", frozenset({
                    ("agent_name", "good"), ("pid", str(os.getpid())), ("agent_instance", str(exp._writer.identity
                                                                                              .instance)),
                    ("hostname", socket.gethostname())}))] == 123
            doc = healthz(port)
            assert [r["agent_name"] for r in doc["live"]] == ["good"] and doc["stale"] == []
            named = {w["details"]["file"].rsplit("/", 1)[-1]: w for w in doc["warnings"]
                     if w["kind"] == "unreadable-store"}
            assert set(named) == set(bad), doc["warnings"]
            assert "symbolic link" in named[next(n for n, k in bad.items() if k == "symlink")]["message"]
            assert not [w for w in doc["warnings"] if w["kind"] == "duplicate-owners"], doc["warnings"]
            for name in bad:
                assert os.path.lexists(tmp_dir / name), f"{name} was reaped"
            assert fingerprint(outside) == before
        finally:
            for sock in sockets:
                sock.close()


def test_foreign_owned_files_are_never_read_nor_reaped_and_warned_once_each(tmp_dir, fresh_warners, monkeypatch,
                                                                            caplog):
    port = free_port()
    count = 100  # more than the warner's bound of 64 distinct files
    foreign = []
    for n in range(count):
        path = tmp_dir / f"nixl.{n + 1}.7.0.mmap"
        path.write_bytes(store_bytes(name=b"intruder", last_update=1))
        os.chown(path, FOREIGN_UID, FOREIGN_UID)
        foreign.append((path, fingerprint(path)))
    read = []
    real_decode = app.collector.decode_named

    def decode_named(data, directory, name):
        read.append(directory / name)
        return real_decode(data, directory, name)

    monkeypatch.setattr(app.collector, "decode_named", decode_named)
    caplog.set_level(logging.WARNING)
    # Served from a thread of this process: the collector whose reads are counted above is this process's.
    env = exporter_env(tmp_dir, port, NIXL_TELEMETRY_MP_STALE_TTL="0", NIXL_PROMETHEUS_MP_SERVE="thread")
    with Exporter("good", env) as exp:
        exp.export_event(EventType.AGENT_RX_BYTES, 5)
        for _ in range(3):
            samples = parse_exposition(scrape(port))
            assert {v for _, labels in samples for k, v in labels if k == "agent_name"} == {"good"}
        doc = healthz(port)
        assert read and set(read) == {exp.store_path}, "a foreign file was read"
    assert len([w for w in doc["warnings"] if w["kind"] == "foreign-store"]) == count
    for path, print_ in foreign:
        assert fingerprint(path) == print_, f"{path} was touched or reaped"
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("nixl_prometheus_mp")]
    per_file = [sum(f"{path}" in line for line in lines) for path, _ in foreign]
    assert max(per_file) == 1, "a foreign file was warned about more than once"
    assert sum(per_file) == 64, "the warnings are not bounded to 64 distinct files"
    assert sum("further ones are not logged" in line for line in lines) == 1


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o770])
def test_group_or_world_writable_directory_is_warned_at_start_and_in_healthz(tmp_dir, mode, caplog):
    os.chmod(tmp_dir, mode)
    port = free_port()
    caplog.set_level(logging.WARNING)
    with Exporter("agent", exporter_env(tmp_dir, port)) as exp:
        assert exp.serving
        assert any("world-writable" in r.getMessage() and str(tmp_dir) in r.getMessage() for r in caplog.records)
        doc = healthz(port)
    perms = [w for w in doc["warnings"] if w["kind"] == "directory-permissions"]
    assert perms and str(tmp_dir) in perms[0]["message"] and f"{mode:04o}" in perms[0]["message"]


# -- planted paths where the exporter creates files -----------------------------------------------------------


@pytest.mark.parametrize("kind", ["symlink", "dangling-symlink", "fifo", "directory", "socket", "foreign"])
def test_planted_owner_lock_is_refused_and_the_run_still_served(tmp_dir, outside, kind, caplog):
    port = free_port()
    lock = tmp_dir / f"nixl-owner.127.0.0.1:{port}.lock"
    dangling = outside.with_name("never-created")
    sock = None
    if kind == "symlink":
        lock.symlink_to(outside)
    elif kind == "dangling-symlink":
        lock.symlink_to(dangling)  # O_CREAT must not create the target through the link
    elif kind == "foreign":
        lock.touch(mode=0o600)
        os.chown(lock, FOREIGN_UID, FOREIGN_UID)
    else:
        sock = make_special(lock, kind)
    before = fingerprint(outside)
    caplog.set_level(logging.WARNING)
    try:
        with Exporter("agent", exporter_env(tmp_dir, port)) as exp:
            exp.export_event(EventType.AGENT_TX_BYTES, 1)
            assert exp.serving  # bind-fallback: the port decides, the run is still served
            assert scrape(port)
            doc = healthz(port)
            assert doc["owner"]["election"] == "bind-fallback"
            unusable = [w for w in doc["warnings"] if w["kind"] == "unusable-lock"]
            assert unusable and str(lock) in unusable[0]["message"]
            assert any(str(lock) in r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    finally:
        if sock is not None:
            sock.close()
    assert fingerprint(outside) == before
    assert not dangling.exists()
    assert os.path.lexists(lock)


@pytest.mark.parametrize("staging", [False, True])
def test_planted_symlink_at_the_store_name_never_touches_its_target(tmp_dir, outside, monkeypatch, staging):
    """A co-tenant who predicts a store's name (pid, run marker and instance are all visible in the directory)
    can make the creation fail, but never make it write through a link."""
    monkeypatch.setattr(store.writer, "_run_marker", 777)
    monkeypatch.setattr(store.writer, "USE_O_TMPFILE", not staging)
    identity = StoreIdentity("victim", "host", "", 5, DEFAULT_BUCKETS_US)
    name = tmp_dir / L.store_file_name(os.getpid(), 777, 5)
    before = fingerprint(outside)

    name.symlink_to(outside)  # the final name taken: O_TMPFILE+linkat and rename both refuse or replace the link
    if staging:
        writer = StoreWriter(tmp_dir, identity)  # rename() replaces the link itself, never its target
        try:
            writer.record(EventType.AGENT_TX_BYTES, 9)
            assert not name.is_symlink() and name.stat().st_size == L.STORE_SIZE
        finally:
            writer.close()
        name.unlink()
    else:
        with pytest.raises(FileExistsError):
            StoreWriter(tmp_dir, identity)
        assert name.is_symlink()
        name.unlink()
    assert fingerprint(outside) == before

    if staging:  # the staging name taken: O_CREAT|O_EXCL|O_NOFOLLOW refuses it
        staged = name.with_name(name.name + L.STAGING_SUFFIX)
        staged.symlink_to(outside)
        with pytest.raises(FileExistsError):
            StoreWriter(tmp_dir, identity)
        assert staged.is_symlink() and not name.exists()
        assert fingerprint(outside) == before


def test_links_to_outside_files_are_never_followed_nor_written(tmp_dir, outside, fresh_warners):
    """A symlink and a hard link named like stores, pointing at a departed store outside the directory."""
    port = free_port()
    (tmp_dir / "nixl.11.1.0.mmap").symlink_to(outside)
    hard = tmp_dir / "nixl.12.1.0.mmap"
    os.link(outside, hard)  # same inode: reading it is reading the outside file
    before = fingerprint(outside)
    # Served from a thread of this process, whose scrapes are the only collections: an address server also looks
    # at the directory on its own, and two collections at once can show a store that one of them is reaping as
    # live to the other (an open bug of the collector's, not of the links' handling).
    env = exporter_env(tmp_dir, port, NIXL_TELEMETRY_MP_STALE_TTL="0", NIXL_PROMETHEUS_MP_SERVE="thread")
    with Exporter("good", env):
        for _ in range(2):
            samples = parse_exposition(scrape(port))
            assert {v for _, labels in samples for k, v in labels if k == "agent_name"} == {"good"}
    content, mtime, size = fingerprint(outside)
    assert (content, mtime, size) == before  # never written nor truncated
    assert outside.exists()  # never unlinked (the hard link's name in the directory may be reaped)
    assert (tmp_dir / "nixl.11.1.0.mmap").is_symlink()


def test_hostile_files_do_not_break_the_wsgi_app_under_http(tmp_dir, fresh_warners):
    """Garbage stores next to a good one, through the real HTTP server: 200 and the good rank."""
    port = free_port()
    garbage = {"nixl.21.1.0.mmap": b"", "nixl.22.1.0.mmap": os.urandom(L.STORE_SIZE),
               "nixl.23.1.0.mmap": VALID[:100], "nixl.24.1.0.mmap": store_bytes(bounds=(float("nan"),))}
    with Exporter("good", exporter_env(tmp_dir, port, NIXL_TELEMETRY_MP_STALE_TTL="3600")):
        for name, data in garbage.items():
            (tmp_dir / name).write_bytes(data)
        response = http_get(metrics_url(port))
        assert response.status == 200
        names = {v for _, labels in parse_exposition(response.text) for k, v in labels if k == "agent_name"}
        assert names == {"good"}
    for name in garbage:  # invalid and held by nobody: reaped
        assert not (tmp_dir / name).exists()


def test_struct_of_store_bytes_is_the_layout():
    """The fuzz tests' builder writes what the reader decodes (guards the helper itself)."""
    snap = decode(store_bytes(pid=77, instance=3, name=b"n", fill=5), Path("x"))
    assert isinstance(snap, Snapshot) and (snap.pid, snap.instance, snap.agent_name) == (77, 3, "n")
    assert snap.counters[0] == 5 and struct.calcsize("=Q") == 8
