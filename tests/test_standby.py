"""Standbys wait for the owner lock in the kernel (election/standby.py): real processes, real flock."""

from __future__ import annotations

import os
import resource
import threading
import time
from pathlib import Path

import pytest
from support import hold_flock, reaper_fixture, wait_until  # noqa: F401  (pytest fixture)

from election import OwnerElection, lock_file_name
from election.standby import LockWaiter, holding_off_fork

ADDR = "127.0.0.1:9123"


def _lock_is_free(path: Path) -> bool:
    """Whether a new open file description can take the lock now (released at once if so)."""
    probe = OwnerElection(path.parent, ADDR)
    try:
        return probe.try_win().value == "flock"
    finally:
        probe.release()


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
        time.sleep(0.2)
        assert not taker.won.is_set()  # the holder lives: nothing to take
        killed = time.monotonic()
        holder.kill()
        assert taker.won.wait(5.0)
        assert taker.wins[0] - killed < 1.0  # (a bound for a loaded machine; bench measures the figure)
        assert taker.election.held
        assert not _lock_is_free(lock_path)  # held through the adopted descriptor
        wait_until(lambda: not waiter._thread.is_alive(), timeout=2.0)  # handed over: the thread is done
    finally:
        waiter.detach()
        taker.election.release()
    assert _lock_is_free(lock_path)


def test_waiting_costs_no_cpu(lock_path: Path, reaper) -> None:
    holder = hold_flock(reaper, lock_path)
    taker = Taker(lock_path.parent)
    waiter = LockWaiter(lock_path, taker, name="test-waiter", backoff_s=5.0)
    before = resource.getrusage(resource.RUSAGE_SELF)
    waiter.start()
    time.sleep(2.0)
    after = resource.getrusage(resource.RUSAGE_SELF)
    waiter.detach()
    holder.kill()
    used = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert used < 0.05, f"the process used {used:.3f} s of CPU over 2 s while its standby waited"
    assert not taker.wins


def test_a_detached_standby_never_takes_nor_keeps_the_lock(lock_path: Path, reaper) -> None:
    holder = hold_flock(reaper, lock_path)
    taker = Taker(lock_path.parent)
    waiter = LockWaiter(lock_path, taker, name="test-waiter", backoff_s=5.0)
    waiter.start()
    time.sleep(0.1)  # blocked in flock by now
    started = time.monotonic()
    waiter.detach()
    assert time.monotonic() - started < 1.0  # bounded: it does not wait for the holder
    holder.kill()
    wait_until(lambda: not waiter._thread.is_alive(), timeout=5.0)
    assert not taker.wins
    assert _lock_is_free(lock_path)  # what the parked call won, the kernel released as it returned


def test_a_conceding_taker_is_offered_the_lock_again_only_after_the_back_off(lock_path: Path) -> None:
    taker = Taker(lock_path.parent, take=False)
    waiter = LockWaiter(lock_path, taker, name="test-waiter", backoff_s=0.3)
    waiter.start()
    time.sleep(1.0)
    waiter.detach()
    wait_until(lambda: not waiter._thread.is_alive(), timeout=2.0)
    assert 2 <= len(taker.wins) <= 5, taker.wins  # about one per back-off, never a tight loop
    assert _lock_is_free(lock_path)  # each concession released it


def test_a_child_forked_while_the_parent_waits_holds_no_stake(lock_path: Path, reaper) -> None:
    holder = hold_flock(reaper, lock_path)
    taker = Taker(lock_path.parent)
    waiter = LockWaiter(lock_path, taker, name="test-waiter", backoff_s=5.0)
    waiter.start()
    time.sleep(0.1)
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
        assert taker.won.wait(5.0)  # the parent's waiter still works after the fork
        taker.election.release()
        assert _lock_is_free(lock_path)  # the living child keeps nothing locked
    finally:
        os.write(write, b"x")
        os.close(write)
        _, status = os.waitpid(pid, 0)
        waiter.detach()
    assert os.waitstatus_to_exitcode(status) == 10  # the child had no descriptor of the lock file
