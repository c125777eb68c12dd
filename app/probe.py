"""Looking at other processes from outside: who answers /healthz, who holds a lock or a port, how a child
ended, and dying with a parent.

Every mode asks these (the demo of its ranks, a rank of its helper, the aggregator of the election's holder),
so each is written once, here.  They only read (/proc, one loopback HTTP request), never decide anything.
"""

from __future__ import annotations

import contextlib
import ctypes
import http.client
import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from election.lock import flock_entries

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


def lock_holder_pid(path: Path) -> int | None:
    """The pid /proc/locks gives for the flock on ``path`` (None: not found, or in another pid namespace)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return next((pid or None for blocked, pid in flock_entries(st) if not blocked), None)


def port_holders(port: int) -> str:
    """Who listens on TCP ``port``, from Linux's /proc: "pid 123 (prometheus)", or why that is unknown."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()  # sl local_address rem_address st ... inode
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    holders = []
    for pid in filter(str.isdigit, os.listdir("/proc") if inodes else []):
        with contextlib.suppress(OSError):
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in inodes for fd in os.listdir(f"/proc/{pid}/fd")):
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


# -- a serving helper, seen from outside ------------------------------------------------------------------------

HELPER_MARK = "serving-helper"  # a serving helper's command line ends "serving-helper --for-pid PID" (and says no more)
_CREDENTIAL_FIELDS = ("Uid", "Gid", "Groups")
_CAPABILITY_FIELDS = ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")


def helper_command(for_pid: int) -> list[str]:
    """The arguments a serving helper's command line ends with."""
    return [HELPER_MARK, "--for-pid", str(for_pid)]


def helper_of(pid: int) -> int | None:
    """The rank whose serving helper process ``pid`` is (from its command line), None if it is none."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    mark = [arg.decode(errors="replace") for arg in argv[-4:-1]]
    if len(mark) == 3 and mark[:2] == [HELPER_MARK, "--for-pid"] and mark[2].isdigit():
        return int(mark[2])
    return None


def credentials(pid: int | str) -> dict[str, str] | None:
    """A process's (``"thread-self"``: this thread's) uids, gids, groups and capability sets, from /proc."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return None
    found = {}
    for line in lines:
        name, _, value = line.partition(":")
        if name in _CREDENTIAL_FIELDS or name in _CAPABILITY_FIELDS:
            found[name] = " ".join(sorted(value.split())) if name == "Groups" else " ".join(value.split())
    return found


def privileges_beyond(helper: dict[str, str], rank: dict[str, str]) -> str | None:
    """What ``helper``'s credentials allow that ``rank``'s do not (both from :func:`credentials`), or None."""
    for name in _CREDENTIAL_FIELDS:
        if helper.get(name) != rank.get(name):
            return f"{name} {helper.get(name)!r} where its rank has {rank.get(name)!r}"
    for name in _CAPABILITY_FIELDS:
        extra = int(helper.get(name, "0"), 16) & ~int(rank.get(name, "0"), 16)
        if extra:
            return f"{name} {extra:#x} beyond its rank's"
    return None


def process_state(pid: int) -> str | None:
    """The state letter of /proc/PID/stat (R, S, T, t, Z, ...), None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return None


def _start_time(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def stopped_orphan_helpers(lock_path: Path) -> list[int]:
    """Serving helpers that hold ``lock_path``'s lock for a rank that is gone, and are stopped (SIGSTOP, a
    debugger): nobody else can free the address until they run again.  This user's only.

    Looked for only when the lock's holder is gone (/proc/locks names the process that took the lock, the rank,
    or 0 once its pid is freed): a helper serving a live rank, or lingering for departed ranks (it runs: state
    S or R), is never one.
    """
    holder = lock_holder_pid(lock_path)
    if holder is not None and process_state(holder) not in (None, "Z", "X"):
        return []
    try:
        wanted = os.stat(lock_path)
    except OSError:
        return []
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        rank = helper_of(pid)
        if rank is None or (holder is not None and rank != holder) or process_state(pid) not in ("T", "t"):
            continue
        try:
            if os.stat(f"/proc/{pid}").st_uid != os.getuid():
                continue
            holds = any(os.path.samestat(os.stat(f"/proc/{pid}/fd/{fd}"), wanted)
                        for fd in os.listdir(f"/proc/{pid}/fd"))
        except OSError:
            continue
        started, rank_started = _start_time(pid), _start_time(rank)
        rank_gone = process_state(rank) in (None, "Z", "X") or (
            rank_started is not None and started is not None and rank_started > started)  # (its pid reused)
        if holds and rank_gone:
            found.append(pid)
    return found
