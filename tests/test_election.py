"""The owner election (election/lock.py): flock per address, hardened lock file, leftovers, fallbacks."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from support import hold_flock, reaper_fixture  # noqa: F401  (pytest fixture)

from election import Outcome, OwnerElection, held_addresses_except, lock_file_name

ADDR = "127.0.0.1:9123"
OTHER = "0.0.0.0:9124"


def test_lock_file_name_carries_the_address() -> None:
    assert lock_file_name("127.0.0.1:9090") == "nixl-owner.127.0.0.1:9090.lock"
    assert lock_file_name("0.0.0.0:80") == "nixl-owner.0.0.0.0:80.lock"
    assert "/" not in lock_file_name("a/b:1")
    assert lock_file_name("a/b:1") == "nixl-owner.a_b:1.lock"


def test_first_wins_second_loses_until_released(tmp_dir: Path) -> None:
    first, second = OwnerElection(tmp_dir, ADDR), OwnerElection(tmp_dir, ADDR)
    try:
        assert first.try_win() is Outcome.WON
        assert first.held
        assert first.try_win() is Outcome.WON  # idempotent while held
        assert second.try_win() is Outcome.LOST
        assert not second.held and second.problem is None
        first.release()
        assert not first.held
        assert second.try_win() is Outcome.WON
        assert first.try_win() is Outcome.LOST
    finally:
        first.release()
        second.release()


def test_lock_file_is_private_regular_and_never_unlinked(tmp_dir: Path) -> None:
    election = OwnerElection(tmp_dir, ADDR)
    assert election.try_win() is Outcome.WON
    path = tmp_dir / lock_file_name(ADDR)
    assert election.path == path
    st = os.stat(path, follow_symlinks=False)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == 0
    election.release()
    assert path.exists()  # never unlinked: a late process must not lock a fresh inode
    election.release()  # idempotent


def test_lock_held_by_another_process_loses_and_wins_after_it_dies(tmp_dir: Path, reaper) -> None:
    path = tmp_dir / lock_file_name(ADDR)
    path.touch(mode=0o600)
    holder = hold_flock(reaper, path)
    election = OwnerElection(tmp_dir, ADDR)
    assert election.try_win() is Outcome.LOST
    assert held_addresses_except(tmp_dir, OTHER) == [ADDR]
    holder.kill()  # the kernel releases the lock however the holder died
    assert election.try_win() is Outcome.WON
    election.release()


def test_different_addresses_do_not_contend(tmp_dir: Path) -> None:
    a, b = OwnerElection(tmp_dir, ADDR), OwnerElection(tmp_dir, OTHER)
    try:
        assert a.try_win() is Outcome.WON
        assert b.try_win() is Outcome.WON
        assert held_addresses_except(tmp_dir, ADDR) == [OTHER]
        assert held_addresses_except(tmp_dir, OTHER) == [ADDR]
    finally:
        a.release()
        b.release()


def test_held_addresses_ignores_leftovers_own_address_and_other_files(tmp_dir: Path) -> None:
    # A leftover of an earlier run: created, never locked by anyone now.
    (tmp_dir / lock_file_name("127.0.0.1:7001")).touch(mode=0o600)
    (tmp_dir / "nixl-owner.unrelated").touch()
    (tmp_dir / "nixl.1.2.0.mmap").touch()
    own = OwnerElection(tmp_dir, ADDR)
    live = OwnerElection(tmp_dir, "127.0.0.1:7002")
    try:
        assert own.try_win() is Outcome.WON
        assert held_addresses_except(tmp_dir, ADDR) == []  # the leftover is not a second owner
        assert live.try_win() is Outcome.WON
        assert held_addresses_except(tmp_dir, ADDR) == ["127.0.0.1:7002"]
        # probing a leftover leaves it unlocked: another run can still win it
        leftover = OwnerElection(tmp_dir, "127.0.0.1:7001")
        assert leftover.try_win() is Outcome.WON
        leftover.release()
    finally:
        own.release()
        live.release()


def test_held_addresses_ignores_foreign_owned_locks(tmp_dir: Path, reaper) -> None:
    planted = tmp_dir / lock_file_name("127.0.0.1:7003")
    planted.touch(mode=0o600)
    os.chown(planted, 12345, 12345)
    hold_flock(reaper, planted)  # held, but foreign: proves nothing about the run
    assert held_addresses_except(tmp_dir, ADDR) == []


def test_held_addresses_of_a_missing_directory_is_empty(tmp_path: Path) -> None:
    assert held_addresses_except(tmp_path / "gone", ADDR) == []


def test_foreign_owned_lock_falls_back_with_a_warning(tmp_dir: Path, reaper, caplog) -> None:
    path = tmp_dir / lock_file_name(ADDR)
    path.touch(mode=0o600)
    os.chown(path, 12345, 12345)
    hold_flock(reaper, path)  # a co-tenant holding a planted lock must not demote every rank
    election = OwnerElection(tmp_dir, ADDR)
    with caplog.at_level("WARNING", logger="nixl_prometheus_mp.election"):
        assert election.try_win() is Outcome.FALLBACK
    assert not election.held
    assert election.problem and "12345" in election.problem and str(path) in election.problem
    assert any("unusable" in r.getMessage() and ADDR in r.getMessage() for r in caplog.records)
    election.release()  # nothing to release; must not fail


@pytest.mark.parametrize("kind", ["symlink", "directory", "fifo"])
def test_lock_that_is_not_a_regular_file_falls_back(tmp_dir: Path, tmp_path: Path, kind: str) -> None:
    path = tmp_dir / lock_file_name(ADDR)
    if kind == "symlink":
        target = tmp_path / "elsewhere.lock"
        target.touch()
        path.symlink_to(target)
    elif kind == "directory":
        path.mkdir()
    else:
        os.mkfifo(path)
    election = OwnerElection(tmp_dir, ADDR)
    assert election.try_win() is Outcome.FALLBACK
    assert election.problem
    if kind == "symlink":
        assert os.path.getsize(target) == 0 and path.is_symlink()  # never followed


def test_forked_child_forgets_without_unlocking(tmp_dir: Path) -> None:
    election = OwnerElection(tmp_dir, ADDR)
    assert election.try_win() is Outcome.WON
    pid = os.fork()
    if pid == 0:  # the child: drop the inherited descriptor, never LOCK_UN
        code = 1
        try:
            election.forget()
            code = 0 if not election.held else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert election.held
    assert OwnerElection(tmp_dir, ADDR).try_win() is Outcome.LOST  # the parent still owns the address
    election.release()



def test_lock_files_are_opened_without_blocking_nor_taking_a_terminal(tmp_dir: Path, monkeypatch) -> None:
    """A FIFO or a terminal planted under a lock file's name is refused after fstat, so the open itself must
    neither block nor make the terminal a session leader's controlling one (O_NONBLOCK | O_NOCTTY)."""
    flags: list[int] = []
    real_open = os.open

    def recording_open(path: str | os.PathLike[str], mode: int, *args: int, **kwargs: int) -> int:
        if Path(path).name.startswith("nixl-owner."):  # (not the fill's /dev/null: store.fds)
            flags.append(mode)
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(os, "open", recording_open)
    election = OwnerElection(tmp_dir, ADDR)
    try:
        assert election.try_win() is Outcome.WON
        assert held_addresses_except(tmp_dir, OTHER) == [ADDR]  # the probe opens it too
    finally:
        election.release()
    assert len(flags) == 2
    assert all(f & os.O_NONBLOCK and f & os.O_NOCTTY and f & os.O_NOFOLLOW for f in flags), flags
