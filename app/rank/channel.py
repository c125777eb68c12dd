"""The channel between a rank and its serving helper: one SOCK_SEQPACKET socketpair, the helper's stdin.

Everything the helper is told travels here, never on its command line (which ``ps`` shows to every local
user): the code that finds this package, the agent, the directory and the election's state, and the
listener and the lock's descriptors themselves (SCM_RIGHTS), sent only once the helper watches its rank.
Each message is one datagram whose first byte says what it is:

rank -> helper: the bootstrap (Python source, the first message), ``S`` the state (JSON) with the
descriptors, ``P`` a liveness ping, ``L`` leave the address to the helper (the rank closes), ``Q`` quit now.

helper -> rank: ``W`` watching (the helper's pid: it holds a pidfd of the rank), ``R`` ready (it accepts
connections), ``O`` the answer to a ping, ``G`` a log record (JSON), ``E`` why it fails (before it exits).

The helper never blocks on the channel: its log records are sent with MSG_DONTWAIT and dropped (counted,
and said in the next record that goes through) while the rank does not read, and an answer to a ping that
finds the channel full is sent again a moment later.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from typing import Any

STATE, PING, LEAVE, QUIT = b"S", b"P", b"L", b"Q"
WATCHING, READY, PONG, LOG, ERROR = b"W", b"R", b"O", b"G", b"E"
MAX_MESSAGE = 1 << 16  # no message is larger (a log record is cut to fit)
_MAX_LOG_CHARS = 8000
# The exit status of a helper (or its launcher) that failed for want of a resource the system may have
# again soon (a process, a thread, a descriptor, memory): its rank tries again later (EX_TEMPFAIL).
TRANSIENT_EXIT = 75


def pair() -> tuple[socket.socket, socket.socket]:
    """A fresh channel: (the rank's end, the helper's end)."""
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


def encode_record(record: logging.LogRecord, prefix: str, dropped: int) -> bytes:
    """A log record as the helper sends it: what the rank needs to re-emit it through its own logging."""
    message = prefix + record.getMessage()
    if record.exc_info and record.exc_info[0] is not None:
        message += "\n" + logging.Formatter().formatException(record.exc_info)
    if dropped:
        message += f" ({dropped} earlier log record(s) of the serving helper were dropped: its rank did not read them)"
    doc = {"name": record.name, "levelno": record.levelno, "msg": message[:_MAX_LOG_CHARS], "created": record.created}
    return LOG + json.dumps(doc).encode()


def decode_record(payload: bytes, helper_pid: int) -> logging.LogRecord | None:
    """The LogRecord a ``G`` message carries, ready for the rank's ``Logger.handle``; None if malformed."""
    try:
        doc = json.loads(payload)
        levelno = int(doc["levelno"])
        return logging.makeLogRecord({
            "name": str(doc["name"]), "levelno": levelno, "levelname": logging.getLevelName(levelno),
            "msg": str(doc["msg"]), "args": None, "created": float(doc["created"]), "process": helper_pid,
            "processName": "serving-helper", "threadName": "serving-helper"})
    except (ValueError, KeyError, TypeError):
        return None


class ChannelHandler(logging.Handler):
    """(In the helper) every record to the rank over the channel, never blocking: dropped while it is full."""

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
