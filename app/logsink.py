"""Serving never waits for the host's log sink.

A rank's logging is the host's: its handlers may write to a pipe a launcher reads slowly, or not at all, and
a write to a full pipe blocks.  A scrape thread that logs (the collector warns about a bad store file, once
per file) would then hang until the connection's deadline cuts it.  So the threads that serve (connection and
serving threads: :func:`never_block_on_logs`) hand their records of this package's loggers to a bounded queue
instead, and one thread of their own emits them through the host's handlers, in order, whatever it waits
for.  The records stay the host's: same loggers, same handlers, same levels and filters; a full queue drops
records, and says how many with the next one that goes through.
"""

from __future__ import annotations

import logging
import queue
import threading

from app.threads import new_thread

# The loggers this package logs through (a logger's filters see only its own records, not its children's).
LOGGERS = ("nixl_prometheus_mp", "nixl_prometheus_mp.store", "nixl_prometheus_mp.election",
           "nixl_prometheus_mp.web", "nixl_prometheus_mp.endpoint", "nixl_prometheus_mp.helper",
           "nixl_prometheus_mp.collector")
QUEUE_SIZE = 1000
IDLE_S = 1.0  # the emitter thread ends after this long without a record (a later one starts another)
_DEFERRED = "_nixl_deferred"  # set on a record the emitter thread hands on: let it through

_local = threading.local()
_lock = threading.Lock()
_queue: queue.Queue[logging.LogRecord] = queue.Queue(QUEUE_SIZE)
_dropped = 0
_emitter: threading.Thread | None = None


def never_block_on_logs() -> None:
    """From now on this thread's records (of this package's loggers) are emitted by another thread."""
    _local.deferring = True


def emit_later(record: logging.LogRecord) -> None:
    """Have ``record`` handled by its logger (``record.name``) on the emitter thread; dropped if it is full."""
    global _dropped, _emitter
    try:
        _queue.put_nowait(record)
    except queue.Full:
        with _lock:
            _dropped += 1
        return
    with _lock:
        if _emitter is not None:
            return
        thread = new_thread(_emit, "nixl-log", "nixl-log")
        try:
            thread.start()
            _emitter = thread
            return
        except RuntimeError:  # no thread (RLIMIT_NPROC): what waits is handled here, as without this module
            pass
    while True:
        try:
            _handle(_queue.get_nowait())
        except queue.Empty:
            return


def _emit() -> None:
    global _emitter
    while True:
        try:
            record = _queue.get(timeout=IDLE_S)
        except queue.Empty:
            with _lock:  # (emit_later puts before it looks for us under this lock: nothing is left behind)
                if _queue.empty():
                    _emitter = None
                    return
            continue
        _handle(record)


def _handle(record: logging.LogRecord) -> None:
    global _dropped
    with _lock:
        dropped, _dropped = _dropped, 0
    if dropped:
        record.msg = f"{record.getMessage()} ({dropped} earlier log record(s) of the telemetry endpoint were " \
                     "dropped: the log sink was blocked)"
        record.args = None
    setattr(record, _DEFERRED, True)
    logger = logging.getLogger(record.name)
    try:
        if logger.isEnabledFor(record.levelno):
            logger.handle(record)
    except Exception:  # a handler's bug is the host's; ours must go on emitting
        pass


class _Deferring(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, _DEFERRED, False) or not getattr(_local, "deferring", False):
            return True
        emit_later(record)
        return False


def _install() -> None:
    for name in LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Deferring) for f in logger.filters):
            logger.addFilter(_Deferring())


def reset_after_fork() -> None:
    """In a forked child (app.rank.exporter's fork hook): the emitter thread, and whoever held the lock, are
    the parent's."""
    global _lock, _queue, _emitter, _dropped
    _lock = threading.Lock()
    _queue = queue.Queue(QUEUE_SIZE)
    _emitter = None
    _dropped = 0


_install()
