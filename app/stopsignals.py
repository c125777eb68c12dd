"""Stop signals for a main thread that waits: SIGTERM, SIGINT and SIGHUP as a flag plus a byte on a self-pipe.

Used by the command line (``demo``, ``serve``) and by the aggregator while it waits for its address, before
gunicorn's own handlers exist.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class StopSignals:
    """SIGTERM, SIGINT and SIGHUP as a flag plus a byte on a self-pipe, for the main thread.

    SIGHUP is a stop too: a closed terminal must not end a command by the
    default action, which skips its clean-up (a demo would leave its
    temporary directory behind, a rank its store, serve its election).

    The handler does nothing else.  It runs between two bytecodes of the
    main thread, which may be inside threading.Event.wait(), or inside an
    earlier run of the handler, holding the lock Event.set() needs: a
    handler calling set() hung about one stop in five under repeated
    signals.  os.write on a non-blocking pipe takes no lock.
    """

    def __init__(self) -> None:
        self.signum = 0
        self._read, self._write = os.pipe()
        for fd in (self._read, self._write):
            os.set_blocking(fd, False)  # a full pipe already holds a pending wake-up
        self._previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}

    def _handle(self, signum: int, frame: object) -> None:
        self.signum = signum
        with contextlib.suppress(OSError):
            os.write(self._write, b"\0")

    def wait(self, timeout: float) -> bool:
        """Sleep up to ``timeout`` seconds, less if a stop signal arrives; True once one has."""
        if not self.signum:
            # After a signal, select is resumed (PEP 475) and sees the byte.
            select.select([self._read], [], [], max(0.0, timeout))
        return bool(self.signum)

    def rearm(self) -> None:
        """Take the stop back (a drain goes on after a first SIGTERM): only a later signal stops."""
        self.signum = 0  # first: a signal from here on sets it again, and its byte is read below or seen
        with contextlib.suppress(OSError):
            while os.read(self._read, 64):
                pass

    def close(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        os.close(self._read)
        os.close(self._write)
