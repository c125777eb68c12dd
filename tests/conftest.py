"""Shared fixtures.  Store tests use: tmp_dir, make_identity, make_writer, lock_probe; permission tests
root_owned_dir."""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support import directory_for

import store
from store import StoreIdentity, StoreWriter

PROJECT_ROOT = Path(store.__file__).resolve().parents[1]


@pytest.fixture
def tmp_dir(tmp_path: Path) -> Path:
    """A fresh, empty directory with mode 0700 (what the exporter asks operators for)."""
    path = tmp_path / "mp"
    path.mkdir(mode=0o700)
    path.chmod(0o700)  # mkdir's mode is narrowed by the umask; be exact
    return path


@pytest.fixture
def make_identity() -> Callable[..., StoreIdentity]:
    """Build a StoreIdentity with sensible defaults; override any field by keyword."""

    def build(agent_name: str = "agent-0", hostname: str = "host-a", local_rank: str = "",
              instance: int = 0, bounds: tuple[float, ...] = store.DEFAULT_BUCKETS_US) -> StoreIdentity:
        return StoreIdentity(agent_name=agent_name, hostname=hostname, local_rank=local_rank,
                             instance=instance, bounds=tuple(bounds))

    return build


@pytest.fixture
def make_writer(tmp_dir: Path, make_identity: Callable[..., StoreIdentity]) -> Iterator[Callable[..., StoreWriter]]:
    """Create StoreWriters in ``tmp_dir`` (identity fields as keywords); all closed at teardown."""
    writers: list[StoreWriter] = []

    def build(directory: Path | None = None, enabled=None, **identity_fields) -> StoreWriter:
        writer = StoreWriter(tmp_dir if directory is None else directory, make_identity(**identity_fields),
                             enabled=enabled)
        writers.append(writer)
        return writer

    yield build
    for writer in writers:
        writer.close()


_LOCK_PROBE = textwrap.dedent("""
    import fcntl, os, sys
    try:
        fd = os.open(sys.argv[1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        sys.exit(4)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        sys.exit(3)
    sys.exit(0)
""")


def _lock_free_elsewhere(path: str | os.PathLike[str], reaped_ok: bool = False) -> bool:
    """Whether another process can take LOCK_EX|LOCK_NB on ``path`` (i.e. no writer holds it). ``reaped_ok``: a
    store gone counts as free (an owner reaps only stores no writer holds), else it fails the test."""
    done = subprocess.run([sys.executable, "-c", _LOCK_PROBE, os.fspath(path)], cwd=PROJECT_ROOT,
                          capture_output=True, text=True, timeout=30)
    if done.returncode == 4 and reaped_ok:
        return True
    if done.returncode not in (0, 3):
        raise AssertionError(f"lock probe failed: rc={done.returncode} {done.stderr}")
    return done.returncode == 0


@pytest.fixture
def lock_probe() -> Callable[..., bool]:
    """``lock_probe(path, reaped_ok=False)``: True if a separate process can flock(LOCK_EX|LOCK_NB) the file."""
    return _lock_free_elsewhere


@pytest.fixture(params=["c", "python"])
def recording_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test on the C recording path (store._recorder) and on its pure-Python twin.

    Writers (and Exporters) created during the test use the chosen path.  The
    C run is skipped where the extension is not built, unless
    CI_REQUIRE_SPEEDUPS=1 (CI), where that is a failure.
    """
    import store.recorders

    if request.param == "c":
        if store.recorders.NATIVE is None:
            if os.environ.get("CI_REQUIRE_SPEEDUPS") == "1":
                pytest.fail("store._recorder is not loaded but CI_REQUIRE_SPEEDUPS=1")
            pytest.skip("store._recorder is not built (or NIXL_PROMETHEUS_MP_PURE_PYTHON=1)")
    else:
        monkeypatch.setattr(store.recorders, "NATIVE", None)
    return str(request.param)


@pytest.fixture
def root_owned_dir() -> Iterator[Path]:
    """A root-owned 0755 directory that uid 65534 can reach but not write."""
    with directory_for("nixl-unwritable-", 0o755) as directory:
        yield directory


# TEST_SERVE_MODES=helper narrows the serving modes (.ci/run's runs on the pure-Python twins and the other
# Pythons, where serving does not depend on what the run varies).
SERVE_MODES = os.environ.get("TEST_SERVE_MODES", "helper,thread").split(",")


@pytest.fixture(params=SERVE_MODES)
def serve_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test with an elected rank serving from its helper process, then from a thread of its own.

    Every rank the test starts (support.child_env) and every Exporter built from support.exporter_env gets it.
    Modules use it for all their tests with ``pytestmark = pytest.mark.usefixtures("serve_mode")``.
    """
    monkeypatch.setenv("NIXL_PROMETHEUS_MP_SERVE", request.param)
    return str(request.param)


# -- address servers -------------------------------------------------------------------------------------------
#
# An address server is the job's: it outlives the rank that started it until the TTL after the last rank's last
# update.  Each pytest worker is a child subreaper, so that every server started by a test (in this process or
# in a rank the test started) becomes this worker's child once its launcher exits: the fixture below stops
# and reaps the ones a module's tests left (a module's fixtures may share one), so that none piles up over the
# run.  Tests use a port and a directory of their own, so a server left until the module ends serves nobody else.

_PR_SET_CHILD_SUBREAPER, _PR_GET_CHILD_SUBREAPER = 36, 37
_LIBC = ctypes.CDLL(None, use_errno=True)


def _is_subreaper() -> bool:
    flag = ctypes.c_int(0)
    _LIBC.prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0)
    return bool(flag.value)


_LIBC.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def stop_address_servers() -> None:
    """SIGKILL and reap every process of an address server's this worker adopted: servers, spares, launchers,
    zombies included.  The servers are stopped first (one whose spare dies would start another); a launcher
    orphaned by its server's death still forks what it launched, adopted here a moment later: looked for again
    until none has shown for a moment (bounded by a deadline only a hang reaches)."""
    import signal
    import time

    from app.probe import HELPER_MARK, SERVER_COMM, SPARE_COMM

    deadline = time.monotonic() + 20.0
    quiet_since = None
    while time.monotonic() < deadline:
        adopted = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                comm, _, rest = Path(f"/proc/{entry}/stat").read_text().partition(") ")
                argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            name = comm.partition(" (")[2]
            if int(rest.split()[1]) == os.getpid() and (HELPER_MARK.encode() in argv or name in (SERVER_COMM,
                                                                                                 SPARE_COMM)):
                adopted.append((int(entry), name))  # (a zombie's command line is empty: its name is kept)
        if not adopted:
            quiet_since = quiet_since or time.monotonic()
            if time.monotonic() - quiet_since > 0.3:
                return
            time.sleep(0.02)
            continue
        quiet_since = None
        for pid, comm in adopted:
            if comm == SERVER_COMM:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGSTOP)
        for pid, _ in adopted:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        for pid, _ in adopted:
            with contextlib.suppress(OSError):
                os.waitpid(pid, 0)


@pytest.fixture(autouse=True, scope="module")
def _no_address_server_outlives_its_module() -> Iterator[None]:
    yield
    stop_address_servers()
    # A module that switched the flag off would send the servers of the worker's later modules to init, where
    # they outlive the run (a test's TTL of an hour): the module that did it fails here.
    assert _is_subreaper(), "a test of this module switched off the worker's child-subreaper flag (conftest's)"
