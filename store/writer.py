"""StoreWriter: one agent's metric state in its own memory-mapped store, from creation to close.

Creation order is what makes liveness trustworthy (see SPEC "Liveness is a
lock, not a pid"): the file is created nameless, locked, its space reserved,
initialised -- magic last -- and only then given its name.  A reader can
therefore never find a store that is initialised but not yet locked, and a
store it *can* lock has no writer left.  Reserving the space up front
(posix_fallocate) means a full disk is an error from the constructor, never a
SIGBUS from the first event that touches an unbacked page.

The events themselves go through store.recorders (the C Store where it was
built, else the Python closures), attached to the current mapping here.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import logging
import mmap
import os
import threading
import time
import weakref
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from store import fds
from store import layout as L
from store import recorders as hot
from store.fds import open_above_stdio, stdio_occupied
from store.metrics import EventType
from store.recorders import (
    W_LAST_UPDATE,
    DetachedTransfer,
    Recorder,
    TransferRecorder,
    event_value,
    int_bounds,
    kinds,
    python_recorders,
    recorder_for,
    transfer_direction,
)
from store.warnonce import OnceWarner

log = logging.getLogger("nixl_prometheus_mp.store")

_W_MAGIC: Final = L.word_index(L.MAGIC_FIELD)

# Tests flip this to exercise the .staging path that filesystems without
# O_TMPFILE (NFS, some overlays) take.
USE_O_TMPFILE: bool = hasattr(os, "O_TMPFILE")
# errnos with which open(O_TMPFILE) says "not supported here" rather than
# "this directory is unusable".
_TMPFILE_UNSUPPORTED: Final = frozenset({errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL})
# errnos with which posix_fallocate says "this filesystem cannot": the zeros
# are then written explicitly, which reserves the blocks just the same.
_FALLOCATE_UNSUPPORTED: Final = frozenset({errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS})


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
_create_warner = OnceWarner(log)
# Mappings whose descriptor the host closed (see StoreWriter.revalidate): kept, never closed, because closing a
# mapping closes its own duplicate of the descriptor, a number that may be the host's by now.
_abandoned: list[tuple[mmap.mmap, memoryview]] = []


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
        if hot.NATIVE is not None:
            try:
                self.native = hot.NATIVE.Store(self._bounds, kinds(self._enabled), self._detached_record,
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
        st = os.fstat(fd)
        self.pid, self.path, self._fd, self._file_id = pid, path, fd, (st.st_dev, st.st_ino)
        with stdio_occupied():  # (mmap keeps a duplicate of fd: never on 0-2, see store.fds)
            self._mm = mmap.mmap(fd, L.STORE_SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._words = memoryview(self._mm).cast("Q")
        self._attach()

    def _create_tmpfile(self, path: Path, pid: int, carry: bytes | None) -> int | None:
        """Nameless create + lock + init + link; None where O_TMPFILE is refused."""
        try:
            fd = open_above_stdio(self.directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)  # store.fds
        except OSError as exc:
            if exc.errno in _TMPFILE_UNSUPPORTED:
                return None
            raise
        try:
            self._lock_and_init(fd, path, pid, carry)
            # An explicit dst_dir_fd makes CPython call linkat() with
            # AT_SYMLINK_FOLLOW; plain link() would not resolve the magic
            # /proc link to our nameless inode and fail with EXDEV.
            dir_fd = open_above_stdio(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
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
        fd = open_above_stdio(staging, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
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
        with stdio_occupied():
            mm = mmap.mmap(fd, L.STORE_SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        with mm:
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
                self._words[W_LAST_UPDATE] = stamp

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
        """Recreate the store, values included, if its file was unlinked (the directory removed and recreated)
        or its descriptor is no longer ours (the host closed it: ``os.closerange``, as daemonizing code does).

        Cheap (one fstat) and meant for the exporter's re-election pace.  The
        new store starts from the old one's values rather than from zero: the
        series continues with no counter reset and nothing recorded so far is
        lost.
        """
        fd = self._fd
        if fd < 0 or self._closed or self.pid != os.getpid():
            return
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) == self._file_id and st.st_nlink:
                return
        except OSError:
            pass  # closed under us: not ours any more
        with self._lock:
            if self._fd != fd or self._closed:
                return
            if self._owns(fd):
                why = f"was removed from disk (was {self.directory} deleted and recreated?)"
            else:
                # The number is not ours any more, nor is the mapping's own duplicate (mmap keeps one): neither is
                # ever closed by us, lest we close what the host opened since.  Our file lost its lock with it: a
                # new one takes its place (its name frees first, if it still names our file).
                why = "lost its descriptor (the host closed it: os.closerange?)"
                self._fd = -1
                with contextlib.suppress(OSError):
                    st = os.stat(self.path, follow_symlinks=False)
                    if (st.st_dev, st.st_ino) == self._file_id:
                        os.unlink(self.path)
            self._detach()
            carry = bytes(self._mm[L.COUNTERS_FIELD[0]:])
            old_path, old_mm, old_words = self.path, self._mm, self._words
            try:
                self._create(carry)
            except OSError as exc:
                _create_warner.warn((self.directory, exc.errno), "the telemetry store %s %s and cannot be "
                                    "recreated yet (%s); this process keeps recording and tries again", old_path,
                                    why, exc.strerror)
                # Back onto the old mapping: nothing is lost meanwhile (retried while its descriptor is ours).
                self._attach()
                return
            if self._owns(fd):
                old_words.release()
                old_mm.close()
                os.close(fd)
            else:
                _abandoned.append((old_mm, old_words))
        log.warning("the telemetry store %s %s; recreated it with the values recorded so far", self.path, why)

    def _owns(self, fd: int) -> bool:
        """Whether ``fd`` is still the descriptor of this writer's store (not one the host opened since)."""
        try:
            st = os.fstat(fd)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self._file_id

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
            if self._fd >= 0 and self._owns(self._fd):  # -1 in a forked child that has not written yet
                self._unmap()
                os.close(self._fd)  # the last reference: this is what releases the flock
            elif self._fd >= 0:  # the host closed it (see revalidate): neither it nor the mapping's is ours to close
                _abandoned.append((self._mm, self._words))
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
        if self._fd < 0 or not self._owns(self._fd):  # forked before this process wrote, or not ours any more
            self._fd = -1
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
    fds.reset_after_fork()
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
