"""A rank signals only a process that is provably our address server for its address.

A rank that wins its election but finds the port held asks the holder to give it up (SIGUSR1) only if the
holder is an address server of this user, for exactly this address, by its process name and command line, and
through a pidfd opened before those checks (never a pid reused meanwhile).  SIGUSR1's default action ends a
process: each case below is a listener whose command line ends like a server's, and which SIGUSR1 would kill.
"""

from __future__ import annotations

import os
import signal
import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import DEADLINE_S, START_DEADLINE_S, exporter_env, free_port

from app import Exporter

UNPRIVILEGED = 54321  # a uid (and gid) no other process of the machine uses
SYSTEM_PYTHON = "/usr/bin/python3"  # any uid can run it (the test's interpreter may sit in root's 0700 home)

# Listens on the port, names itself argv[1] (PR_SET_NAME), and waits for a signal; its command line ends
# "serving-helper ADDRESS" as an address server's does.
LISTENER = textwrap.dedent("""
    import ctypes, signal, socket, sys
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", int(sys.argv[2])))
    sock.listen()
    ctypes.CDLL(None).prctl(15, sys.argv[1].encode(), 0, 0, 0)
    print("listening", flush=True)
    while True:
        signal.pause()
""")

CASES = {  # (its name, the address on its command line, its uid), and whether it is our server
    "another user's process": ("nixl-server", "{address}", UNPRIVILEGED, False),
    "another address": ("nixl-server", "not-an-address", None, False),
    "another name": ("python3", "{address}", None, False),
    "our server for this address (the control)": ("nixl-server", "{address}", None, True),
}


@pytest.fixture
def listeners() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for process in started:
        process.kill()
        process.wait(DEADLINE_S)


@pytest.mark.skipif(os.geteuid() != 0, reason="another user's process needs root to start")
@pytest.mark.parametrize("case", list(CASES))
def test_sigusr1_goes_only_to_our_server_for_this_address(tmp_dir: Path, listeners: list[subprocess.Popen[str]],
                                                          case: str) -> None:
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        pytest.skip(f"needs {SYSTEM_PYTHON}")
    name, address, uid, ours = CASES[case]
    port = free_port()
    address = address.format(address=f"127.0.0.1:{port}")
    listener = subprocess.Popen([SYSTEM_PYTHON, "-c", LISTENER, name, str(port), "serving-helper", address],
                                cwd="/", stdout=subprocess.PIPE, text=True, user=uid, group=uid,
                                extra_groups=[] if uid is not None else None)
    listeners.append(listener)
    assert listener.stdout is not None and listener.stdout.readline() == "listening\n"
    exporter = Exporter("newcomer", exporter_env(tmp_dir, port, NIXL_PROMETHEUS_MP_SERVE="helper"))
    try:  # its constructor won its own election, found the port held, and looked at the holder
        if ours:
            assert listener.wait(START_DEADLINE_S) == -signal.SIGUSR1  # the test can fail: this one is asked
        else:
            assert listener.poll() is None, f"{case}: ended by {listener.returncode}"
            assert not exporter.serving
    finally:
        exporter.close()
