"""Standbys wait for the owner lock in the kernel (election/standby.py): real processes, real flock."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
from support import DEADLINE_S, hold_flock, reaper_fixture, wait_until  # noqa: F401  (pytest fixture)

from election import OwnerElection, lock_file_name
from election.lock import flock_entries
from election.standby import LockWaiter, holding_off_fork

ADDR = "127.0.0.1:9123"


def _lock_is_free(path: Path) -> bool:
    """Whether a new open file description can take the lock now (released at once if so)."""
    probe = OwnerElection(path.parent, ADDR)
    try:
        return probe.try_win().value == "flock"
    finally:
        probe.release()


def _blocked_in_flock(path: Path) -> bool:
    """Whether a flock() request of this process waits for ``path``'s lock (/proc/locks: a "->" line)."""
    return any(blocked and pid == os.getpid() for blocked, pid in flock_entries(os.stat(path)))


def _thread_cpu_s(thread: threading.Thread) -> float:
    """The CPU time one thread of this process has used (/proc/self/task/TID/stat: utime + stime)."""
    fields = Path(f"/proc/self/task/{thread.native_id}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Taker:
    """An ``on_won`` that records each win, and takes the descriptor into an election when asked to."""

    def __init__(self, directory: Path, take: bool = True) -> None:
        self.election = OwnerElection(directory, ADDR)
        self.take = take
        self.wins: list[float] = []
        self.won = threading.Event()

    def __call__(self, waiter: LockWaiter) -> None:
        self.wins.append(time.monotonic())
        if self.take:
            with holding_off_fork():
                fd = waiter.hand_over()
                if fd is not None:
                    self.election.adopt(fd)
        self.won.set()


@pytest.fixture
def lock_path(tmp_dir: Path) -> Path:
    path = tmp_dir / lock_file_name(ADDR)
    path.touch(mode=0o600)
    return path


def test_a_standby_takes_the_lock_the_moment_its_holder_is_killed(lock_path: Path, reaper) -> None:
    holder = hold_flock(reaper, lock_path)
    taker = Taker(lock_path.parent)
    waiter = LockWaiter(lock_path, taker, name="test-waiter", backoff_s=5.0)
    waiter.start()
    try:
        wait_until(lambda: _blocked_in_flock(lock_path), message="the waiter blocked in flock()")
        assert not taker.won.is_set()  # the holder lives: nothing to take
        killed = time.monotonic()
        holder.kill()
        assert taker.won.wait(DEADLINE_S)  # (how soon is bench's figure)
        assert taker.wins[0] >= killed
        assert taker.election.held
        assert not _lock_is_free(lock_path)  # held through the adopted descriptor
        wait_until(lambda: not waiter._thread.is_alive(), message="the waiter's thread done once it handed over")
    finally:
        waiter.detach()
        taker.election.release()
    assert _lock_is_free(lock_path)


def test_waiting_costs_no_cpu(lock_path: Path, reaper) -> None:
    holder = hold_flock(reaper, lock_path)
    taker = Taker(lock_path.parent)
    waiter = LockWaiter(lock_path, taker, name="test-waiter", backoff_s=5.0)
    waiter.start()
    try:
        wait_until(lambda: _blocked_in_flock(lock_path), message="the waiter blocked in flock()")
        before = _thread_cpu_s(waiter._thread)
        time.sleep(2.0)  # the interval measured, not a wait for a state
        used = _thread_cpu_s(waiter._thread) - before
    finally:
        waiter.detach()
        holder.kill()
    # Per thread: the worker's other threads (pytest's, xdist's) are not the waiter's doing.  A thread blocked in
    # the kernel uses none; one tick (10 ms) of rounding is all that may show.
    assert used <= 0.01, f"the waiting thread used {used:.3f} s of CPU over 2 s"
    assert not taker.wins


def test_a_detached_standby_never_takes_nor_keeps_the_lock(lock_path: Path, reaper) -> None:
    holder = hold_flock(reaper, lock_path)
    taker = Taker(lock_path.parent)
    waiter = LockWaiter(lock_path, taker, name="test-waiter", backoff_s=5.0)
    waiter.start()
    wait_until(lambda: _blocked_in_flock(lock_path), message="the waiter blocked in flock()")
    started = time.monotonic()
    waiter.detach()
    assert time.monotonic() - started < 5.0  # bounded: it does not wait for the holder (who lives on)
    assert holder.proc.poll() is None
    holder.kill()
    wait_until(lambda: not waiter._thread.is_alive(), message="the parked thread ending once the lock is free")
    assert not taker.wins
    assert _lock_is_free(lock_path)  # what the parked call won, the kernel released as it returned


def test_a_conceding_taker_is_offered_the_lock_again_only_after_the_back_off(lock_path: Path) -> None:
    taker = Taker(lock_path.parent, take=False)
    waiter = LockWaiter(lock_path, taker, name="test-waiter", backoff_s=0.3)
    waiter.start()
    try:
        wait_until(lambda: len(taker.wins) >= 3, message="three offers")
    finally:
        waiter.detach()
    wait_until(lambda: not waiter._thread.is_alive(), message="the waiter's thread done once detached")
    gaps = [b - a for a, b in zip(taker.wins, taker.wins[1:], strict=False)]
    assert min(gaps) >= 0.29, gaps  # never sooner than the back-off (0.3 s): no tight loop of taking and conceding
    assert _lock_is_free(lock_path)  # each concession released it


def test_a_child_forked_while_the_parent_waits_holds_no_stake(lock_path: Path, reaper) -> None:
    holder = hold_flock(reaper, lock_path)
    taker = Taker(lock_path.parent)
    waiter = LockWaiter(lock_path, taker, name="test-waiter", backoff_s=5.0)
    waiter.start()
    wait_until(lambda: _blocked_in_flock(lock_path), message="the waiter blocked in flock()")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no descriptor of the lock file, and it stays alive until told
        try:
            os.close(write)
            held = [fd for fd in os.listdir("/proc/self/fd")
                    if os.path.realpath(f"/proc/self/fd/{fd}") == str(lock_path)]
            os.read(read, 1)
            os._exit(10 + len(held))
        finally:
            os._exit(99)
    os.close(read)
    try:
        holder.kill()
        assert taker.won.wait(DEADLINE_S)  # the parent's waiter still works after the fork
        taker.election.release()
        assert _lock_is_free(lock_path)  # the living child keeps nothing locked
    finally:
        os.write(write, b"x")
        os.close(write)
        _, status = os.waitpid(pid, 0)
        waiter.detach()
    assert os.waitstatus_to_exitcode(status) == 10  # the child had no descriptor of the lock file


def test_a_child_forked_while_a_parent_thread_holds_the_waiters_flag_does_not_hang(lock_path: Path, reaper) -> None:
    """The child's fork hook marks each waiter detached.  A parent thread may be inside the flag's lock at the
    fork (a waiter entering or leaving its back-off's wait, a detach): that thread does not exist in the child,
    so the hook must not take the inherited lock.  (It did: a fork storm beside standbys hung a child for ever,
    and its parent in waitpid.)  The window, microseconds wide in a real host, is held open here."""
    holder = hold_flock(reaper, lock_path)
    waiter = LockWaiter(lock_path, Taker(lock_path.parent), name="test-waiter", backoff_s=5.0)
    waiter.start()
    wait_until(lambda: _blocked_in_flock(lock_path), message="the waiter blocked in flock()")
    inside, leave = threading.Event(), threading.Event()

    def hold_the_flags_lock() -> None:
        with waiter._detached._cond:  # (threading.Event's lock, as its wait() and set() take it)
            inside.set()
            leave.wait(DEADLINE_S)

    thread = threading.Thread(target=hold_the_flags_lock)
    thread.start()
    statuses: list[int] = []

    def reaped() -> bool:
        done, status = os.waitpid(pid, os.WNOHANG)
        statuses.extend([status] if done else [])
        return bool(done)

    try:
        assert inside.wait(DEADLINE_S)
        pid = os.fork()
        if pid == 0:
            os._exit(0 if waiter.detached else 1)  # (its hook ran: the waiter is detached here)
        try:
            wait_until(reaped, DEADLINE_S, message="the forked child to exit (it hangs if its hook takes the lock)")
        finally:
            if not statuses:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
    finally:
        leave.set()
        thread.join(DEADLINE_S)
        waiter.detach()
        holder.kill()
    assert os.waitstatus_to_exitcode(statuses[0]) == 0


def test_a_fork_that_cannot_wait_for_a_hold_goes_ahead_and_says_so(monkeypatch: pytest.MonkeyPatch,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    # The bound is a hang's (10 s): cut here, so that a thread holding the guard stands for a hang of ours.
    monkeypatch.setattr("store.forkguard._FORK_LOCK_WAIT_S", 0.2)
    holding, leave = threading.Event(), threading.Event()

    def hold() -> None:
        with holding_off_fork():
            holding.set()
            leave.wait(DEADLINE_S)

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        assert holding.wait(DEADLINE_S)
        with caplog.at_level("WARNING", logger="nixl_prometheus_mp.store"):
            pid = os.fork()
            if pid == 0:
                os._exit(0)
            assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
        said = [r.getMessage() for r in caplog.records if r.name == "nixl_prometheus_mp.store"]
        assert len(said) == 1 and "a standby's descriptor of a lock file" in said[0], said
    finally:
        leave.set()
        thread.join(DEADLINE_S)
    with caplog.at_level("WARNING", logger="nixl_prometheus_mp.store"):  # a fork that could wait says nothing
        caplog.clear()
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
    assert not [r for r in caplog.records if r.name == "nixl_prometheus_mp.store"]
