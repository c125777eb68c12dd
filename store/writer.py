"""StoreWriter: one agent's metric state in its own memory-mapped store.

Creation order is what makes liveness trustworthy (see SPEC "Liveness is a
lock, not a pid"): the file is created nameless, locked, its space reserved,
initialised -- magic last -- and only then given its name.  A reader can
therefore never find a store that is initialised but not yet locked, and a
store it *can* lock has no writer left.  Reserving the space up front
(posix_fallocate) means a full disk is an error from the constructor, never a
SIGBUS from the first event that touches an unbacked page.

The hot path has two implementations with the same behaviour, byte for byte:
the C extension ``store._recorder`` (relaxed 8-byte atomics, no Python frame
per event) where it was built, else one Python closure per event type with
every slot offset bound at creation (one lock acquisition, a handful of
aligned 8-byte stores through a ``memoryview`` cast to ``Q``).  One completed
transfer (NIXL's four events) is fused in both: every value validated first,
then all four applied with one heartbeat.  Errors are always raised by the
Python validators below, so both paths say the same thing.
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
from types import ModuleType
from typing import Any, Final

from store import layout as L
from store import native
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
# errnos with which posix_fallocate says "this filesystem cannot": the zeros
# are then written explicitly, which reserves the blocks just the same.
_FALLOCATE_UNSUPPORTED: Final = frozenset({errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS})

Recorder = Callable[[int], int]
# (xfer_time_us, post_time_us, nbytes) -> the heartbeat stamped
TransferRecorder = Callable[[int, int, int], int]
DetachedRecorder = Callable[[Any, Any], int]
DetachedTransfer = Callable[[Any, Any, Any, Any], int]
_TRANSFER_EVENTS: Final = {
    True: (EventType.AGENT_TX_BYTES, EventType.AGENT_TX_REQUESTS_NUM),
    False: (EventType.AGENT_RX_BYTES, EventType.AGENT_RX_REQUESTS_NUM),
}
# What an event slot feeds, as store._recorder numbers it.
_OFF, _COUNTER, _GAUGE, _HISTOGRAM = range(4)


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
    """Validate an event type: an EventType or a plain int, never a bool or float (ValueError naming it)."""
    valid = f"EventType members or ints 0..{len(EventType) - 1}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"unknown event type {value!r}: event types are {valid}, not {type(value).__name__}")
    try:
        return EventType(value)
    except ValueError:
        raise ValueError(f"unknown event type {value!r} (valid: {valid})") from None


def transfer_direction(is_write: Any) -> bool:
    """Validate record_transfer's is_write: a real bool (a string like "no" would read as a write)."""
    if is_write is True or is_write is False:
        return is_write
    raise TypeError(f"is_write must be a bool, got {type(is_write).__name__} {is_write!r}")


def _load_native() -> ModuleType | None:
    module = native.load("_recorder")
    if module is None:
        return None
    expected = (L.SLOT_COUNT, L.MAX_BUCKETS, L.STORE_SIZE, _W_LAST_UPDATE, _W_COUNTERS, _W_GAUGES, _W_BUCKETS,
                _W_SUMS)
    if tuple(module.LAYOUT) != expected:
        log.warning("store._recorder was built for another store layout (%s, expected %s); using the "
                    "pure-Python path. Rebuild the package (pip install .) to get the C path back.",
                    module.LAYOUT, expected)
        native.refuse("_recorder")
        return None
    module.install(event_type, event_value, transfer_direction)
    return module


# The C hot path, or None for the Python twin.  Read when a writer is created
# (tests set it to None to run the Python path in the same process).
NATIVE: ModuleType | None = _load_native()


def kinds(enabled: Collection[EventType]) -> bytes:
    """What each slot feeds (store._recorder's table): off, counter, +gauge, +histogram."""
    return bytes(_OFF if ev not in enabled else _HISTOGRAM if ev in HISTOGRAM_EVENTS
                 else _GAUGE if ev in GAUGE_EVENTS else _COUNTER for ev in EventType)


def int_bounds(bounds: tuple[float, ...]) -> tuple[int, ...]:
    """Values are ints, so "value <= bound" equals "value <= floor(bound)"; both paths compare ints."""
    return tuple(math.floor(b) for b in bounds)


def recorder_for(recorders: dict[int, Recorder], event: Any) -> Recorder:
    """The recorder of ``event``; raises as an unknown event type must, changing nothing.

    Only an int or an EventType is an event type: a bool or a float would
    otherwise hash like an int and be taken for one.
    """
    if event.__class__ is not int and event.__class__ is not EventType:
        event = event_type(event)
    try:
        return recorders[event]
    except KeyError:
        event_type(event)
        raise


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


def python_recorders(words: memoryview, lock: threading.Lock, live: list[bool], bounds: tuple[int, ...],
                     enabled: Collection[EventType], detached: DetachedRecorder,
                     detached_transfer: DetachedTransfer) -> tuple[dict[int, Recorder], dict[bool, TransferRecorder]]:
    """The pure-Python twin of store._recorder.Store: one closure per event type, one per transfer direction.

    ``bounds`` are int floors (int_bounds).  An event that finds ``live``
    cleared (the store closed, or being recreated) goes to ``detached``, which
    drops it or replays it into the store that replaced this one.
    """
    mask, hb, now = U64_MAX, _W_LAST_UPDATE, time.monotonic_ns

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
                return detached(ev, value)
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
                return detached(ev, value)
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
                return detached(ev, value)
        return record

    recorders = {int(ev): make(ev) for ev in EventType}
    xt, pt = EventType.AGENT_XFER_TIME, EventType.AGENT_XFER_POST_TIME

    def make_transfer(is_write: bool) -> TransferRecorder:
        bytes_ev, requests_ev = _TRANSFER_EVENTS[is_write]
        if not {bytes_ev, requests_ev, xt, pt} <= set(enabled):
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
            return detached_transfer(xfer, post, nbytes, is_write)
        return transfer

    return recorders, {True: make_transfer(True), False: make_transfer(False)}


class NullSink:
    """Validates events exactly as a store does and records them nowhere (telemetry off).

    The same recorders as a StoreWriter's, over a private buffer with every
    event disabled: no duplicated validation, one cheap check per event.
    """

    def __init__(self) -> None:
        buffer = bytearray(L.STORE_SIZE)  # never written: nothing is enabled
        self.native: Any = None
        if NATIVE is not None:
            self.native = NATIVE.Store((), kinds(()), _never_detached, _never_detached)
            self.native.attach(buffer)
        self.recorders, self.transfer_recorders = python_recorders(
            memoryview(buffer).cast("Q"), threading.Lock(), [True], (), (), _never_detached, _never_detached)


def _never_detached(*args: Any) -> int:
    raise AssertionError("a NullSink never detaches")


_run_marker: int = time.time_ns()  # CLOCK_REALTIME ns, fixed for the life of the process
_writers: weakref.WeakSet[StoreWriter] = weakref.WeakSet()
_closed_warner = OnceWarner(log)
_create_warner = OnceWarner(log)


class StoreWriter:
    """The writer side of one agent's store (thread-safe; fork-aware)."""

    def __init__(self, directory: str | os.PathLike[str], identity: StoreIdentity,
                 enabled: Collection[EventType] | None = None) -> None:
        if len(identity.bounds) > L.MAX_BUCKETS:
            raise ValueError(f"{len(identity.bounds)} bucket bounds, the store holds at most {L.MAX_BUCKETS}")
        self.directory = Path(directory)
        self.identity = identity
        self._enabled = frozenset(EventType if enabled is None else enabled)
        self._bounds = int_bounds(identity.bounds)
        self._names = (
            encode_field(identity.agent_name, L.AGENT_NAME_SIZE, "agent name"),
            encode_field(identity.hostname, L.HOSTNAME_SIZE, "hostname"),
            encode_field(identity.local_rank, L.LOCAL_RANK_SIZE, "local rank"),
        )
        # The C Store, or None where the Python recorders below do the work.
        self.native: Any = None
        if NATIVE is not None:
            try:
                self.native = NATIVE.Store(self._bounds, kinds(self._enabled), self._detached_record,
                                           self._detached_transfer)
            except ValueError:
                pass  # negative or unsorted bounds (never from parse_buckets): only bisect places those alike
        # The recorders dicts are mutated in place (fork, close) so callers may
        # keep a reference to them and skip one attribute lookup per event.
        self.recorders: dict[int, Recorder] = {}
        # The same for one whole transfer, keyed by is_write (True: TX, False: RX).
        self.transfer_recorders: dict[bool, TransferRecorder] = {}
        self._lock = threading.Lock()
        self._live = [False]
        self._closed = False
        self._fd = -1
        self._carry: bytes | None = None  # values waiting for the next store (see revalidate)
        try:
            self._create()
        except OSError as exc:
            raise _creation_error(exc, self.directory) from exc
        _writers.add(self)

    # -- creation ---------------------------------------------------------

    def _create(self, carry: bytes | None = None) -> None:
        """Create, lock and map this process's store (with ``carry`` as its values); attach the recorders."""
        pid = os.getpid()
        path = self.directory / L.store_file_name(pid, _run_marker, self.identity.instance)
        fd = self._create_tmpfile(path, pid, carry) if USE_O_TMPFILE else None
        if fd is None:
            fd = self._create_staged(path, pid, carry)
        self.pid, self.path, self._fd = pid, path, fd
        self._mm = mmap.mmap(fd, L.STORE_SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._words = memoryview(self._mm).cast("Q")
        self._attach()

    def _create_tmpfile(self, path: Path, pid: int, carry: bytes | None) -> int | None:
        """Nameless create + lock + init + link; None where O_TMPFILE is refused."""
        try:
            fd = os.open(self.directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            if exc.errno in _TMPFILE_UNSUPPORTED:
                return None
            raise
        try:
            self._lock_and_init(fd, path, pid, carry)
            # An explicit dst_dir_fd makes CPython call linkat() with
            # AT_SYMLINK_FOLLOW; plain link() would not resolve the magic
            # /proc link to our nameless inode and fail with EXDEV.
            dir_fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.link(f"/proc/self/fd/{fd}", path.name, dst_dir_fd=dir_fd, follow_symlinks=True)
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

    def _create_staged(self, path: Path, pid: int, carry: bytes | None) -> int:
        """The NFS path: a .staging name renamed into place once initialised.

        A process killed between the open and the rename leaks one staging
        file; readers only look at ``*.mmap``, so it is never mistaken for a
        store.
        """
        staging = path.with_name(path.name + L.STAGING_SUFFIX)
        fd = os.open(staging, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            self._lock_and_init(fd, path, pid, carry)
            os.rename(staging, path)
        except BaseException:
            os.close(fd)
            staging.unlink(missing_ok=True)
            raise
        return fd

    def _lock_and_init(self, fd: int, path: Path, pid: int, carry: bytes | None) -> None:
        self.locked = _flock_store(fd, path)
        os.fchmod(fd, 0o600)  # the umask can only narrow 0600, but be explicit
        _reserve(fd)
        with mmap.mmap(fd, L.STORE_SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as mm:
            ident = self.identity
            L.HEADER_STRUCT.pack_into(
                mm, L.VERSION_FIELD[0], L.SCHEMA_VERSION, L.SLOT_COUNT, pid, time.monotonic_ns(),
                ident.instance, len(ident.bounds), *self._names)
            bounds = list(ident.bounds) + [0.0] * (L.MAX_BUCKETS - len(ident.bounds))
            L.F64_BOUNDS.pack_into(mm, L.BOUNDS_FIELD[0], *bounds)
            if carry is not None:
                mm[L.COUNTERS_FIELD[0]:] = carry
            # Magic last: a reader that sees it sees a fully initialised header.
            words = memoryview(mm).cast("Q")
            words[_W_MAGIC] = L.MAGIC
            words.release()

    # -- the hot path -----------------------------------------------------

    def _attach(self) -> None:
        """Point the recorders at the current mapping."""
        self._live = [True]
        if self.native is not None:
            self.native.attach(self._mm)
            # The dicts' entries go through the C Store, which handles its own detaching.
            self.recorders.update({int(ev): functools.partial(self.native.record, int(ev)) for ev in EventType})
            self.transfer_recorders.update({w: functools.partial(_transfer_with, self.native.transfer, w)
                                            for w in (True, False)})
        else:
            recorders, transfers = python_recorders(self._words, self._lock, self._live, self._bounds,
                                                    self._enabled, self._detached_record, self._detached_transfer)
            self.recorders.update(recorders)
            self.transfer_recorders.update(transfers)

    def _detach(self) -> None:
        """Stop writing into the current mapping: events go to _detached_record until _attach."""
        self._live[0] = False  # Python recorders waiting for the lock see this
        if self.native is not None:
            self.native.detach()
            return
        for ev in EventType:
            self.recorders[int(ev)] = functools.partial(self._detached_record, int(ev))
        for is_write in (True, False):
            self.transfer_recorders[is_write] = functools.partial(_transfer_with, self._detached_transfer, is_write)

    def record(self, event: int, value: int) -> int:
        """Apply one event (counter, gauge, histogram per the descriptor).

        Returns the CLOCK_MONOTONIC ns stamped as the store's last update.
        Raises (and changes nothing) for an unknown event type or a value
        that is not an unsigned 64-bit integer.
        """
        if self.native is not None:
            return int(self.native.record(event, value))
        return recorder_for(self.recorders, event)(value)

    def record_transfer(self, xfer_time_us: int, post_time_us: int, nbytes: int, is_write: bool) -> int:
        """One completed transfer: bytes, one request, post time, transfer time.

        TX_BYTES and TX_REQUESTS_NUM for a write, RX_* otherwise.  Every value
        is validated before anything is written; returns the heartbeat stamp.
        """
        if self.native is not None:
            return int(self.native.transfer(xfer_time_us, post_time_us, nbytes, is_write))
        if is_write is not True and is_write is not False:
            transfer_direction(is_write)
        return self.transfer_recorders[is_write](xfer_time_us, post_time_us, nbytes)

    def heartbeat(self) -> None:
        """Mark the store as updated now, without recording an event."""
        stamp = time.monotonic_ns()  # before the lock: no call under it (see python_recorders)
        with self._lock:
            if self._live[0]:
                self._words[_W_LAST_UPDATE] = stamp

    # -- detached: closed, forked, or being recreated ---------------------

    def _detached_record(self, event: int, value: Any) -> int:
        value = event_value(value)  # a closed store still refuses a bad value
        if self._reattach():
            return self.record(event, value)
        return time.monotonic_ns()

    def _detached_transfer(self, xfer_time_us: Any, post_time_us: Any, nbytes: Any, is_write: bool) -> int:
        xfer, post, size = (event_value(v) for v in (xfer_time_us, post_time_us, nbytes))
        if self._reattach():
            return self.record_transfer(xfer, post, size, is_write)
        return time.monotonic_ns()

    def _reattach(self) -> bool:
        """Whether this process has a store to write into (creating it if needed); False drops the event.

        A forked child gets its own store here, on its first event.  If that
        fails (no descriptor left, disk full) the event is dropped with one
        warning and the next event tries again: recording never raises for
        the environment, and never recurses.
        """
        with self._lock:
            if self._closed:
                _closed_warner.warn(self.path, "events were exported after the Exporter of %s was closed; they "
                                    "are dropped (close the Exporter only once the agent stops recording)",
                                    self.path.name)
                return False
            if self._live[0]:
                return True  # attached while we waited for the lock
            try:
                self._create(self._carry)
            except OSError as exc:
                _create_warner.warn((self.directory, exc.errno), "%s; telemetry events of process %d are "
                                    "dropped until it can be created (retried on every event)",
                                    _creation_error(exc, self.directory), os.getpid())
                return False
            self._carry = None
            return True

    def revalidate(self) -> None:
        """Recreate the store, values included, if its file was unlinked (the directory removed and recreated).

        Cheap (one fstat) and meant for the exporter's re-election pace.  The
        new store starts from the old one's values rather than from zero: the
        series continues with no counter reset and nothing recorded so far is
        lost.
        """
        fd = self._fd
        if fd < 0 or self._closed or self.pid != os.getpid():
            return
        try:
            if os.fstat(fd).st_nlink:
                return
        except OSError:
            return
        with self._lock:
            if self._fd != fd or self._closed:
                return
            self._detach()
            carry = bytes(self._mm[L.COUNTERS_FIELD[0]:])
            old_path, old_mm, old_words = self.path, self._mm, self._words
            try:
                self._create(carry)
            except OSError as exc:
                _create_warner.warn((self.directory, exc.errno), "the telemetry store %s was removed from disk "
                                    "and cannot be recreated yet (%s); this process keeps recording and "
                                    "tries again", old_path, exc.strerror)
                self._attach()  # back onto the unlinked mapping: nothing is lost meanwhile
                return
            old_words.release()
            old_mm.close()
            os.close(fd)
        log.warning("the telemetry store %s was removed from disk (was %s deleted and recreated?); recreated it "
                    "with the values recorded so far", self.path, self.directory)

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
            self._detach()
            if self._fd >= 0:  # -1 in a forked child that has not written yet
                self._unmap()
                os.close(self._fd)  # the last reference: this is what releases the flock
                self._fd = -1
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
        self._detach()
        if self._fd < 0:  # forked again before this process ever wrote: nothing of ours to close
            return
        try:
            self._unmap()
        except (BufferError, ValueError):
            pass  # an export still alive in the child; the mapping dies with it
        os.close(self._fd)
        self._fd = -1  # close() must not close a number the child may have reused


def _transfer_with(detached_transfer: DetachedTransfer, is_write: bool, xfer: Any, post: Any, nbytes: Any) -> int:
    return detached_transfer(xfer, post, nbytes, is_write)


def _reserve(fd: int) -> None:
    """Give the store its blocks now, so that no later store into the mapping can fault (SIGBUS)."""
    try:
        os.posix_fallocate(fd, 0, L.STORE_SIZE)
    except OSError as exc:
        if exc.errno not in _FALLOCATE_UNSUPPORTED:
            raise
        if os.pwrite(fd, bytes(L.STORE_SIZE), 0) != L.STORE_SIZE:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)) from exc


def _creation_error(exc: OSError, directory: Path) -> OSError:
    """The same OSError subclass, saying which directory and what to do."""
    hint = ("free space there or point NIXL_TELEMETRY_MULTIPROC_DIR at a filesystem with room"
            if exc.errno in (errno.ENOSPC, errno.EDQUOT) else
            "raise the descriptor limit (ulimit -n)" if exc.errno in (errno.EMFILE, errno.ENFILE) else
            "check that the directory exists and this user may write to it"
            if exc.errno in (errno.ENOENT, errno.EACCES, errno.EPERM, errno.EROFS) else "")
    return OSError(exc.errno, f"cannot create the telemetry store in {directory}: {exc.strerror}"
                   + (f" ({hint})" if hint else ""))


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
    for warner in (_closed_warner, _create_warner):
        warner.reset_after_fork()
    for writer in list(_writers):
        try:
            writer._after_fork_in_child()
        except OSError as exc:  # one writer's trouble must not leave the next one writing into the parent's store
            log.warning("after fork, could not detach the telemetry store %s from the parent's (%s); this "
                        "process records nothing into it", writer.path, exc.strerror)


os.register_at_fork(after_in_child=_after_fork_in_child)
