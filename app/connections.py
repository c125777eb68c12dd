"""A server's open connections (Connections): their deadlines, which wait between requests, whose peer each
one is, and the pooled threads that serve them.  app.http's request path runs on them; app.server's
BoundedServer admits, dispatches and cuts them.
"""

from __future__ import annotations

import contextlib
import math
import queue
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from app.threads import new_thread

REQUEST_TIMEOUT_S = 10.0  # from a request's first byte (a new connection's accept) to the end of its answer
# ... less the time our app takes to compute the answer, plus the time the answer's bytes take at this rate: a
# reader that takes a large answer (a directory of 50k stores: hundreds of MB) steadily is never cut, one that
# stops reading is, REQUEST_TIMEOUT_S after the answer began.
MIN_SEND_RATE = 1 << 20  # bytes per second
IDLE_S = 90.0  # a persistent connection waits this long for its next request (Prometheus scrapes every 15-60 s)
SPARE_WORKERS = 2  # pool threads left waiting for the next connection...
SPARE_IDLE_S = 2.0  # ...for this long at most: an idle process gets back to its own threads
PEER_SHARE = 2  # a peer address holds at most 1/PEER_SHARE of a server's connections (a slowloris under the cap, from
# the scraper's own address, still leaves it room)


class Connections:
    """A server's open connections: each one's deadline, which wait between requests, and the threads serving
    them (a pool).

    ``serve(sock, address)`` serves one connection to its end and closes it (through ``forget``).  All methods
    are safe from any thread.
    """

    def __init__(self, name: str, serve: Callable[[socket.socket, Any], None], limit: int,
                 request_timeout_s: float = REQUEST_TIMEOUT_S, idle_s: float = IDLE_S) -> None:
        self.name = name  # the pool threads' names start with it
        self._serve = serve
        self.limit = limit
        self.request_timeout_s, self.idle_s = request_timeout_s, idle_s
        self._lock = threading.Lock()
        self._deadlines: dict[socket.socket, float] = {}  # open connections -> when they are cut (monotonic s)
        self._idle: dict[socket.socket, None] = {}  # those waiting for their next request, oldest first
        self._peer: dict[socket.socket, str] = {}  # open connections -> the peer's address
        self._jobs: queue.SimpleQueue[tuple[socket.socket, Any] | None] = queue.SimpleQueue()
        self._spare = 0  # pool threads waiting on _jobs
        self.workers: set[threading.Thread] = set()
        self.keep_alive = True  # False once the server stops or is abandoned: no connection waits for another request

    def admit(self, sock: socket.socket, peer: str) -> bool:
        """Register a new connection from ``peer`` (its address); False: it is to be refused (503).

        A peer holds at most a PEER_SHARE-th of the connections: past its share, its own longest idle connection
        is closed for the new one, and failing that the new one is refused.  A full server closes the longest
        idle connection of the busiest peer (one that has an idle connection) for the new one, and failing that
        refuses it.  So a peer that opens connections and keeps them busy (slow requests) takes at most its
        share, and the others always find a slot.
        """
        with self._lock:
            share = max(1, self.limit // PEER_SHARE)
            if sum(1 for p in self._peer.values() if p == peer) >= share and not self._evict_idle_of({peer}):
                return False
            if len(self._deadlines) >= self.limit:
                counts: dict[str, int] = {}
                for p in self._peer.values():
                    counts[p] = counts.get(p, 0) + 1
                idle_peers = {self._peer[s] for s in self._idle}
                busiest = max(idle_peers, key=lambda p: counts.get(p, 0), default=None)
                if busiest is None or not self._evict_idle_of({busiest}):
                    return False
            self._deadlines[sock] = time.monotonic() + self.request_timeout_s
            self._peer[sock] = peer
            return True

    def _evict_idle_of(self, peers: set[str]) -> bool:
        """(Under the lock) close the longest idle connection of one of ``peers``; whether there was one."""
        oldest = next((s for s in self._idle if self._peer.get(s) in peers), None)
        if oldest is None:
            return False
        self._cut(oldest)
        del self._idle[oldest], self._deadlines[oldest], self._peer[oldest]  # its thread sees EOF and closes it
        return True

    def dispatch(self, sock: socket.socket, address: Any) -> bool:
        """Serve an admitted connection on a spare thread, or a new one; False: no thread could be started."""
        with self._lock:
            if self._spare:
                self._spare -= 1
                self._jobs.put((sock, address))
                return True
            worker = new_thread(self._work, f"{self.name}-conn", "nixl-conn", (sock, address))
            self.workers.add(worker)
        try:
            worker.start()
        except RuntimeError:  # the process is at its thread limit
            with self._lock:
                self.workers.discard(worker)
            return False
        return True

    def _work(self, sock: socket.socket, address: Any) -> None:
        me = threading.current_thread()
        job: tuple[socket.socket, Any] | None = (sock, address)
        try:
            while job is not None:
                self._serve(*job)
                with self._lock:
                    if not self.keep_alive or self._spare >= SPARE_WORKERS:
                        return
                    self._spare += 1
                job = self._next_job()
        finally:
            with self._lock:
                self.workers.discard(me)

    def _next_job(self) -> tuple[socket.socket, Any] | None:
        """A spare's wait for its next connection (None: end); at most SPARE_IDLE_S."""
        try:
            return self._jobs.get(timeout=SPARE_IDLE_S)
        except queue.Empty:
            with self._lock:  # (dispatch counts a spare out and queues its job under this lock)
                try:
                    return self._jobs.get_nowait()
                except queue.Empty:
                    self._spare -= 1
                    return None

    def await_request(self, sock: socket.socket) -> bool:
        """A connection waits for its next request: it is cut IDLE_S from now (or sooner, when the server is full);
        False: it is to close instead."""
        with self._lock:
            if not self.keep_alive or sock not in self._deadlines:
                return False
            self._deadlines[sock] = time.monotonic() + self.idle_s
            self._idle[sock] = None
            return True

    def request_begins(self, sock: socket.socket) -> bool:
        """The next request's first byte arrived: it has REQUEST_TIMEOUT_S; False: the connection was closed
        while it waited."""
        with self._lock:
            if sock not in self._idle:
                return False
            del self._idle[sock]
            self._deadlines[sock] = time.monotonic() + self.request_timeout_s
            return True

    def answering(self, sock: socket.socket) -> None:
        """The request was read: our app computes the answer, which its deadline does not count (a large
        directory's scan is the server's delay, not the client's; the thread is busy either way)."""
        with self._lock:
            if sock in self._deadlines:
                self._deadlines[sock] = math.inf

    def sent(self, sock: socket.socket, nbytes: int, first: bool) -> None:
        """``nbytes`` of an answer went out (``first``: its first bytes): the connection has REQUEST_TIMEOUT_S from
        the answer's start, plus what its bytes take at MIN_SEND_RATE."""
        with self._lock:
            if sock in self._deadlines:
                now = time.monotonic()
                start = now + self.request_timeout_s if first else self._deadlines[sock]
                self._deadlines[sock] = start + nbytes / MIN_SEND_RATE

    def in_time(self, sock: socket.socket) -> bool:
        """Whether a connection is open and within its deadline (not cut)."""
        with self._lock:
            return time.monotonic() <= self._deadlines.get(sock, 0.0)

    def forget(self, sock: socket.socket, close: Callable[[socket.socket], None]) -> None:
        """Close a connection (``close``), under the lock: nothing cuts a descriptor that was closed and reused."""
        with self._lock:
            self._deadlines.pop(sock, None)
            self._idle.pop(sock, None)
            self._peer.pop(sock, None)
            close(sock)

    def cut_overdue(self) -> None:
        now = time.monotonic()
        with self._lock:
            for sock, deadline in self._deadlines.items():
                if now > deadline:
                    self._cut(sock)

    def cut_all(self) -> None:
        with self._lock:
            for sock in self._deadlines:
                self._cut(sock)

    def close_all(self, idle_only: bool = False) -> None:
        """Keep no connection for another request from now on, and let the spare threads end; cut the connections
        waiting for one (``idle_only``: the others finish their request) or all of them."""
        with self._lock:
            self.keep_alive = False
            for sock in list(self._idle if idle_only else self._deadlines):
                self._cut(sock)
            self._idle.clear()
            for _ in range(self._spare):
                self._jobs.put(None)
            self._spare = 0

    @staticmethod
    def _cut(sock: socket.socket) -> None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)

    def busy(self) -> bool:
        """Whether a thread of the pool is alive (serving, or spare until close_all)."""
        with self._lock:
            return any(worker.is_alive() for worker in self.workers)

    def idle(self) -> int:
        """How many connections wait for their next request."""
        with self._lock:
            return len(self._idle)

    def spare(self) -> int:
        """How many pool threads wait for the next connection."""
        with self._lock:
            return self._spare

    def open(self) -> int:
        """How many connections are open."""
        with self._lock:
            return len(self._deadlines)

    def threads(self) -> list[threading.Thread]:
        with self._lock:
            return list(self.workers)
