"""Multi-process behaviour: a SIGKILLed writer's store, and writers across os.fork()."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
import traceback
from pathlib import Path

import pytest

import store
from store import EventType, Snapshot, read_snapshot, writer_alive

# Every test here runs on the C recording path and on its pure-Python twin.
pytestmark = pytest.mark.usefixtures("recording_path")

E = EventType
PROJECT_ROOT = Path(store.__file__).resolve().parents[1]

WRITER_SCRIPT = textwrap.dedent("""
    import sys
    from store import EventType as E, StoreIdentity, StoreWriter
    w = StoreWriter(sys.argv[1], StoreIdentity("doomed", "host-k", "2", 4, (10.0, 100.0)))
    w.record(E.AGENT_TX_BYTES, 4096)
    w.record(E.AGENT_TX_BYTES, 1000)
    w.record(E.AGENT_XFER_TIME, 100)
    w.record(E.AGENT_XFER_TIME, 101)
    w.record(E.AGENT_ERR_CANCELED, 3)
    print(w.path, flush=True)
    sys.stdin.read()  # until killed, or until the test closes our stdin
""")


def read_line(stream, timeout: float) -> str:
    ready, _, _ = select.select([stream], [], [], timeout)
    assert ready, f"no output within {timeout} s"
    return stream.readline().strip()


def check_killed_store(snapshot: Snapshot, pid: int) -> None:
    assert snapshot.pid == pid
    assert snapshot.agent_name == "doomed" and snapshot.hostname == "host-k" and snapshot.local_rank == "2"
    assert snapshot.instance == 4
    assert snapshot.counters[E.AGENT_TX_BYTES] == 5096
    assert snapshot.gauges[E.AGENT_TX_BYTES] == 1000
    assert snapshot.counters[E.AGENT_XFER_TIME] == 201
    assert snapshot.histogram(E.AGENT_XFER_TIME) == (0, 1, 1)
    assert snapshot.sums[E.AGENT_XFER_TIME] == 201
    assert snapshot.counters[E.AGENT_ERR_CANCELED] == 3


def test_sigkilled_writer_releases_lock_and_keeps_values(tmp_dir, lock_probe):
    proc = subprocess.Popen([sys.executable, "-c", WRITER_SCRIPT, str(tmp_dir)], cwd=PROJECT_ROOT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        path = Path(read_line(proc.stdout, 30))
        assert path.parent == tmp_dir
        assert path.name.startswith(f"nixl.{proc.pid}.") and path.name.endswith(".4.mmap")
        # Alive: another process cannot take the lock, the probe says alive, values are readable.
        assert lock_probe(path) is False
        assert writer_alive(path) is True
        live = read_snapshot(path)
        assert isinstance(live, Snapshot), live
        check_killed_store(live, proc.pid)
        contents = path.read_bytes()

        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        proc.stdin.close()
        proc.stdout.close()
        proc.stderr.close()

    assert path.exists()
    assert path.read_bytes() == contents
    assert writer_alive(path) is False
    assert lock_probe(path) is True
    dead = read_snapshot(path)
    assert isinstance(dead, Snapshot), dead
    check_killed_store(dead, proc.pid)


# -- fork ---------------------------------------------------------------------------


def fork_child(body) -> tuple[int, int]:
    """Fork; the child runs ``body()`` and sends its JSON result back; never returns in the child."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        code = 0
        try:
            os.close(rfd)
            payload = json.dumps({"ok": body()})
        except BaseException:
            payload = json.dumps({"error": traceback.format_exc()})
            code = 1
        try:
            os.write(wfd, payload.encode())
        finally:
            os._exit(code)
    os.close(wfd)
    return pid, rfd


def reap(pid: int, rfd: int, timeout: float = 30.0):
    """Collect the child's JSON result and exit status, with bounded waits."""
    deadline = time.monotonic() + timeout
    chunks = []
    try:
        while True:
            remaining = deadline - time.monotonic()
            ready, _, _ = select.select([rfd], [], [], max(remaining, 0))
            if not ready:
                break
            chunk = os.read(rfd, 65536)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(rfd)
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("forked child did not exit in time")
        time.sleep(0.01)
    result = json.loads(b"".join(chunks) or b"{}")
    assert "error" not in result, result.get("error")
    assert os.waitstatus_to_exitcode(status) == 0
    return result["ok"]


def test_fork_child_writes_its_own_store(make_writer, tmp_dir, lock_probe):
    writer = make_writer(agent_name="forky", instance=2, bounds=(10.0, 100.0))
    writer.record(E.AGENT_TX_BYTES, 100)
    writer.record(E.AGENT_XFER_TIME, 50)
    parent_path = writer.path
    parent_before = parent_path.read_bytes()

    def child():
        inherited = str(writer.path)
        for _ in range(3):
            writer.record(E.AGENT_TX_BYTES, 7)
        writer.record(E.AGENT_XFER_TIME, 500)
        writer.record(E.AGENT_ERR_BACKEND, 1)
        return {"inherited": inherited, "path": str(writer.path), "pid": os.getpid(), "writer_pid": writer.pid}

    pid, rfd = fork_child(child)
    out = reap(pid, rfd)

    assert out["inherited"] == str(parent_path)
    assert out["pid"] == pid and out["writer_pid"] == pid
    child_path = Path(out["path"])
    assert child_path != parent_path
    assert child_path.parent == tmp_dir
    assert child_path.name.startswith(f"nixl.{pid}.") and child_path.name.endswith(".2.mmap")
    # A new run marker for the child's "process", so names never collide with the parent's.
    assert child_path.name.split(".")[2] != parent_path.name.split(".")[2]
    assert sorted(p.name for p in tmp_dir.iterdir()) == sorted([parent_path.name, child_path.name])

    # The parent's store is untouched by the child and still locked by the parent.
    assert parent_path.read_bytes() == parent_before
    assert lock_probe(parent_path) is False
    assert writer_alive(parent_path) is True
    parent = read_snapshot(parent_path)
    assert isinstance(parent, Snapshot)
    assert parent.pid == os.getpid()
    assert parent.counters[E.AGENT_TX_BYTES] == 100 and parent.counters[E.AGENT_ERR_BACKEND] == 0
    assert parent.histogram(E.AGENT_XFER_TIME) == (0, 1, 0)

    # The child's store holds only the child's events; the child exited so its lock is gone.
    kid = read_snapshot(child_path)
    assert isinstance(kid, Snapshot), kid
    assert kid.pid == pid and kid.agent_name == "forky" and kid.instance == 2
    assert kid.counters[E.AGENT_TX_BYTES] == 21
    assert kid.gauges[E.AGENT_TX_BYTES] == 7
    assert kid.counters[E.AGENT_ERR_BACKEND] == 1
    assert kid.histogram(E.AGENT_XFER_TIME) == (0, 0, 1)
    assert kid.sums[E.AGENT_XFER_TIME] == 500
    assert writer_alive(child_path) is False
    assert lock_probe(child_path) is True

    # The parent keeps writing to its own store.
    writer.record(E.AGENT_TX_BYTES, 1)
    assert writer.path == parent_path
    assert read_snapshot(parent_path).counters[E.AGENT_TX_BYTES] == 101


def test_fork_child_that_closes_without_writing(make_writer, tmp_dir, lock_probe):
    """close() in the child must not touch the parent's lock, nor close a reused descriptor."""
    writer = make_writer()
    writer.record(E.AGENT_RX_BYTES, 9)
    before = writer.path.read_bytes()
    store_fd = writer._fd  # the descriptor number the child inherits

    def child():
        writer.heartbeat()  # no store of its own yet: nothing to stamp, must not fail
        # The child already closed its copy; give the number to something else of the child's.
        spare = os.open(os.devnull, os.O_RDONLY)
        if spare != store_fd:
            os.dup2(spare, store_fd)
            os.close(spare)
        writer.close()
        os.fstat(store_fd)  # still open: close() did not close somebody else's descriptor
        os.close(store_fd)
        writer.record(E.AGENT_RX_BYTES, 1)  # dropped with a warning, no new store
        return {"closed": writer.closed}

    pid, rfd = fork_child(child)
    assert reap(pid, rfd) == {"closed": True}
    assert sorted(p.name for p in tmp_dir.iterdir()) == [writer.path.name]
    assert writer.path.read_bytes() == before
    assert lock_probe(writer.path) is False
    assert writer.closed is False
    writer.record(E.AGENT_RX_BYTES, 1)
    assert read_snapshot(writer.path).counters[E.AGENT_RX_BYTES] == 10


def test_fork_child_exiting_without_writing_keeps_parent_locked(make_writer, tmp_dir, lock_probe):
    writer = make_writer()
    pid, rfd = fork_child(lambda: os.getpid())
    assert reap(pid, rfd) == pid
    assert sorted(p.name for p in tmp_dir.iterdir()) == [writer.path.name]
    assert lock_probe(writer.path) is False
    writer.close()
    assert lock_probe(writer.path) is True


def test_fork_child_of_a_closed_writer_stays_closed(make_writer, tmp_dir):
    writer = make_writer()
    writer.close()

    def child():
        writer.record(E.AGENT_TX_BYTES, 1)
        return writer.closed

    pid, rfd = fork_child(child)
    assert reap(pid, rfd) is True
    assert sorted(p.name for p in tmp_dir.iterdir()) == [writer.path.name]
