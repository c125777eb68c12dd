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
import logging
import math
import operator
import os
import stat
import struct
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from store import layout as L
from store.fds import open_above_stdio
from store.warnonce import OnceWarner

log = logging.getLogger("nixl_prometheus_mp.store")
foreign_warner = OnceWarner(log)

_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One store's content at one instant (each word read atomically).

    ``words`` is the whole store as u64[] (``array('Q')``, indexed like the
    writer's view: ``layout.W_COUNTERS + slot`` and so on); ``counters``,
    ``gauges``, ``buckets`` and ``sums`` are tuples sliced from it on access.
    A scrape builds one of these per store, so it holds as few objects as it
    can: one flat array the cyclic GC never scans, no slices, and the path
    only assembled when asked for.
    """

    directory: Path
    name: str  # the store's file name in ``directory``
    pid: int
    last_update_ns: int
    instance: int
    agent_name: str
    hostname: str
    local_rank: str
    bounds: tuple[float, ...]
    words: array[int]
    identity_key: bytes  # the bytes that fix this store's labels, for caching

    @property
    def path(self) -> Path:
        return self.directory / self.name

    @property
    def counters(self) -> tuple[int, ...]:
        """[slot]"""
        return tuple(self.words[L.W_COUNTERS:L.W_GAUGES])

    @property
    def gauges(self) -> tuple[int, ...]:
        """[slot]"""
        return tuple(self.words[L.W_GAUGES:L.W_BUCKETS])

    @property
    def buckets(self) -> tuple[int, ...]:
        """[slot * BUCKET_SLOTS + bucket], not cumulative"""
        return tuple(self.words[L.W_BUCKETS:L.W_SUMS])

    @property
    def sums(self) -> tuple[int, ...]:
        """[slot]"""
        return tuple(self.words[L.W_SUMS:L.W_SUMS + L.SLOT_COUNT])

    def histogram(self, slot: int) -> tuple[int, ...]:
        """Per-bucket counts of one slot: one per bound, then the overflow."""
        start = L.W_BUCKETS + slot * L.BUCKET_SLOTS
        return tuple(self.words[start:start + len(self.bounds) + 1])


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
    transient: bool = False  # the reader ran short (descriptors, memory), not a property of the file


# Failures that say something about the reading process, not about the file:
# the same open succeeds once descriptors or memory are back.
TRANSIENT_ERRNOS: frozenset[int] = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS,
                                              errno.EINTR, errno.EAGAIN})


ReadResult = Snapshot | InvalidStore | Unreadable


def open_store(path: str | os.PathLike[str]) -> int | Unreadable:
    """Open a store for reading if it is a regular file we own."""
    try:
        fd = open_above_stdio(path, _OPEN_FLAGS)
    except OSError as exc:
        return open_failure(Path(path), exc.errno or 0)
    try:
        st = os.fstat(fd)
    except OSError as exc:
        os.close(fd)
        return Unreadable(Path(path), os.strerror(exc.errno or 0))
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        return not_regular(Path(path))
    if st.st_uid != os.geteuid():
        os.close(fd)
        return foreign_owner(Path(path), st.st_uid)
    return fd


def open_failure(path: Path, err: int) -> Unreadable:
    """Why opening ``path`` (without following a symlink) failed with errno ``err``."""
    if err == errno.ELOOP:
        return Unreadable(path, "is a symbolic link, which is never followed")
    if err == errno.EACCES:
        return _permission_denied(path)
    return Unreadable(path, os.strerror(err), missing=err == errno.ENOENT, transient=err in TRANSIENT_ERRNOS)


def not_regular(path: Path) -> Unreadable:
    return Unreadable(path, "is not a regular file")


def foreign_owner(path: Path, uid: int) -> Unreadable:
    return Unreadable(path, f"is owned by uid {uid}, not {os.geteuid()}", foreign=True)


def _permission_denied(path: Path) -> Unreadable:
    """Why a store could not be opened for reading: another user's file, or ours with its read bit removed."""
    try:
        owner = os.stat(path, follow_symlinks=False).st_uid
    except OSError:
        owner = None
    if owner == os.geteuid():
        return Unreadable(path, "is not readable (permission denied; its mode was changed)")
    if owner is None:
        return Unreadable(path, "permission denied", foreign=True)
    return Unreadable(path, f"is owned by uid {owner}, not {os.geteuid()} (permission denied)", foreign=True)


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


_directories: dict[str, Path] = {}


def _directory_of(path: Path) -> Path:
    """``path.parent``, one shared object per directory: a scrape's snapshots all point at the same one."""
    text = os.path.dirname(os.fspath(path))
    directory = _directories.get(text)
    if directory is None:
        if len(_directories) >= 64:
            _directories.clear()
        directory = _directories[text] = Path(text)
    return directory


# What a store's identity bytes (pid, instance, bucket count, names, bounds)
# decode to, once validated: they never change for a store, and decoding and
# validating them is most of decode()'s work.  Bounded: a directory churning
# through more identities than this just starts over.
_IDENTITY_CACHE_SIZE = 4096
_identities: dict[bytes, tuple[str, str, str, tuple[float, ...]]] = {}
_IDENTITY_SLICES = (slice(L.PID_FIELD[0], L.LAST_UPDATE_FIELD[0]),
                    slice(L.AGENT_INSTANCE_FIELD[0], L.COUNTERS_FIELD[0]))


# The fixed header up to the agent instance: magic, version, slot count, pid, last update, instance.
_HEAD_STRUCT = struct.Struct("=QIIqQQ")


def decode(data: bytes, path: Path) -> Snapshot | InvalidStore:
    """Validate and decode a store's bytes (at least its first STORE_SIZE)."""
    return decode_named(data, _directory_of(path), path.name)


def decode_named(data: bytes, directory: Path, name: str) -> Snapshot | InvalidStore:
    """``decode`` for the store ``name`` in ``directory``: a scrape builds no path per store."""
    if len(data) < L.STORE_SIZE:
        return InvalidStore(directory / name, f"too small ({len(data)} bytes, a store is {L.STORE_SIZE})")
    # Only the fixed header first: the names and bounds are decoded once per
    # identity, not once per scrape.
    magic, version, slot_count, pid, last_update, instance = _HEAD_STRUCT.unpack_from(data)
    if magic != L.MAGIC or version != L.SCHEMA_VERSION or slot_count != L.SLOT_COUNT:
        return _invalid_header(L.PREFIX_STRUCT.unpack_from(data), directory / name)
    pid_slice, ident_slice = _IDENTITY_SLICES
    key = data[pid_slice] + data[ident_slice]
    ident = _identities.get(key)
    if ident is None:
        v = L.PREFIX_STRUCT.unpack_from(data)
        nb = v[L.IDX_BUCKET_COUNT]
        if nb > L.MAX_BUCKETS:
            return InvalidStore(directory / name, f"bucket count {nb}, at most {L.MAX_BUCKETS}")
        bounds = v[L.IDX_BOUNDS:L.IDX_BOUNDS + nb]
        # Strictly increasing from above 0 to below +Inf, so every bound is
        # positive and finite; NaN fails every comparison.
        if nb and not (0.0 < bounds[0] and bounds[-1] < math.inf and all(map(operator.lt, bounds, bounds[1:]))):
            return InvalidStore(directory / name, "bucket bounds are not strictly increasing positive finite numbers")
        ident = (_text(v[L.IDX_AGENT_NAME]), _text(v[L.IDX_HOSTNAME]), _text(v[L.IDX_LOCAL_RANK]), bounds)
        if len(_identities) >= _IDENTITY_CACHE_SIZE:
            _identities.clear()
        _identities[key] = ident
    agent_name, hostname, local_rank, bounds = ident
    words = array("Q", data[:L.STORE_SIZE] if len(data) > L.STORE_SIZE else data)
    return Snapshot(directory, name, pid, last_update, instance, agent_name, hostname, local_rank, bounds, words, key)


def _invalid_header(v: tuple[Any, ...], path: Path) -> InvalidStore:
    magic = v[L.IDX_MAGIC]
    if magic == 0:
        return InvalidStore(path, "magic is 0 (never initialised)")
    if magic != L.MAGIC:
        return InvalidStore(path, f"bad magic {magic:#018x}")
    if v[L.IDX_VERSION] != L.SCHEMA_VERSION:
        return InvalidStore(path, f"schema version {v[L.IDX_VERSION]}, expected {L.SCHEMA_VERSION}")
    return InvalidStore(path, f"slot count {v[L.IDX_SLOT_COUNT]}, expected {L.SLOT_COUNT}")


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
        fd = open_above_stdio(path, _OPEN_FLAGS)
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
