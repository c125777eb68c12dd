"""The channel between a rank and the address server it started: one SOCK_SEQPACKET socketpair, the server's
stdin (app.rank.spawn, app.address.server).

Everything the server is told travels here, never on its command line (which ``ps`` shows to every local
user): the code that finds this package, then the state (``ServerArgs``) with the listener's and the lock's
descriptors (SCM_RIGHTS).  Both are queued before the server even starts.  Each message is one datagram whose
first byte says what it is:

rank -> server: the bootstrap (Python source, the first message), ``S`` the state (JSON) with the
descriptors, ``P`` a liveness ping.

server -> rank: ``R`` ready (and its pid: it accepts connections), ``O`` the answer to a ping, ``G`` a log
record (JSON), ``E`` why it fails (before it exits).

The end of file says, to the server, that the rank that started it is gone (it closed its Exporter, exited
or died: the server logs to its file from then on) and, to the rank, that the server is gone.  The server
never blocks on the channel: its log records are sent with MSG_DONTWAIT and dropped (counted, and said in
the next record that goes through) while the rank does not read, and an answer to a ping that finds the
channel full is sent again a moment later.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

STATE, PING = b"S", b"P"
READY, PONG, LOG, ERROR = b"R", b"O", b"G", b"E"
MAX_MESSAGE = 1 << 16  # no message is larger (a log record is cut to fit)
_MAX_LOG_CHARS = 8000
# The exit status of a server that failed for want of a resource the system may have
# again soon (a process, a thread, a descriptor, memory): a rank tries again later (EX_TEMPFAIL).
TRANSIENT_EXIT = 75


def pair() -> tuple[socket.socket, socket.socket]:
    """A fresh channel: (the rank's end, the server's end)."""
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


def encode_record(record: logging.LogRecord, prefix: str, dropped: int) -> bytes:
    """A log record as the server sends it: what the rank needs to re-emit it through its own logging."""
    message = prefix + record.getMessage()
    if record.exc_info and record.exc_info[0] is not None:
        message += "\n" + logging.Formatter().formatException(record.exc_info)
    if dropped:
        message += (f" ({dropped} earlier log record(s) of the address server were dropped: the rank that started it "
                    "did not read them)")
    doc = {"name": record.name, "levelno": record.levelno, "msg": message[:_MAX_LOG_CHARS], "created": record.created}
    return LOG + json.dumps(doc).encode()


def decode_record(payload: bytes, server_pid: int) -> logging.LogRecord | None:
    """The LogRecord a ``G`` message carries, ready for the rank's ``Logger.handle``; None if malformed."""
    try:
        doc = json.loads(payload)
        levelno = int(doc["levelno"])
        return logging.makeLogRecord({
            "name": str(doc["name"]), "levelno": levelno, "levelname": logging.getLevelName(levelno),
            "msg": str(doc["msg"]), "args": None, "created": float(doc["created"]), "process": server_pid,
            "processName": "address-server", "threadName": "address-server"})
    except (ValueError, KeyError, TypeError):
        return None


class ChannelHandler(logging.Handler):
    """(In the server) every record to the rank over the channel, never blocking: dropped while it is full."""

    def __init__(self, channel: socket.socket, prefix: str) -> None:
        super().__init__()
        self._channel = channel
        self._prefix = prefix
        self._dropped = 0
        self._count_lock = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        with self._count_lock:
            dropped, self._dropped = self._dropped, 0
        try:
            message = encode_record(record, self._prefix, dropped)
            if len(message) > MAX_MESSAGE:
                message = message[:MAX_MESSAGE]  # (cut JSON: the rank drops it as malformed, counted nowhere)
            self._channel.send(message, socket.MSG_DONTWAIT)
        except OSError:  # full (EAGAIN), or the rank is gone: the record is lost, and said so with the next one
            with self._count_lock:
                self._dropped += dropped + 1
        except Exception:
            self.handleError(record)


def state_message(doc: dict[str, Any]) -> bytes:
    return STATE + json.dumps(doc, separators=(",", ":")).encode()


@dataclass(frozen=True)
class ServerArgs:
    """What the starting rank tells its server with the descriptors (the ``S`` message)."""

    address: str
    directory: Path
    has_lock: bool  # False: the election fell back to the bind (no usable lock); only the listener is sent
    problem: str | None  # why the lock is unusable, for /healthz
    started_by: int  # the rank's pid
    agent_name: str | None  # the rank's agent
    stale_ttl_s: float
    serving_since: float
    replaced_at: float | None  # when the rank found its directory replaced, for /healthz
    log_level: int

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "directory": str(self.directory)}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> ServerArgs:
        return cls(**{**doc, "directory": Path(doc["directory"])})
