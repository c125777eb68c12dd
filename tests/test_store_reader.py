"""The reader: stores built by hand at the offsets of docs/format.md, invalid content vs unreadable files."""

from __future__ import annotations

import fcntl
import logging
import math
import os
import struct
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

import store
import store.reader
from store import EventType, InvalidStore, Snapshot, Unreadable, read_snapshot, writer_alive
from store.warnonce import OnceWarner

LOGGER = "nixl_prometheus_mp.store"
MAGIC = 0x3153504D4C58494E
SIZE = 6800
E = EventType

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
little_endian = pytest.mark.skipif(sys.byteorder != "little", reason="hand-built stores are little-endian")


def build_store(*, magic: int = MAGIC, version: int = 1, slots: int = 21, pid: int = 4242,
                last_update: int = 123_456_789, instance: int = 0, bucket_count: int | None = None,
                bounds: tuple[float, ...] = (10.0, 100.0), name: bytes = b"cxx-agent", host: bytes = b"node-9",
                rank: bytes = b"", counters: dict[int, int] | None = None, gauges: dict[int, int] | None = None,
                buckets: dict[tuple[int, int], int] | None = None, sums: dict[int, int] | None = None) -> bytearray:
    """A store as another implementation (the C++ plug-in) lays it out, field by field."""
    data = bytearray(SIZE)
    struct.pack_into("<I", data, 8, version)
    struct.pack_into("<I", data, 12, slots)
    struct.pack_into("<q", data, 16, pid)
    struct.pack_into("<Q", data, 24, last_update)
    struct.pack_into("<Q", data, 32, instance)
    struct.pack_into("<Q", data, 40, len(bounds) if bucket_count is None else bucket_count)
    struct.pack_into("<256s", data, 48, name)
    struct.pack_into("<128s", data, 304, host)
    struct.pack_into("<64s", data, 432, rank)
    for i, bound in enumerate(bounds):
        struct.pack_into("<d", data, 496 + 8 * i, bound)
    for slot, value in (counters or {}).items():
        struct.pack_into("<Q", data, 752 + 8 * slot, value)
    for slot, value in (gauges or {}).items():
        struct.pack_into("<Q", data, 920 + 8 * slot, value)
    for (slot, bucket), value in (buckets or {}).items():
        struct.pack_into("<Q", data, 1088 + 8 * (slot * 33 + bucket), value)
    for slot, value in (sums or {}).items():
        struct.pack_into("<Q", data, 6632 + 8 * slot, value)
    struct.pack_into("<Q", data, 0, magic)  # last, as the contract says
    return data


def plant(directory: Path, data: bytes, name: str = "nixl.4242.1.0.mmap") -> Path:
    path = directory / name
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    return path


@pytest.fixture
def fresh_warner(monkeypatch) -> OnceWarner:
    """The module-level warner remembers every file it warned about; give each test a new one."""
    warner = OnceWarner(store.reader.log)
    monkeypatch.setattr(store.reader, "foreign_warner", warner)
    return warner


def store_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


# -- a store written by someone else -----------------------------------------------


@little_endian
def test_hand_built_store_reads_back(tmp_dir):
    bounds = (10.0, 25.5, 1e6)
    ev = int(E.AGENT_XFER_POST_TIME)
    data = build_store(
        pid=987654, last_update=2**63 + 5, instance=3, bounds=bounds, name="agent-é".encode(), host=b"gpu-node-12",
        rank=b"7",
        counters={0: 4096, ev: 2**64 - 1, 8: 2, 20: 11},
        gauges={0: 512, ev: 1_000_001},
        buckets={(ev, 0): 5, (ev, 1): 6, (ev, 2): 7, (ev, 3): 8, (ev, 32): 999, (6, 0): 1},
        sums={ev: 123_456, 6: 3},
    )
    path = plant(tmp_dir, data)
    s = read_snapshot(path)
    assert isinstance(s, Snapshot), s
    assert s.path == path
    assert s.pid == 987654
    assert s.last_update_ns == 2**63 + 5
    assert s.instance == 3
    assert s.agent_name == "agent-é"
    assert s.hostname == "gpu-node-12"
    assert s.local_rank == "7"
    assert s.bounds == bounds
    assert s.counters == tuple({0: 4096, ev: 2**64 - 1, 8: 2, 20: 11}.get(i, 0) for i in range(21))
    assert s.gauges == tuple({0: 512, ev: 1_000_001}.get(i, 0) for i in range(21))
    assert s.sums == tuple({ev: 123_456, 6: 3}.get(i, 0) for i in range(21))
    assert s.histogram(ev) == (5, 6, 7, 8)  # the used buckets plus overflow at index bucket_count
    assert s.buckets[ev * 33 + 32] == 999  # beyond bucket_count: kept but not part of the histogram
    assert s.histogram(6) == (1, 0, 0, 0)
    assert len(s.buckets) == 21 * 33
    assert writer_alive(path) is False  # nobody holds it


@little_endian
def test_hand_built_negative_pid_and_full_buckets(tmp_dir):
    bounds = tuple(float(2**i) for i in range(32))
    path = plant(tmp_dir, build_store(pid=-1, bounds=bounds, buckets={(7, 32): 4}))
    s = read_snapshot(path)
    assert isinstance(s, Snapshot), s
    assert s.pid == -1
    assert s.bounds == bounds
    assert s.histogram(7)[-1] == 4 and len(s.histogram(7)) == 33


@little_endian
def test_unused_bounds_are_ignored(tmp_dir):
    data = build_store(bounds=(10.0, 100.0))
    struct.pack_into("<d", data, 496 + 8 * 5, math.nan)  # garbage past bucket_count
    s = read_snapshot(plant(tmp_dir, data))
    assert isinstance(s, Snapshot), s
    assert s.bounds == (10.0, 100.0)


@little_endian
def test_zero_buckets(tmp_dir):
    s = read_snapshot(plant(tmp_dir, build_store(bounds=(), buckets={(6, 0): 3})))
    assert isinstance(s, Snapshot), s
    assert s.bounds == () and s.histogram(6) == (3,)


@little_endian
def test_lock_held_by_another_implementation_is_honoured(tmp_dir, lock_probe):
    path = plant(tmp_dir, build_store())
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert writer_alive(path) is True
        assert isinstance(read_snapshot(path), Snapshot)
        assert lock_probe(path) is False  # the read left the holder's lock alone
    finally:
        os.close(fd)
    assert writer_alive(path) is False
    assert lock_probe(path) is True  # and the reader never kept it locked


def test_readers_never_keep_a_store_locked(make_writer, lock_probe):
    writer = make_writer()
    writer.close()
    for _ in range(3):
        assert writer_alive(writer.path) is False
        assert isinstance(read_snapshot(writer.path), Snapshot)
    assert lock_probe(writer.path) is True


def test_probing_a_live_store_keeps_its_writer_locked(make_writer, lock_probe):
    writer = make_writer()
    for _ in range(3):
        assert writer_alive(writer.path) is True
        assert isinstance(read_snapshot(writer.path), Snapshot)
    assert lock_probe(writer.path) is False
    writer.record(E.AGENT_TX_BYTES, 1)
    assert read_snapshot(writer.path).counters[0] == 1


# -- invalid content -----------------------------------------------------------------


def _corrupt(offset: int, fmt: str, value: int) -> Callable[[bytearray], bytes]:
    def apply(data: bytearray) -> bytes:
        struct.pack_into(fmt, data, offset, value)
        return bytes(data)
    return apply


def _bounds(*values: float) -> Callable[[bytearray], bytes]:
    def apply(data: bytearray) -> bytes:
        struct.pack_into("<Q", data, 40, len(values))
        struct.pack_into(f"<{len(values)}d", data, 496, *values)
        return bytes(data)
    return apply


INVALID = [
    pytest.param(lambda d: b"", "too small", id="empty"),
    pytest.param(lambda d: bytes(d[:100]), "too small", id="100-bytes"),
    pytest.param(lambda d: bytes(d[:SIZE - 1]), "too small", id="6799-bytes"),
    pytest.param(_corrupt(0, "<Q", 0), "magic is 0", id="magic-0"),
    pytest.param(lambda d: b"NIXLMPS2" + bytes(d[8:]), "bad magic", id="bad-magic"),
    pytest.param(_corrupt(0, ">Q", MAGIC), "bad magic", id="byte-swapped-magic"),
    pytest.param(_corrupt(8, "<I", 2), "version", id="version-2"),
    pytest.param(_corrupt(8, "<I", 0), "version", id="version-0"),
    pytest.param(_corrupt(12, "<I", 20), "slot count", id="slots-20"),
    pytest.param(_corrupt(12, "<I", 22), "slot count", id="slots-22"),
    pytest.param(_corrupt(40, "<Q", 33), "bucket count", id="bucket-count-33"),
    pytest.param(_corrupt(40, "<Q", 2**64 - 1), "bucket count", id="bucket-count-huge"),
    pytest.param(_bounds(10.0, math.nan, 100.0), "bounds", id="nan-bound"),
    pytest.param(_bounds(10.0, math.inf), "bounds", id="inf-bound"),
    pytest.param(_bounds(100.0, 10.0), "bounds", id="unsorted"),
    pytest.param(_bounds(10.0, 10.0), "bounds", id="duplicate"),
    pytest.param(_bounds(0.0, 10.0), "bounds", id="zero-bound"),
    pytest.param(_bounds(-1.0, 10.0), "bounds", id="negative-bound"),
]


@little_endian
@pytest.mark.parametrize(("mutate", "reason"), INVALID)
def test_invalid_content(tmp_dir, mutate, reason):
    path = plant(tmp_dir, mutate(build_store()))
    result = read_snapshot(path)
    assert isinstance(result, InvalidStore), result
    assert result.path == path
    assert reason in result.reason


def test_invalid_content_of_a_writer_store(make_writer):
    writer = make_writer()
    writer.close()
    data = bytearray(writer.path.read_bytes())
    data[0] ^= 0xFF
    writer.path.write_bytes(bytes(data))
    result = read_snapshot(writer.path)
    assert isinstance(result, InvalidStore) and "magic" in result.reason


@little_endian
def test_valid_baseline_of_the_invalid_cases(tmp_dir):
    """The unmutated builder output is valid, so each case above fails for its own reason."""
    assert isinstance(read_snapshot(plant(tmp_dir, build_store())), Snapshot)
    assert isinstance(read_snapshot(plant(tmp_dir, _bounds(*range(1, 33))(build_store()), "nixl.1.1.1.mmap")),
                      Snapshot)


# -- unreadable ------------------------------------------------------------------------


def test_missing_file(tmp_dir, fresh_warner, caplog):
    path = tmp_dir / "nixl.1.2.0.mmap"
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        result = read_snapshot(path)
    assert isinstance(result, Unreadable), result
    assert result.missing is True and result.foreign is False
    assert result.path == path and result.reason
    assert store_warnings(caplog) == []


def test_symlink_named_like_a_store_is_not_followed(make_writer, tmp_dir, tmp_path):
    writer = make_writer()
    writer.record(E.AGENT_TX_BYTES, 1)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    link = tmp_dir / "nixl.99999.1.0.mmap"
    link.symlink_to(writer.path)  # points at a perfectly valid store
    result = read_snapshot(link)
    assert isinstance(result, Unreadable), result
    assert not result.missing and not result.foreign
    assert "symbolic link" in result.reason
    dangling = tmp_dir / "nixl.99998.1.0.mmap"
    dangling.symlink_to(elsewhere / "nothing")
    result = read_snapshot(dangling)
    assert isinstance(result, Unreadable) and not result.missing, result


def test_fifo_does_not_hang(tmp_dir):
    fifo = tmp_dir / "nixl.4.5.0.mmap"
    os.mkfifo(fifo, 0o600)
    results: list[object] = []
    reader = threading.Thread(target=lambda: results.append(read_snapshot(fifo)), daemon=True)
    reader.start()
    reader.join(timeout=10)
    assert not reader.is_alive(), "read_snapshot blocked on a FIFO"
    (result,) = results
    assert isinstance(result, Unreadable), result
    assert not result.missing and not result.foreign
    assert "regular" in result.reason


def test_directory_named_like_a_store(tmp_dir):
    path = tmp_dir / "nixl.4.5.0.mmap"
    path.mkdir()
    result = read_snapshot(path)
    assert isinstance(result, Unreadable), result
    assert not result.missing and not result.foreign
    assert "regular" in result.reason


@needs_root
def test_foreign_owned_store_is_skipped_and_warned_once(make_writer, fresh_warner, caplog):
    writer = make_writer()
    writer.record(E.AGENT_TX_BYTES, 1)
    writer.close()
    assert isinstance(read_snapshot(writer.path), Snapshot)
    os.chown(writer.path, 12345, 12345)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        result = read_snapshot(writer.path)
    assert isinstance(result, Unreadable), result
    assert result.foreign is True and result.missing is False
    assert "12345" in result.reason
    (message,) = store_warnings(caplog)
    assert str(writer.path) in message
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        again = read_snapshot(writer.path)
    assert isinstance(again, Unreadable) and again.foreign
    assert store_warnings(caplog) == []


@needs_root
def test_foreign_warnings_are_bounded(tmp_dir, fresh_warner, caplog):
    paths = []
    for i in range(70):
        path = plant(tmp_dir, bytes(build_store()), f"nixl.{1000 + i}.1.0.mmap")
        os.chown(path, 12345, 12345)
        paths.append(path)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        results = [read_snapshot(p) for p in paths]
    assert all(isinstance(r, Unreadable) and r.foreign for r in results)
    messages = store_warnings(caplog)
    overflow = [m for m in messages if "more than 64" in m]
    per_file = [m for m in messages if "more than 64" not in m]
    assert len(overflow) == 1
    assert len(per_file) == 64
    assert {next(str(p) for p in paths if str(p) in m) for m in per_file} == {str(p) for p in paths[:64]}
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for p in paths:
            read_snapshot(p)
    assert store_warnings(caplog) == []


def test_once_warner_counts_keys_not_calls(caplog):
    logger = logging.getLogger(LOGGER)
    warner = OnceWarner(logger, limit=2)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert warner.warn("a", "first %s", "a") is True
        assert warner.warn("a", "first %s", "a") is False
        assert warner.warn("b", "second") is True
        assert warner.warn("c", "third") is False
        assert warner.warn("d", "fourth") is False
        assert warner.warn("a", "first again") is False
    messages = store_warnings(caplog)
    assert messages[:2] == ["first a", "second"]
    assert len(messages) == 3 and "more than 2" in messages[2]
