"""The on-disk contract: NIXL prometheus_mp store, schema 1.

This module *is* the contract shared with the C++ plug-in.  A store is one
fixed-size file per agent, native byte order (little-endian on every platform
NIXL ships on), no padding.  Every field below is stated once, as an offset
and a size; the checks at the bottom of the module fail the import if a field
moves, overlaps its neighbour or leaves a gap, so the byte layout cannot drift
without someone noticing.

Every 8-byte field sits at an 8-byte aligned offset: writers store each word
with one aligned 8-byte store, so a concurrent reader sees either the old or
the new value of a word, never a torn mix.
"""

from __future__ import annotations

import re
import struct
from typing import Final

MAGIC: Final = 0x3153504D4C58494E  # b"NIXLMPS1" read as a little-endian u64
SCHEMA_VERSION: Final = 1
SLOT_COUNT: Final = 21  # one slot per EventType, indexed by its value
MAX_BUCKETS: Final = 32  # finite bucket bounds per histogram
BUCKET_SLOTS: Final = MAX_BUCKETS + 1  # plus the overflow (+Inf) bucket

AGENT_NAME_SIZE: Final = 256  # NUL-terminated, so at most 255 bytes of name
HOSTNAME_SIZE: Final = 128
LOCAL_RANK_SIZE: Final = 64  # empty means "no local_rank label"

# (offset, size in bytes) of every field, in file order.
MAGIC_FIELD: Final = (0, 8)  # u64, written last
VERSION_FIELD: Final = (8, 4)  # u32
SLOT_COUNT_FIELD: Final = (12, 4)  # u32
PID_FIELD: Final = (16, 8)  # i64
LAST_UPDATE_FIELD: Final = (24, 8)  # u64, CLOCK_MONOTONIC ns
AGENT_INSTANCE_FIELD: Final = (32, 8)  # u64
BUCKET_COUNT_FIELD: Final = (40, 8)  # u64, 0..MAX_BUCKETS
AGENT_NAME_FIELD: Final = (48, AGENT_NAME_SIZE)  # char[256]
HOSTNAME_FIELD: Final = (304, HOSTNAME_SIZE)  # char[128]
LOCAL_RANK_FIELD: Final = (432, LOCAL_RANK_SIZE)  # char[64]
BOUNDS_FIELD: Final = (496, 8 * MAX_BUCKETS)  # f64[32], inclusive upper bounds
COUNTERS_FIELD: Final = (752, 8 * SLOT_COUNT)  # u64[21], by event type
GAUGES_FIELD: Final = (920, 8 * SLOT_COUNT)  # u64[21], by event type
BUCKETS_FIELD: Final = (1088, 8 * SLOT_COUNT * BUCKET_SLOTS)  # u64[21][33], NOT cumulative
SUMS_FIELD: Final = (6632, 8 * SLOT_COUNT)  # u64[21]
STORE_SIZE: Final = 6800  # the file is exactly this long

FIELDS: Final = (
    MAGIC_FIELD,
    VERSION_FIELD,
    SLOT_COUNT_FIELD,
    PID_FIELD,
    LAST_UPDATE_FIELD,
    AGENT_INSTANCE_FIELD,
    BUCKET_COUNT_FIELD,
    AGENT_NAME_FIELD,
    HOSTNAME_FIELD,
    LOCAL_RANK_FIELD,
    BOUNDS_FIELD,
    COUNTERS_FIELD,
    GAUGES_FIELD,
    BUCKETS_FIELD,
    SUMS_FIELD,
)

# The whole file as one struct, so a store decodes with one call over one
# copy (the scrape's reader unpacks PREFIX_STRUCT and takes the u64 words as
# one array instead).  "=" is native byte order with no alignment padding.
STORE_STRUCT: Final = struct.Struct(
    "=QIIqQQQ"
    f"{AGENT_NAME_SIZE}s{HOSTNAME_SIZE}s{LOCAL_RANK_SIZE}s"
    f"{MAX_BUCKETS}d{SLOT_COUNT}Q{SLOT_COUNT}Q{SLOT_COUNT * BUCKET_SLOTS}Q{SLOT_COUNT}Q"
)
# The header fields before the magic, packed at offset 8 by the writer.
HEADER_STRUCT: Final = struct.Struct(
    f"=IIqQQQ{AGENT_NAME_SIZE}s{HOSTNAME_SIZE}s{LOCAL_RANK_SIZE}s"
)
# Everything before the counters (header, names, bounds): what a reader
# unpacks field by field; the u64 arrays after it are read as words.
PREFIX_STRUCT: Final = struct.Struct(
    f"=QIIqQQQ{AGENT_NAME_SIZE}s{HOSTNAME_SIZE}s{LOCAL_RANK_SIZE}s{MAX_BUCKETS}d"
)
U64: Final = struct.Struct("=Q")
F64_BOUNDS: Final = struct.Struct(f"={MAX_BUCKETS}d")

# Index of each field's first element in STORE_STRUCT.unpack() output.
IDX_MAGIC: Final = 0
IDX_VERSION: Final = 1
IDX_SLOT_COUNT: Final = 2
IDX_PID: Final = 3
IDX_LAST_UPDATE: Final = 4
IDX_AGENT_INSTANCE: Final = 5
IDX_BUCKET_COUNT: Final = 6
IDX_AGENT_NAME: Final = 7
IDX_HOSTNAME: Final = 8
IDX_LOCAL_RANK: Final = 9
IDX_BOUNDS: Final = 10
IDX_COUNTERS: Final = IDX_BOUNDS + MAX_BUCKETS
IDX_GAUGES: Final = IDX_COUNTERS + SLOT_COUNT
IDX_BUCKETS: Final = IDX_GAUGES + SLOT_COUNT
IDX_SUMS: Final = IDX_BUCKETS + SLOT_COUNT * BUCKET_SLOTS


def word_index(field: tuple[int, int]) -> int:
    """Index of a u64 field's first word when the store is viewed as u64[]."""
    return field[0] // 8


# The store viewed as u64[] (the writer's memoryview, a Snapshot's words):
# where each per-slot array starts.
STORE_WORDS: Final = STORE_SIZE // 8
W_COUNTERS: Final = word_index(COUNTERS_FIELD)  # + slot
W_GAUGES: Final = word_index(GAUGES_FIELD)  # + slot
W_BUCKETS: Final = word_index(BUCKETS_FIELD)  # + slot * BUCKET_SLOTS + bucket
W_SUMS: Final = word_index(SUMS_FIELD)  # + slot


STORE_PREFIX: Final = "nixl."
STORE_SUFFIX: Final = ".mmap"
STAGING_SUFFIX: Final = ".staging"  # only where O_TMPFILE is refused
OWNER_LOCK_PREFIX: Final = "nixl-owner."
OWNER_LOCK_SUFFIX: Final = ".lock"


def store_file_name(pid: int, run_marker: int, instance: int) -> str:
    """``nixl.<pid>.<run_marker>.<instance>.mmap``: unique per agent and run."""
    return f"{STORE_PREFIX}{pid}.{run_marker}.{instance}{STORE_SUFFIX}"


# Exactly what store_file_name (and the C++ plug-in's makeStoreFileName, which
# writes three std::to_string()s) can produce: ASCII decimal digits only, no
# sign, nothing before or after.  The plug-in's own reader only checks the
# prefix and the suffix; a stricter grammar means that nixl.mmap, nixl..mmap,
# an editor's nixl.1.2.0.mmap~ or an operator's nixl.backup.mmap is never
# read, published nor reaped.
_STORE_NAME: Final = re.compile(r"nixl\.([0-9]+)\.([0-9]+)\.([0-9]+)\.mmap")


def parse_store_name(name: str) -> tuple[int, int, int] | None:
    """``(pid, run_marker, instance)`` of a store's file name, or None if ``name`` is not one."""
    match = _STORE_NAME.fullmatch(name)
    if match is None:
        return None
    pid, run_marker, instance = match.groups()
    return int(pid), int(run_marker), int(instance)


def is_store_name(name: str) -> bool:
    """Whether a directory entry named ``name`` is a store (the only files readers read or reap)."""
    return _STORE_NAME.fullmatch(name) is not None


def _check_layout() -> None:
    """Fail the import if the table above stopped describing a gapless file."""
    end = 0
    for offset, size in FIELDS:
        if offset != end:
            raise AssertionError(f"store field at {offset} should start at {end}")
        end = offset + size
    if end != STORE_SIZE:
        raise AssertionError(f"store fields end at {end}, not {STORE_SIZE}")
    if STORE_STRUCT.size != STORE_SIZE:
        raise AssertionError(f"STORE_STRUCT is {STORE_STRUCT.size} bytes, not {STORE_SIZE}")
    if PREFIX_STRUCT.size != COUNTERS_FIELD[0] or STORE_SIZE % 8:
        raise AssertionError("PREFIX_STRUCT does not end where the counters start")
    if VERSION_FIELD[0] + HEADER_STRUCT.size != BOUNDS_FIELD[0]:
        raise AssertionError("HEADER_STRUCT does not end where the bucket bounds start")
    for field in (PID_FIELD, LAST_UPDATE_FIELD, AGENT_INSTANCE_FIELD, BUCKET_COUNT_FIELD,
                  BOUNDS_FIELD, COUNTERS_FIELD, GAUGES_FIELD, BUCKETS_FIELD, SUMS_FIELD):
        if field[0] % 8:
            raise AssertionError(f"8-byte field at {field[0]} is not 8-byte aligned")
    if MAGIC.to_bytes(8, "little") != b"NIXLMPS1":
        raise AssertionError("MAGIC no longer spells NIXLMPS1")
    if IDX_SUMS + SLOT_COUNT != len(STORE_STRUCT.unpack(bytes(STORE_SIZE))):
        raise AssertionError("STORE_STRUCT element indexes are off")


_check_layout()
