"""StoreWriter: one agent's metric state in its own memory-mapped store.

Creation order is what makes liveness trustworthy (see SPEC "Liveness is a
lock, not a pid"): the file is created nameless, locked, sized and
initialised -- magic last -- and only then given its name.  A reader can
therefore never find a store that is initialised but not yet locked, and a
store it *can* lock has no writer left.

The hot path is one closure per event type with every slot offset bound at
creation: one lock acquisition, a handful of aligned 8-byte stores through a
``memoryview`` cast to ``Q``, no allocation beyond Python's own ints.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import logging
import mmap
import os
import threading
import time
import weakref
from bisect import bisect_left
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from store import layout as L
from store.metrics import GAUGE_EVENTS, HISTOGRAM_EVENTS, EventType

log = logging.getLogger("nixl_prometheus_mp.store")

U64_MAX: Final = (1 << 64) - 1
_W_MAGIC: Final = L.word_index(L.MAGIC_FIELD)
_W_LAST_UPDATE: Final = L.word_index(L.LAST_UPDATE_FIELD)
_W_COUNTERS: Final = L.word_index(L.COUNTERS_FIELD)
_W_GAUGES: Final = L.word_index(L.GAUGES_FIELD)
_W_BUCKETS: Final = L.word_index(L.BUCKETS_FIELD)
_W_SUMS: Final = L.word_index(L.SUMS_FIELD)

# Tests flip this to exercise the .staging path that filesystems without
# O_TMPFILE (NFS, some overlays) take.
USE_O_TMPFILE: bool = hasattr(os, "O_TMPFILE")
# errnos with which open(O_TMPFILE) says "not supported here" rather than
# "this directory is unusable".
_TMPFILE_UNSUPPORTED: Final = frozenset({errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL})

Recorder = Callable[[int], int]


def event_value(value: object) -> int:
    """Validate one event value: an unsigned 64-bit integer, else raise.

    The hot path only calls this when ``type(value) is not int`` or the value
    is out of range, so the common case costs one type check.
    """
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"event value must be an unsigned 64-bit integer, got {type(value).__name__} {value!r}")
    number = value.__index__()  # type: ignore[attr-defined]
    if not 0 <= number <= U64_MAX:
        raise ValueError(f"event value {number} is outside 0..2**64-1")
    return number


def event_type(value: object) -> EventType:
    """Validate an event type, naming the bad value."""
    try:
        return EventType(value)
    except ValueError:
        raise ValueError(f"unknown event type {value!r} (valid: 0..{len(EventType) - 1})") from None


def encode_field(value: str, size: int, what: str) -> bytes:
    """UTF-8 bytes of ``value`` that fit a NUL-terminated field of ``size``.

    Truncates to size-1 bytes with a warning, backing off so that a
    multi-byte character is dropped whole rather than split (a reader would
    otherwise see invalid UTF-8 in the label).
    """
    raw = value.encode("utf-8", errors="replace")
    cap = size - 1
    if len(raw) <= cap:
        return raw
    cut = cap
    while cut > 0 and raw[cut] & 0xC0 == 0x80:  # raw[cut] continues a character
        cut -= 1
    log.warning("%s %r is %d bytes, longer than the store's %d-byte field; it is exported truncated to %r",
                what, value, len(raw), cap, raw[:cut].decode("utf-8"))
    return raw[:cut]


@dataclass(frozen=True)
class StoreIdentity:
    """What a store says about its agent; fixed for the store's life."""

    agent_name: str
    hostname: str
    local_rank: str
    instance: int
    bounds: tuple[float, ...]


_run_marker: int = time.time_ns()  # CLOCK_REALTIME ns, fixed for the life of the process
_writers: weakref.WeakSet[StoreWriter] = weakref.WeakSet()


class StoreWriter:
    """The writer side of one agent's store (thread-safe; fork-aware)."""

    def __init__(self, directory: str | os.PathLike[str], identity: StoreIdentity,
                 enabled: Collection[EventType] | None = None) -> None:
        if len(identity.bounds) > L.MAX_BUCKETS:
            raise ValueError(f"{len(identity.bounds)} bucket bounds, the store holds at most {L.MAX_BUCKETS}")
        self.directory = Path(directory)
        self.identity = identity
        self._enabled = frozenset(EventType if enabled is None else enabled)
        self._names = (
            encode_field(identity.agent_name, L.AGENT_NAME_SIZE, "agent name"),
            encode_field(identity.hostname, L.HOSTNAME_SIZE, "hostname"),
            encode_field(identity.local_rank, L.LOCAL_RANK_SIZE, "local rank"),
        )
        # The recorders dict is mutated in place (fork, close) so callers may
        # keep a reference to it and skip one attribute lookup per event.
        self.recorders: dict[int, Recorder] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._create()
        _writers.add(self)

    # -- creation ---------------------------------------------------------

    def _create(self) -> None:
        pid = os.getpid()
        self.pid = pid
        self.path = self.directory / L.store_file_name(pid, _run_marker, self.identity.instance)
        fd = self._create_tmpfile() if USE_O_TMPFILE else None
        if fd is None:
            fd = self._create_staged()
        self._fd = fd
        self._map(fd)
        self._bind_recorders()

    def _create_tmpfile(self) -> int | None:
        """Nameless create + lock + init + link; None where O_TMPFILE is refused."""
        try:
            fd = os.open(self.directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            if exc.errno in _TMPFILE_UNSUPPORTED:
                return None
            raise
        try:
            self._lock_and_init(fd)
            # An explicit dst_dir_fd makes CPython call linkat() with
            # AT_SYMLINK_FOLLOW; plain link() would not resolve the magic
            # /proc link to our nameless inode and fail with EXDEV.
            dir_fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.link(f"/proc/self/fd/{fd}", self.path.name, dst_dir_fd=dir_fd, follow_symlinks=True)
            finally:
                os.close(dir_fd)
        except FileNotFoundError:
            if Path(f"/proc/self/fd/{fd}").exists():
                os.close(fd)
                raise
            os.close(fd)  # no /proc: the staging path needs no magic link
            return None
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _create_staged(self) -> int:
        """The NFS path: a .staging name renamed into place once initialised.

        A process killed between the open and the rename leaks one staging
        file; readers only look at ``*.mmap``, so it is never mistaken for a
        store.
        """
        staging = self.path.with_name(self.path.name + L.STAGING_SUFFIX)
        fd = os.open(staging, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            self._lock_and_init(fd)
            os.rename(staging, self.path)
        except BaseException:
            os.close(fd)
            staging.unlink(missing_ok=True)
            raise
        return fd

    def _lock_and_init(self, fd: int) -> None:
        self.locked = _flock_store(fd, self.path)
        os.fchmod(fd, 0o600)  # the umask can only narrow 0600, but be explicit
        os.ftruncate(fd, L.STORE_SIZE)
        with mmap.mmap(fd, L.STORE_SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as mm:
            ident = self.identity
            L.HEADER_STRUCT.pack_into(
                mm, L.VERSION_FIELD[0], L.SCHEMA_VERSION, L.SLOT_COUNT, self.pid, time.monotonic_ns(),
                ident.instance, len(ident.bounds), *self._names)
            bounds = list(ident.bounds) + [0.0] * (L.MAX_BUCKETS - len(ident.bounds))
            L.F64_BOUNDS.pack_into(mm, L.BOUNDS_FIELD[0], *bounds)
            # Magic last: a reader that sees it sees a fully initialised header.
            words = memoryview(mm).cast("Q")
            words[_W_MAGIC] = L.MAGIC
            words.release()

    def _map(self, fd: int) -> None:
        self._mm = mmap.mmap(fd, L.STORE_SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._words = memoryview(self._mm).cast("Q")

    # -- the hot path -----------------------------------------------------

    def _bind_recorders(self) -> None:
        words, lock, now = self._words, self._lock, time.monotonic_ns
        bounds = self.identity.bounds
        live = [True]  # cleared under the lock by close(); see _unmap
        self._live = live
        mask, hb = U64_MAX, _W_LAST_UPDATE

        def make(ev: EventType) -> Recorder:
            c, g, s = _W_COUNTERS + ev, _W_GAUGES + ev, _W_SUMS + ev
            base = _W_BUCKETS + ev * L.BUCKET_SLOTS
            if ev not in self._enabled:
                def record(value: int) -> int:
                    if type(value) is not int or not 0 <= value <= mask:
                        event_value(value)
                    return now()
            elif ev in HISTOGRAM_EVENTS:
                def record(value: int) -> int:
                    if type(value) is not int or not 0 <= value <= mask:
                        value = event_value(value)
                    b = base + bisect_left(bounds, value)
                    with lock:
                        if live[0]:
                            words[c] = (words[c] + value) & mask
                            words[g] = value
                            words[b] = (words[b] + 1) & mask
                            words[s] = (words[s] + value) & mask
                            words[hb] = t = now()
                            return t
                    return now()
            elif ev in GAUGE_EVENTS:
                def record(value: int) -> int:
                    if type(value) is not int or not 0 <= value <= mask:
                        value = event_value(value)
                    with lock:
                        if live[0]:
                            words[c] = (words[c] + value) & mask
                            words[g] = value
                            words[hb] = t = now()
                            return t
                    return now()
            else:
                def record(value: int) -> int:
                    if type(value) is not int or not 0 <= value <= mask:
                        value = event_value(value)
                    with lock:
                        if live[0]:
                            words[c] = (words[c] + value) & mask
                            words[hb] = t = now()
                            return t
                    return now()
            return record

        self.recorders.update({int(ev): make(ev) for ev in EventType})

    def record(self, event: int, value: int) -> int:
        """Apply one event (counter, gauge, histogram per the descriptor).

        Returns the CLOCK_MONOTONIC ns stamped as the store's last update.
        Raises (and changes nothing) for an unknown event type or a value
        that is not an unsigned 64-bit integer.
        """
        try:
            recorder = self.recorders[event]
        except (KeyError, TypeError):
            event_type(event)
            raise
        return recorder(value)

    def heartbeat(self) -> None:
        """Mark the store as updated now, without recording an event."""
        with self._lock:
            if self._live[0]:
                self._words[_W_LAST_UPDATE] = time.monotonic_ns()

    # -- life cycle -------------------------------------------------------

    def close(self) -> None:
        """Unmap and release the lock; the file stays with its final values.

        The owner publishes a departed store until it is stale, because its
        last values were most likely not scraped yet.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._live[0] = False
            for ev in EventType:
                self.recorders[int(ev)] = _closed_recorder
            if self._fd >= 0:  # -1 in a forked child that has not written yet
                self._unmap()
                os.close(self._fd)  # the last reference: this is what releases the flock
        _writers.discard(self)

    @property
    def closed(self) -> bool:
        return self._closed

    def _unmap(self) -> None:
        self._words.release()
        self._mm.close()

    def _after_fork_in_child(self) -> None:
        """Stop writing into the parent's store; get our own on the next write.

        The child closes its copies of the parent's descriptor and mapping but
        never unlocks: the flock belongs to the open file description the two
        processes share, and LOCK_UN here would release it for the parent.
        """
        self._lock = threading.Lock()  # may have been held by a parent thread at fork
        if self._closed:
            return
        self._live[0] = False  # heartbeat() must not touch the released mapping
        try:
            self._unmap()
        except (BufferError, ValueError):
            pass  # an export still alive in the child; the mapping dies with it
        os.close(self._fd)
        self._fd = -1  # close() must not close a number the child may have reused
        for ev in EventType:
            self.recorders[int(ev)] = functools.partial(self._respawn, int(ev))

    def _respawn(self, ev: int, value: int) -> int:
        with self._lock:
            if self.pid != os.getpid() and not self._closed:
                self._create()
        return self.recorders[ev](value)


def _closed_recorder(value: int) -> int:
    log.warning("an event was exported after its Exporter was closed; it was dropped")
    return time.monotonic_ns()


def _flock_store(fd: int, path: Path) -> bool:
    """Lock a new store for its writer's lifetime; warn, not fail, if we cannot."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as exc:
        log.warning(
            "could not flock the telemetry store %s (%s): readers cannot tell this process is alive, so "
            "if it records nothing for longer than NIXL_TELEMETRY_MP_STALE_TTL its series are dropped and "
            "its store reaped while it still runs. Put NIXL_TELEMETRY_MULTIPROC_DIR on a local filesystem "
            "that supports flock (tmpfs or a local disk).", path, os.strerror(exc.errno or 0))
        return False


def _after_fork_in_child() -> None:
    global _run_marker
    _run_marker = time.time_ns()
    for writer in list(_writers):
        writer._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)

