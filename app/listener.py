"""The listening socket of an address, bound by us: what a rank binds (and hands its address server), whichever
way it is then served.  Light on purpose: a rank that starts an address server loads no HTTP server.
"""

from __future__ import annotations

import socket

from store.fds import stdio_occupied


def bind_listener(host: str, port: int) -> socket.socket:
    """Bind and listen ourselves, so a failure is ours to report.

    (werkzeug's own bind prints to stderr and calls sys.exit on failure,
    which must never happen inside a rank.)  SO_REUSEADDR lets a new owner
    bind while the dead owner's connections sit in TIME_WAIT; it does not
    let two processes listen on one port.
    """
    with stdio_occupied():  # (never on 0-2: see store.fds)
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        # Non-blocking, for every holder of this socket (the flag belongs to the open file description, which
        # the address server is handed): where two threads or processes poll one listener, both wake for a
        # connection and one of them accepts it; the other's accept() must fail with EAGAIN, which
        # socketserver ignores, not block its serving loop until the next client.
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock
