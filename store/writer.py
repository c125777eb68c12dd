"""StoreWriter: one agent's metric state in its own memory-mapped store.

Creation order is what makes liveness trustworthy (see SPEC "Liveness is a
lock, not a pid"): the file is created nameless, locked, sized and
initialised -- magic last -- and only then given its name.  A reader can
therefore never find a store that is initialised but not yet locked, and a
store it *can* lock has no writer left.

The hot path is one closure per event type with every slot offset bound at
creation: one lock acquisition, a handful of aligned 8-byte stores through a
``memoryview`` cast to ``Q``, no allocation beyond Python's own ints.  One
completed transfer (NIXL's four events) has a fused closure of its own that
validates every value first, then applies all four events under one lock
acquisition with one heartbeat.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import logging
import math
import mmap
import os
import threading
import time
import weakref
from bisect import bisect_left
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from store import layout as L
from store.metrics import GAUGE_EVENTS, HISTOGRAM_EVENTS, EventType
from store.warnonce import OnceWarner

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
# (xfer_time_us, post_time_us, nbytes) -> the heartbeat stamped
TransferRecorder = Callable[[int, int, int], int]
_TRANSFER_EVENTS: Final = {
    True: (EventType.AGENT_TX_BYTES, EventType.AGENT_TX_REQUESTS_NUM),
    False: (EventType.AGENT_RX_BYTES, EventType.AGENT_RX_REQUESTS_NUM),
}


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


def event_type(value: Any) -> EventType:
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
_closed_warner = OnceWarner(log)


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
        # The same for one whole transfer, keyed by is_write (True: TX, False: RX).
        self.transfer_recorders: dict[bool, TransferRecorder] = {}
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
        # Values are ints, so "value <= bound" equals "value <= floor(bound)";
        # bisecting int bounds is twice as fast as comparing ints to floats.
        bounds = tuple(math.floor(b) for b in self.identity.bounds)
        live = [True]  # cleared under the lock by close(); see _unmap
        self._live = live
        mask, hb = U64_MAX, _W_LAST_UPDATE
        enabled = self._enabled

        # Under the lock there is no call at all: the clock is read before it
        # is taken, and ``with`` calls the lock's __enter__ from C.  CPython
        # only switches threads at calls and loop jumps, so a thread is never
        # descheduled while it holds the lock, and threads recording at once
        # never queue on it (a lock convoy costs several times the update).
        # The heartbeat is the instant the event was taken; a thread switch
        # between the two may leave it a few ms behind another thread's.
        #
        # A histogram event's counter and sum both accumulate the value, mod
        # 2**64, under this one lock, in a store only this process writes: they
        # are always equal, so the sum is the counter's new value.
        def make(ev: EventType) -> Recorder:
            c, g, s = _W_COUNTERS + ev, _W_GAUGES + ev, _W_SUMS + ev
            base = _W_BUCKETS + ev * L.BUCKET_SLOTS
            if ev not in enabled:
                def record(value: int) -> int:
                    if type(value) is not int or not 0 <= value <= mask:
                        event_value(value)
                    return now()
            elif ev in HISTOGRAM_EVENTS:
                def record(value: int) -> int:
                    if type(value) is not int or not 0 <= value <= mask:
                        value = event_value(value)
                    b = base + bisect_left(bounds, value)
                    t = now()
                    with lock:
                        if live[0]:
                            words[c] = words[s] = (words[c] + value) & mask
                            words[g] = value
                            words[b] = (words[b] + 1) & mask
                            words[hb] = t
                    return t
            elif ev in GAUGE_EVENTS:
                def record(value: int) -> int:
                    if type(value) is not int or not 0 <= value <= mask:
                        value = event_value(value)
                    t = now()
                    with lock:
                        if live[0]:
                            words[c] = (words[c] + value) & mask
                            words[g] = value
                            words[hb] = t
                    return t
            else:
                def record(value: int) -> int:
                    if type(value) is not int or not 0 <= value <= mask:
                        value = event_value(value)
                    t = now()
                    with lock:
                        if live[0]:
                            words[c] = (words[c] + value) & mask
                            words[hb] = t
                    return t
            return record

        recorders = {int(ev): make(ev) for ev in EventType}
        xt, pt = EventType.AGENT_XFER_TIME, EventType.AGENT_XFER_POST_TIME

        def make_transfer(is_write: bool) -> TransferRecorder:
            bytes_ev, requests_ev = _TRANSFER_EVENTS[is_write]
            if not {bytes_ev, requests_ev, xt, pt} <= enabled:
                # Some of the four are filtered out: apply each through its own
                # recorder (a disabled one records nothing), after validating all.
                rec_bytes, rec_requests = recorders[bytes_ev], recorders[requests_ev]
                rec_post, rec_xfer = recorders[pt], recorders[xt]

                def partial_transfer(xfer: int, post: int, nbytes: int) -> int:
                    for value in (xfer, post, nbytes):
                        if type(value) is not int or not 0 <= value <= mask:
                            event_value(value)
                    rec_bytes(nbytes)
                    rec_requests(1)
                    rec_post(post)
                    return rec_xfer(xfer)
                return partial_transfer

            bc, bg, rc = _W_COUNTERS + bytes_ev, _W_GAUGES + bytes_ev, _W_COUNTERS + requests_ev
            xc, xg, xs, xb = _W_COUNTERS + xt, _W_GAUGES + xt, _W_SUMS + xt, _W_BUCKETS + xt * L.BUCKET_SLOTS
            pc, pg, ps, pb = _W_COUNTERS + pt, _W_GAUGES + pt, _W_SUMS + pt, _W_BUCKETS + pt * L.BUCKET_SLOTS

            def transfer(xfer: int, post: int, nbytes: int) -> int:
                if type(xfer) is not int or not 0 <= xfer <= mask:
                    xfer = event_value(xfer)
                if type(post) is not int or not 0 <= post <= mask:
                    post = event_value(post)
                if type(nbytes) is not int or not 0 <= nbytes <= mask:
                    nbytes = event_value(nbytes)
                b_post = pb + bisect_left(bounds, post)
                b_xfer = xb + bisect_left(bounds, xfer)
                t = now()
                with lock:
                    if live[0]:
                        words[bc] = (words[bc] + nbytes) & mask
                        words[bg] = nbytes
                        words[rc] = (words[rc] + 1) & mask
                        words[pc] = words[ps] = (words[pc] + post) & mask
                        words[pg] = post
                        words[b_post] = (words[b_post] + 1) & mask
                        words[xc] = words[xs] = (words[xc] + xfer) & mask
                        words[xg] = xfer
                        words[b_xfer] = (words[b_xfer] + 1) & mask
                        words[hb] = t
                return t
            return transfer

        self.recorders.update(recorders)
        self.transfer_recorders.update({True: make_transfer(True), False: make_transfer(False)})

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

    def record_transfer(self, xfer_time_us: int, post_time_us: int, nbytes: int, is_write: bool) -> int:
        """One completed transfer: bytes, one request, post time, transfer time.

        TX_BYTES and TX_REQUESTS_NUM for a write, RX_* otherwise.  Every value
        is validated before anything is written; returns the heartbeat stamp.
        """
        return self.transfer_recorders[True if is_write else False](xfer_time_us, post_time_us, nbytes)

    def heartbeat(self) -> None:
        """Mark the store as updated now, without recording an event."""
        stamp = time.monotonic_ns()  # before the lock: no call under it (see _bind_recorders)
        with self._lock:
            if self._live[0]:
                self._words[_W_LAST_UPDATE] = stamp

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
                self.recorders[int(ev)] = functools.partial(_dropped_after_close, self.path)
            for is_write in (True, False):
                self.transfer_recorders[is_write] = functools.partial(_dropped_after_close, self.path)
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
        for is_write in (True, False):
            self.transfer_recorders[is_write] = functools.partial(self._respawn_transfer, is_write)

    def _respawn_if_forked(self) -> None:
        with self._lock:
            if self.pid != os.getpid() and not self._closed:
                self._create()

    def _respawn(self, ev: int, value: int) -> int:
        self._respawn_if_forked()
        return self.recorders[ev](value)

    def _respawn_transfer(self, is_write: bool, xfer_time_us: int, post_time_us: int, nbytes: int) -> int:
        self._respawn_if_forked()
        return self.transfer_recorders[is_write](xfer_time_us, post_time_us, nbytes)


def _dropped_after_close(path: Path, *values: int) -> int:
    # Once per store: a loop that keeps exporting after close() must not
    # turn into one warning per event.
    _closed_warner.warn(path, "events were exported after the Exporter of %s was closed; they are dropped "
                        "(close the Exporter only once the agent stops recording)", path.name)
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

