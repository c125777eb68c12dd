"""Reading stores: snapshots, validation and the liveness probe.

Readers never trust a file in the shared directory: each is opened without
following symlinks and without blocking (a FIFO named like a store must not
hang a scrape), must be a regular file owned by the reader's effective uid,
and is validated field by field before anything in it is believed.

Two kinds of failure are kept apart because they lead to opposite actions:
*invalid content* (the bytes are not a schema-1 store) may be reaped once no
writer holds the file; *could not read* (missing, transient error, foreign
owner, not a regular file) must never lead to reaping.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import logging
import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from store import layout as L
from store.warnonce import OnceWarner

log = logging.getLogger("nixl_prometheus_mp.store")
foreign_warner = OnceWarner(log)

_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One store's content at one instant (each word read atomically)."""

    path: Path
    pid: int
    last_update_ns: int
    instance: int
    agent_name: str
    hostname: str
    local_rank: str
    bounds: tuple[float, ...]
    counters: tuple[int, ...]  # [slot]
    gauges: tuple[int, ...]  # [slot]
    buckets: tuple[int, ...]  # [slot * BUCKET_SLOTS + bucket], not cumulative
    sums: tuple[int, ...]  # [slot]
    identity_key: bytes  # the bytes that fix this store's labels, for caching

    def histogram(self, slot: int) -> tuple[int, ...]:
        """Per-bucket counts of one slot: one per bound, then the overflow."""
        start = slot * L.BUCKET_SLOTS
        return self.buckets[start:start + len(self.bounds) + 1]


@dataclass(frozen=True, slots=True)
class InvalidStore:
    """The file's bytes are not a schema-1 store (reapable once unlocked)."""

    path: Path
    reason: str


@dataclass(frozen=True, slots=True)
class Unreadable:
    """The file could not be read; never a reason to reap it."""

    path: Path
    reason: str
    foreign: bool = False  # owned by another uid: never read, never reaped
    missing: bool = False  # gone (reaped by someone else, or raced)


ReadResult = Snapshot | InvalidStore | Unreadable


def open_store(path: Path) -> int | Unreadable:
    """Open a store for reading if it is a regular file we own."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return Unreadable(path, "is a symbolic link, which is never followed")
        if exc.errno == errno.EACCES:
            return Unreadable(path, "permission denied (owned by another user?)", foreign=True)
        return Unreadable(path, os.strerror(exc.errno or 0), missing=exc.errno == errno.ENOENT)
    try:
        st = os.fstat(fd)
    except OSError as exc:
        os.close(fd)
        return Unreadable(path, os.strerror(exc.errno or 0))
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        return Unreadable(path, "is not a regular file")
    if st.st_uid != os.geteuid():
        os.close(fd)
        return Unreadable(path, f"is owned by uid {st.st_uid}, not {os.geteuid()}", foreign=True)
    return fd


def probe_alive(fd: int) -> bool:
    """True unless we could take the lock, i.e. no writer holds it any more.

    Conservative: any failure other than success reads as alive, because a
    false "dead" leads to reaping a live writer's store.  LOCK_SH lets
    concurrent readers (several gunicorn workers) probe at the same time
    without mistaking each other for a writer.
    """
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def read_fd(fd: int, path: Path) -> Snapshot | InvalidStore | Unreadable:
    """Read and validate a store from an open descriptor, with one copy."""
    try:
        data = os.pread(fd, L.STORE_SIZE, 0)
    except OSError as exc:
        return Unreadable(path, os.strerror(exc.errno or 0))
    return decode(data, path)


def decode(data: bytes, path: Path) -> Snapshot | InvalidStore:
    """Validate and decode a store's bytes (at least its first STORE_SIZE)."""
    if len(data) < L.STORE_SIZE:
        return InvalidStore(path, f"too small ({len(data)} bytes, a store is {L.STORE_SIZE})")
    v = L.STORE_STRUCT.unpack_from(data)
    magic = v[L.IDX_MAGIC]
    if magic == 0:
        return InvalidStore(path, "magic is 0 (never initialised)")
    if magic != L.MAGIC:
        return InvalidStore(path, f"bad magic {magic:#018x}")
    if v[L.IDX_VERSION] != L.SCHEMA_VERSION:
        return InvalidStore(path, f"schema version {v[L.IDX_VERSION]}, expected {L.SCHEMA_VERSION}")
    if v[L.IDX_SLOT_COUNT] != L.SLOT_COUNT:
        return InvalidStore(path, f"slot count {v[L.IDX_SLOT_COUNT]}, expected {L.SLOT_COUNT}")
    nb = v[L.IDX_BUCKET_COUNT]
    if nb > L.MAX_BUCKETS:
        return InvalidStore(path, f"bucket count {nb}, at most {L.MAX_BUCKETS}")
    bounds = v[L.IDX_BOUNDS:L.IDX_BOUNDS + nb]
    if not all(math.isfinite(b) and b > 0 for b in bounds) or any(
            a >= b for a, b in itertools.pairwise(bounds)):
        return InvalidStore(path, "bucket bounds are not strictly increasing positive finite numbers")
    return Snapshot(
        path=path,
        pid=v[L.IDX_PID],
        last_update_ns=v[L.IDX_LAST_UPDATE],
        instance=v[L.IDX_AGENT_INSTANCE],
        agent_name=_text(v[L.IDX_AGENT_NAME]),
        hostname=_text(v[L.IDX_HOSTNAME]),
        local_rank=_text(v[L.IDX_LOCAL_RANK]),
        bounds=bounds,
        counters=v[L.IDX_COUNTERS:L.IDX_GAUGES],
        gauges=v[L.IDX_GAUGES:L.IDX_BUCKETS],
        buckets=v[L.IDX_BUCKETS:L.IDX_SUMS],
        sums=v[L.IDX_SUMS:],
        identity_key=data[L.PID_FIELD[0]:L.LAST_UPDATE_FIELD[0]] + data[L.AGENT_INSTANCE_FIELD[0]:L.COUNTERS_FIELD[0]],
    )


def _text(field: bytes) -> str:
    return field.split(b"\0", 1)[0].decode("utf-8", errors="replace")


def read_snapshot(path: str | os.PathLike[str]) -> ReadResult:
    """Read one store: a Snapshot, or why not (InvalidStore vs Unreadable)."""
    path = Path(path)
    fd = open_store(path)
    if isinstance(fd, Unreadable):
        if fd.foreign:
            warn_foreign(fd)
        return fd
    try:
        return read_fd(fd, path)
    finally:
        os.close(fd)


def writer_alive(path: str | os.PathLike[str]) -> bool:
    """Whether a writer still holds the store (a failed probe reads as alive)."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError:
        return True
    try:
        return probe_alive(fd)
    finally:
        os.close(fd)


def warn_foreign(result: Unreadable) -> None:
    """Warn once per file (bounded) that a store is skipped for its owner."""
    foreign_warner.warn(
        ("foreign", str(result.path)),
        "skipping %s in the telemetry directory: it %s, so it is never read nor reaped (another user "
        "cannot inject series). Remove it, or give each user a private NIXL_TELEMETRY_MULTIPROC_DIR.",
        result.path, result.reason)
