"""The on-disk contract (docs/format.md), checked against a table typed in here.

Nothing below takes an offset from store.layout: the table is copied from
docs/format.md, so moving a field in layout.py (or in the writer) fails these tests.
"""

from __future__ import annotations

import os
import re
import stat
import struct
import sys
import time

import pytest

import store
from store import EventType
from store import layout as L

pytestmark = pytest.mark.skipif(sys.byteorder != "little", reason="the contract is checked on little-endian hosts")

# docs/format.md: name -> (offset, size in bytes).
CONTRACT = {
    "magic": (0, 8),
    "version": (8, 4),
    "slot_count": (12, 4),
    "pid": (16, 8),
    "last_update": (24, 8),
    "instance": (32, 8),
    "bucket_count": (40, 8),
    "agent_name": (48, 256),
    "hostname": (304, 128),
    "local_rank": (432, 64),
    "bounds": (496, 8 * 32),
    "counters": (752, 8 * 21),
    "gauges": (920, 8 * 21),
    "buckets": (1088, 8 * 21 * 33),
    "sums": (6632, 8 * 21),
}
SIZE = 6800
MAGIC_BYTES = b"NIXLMPS1"
MAGIC_U64 = 0x3153504D4C58494E
OFF = {name: offset for name, (offset, _) in CONTRACT.items()}

LAYOUT_FIELDS = {
    "magic": "MAGIC_FIELD",
    "version": "VERSION_FIELD",
    "slot_count": "SLOT_COUNT_FIELD",
    "pid": "PID_FIELD",
    "last_update": "LAST_UPDATE_FIELD",
    "instance": "AGENT_INSTANCE_FIELD",
    "bucket_count": "BUCKET_COUNT_FIELD",
    "agent_name": "AGENT_NAME_FIELD",
    "hostname": "HOSTNAME_FIELD",
    "local_rank": "LOCAL_RANK_FIELD",
    "bounds": "BOUNDS_FIELD",
    "counters": "COUNTERS_FIELD",
    "gauges": "GAUGES_FIELD",
    "buckets": "BUCKETS_FIELD",
    "sums": "SUMS_FIELD",
}


def u64(data: bytes, offset: int) -> int:
    return struct.unpack_from("<Q", data, offset)[0]


def counter_at(ev: int) -> int:
    return OFF["counters"] + 8 * ev


def gauge_at(ev: int) -> int:
    return OFF["gauges"] + 8 * ev


def bucket_at(ev: int, bucket: int) -> int:
    return OFF["buckets"] + 8 * (ev * 33 + bucket)


def sum_at(ev: int) -> int:
    return OFF["sums"] + 8 * ev


def c_string(data: bytes, name: str) -> bytes:
    offset, size = CONTRACT[name]
    field = data[offset:offset + size]
    assert b"\0" in field, f"{name} is not NUL-terminated"
    return field.split(b"\0", 1)[0]


# -- layout.py against the table -----------------------------------------------


@pytest.mark.parametrize("name", list(CONTRACT))
def test_field_offset_and_size_match_design(name):
    assert getattr(L, LAYOUT_FIELDS[name]) == CONTRACT[name]


def test_fields_in_file_order_and_gapless():
    assert L.FIELDS == tuple(CONTRACT[name] for name in CONTRACT)
    end = 0
    for offset, size in CONTRACT.values():
        assert offset == end
        end = offset + size
    assert end == SIZE


def test_sizes_and_constants():
    assert L.STORE_SIZE == SIZE == store.STORE_SIZE
    assert L.STORE_STRUCT.size == SIZE
    assert L.MAGIC == MAGIC_U64
    assert L.MAGIC.to_bytes(8, "little") == MAGIC_BYTES
    assert struct.pack("<Q", MAGIC_U64) == MAGIC_BYTES
    assert (L.SCHEMA_VERSION, L.SLOT_COUNT, L.MAX_BUCKETS, L.BUCKET_SLOTS) == (1, 21, 32, 33)
    assert (L.AGENT_NAME_SIZE, L.HOSTNAME_SIZE, L.LOCAL_RANK_SIZE) == (256, 128, 64)
    assert len(EventType) == 21


def test_store_struct_places_every_element_at_the_contract_offset():
    """Pack distinct values with STORE_STRUCT and read them back at the table's offsets."""
    bounds = [float(i + 1) * 1.5 for i in range(32)]
    counters = [1000 + i for i in range(21)]
    gauges = [2000 + i for i in range(21)]
    buckets = [10_000 + i for i in range(21 * 33)]
    sums = [50_000 + i for i in range(21)]
    data = L.STORE_STRUCT.pack(MAGIC_U64, 1, 21, -7, 11, 12, 13, b"name", b"host", b"rank",
                               *bounds, *counters, *gauges, *buckets, *sums)
    assert data[:8] == MAGIC_BYTES
    assert struct.unpack_from("<IIqQQQ", data, 8) == (1, 21, -7, 11, 12, 13)
    assert c_string(data, "agent_name") == b"name"
    assert c_string(data, "hostname") == b"host"
    assert c_string(data, "local_rank") == b"rank"
    assert list(struct.unpack_from("<32d", data, OFF["bounds"])) == bounds
    assert [u64(data, counter_at(i)) for i in range(21)] == counters
    assert [u64(data, gauge_at(i)) for i in range(21)] == gauges
    assert [u64(data, bucket_at(s, b)) for s in range(21) for b in range(33)] == buckets
    assert [u64(data, sum_at(i)) for i in range(21)] == sums
    # The element indexes the reader uses point at the same fields.
    v = L.STORE_STRUCT.unpack(data)
    assert v[L.IDX_PID] == -7 and v[L.IDX_LAST_UPDATE] == 11 and v[L.IDX_AGENT_INSTANCE] == 12
    assert v[L.IDX_BUCKET_COUNT] == 13
    assert v[L.IDX_COUNTERS] == 1000 and v[L.IDX_GAUGES] == 2000 and v[L.IDX_BUCKETS] == 10_000
    assert v[L.IDX_SUMS] == 50_000


def test_store_file_name_pattern():
    assert L.store_file_name(123, 456, 7) == "nixl.123.456.7.mmap"


# -- a store written by StoreWriter, read byte by byte ---------------------------


def test_writer_output_at_contract_offsets(make_writer, tmp_dir):
    bounds = (10.0, 100.0, 1000.0)
    t0 = time.monotonic_ns()
    writer = make_writer(agent_name="agent-7", hostname="node-1", local_rank="3", instance=5, bounds=bounds)
    data = writer.path.read_bytes()
    t1 = time.monotonic_ns()

    assert len(data) == SIZE
    assert data[:8] == MAGIC_BYTES
    assert u64(data, 0) == MAGIC_U64
    assert struct.unpack_from("<I", data, 8)[0] == 1
    assert struct.unpack_from("<I", data, 12)[0] == 21
    assert struct.unpack_from("<q", data, 16)[0] == os.getpid()
    assert t0 <= u64(data, 24) <= t1
    assert u64(data, 32) == 5
    assert u64(data, 40) == 3
    assert c_string(data, "agent_name") == b"agent-7"
    assert c_string(data, "hostname") == b"node-1"
    assert c_string(data, "local_rank") == b"3"
    # The whole rest of each name field is NUL padding.
    assert data[48 + 7:304] == bytes(256 - 7)
    assert struct.unpack_from("<3d", data, 496) == bounds
    assert data[496 + 24:752] == bytes(8 * 29)
    # A fresh store has every metric word at zero.
    assert data[752:SIZE] == bytes(SIZE - 752)

    # Record events and find them at their offsets.
    before = time.monotonic_ns()
    stamp = writer.record(EventType.AGENT_XFER_TIME, 100)  # == bound 1 -> bucket 1
    writer.record(EventType.AGENT_XFER_TIME, 5)  # bucket 0
    writer.record(EventType.AGENT_XFER_TIME, 5000)  # above the last bound: overflow, index 3
    writer.record(EventType.AGENT_TX_BYTES, 4096)
    writer.record(EventType.AGENT_TX_BYTES, 1024)
    writer.record(EventType.AGENT_ERR_BACKEND, 1)
    last = writer.record(EventType.AGENT_TELEMETRY_EVENTS_DROPPED, 9)
    after = time.monotonic_ns()
    data = writer.path.read_bytes()

    assert before <= stamp <= last <= after
    assert u64(data, 24) == last
    xfer = int(EventType.AGENT_XFER_TIME)
    assert xfer == 6
    assert u64(data, counter_at(xfer)) == 5105
    assert u64(data, gauge_at(xfer)) == 5000
    assert [u64(data, bucket_at(xfer, b)) for b in range(33)] == [1, 1, 0, 1] + [0] * 29
    assert u64(data, sum_at(xfer)) == 5105
    assert u64(data, counter_at(0)) == 5120
    assert u64(data, gauge_at(0)) == 1024
    assert u64(data, counter_at(10)) == 1
    assert u64(data, counter_at(20)) == 9
    expected_counters = {0: 5120, 6: 5105, 10: 1, 20: 9}
    assert [u64(data, counter_at(i)) for i in range(21)] == [expected_counters.get(i, 0) for i in range(21)]
    assert [u64(data, gauge_at(i)) for i in range(21)] == [1024 if i == 0 else 5000 if i == 6 else 0
                                                           for i in range(21)]
    assert [u64(data, sum_at(i)) for i in range(21)] == [5105 if i == 6 else 0 for i in range(21)]
    other_buckets = [u64(data, bucket_at(s, b)) for s in range(21) if s != xfer for b in range(33)]
    assert other_buckets == [0] * (20 * 33)


def test_writer_file_name_mode_and_size(make_writer, tmp_dir):
    writer = make_writer(instance=4)
    m = re.fullmatch(r"nixl\.(\d+)\.(\d+)\.(\d+)\.mmap", writer.path.name)
    assert m, writer.path.name
    assert int(m.group(1)) == os.getpid()
    assert int(m.group(3)) == 4
    marker = int(m.group(2))
    # The run marker is CLOCK_REALTIME ns taken when the process started (well, imported store).
    assert 0 < marker <= time.time_ns()
    assert writer.path.parent == tmp_dir
    st = os.lstat(writer.path)
    assert stat.S_ISREG(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_size == SIZE
    assert st.st_uid == os.geteuid()
    assert sorted(p.name for p in tmp_dir.iterdir()) == [writer.path.name]


def test_run_marker_fixed_for_the_process(make_writer):
    first = make_writer(instance=0)
    second = make_writer(instance=1)
    marker = first.path.name.split(".")[2]
    assert second.path.name == f"nixl.{os.getpid()}.{marker}.1.mmap"
