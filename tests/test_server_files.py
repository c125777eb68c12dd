"""The address server opens its log file as hostile input: in a shared directory, a co-tenant may have put a
symlink, a FIFO, a directory, a device or a file of its own at its path.  Only a regular file of the run's user
is written (created 0600, never following a link, never blocking); anything else makes the server log nowhere,
said once by the rank that started it, and the server serves and gives the address up on time as usual.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
from support import (  # noqa: F401  (pytest fixtures)
    DEADLINE_S,
    Reaper,
    can_bind,
    free_port,
    healthz,
    reaper_fixture,
    scrape,
    start_exporter_rank,
    wait_until,
)

FOREIGN = 12345  # a uid (and gid) no process of the machine uses
TTL_S = 2.0


def _symlink(log: Path, outside: Path) -> None:
    log.symlink_to(outside)


def _fifo(log: Path, outside: Path) -> None:
    os.mkfifo(log, 0o600)


def _directory(log: Path, outside: Path) -> None:
    log.mkdir(mode=0o700)


def _device(log: Path, outside: Path) -> None:
    os.mknod(log, 0o600 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's numbers


def _foreign_file(log: Path, outside: Path) -> None:
    log.write_text("another user's\n")
    os.chown(log, FOREIGN, FOREIGN)


PLANTS: dict[str, Callable[[Path, Path], None]] = {
    "a symlink to a file outside": _symlink, "a FIFO": _fifo, "a directory": _directory, "a device": _device,
    "another user's regular file": _foreign_file}


@pytest.mark.skipif(os.geteuid() != 0, reason="devices and another user's file need root to make")
@pytest.mark.parametrize("plant", list(PLANTS))
def test_a_log_path_that_is_not_our_regular_file_is_never_written_nor_blocks(tmp_dir: Path, tmp_path: Path,
                                                                             reaper: Reaper, plant: str) -> None:
    port = free_port()
    log = tmp_dir / f"nixl-server.127.0.0.1:{port}.log"
    outside = tmp_path / "outside.txt"
    outside.write_text("untouched\n")
    PLANTS[plant](log, outside)
    before = os.lstat(log)
    rank = start_exporter_rank(reaper, tmp_dir, port, tick_hz=20, log_level="INFO",
                               extra_env={"NIXL_PROMETHEUS_MP_SERVE": "helper",
                                          "NIXL_TELEMETRY_MP_STALE_TTL": str(TTL_S)})
    wait_until(lambda: healthz(port)["owner"]["serving"] == "helper", message="the address server serving")
    assert healthz(port)["owner"]["log_file"] is None  # (it names none: it writes none)
    wait_until(lambda: "logs nowhere" in rank.stderr(), message="the rank saying why")
    (tmp_dir / "nixl.1.9.0.mmap").write_bytes(b"not a store")  # something for the server to warn about
    scrape(port)
    rank.command("close")
    # It never blocks on the path: it gives the address up once the TTL after the last update has passed.
    wait_until(lambda: can_bind(port), timeout=TTL_S + DEADLINE_S, message="the port free after the TTL")
    assert outside.read_text() == "untouched\n"
    after = os.lstat(log)
    assert (after.st_ino, after.st_mode, after.st_uid, after.st_size) == \
        (before.st_ino, before.st_mode, before.st_uid, before.st_size)
    said = [line for line in rank.stderr().splitlines() if "logs nowhere" in line]
    assert len(said) == 1 and said[0].startswith("WARNING"), rank.stderr()


def test_the_log_file_is_ours_and_private(tmp_dir: Path, reaper: Reaper) -> None:
    port = free_port()
    rank = start_exporter_rank(reaper, tmp_dir, port, extra_env={"NIXL_PROMETHEUS_MP_SERVE": "helper"})
    log = Path(wait_until(lambda: healthz(port)["owner"]["log_file"], message="the log file named"))
    st = os.lstat(log)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
    assert "logs nowhere" not in rank.stderr()
