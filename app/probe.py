"""Looking at other processes from outside: who answers /healthz, who holds a lock or a port, how a child
ended, and dying with a parent.

Every mode asks these (the demo of its ranks, a rank of its helper, the aggregator of the election's holder),
so each is written once, here.  They only read (/proc, one loopback HTTP request), never decide anything.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from store.fds import stdio_occupied

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


@dataclass(frozen=True)
class HealthzAnswer:
    """What ``GET /healthz`` on a local address answered."""

    status: int | None  # the HTTP status, None when nothing answered over HTTP (refused, timed out, not HTTP)
    doc: dict[str, Any] | None  # the JSON document (this project answers one with 200 and 503 alike)

    @property
    def owner(self) -> dict[str, Any] | None:
        """The document's ``owner`` (app.health.owner_doc), if the answer was this project's /healthz."""
        owner = None if self.doc is None else self.doc.get("owner")
        return owner if isinstance(owner, dict) else None


def http_get(host: str, port: int, path: str, timeout_s: float = 1.0) -> tuple[int | None, bytes]:
    """``GET http://HOST:PORT/PATH``, straight to the address: (status, body), status None when nothing
    answered over HTTP (refused, timed out, not HTTP).

    With http.client, which never consults http_proxy/no_proxy: the address is on this host, and a proxy
    from the environment (many corporate shells set one) would not reach it, or would answer for it.
    """
    import http.client  # (here: a rank imports this module, and never asks; http.client weighs 6 MiB)

    connection = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read()
    except (OSError, http.client.HTTPException):
        return None, b""
    finally:
        connection.close()


def get_healthz(host: str, port: int, timeout_s: float = 1.0) -> HealthzAnswer:
    """``GET http://HOST:PORT/healthz`` (see http_get)."""
    status, body = http_get(host, port, "/healthz", timeout_s)
    if status is None:
        return HealthzAnswer(None, None)
    try:
        doc = json.loads(body)
    except ValueError:
        doc = None
    return HealthzAnswer(status, doc if isinstance(doc, dict) else None)


def exit_words(status: int | None) -> str:
    """A child's exit status as Popen reports it, in words: "exited with status 3", "was killed by SIGKILL"."""
    if status is None:
        return "exited (reaped by another handler of this process)"
    if status >= 0:
        return f"exited with status {status}"
    try:
        return f"was killed by {signal.Signals(-status).name}"
    except ValueError:
        return f"was killed by signal {-status}"


def flock_entries(st: os.stat_result) -> list[tuple[bool, int]]:
    """The flocks the kernel lists (/proc/locks) on the file ``st`` describes: (blocked, pid) each.

    ``blocked``: a request waiting for the lock ("->" lines); the pid is as this process's pid namespace
    sees it (0 from another one).  Empty where /proc/locks cannot be read.
    """
    device = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    entries = []
    try:
        with stdio_occupied(), open("/proc/locks", encoding="ascii", errors="replace") as locks:
            for line in locks:
                # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF", a waiter "1: -> FLOCK  ADVISORY  WRITE ..."
                fields = line.split()
                blocked = len(fields) > 1 and fields[1] == "->"
                fields = fields[2:] if blocked else fields[1:]
                if len(fields) < 5 or fields[0] != "FLOCK" or not fields[3].isdigit():
                    continue
                major, minor, inode = fields[4].split(":")
                if (int(major, 16), int(minor, 16), int(inode)) == device:
                    entries.append((blocked, int(fields[3])))
    except (OSError, ValueError):
        return []
    return entries


def lock_holder_pid(path: Path) -> int | None:
    """The pid /proc/locks gives for the flock on ``path`` (None: not found, or in another pid namespace)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return next((pid or None for blocked, pid in flock_entries(st) if not blocked), None)


def listening_sockets(port: int) -> set[str]:
    """The sockets listening on TCP ``port`` ("socket:[inode]"), whoever holds them, from Linux's /proc."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with stdio_occupied():  # (a rank calls this: never on 0-2, see store.fds)
                lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()  # sl local_address rem_address st ... inode
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    return inodes


def listening_pids(port: int) -> list[int]:
    """The processes listening on TCP ``port`` that this user can see, from Linux's /proc."""
    inodes = listening_sockets(port)
    holders = []
    with stdio_occupied():
        for pid in filter(str.isdigit, os.listdir("/proc") if inodes else []):
            with contextlib.suppress(OSError):
                if any(os.readlink(f"/proc/{pid}/fd/{fd}") in inodes for fd in os.listdir(f"/proc/{pid}/fd")):
                    holders.append(int(pid))
    return holders


def holds_file(pid: int, st: os.stat_result) -> bool:
    """Whether process ``pid`` has a descriptor of the file ``st`` describes (that this user can see)."""
    with contextlib.suppress(OSError), stdio_occupied():
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                if os.path.samestat(os.stat(f"/proc/{pid}/fd/{fd}"), st):
                    return True
    return False


def port_holders(port: int) -> str:
    """Who listens on TCP ``port``, from Linux's /proc: "pid 123 (prometheus)", or why that is unknown."""
    holders = []
    for pid in listening_pids(port):
        with contextlib.suppress(OSError), stdio_occupied():
            holders.append(f"pid {pid} ({Path(f'/proc/{pid}/comm').read_text().strip()})")
    return ", ".join(holders) or "a process this user cannot see"


def die_with_parent(parent_pid: int | None) -> None:
    """PR_SET_PDEATHSIG: SIGKILL this process when its parent dies (Linux; elsewhere nothing).

    ``parent_pid``: the parent expected; if it has died already (before prctl took effect), die now.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):
        return
    if parent_pid is not None and os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGKILL)


# -- an address server, seen from outside ----------------------------------------------------------------------

HELPER_MARK = "serving-helper"  # an address server's command line ends "serving-helper ADDRESS" (and says no more)
SERVER_COMM = "nixl-server"  # an address server's process name (``ps -e``, /proc/PID/comm)
SPARE_COMM = "nixl-spare"  # its spare's, until it takes over


def helper_command(address: str) -> list[str]:
    """The arguments an address server's (and its spare's) command line ends with."""
    return [HELPER_MARK, address]


def process_state(pid: int) -> str | None:
    """The state letter the kernel gives process ``pid`` (R, S, D, T, t, Z, ...); None: no such process."""
    try:
        with stdio_occupied():
            stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[0]


def _comm(pid: int) -> str | None:
    try:
        with stdio_occupied():
            return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


def runs_helper_command(pid: int, address: str) -> bool:
    """Whether process ``pid`` is this user's and its command line is ours for exactly ``address`` (an address
    server, its spare, or the launcher of either, which has no name of ours yet)."""
    try:
        with stdio_occupied():
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    uids = next((line.split()[1:] for line in status.splitlines() if line.startswith("Uid:")), [])
    return (bool(uids) and all(uid == str(os.geteuid()) for uid in uids)
            and argv[-3:] == [HELPER_MARK.encode(), address.encode(), b""])


def is_address_server(pid: int, address: str, comms: tuple[str, ...] = (SERVER_COMM,)) -> bool:
    """Whether process ``pid`` is provably ours for ``address``: an address server (with SPARE_COMM in ``comms``,
    or its spare) of this user, for exactly that address."""
    return _comm(pid) in comms and runs_helper_command(pid, address)


def signal_address_server(pid: int, address: str, signum: int, comms: tuple[str, ...] = (SERVER_COMM,)) -> bool:
    """Send ``signum`` to ``pid`` only if it is our address server for ``address`` (see is_address_server);
    whether it was sent.

    The pidfd is opened before the checks, and the signal sent through it: a pid that is reused after the
    checks names another process, the pidfd never does.
    """
    try:
        with stdio_occupied():
            pidfd = os.pidfd_open(pid)
    except OSError:
        return False
    try:
        if not is_address_server(pid, address, comms):
            return False
        signal.pidfd_send_signal(pidfd, signum)
        return True
    except OSError:
        return False
    finally:
        os.close(pidfd)
