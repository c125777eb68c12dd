"""The scrape's directory scan (store/scan.py and its C speedup store/_scan.c).

Both implementations run on the same directories here and must agree entry
for entry, including on every hostile kind of file; the collector built on
either must publish the same thing.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import PROJECT_ROOT
from support import hold_flock, reaper_fixture  # noqa: F401  (pytest fixture)
from support_native import c_speedup, preloading, syscall_shim

import app.collector
from app.collector import Collection, Collector
from app.exposition import Renderer
from store import EventType, StoreWriter
from store import scan as S
from store.layout import STORE_SIZE

_c = c_speedup("_scan")
EVERY = sys.maxsize  # a first batch of every store


def c_scan(directory: Path) -> list[tuple[object, ...]]:
    """The C listing and reads of every store, as the C module returns them."""
    return _c.scan(directory, EVERY)[1]


def python_scan(directory: Path) -> list[S.Entry]:
    return S.scan_python(directory, EVERY)[1]


def use_scan(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """Make the collector list and read with the C module ("c") or its twin ("python")."""
    if path == "c":
        monkeypatch.setattr(app.collector, "scan", lambda d, first: (
            (result := _c.scan(d, first))[0], list(map(S.Entry._make, result[1]))))
        monkeypatch.setattr(app.collector, "read_stores", lambda d, names: list(map(S.Entry._make, _c.read(d, names))))
    else:
        monkeypatch.setattr(app.collector, "scan", S.scan_python)
        monkeypatch.setattr(app.collector, "read_stores", S.read_python)


FOREIGN_UID = 12345


def both(directory: Path) -> list[tuple[object, ...]]:
    """Scan with C and with the twin; they must agree; the (shared) result."""
    from_c = [tuple(S.Entry._make(e)) for e in c_scan(directory)]
    from_python = [tuple(e) for e in python_scan(directory)]
    assert from_c == from_python
    return from_c


def hostile_directory(directory: Path, make_writer: Callable[..., StoreWriter]) -> dict[str, int]:
    """Every kind of file a scan can meet; the outcome each must get."""
    live = make_writer(directory, agent_name="live", instance=0)
    live.record(EventType.AGENT_TX_BYTES, 4096)
    departed = make_writer(directory, agent_name="departed", instance=1)
    departed.record(EventType.AGENT_RX_BYTES, 7)
    departed.close()
    (directory / "nixl.10.1.0.mmap").write_bytes(departed.path.read_bytes()[:100])
    (directory / "nixl.11.1.0.mmap").write_bytes(b"")
    os.symlink(live.path, directory / "nixl.12.1.0.mmap")
    os.mkfifo(directory / "nixl.13.1.0.mmap")
    (directory / "nixl.14.1.0.mmap").mkdir()
    foreign = directory / "nixl.15.1.0.mmap"
    shutil.copyfile(departed.path, foreign)
    os.chown(foreign, FOREIGN_UID, FOREIGN_UID)
    (directory / "nixl.16.1.0.mmap").write_bytes(departed.path.read_bytes() + b"tail")
    # Never stores: not one of these may even be opened.
    for stray in ("nixl.mmap", "nixl..mmap", "nixl.1.2.mmap", "nixl.a.1.0.mmap", "nixl.1.1.0.mmap.staging",
                  "nixl.-1.1.0.mmap", "nixl.1.1.0.mmapx", "NIXL.1.1.0.mmap", "other"):
        shutil.copyfile(departed.path, directory / stray)
    return {live.path.name: S.OK, departed.path.name: S.OK, "nixl.10.1.0.mmap": S.SHORT,
            "nixl.11.1.0.mmap": S.SHORT, "nixl.12.1.0.mmap": S.UNREADABLE, "nixl.13.1.0.mmap": S.NOT_REGULAR,
            "nixl.14.1.0.mmap": S.NOT_REGULAR, "nixl.15.1.0.mmap": S.FOREIGN, "nixl.16.1.0.mmap": S.OK}


def test_c_and_python_scans_agree_on_every_kind_of_file(tmp_dir: Path, make_writer) -> None:
    expected = hostile_directory(tmp_dir, make_writer)
    entries = [S.Entry._make(e) for e in both(tmp_dir)]
    assert {e.name: e.outcome for e in entries} == expected
    assert [e.name for e in entries] == sorted(expected)
    by_name = {e.name: e for e in entries}
    live, departed = (name for name in expected if name.startswith(f"nixl.{os.getpid()}."))
    assert by_name[live].alive and not by_name[departed].alive
    assert by_name[live].data == (tmp_dir / live).read_bytes()
    assert by_name["nixl.10.1.0.mmap"].data is not None and len(by_name["nixl.10.1.0.mmap"].data) == 100
    assert by_name["nixl.12.1.0.mmap"].err == errno.ELOOP
    assert by_name["nixl.15.1.0.mmap"].uid == FOREIGN_UID and by_name["nixl.15.1.0.mmap"].data is None
    assert len(by_name["nixl.16.1.0.mmap"].data or b"") == STORE_SIZE
    assert by_name[departed].ino == os.stat(tmp_dir / departed).st_ino


def test_a_lock_held_by_another_process_reads_as_alive_on_both(tmp_dir: Path, make_writer, reaper) -> None:
    writer = make_writer(agent_name="gone")
    writer.close()
    assert [e[3] for e in both(tmp_dir)] == [False]
    holder = hold_flock(reaper, writer.path)
    assert [e[3] for e in both(tmp_dir)] == [True]
    holder.kill()
    assert [e[3] for e in both(tmp_dir)] == [False]


@pytest.mark.parametrize("what", ["missing", "a file"])
def test_a_directory_that_cannot_be_listed_raises_the_same_error(tmp_dir: Path, what: str) -> None:
    target = tmp_dir / "absent"
    if what == "a file":
        target.write_bytes(b"")
    errors = []
    for scan in (c_scan, python_scan):
        with pytest.raises(OSError) as info:
            scan(target)
        errors.append((info.value.errno, os.fspath(info.value.filename)))
    assert errors[0] == errors[1] == (errno.ENOENT if what == "missing" else errno.ENOTDIR, str(target))


def test_stores_vanishing_during_scans_are_missing_never_an_error(tmp_dir: Path, make_writer) -> None:
    keep = make_writer(agent_name="keep")
    template = keep.path.read_bytes()
    stop = threading.Event()

    def churn() -> None:
        # Create and delete stores as fast as possible, so that scans list
        # names that are gone by the time they are opened.
        n = 0
        while not stop.is_set():
            path = tmp_dir / f"nixl.{n % 50 + 100}.1.0.mmap"
            path.write_bytes(template)
            path.unlink()
            n += 1

    thread = threading.Thread(target=churn)
    thread.start()
    outcomes: set[int] = set()
    try:
        for _ in range(300):
            for scan in (c_scan, python_scan):
                entries = [S.Entry._make(e) for e in scan(tmp_dir)]
                assert keep.path.name in {e.name for e in entries}
                outcomes |= {e.outcome for e in entries}
    finally:
        stop.set()
        thread.join(timeout=30)
    # write_bytes truncates then writes, so a scan can also meet a short file
    assert outcomes <= {S.OK, S.MISSING, S.SHORT}


def collection_facts(result: Collection, directory: Path) -> str:
    facts = ([(v.snapshot.name, v.alive, v.reap_in_s is None) for v in result.live + result.stale],
             result.warnings, result.scan_error)
    return json.dumps(facts).replace(str(directory), "<dir>")


def test_the_collector_publishes_and_reaps_the_same_on_both_paths(tmp_dir: Path, make_writer, monkeypatch) -> None:
    results = []
    for tag in ("c", "python"):
        directory = tmp_dir / tag
        directory.mkdir()
        hostile_directory(directory, make_writer)
        use_scan(monkeypatch, tag)
        collector = Collector(directory, stale_ttl_s=3600)
        first = collector.collect()  # reaps the short files nobody holds
        second = collector.collect()
        results.append((collection_facts(first, directory), collection_facts(second, directory),
                        Renderer().render(second.published), sorted(os.listdir(directory))))
    assert results[0] == results[1]
    first_facts, second_facts, body, left = results[0]
    assert first_facts == second_facts  # what was reaped is neither published nor warned about
    assert b'agent_name="live"' in body and b'agent_name="departed"' in body
    assert {w["kind"] for w in json.loads(second_facts)[1]} == {"unreadable-store", "foreign-store", "duplicate-labels"}
    assert "nixl.10.1.0.mmap" not in left and "nixl.11.1.0.mmap" not in left and "nixl.mmap" in left


def test_both_paths_reap_only_what_the_scan_judged(tmp_dir: Path, make_writer, monkeypatch) -> None:
    for path in ("c", "python"):
        use_scan(monkeypatch, path)
        gone = make_writer(agent_name="gone")
        gone.close()
        live = make_writer(agent_name="live", instance=1)
        Collector(tmp_dir, stale_ttl_s=0).collect()
        assert not gone.path.exists() and live.path.exists()
        live.close()
        live.path.unlink()


@pytest.mark.parametrize(("forced", "python_path"), [("", False), ("0", False), ("false", False), ("No", False),
                                                    ("off", False), ("1", True), ("true", True), ("YES", True)])
def test_the_c_speedups_are_used_unless_the_python_path_is_forced(forced: str, python_path: bool) -> None:
    """NIXL_PROMETHEUS_MP_PURE_PYTHON takes the same yes/no words as every other flag ("false" used to force it)."""
    code = ("import store.scan as s, app.exposition as x; "
            "print(s.read_stores is s.read_python, x._native is None)")
    env = {**os.environ, "NIXL_PROMETHEUS_MP_PURE_PYTHON": forced}
    done = subprocess.run([sys.executable, "-c", code], cwd=PROJECT_ROOT, env=env, capture_output=True,
                          text=True, timeout=60, check=True)
    assert done.stdout.split() == [str(python_path)] * 2


def test_a_pure_python_value_that_is_no_yes_no_word_is_an_error_naming_it(tmp_path: Path) -> None:
    """One line naming the value where the package is first used, never a traceback: the Exporter's ConfigError,
    the command line's error; importing the package is fine (every rank imports it)."""
    env = {**os.environ, "NIXL_PROMETHEUS_MP_PURE_PYTHON": "maybe", "NIXL_TELEMETRY_MULTIPROC_DIR": str(tmp_path)}
    said = ("NIXL_PROMETHEUS_MP_PURE_PYTHON='maybe' is not a yes/no word (use one of y, yes, on, 1, true, "
            "enable or n, no, off, 0, false, disable, in any case)")
    code = ("import store, app.rank.exporter\nfrom app import ConfigError, Exporter\n"
            "try:\n    Exporter('a')\nexcept ConfigError as exc:\n    print(exc)")
    done = subprocess.run([sys.executable, "-c", code], cwd=PROJECT_ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert (done.returncode, done.stdout.strip(), done.stderr) == (0, said, ""), done
    done = subprocess.run([sys.executable, "-m", "app", "inspect", str(tmp_path)], cwd=PROJECT_ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr.strip()) == (2, f"nixl-prometheus-mp: error: {said}"), done


# Both scans with the system-call shim armed: every other openat, fstat, flock and pread is interrupted (EINTR).
_INTERRUPTED_SCANS = textwrap.dedent("""
    import ctypes, json, sys
    from store import scan as S, _scan

    shim = ctypes.CDLL(sys.argv[2])  # the preloaded copy
    runs = {}
    for name, scan in (("c", lambda d: [list(S.Entry._make(e)) for e in _scan.scan(d, sys.maxsize)[1]]),
                       ("python", lambda d: [list(e) for e in S.scan_python(d, sys.maxsize)[1]])):
        shim.shim_arm(1)
        entries = scan(sys.argv[1])
        shim.shim_arm(0)
        runs[name] = {"entries": [e[:6] + [e[6] is not None and len(e[6])] for e in entries],
                      "interrupted": [shim.shim_interrupted(call) for call in range(4)],
                      "open_flags": [shim.shim_open_flags(i) for i in range(shim.shim_opens())]}
    print(json.dumps(runs))
""")


def _interrupted_scans(directory: Path, shim_dir: Path) -> dict[str, dict]:
    library = syscall_shim(shim_dir)
    done = subprocess.run([sys.executable, "-c", _INTERRUPTED_SCANS, str(directory), str(library)], cwd=PROJECT_ROOT,
                          env=preloading(library), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_system_calls_interrupted_by_a_signal_are_made_again_on_both_paths(tmp_dir: Path, tmp_path: Path,
                                                                          make_writer) -> None:
    """PEP 475: the twin's os calls retry on EINTR, and so must the C scan's."""
    expected = hostile_directory(tmp_dir, make_writer)
    runs = _interrupted_scans(tmp_dir, tmp_path)
    assert runs["c"]["entries"] == runs["python"]["entries"]
    assert {name: outcome for name, outcome, *_ in runs["c"]["entries"]} == expected
    for path in ("c", "python"):  # openat, fstat, flock, pread: each was interrupted at least once
        assert all(runs[path]["interrupted"]), (path, runs[path]["interrupted"])


def test_stores_are_opened_without_blocking_nor_taking_a_terminal_on_both_paths(tmp_dir: Path, tmp_path: Path,
                                                                              make_writer) -> None:
    """A device node named like a store is opened before fstat can tell what it is: O_NONBLOCK | O_NOCTTY."""
    expected = hostile_directory(tmp_dir, make_writer)
    runs = _interrupted_scans(tmp_dir, tmp_path)
    for path in ("c", "python"):
        flags = runs[path]["open_flags"]
        assert len(flags) >= len(expected), (path, flags)  # every store-named file (and retries)
        assert all(f & os.O_NONBLOCK and f & os.O_NOCTTY and f & os.O_NOFOLLOW for f in flags), (path, flags)


_PEAK_GROWTH = textwrap.dedent("""
    import resource, sys
    from store import scan as S, _scan

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    entries = (_scan.scan(sys.argv[1], sys.maxsize) if sys.argv[2] == "c"
               else S.scan_python(sys.argv[1], sys.maxsize))[1]
    print(len(entries), (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
""")


def test_a_scan_keeps_only_what_it_read(tmp_dir: Path) -> None:
    """Empty store-named files: the C scan allocated 6,800 bytes for each and kept them all (68 MB here)."""
    count = 10_000
    # On tmpfs where there is one: creating and removing that many files on a busy disk takes seconds.
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else tmp_dir) as where:
        directory = Path(where)
        for i in range(count):
            (directory / f"nixl.{i}.1.0.mmap").touch()
        growth = {}
        for path in ("c", "python"):
            done = subprocess.run([sys.executable, "-c", _PEAK_GROWTH, where, path], cwd=PROJECT_ROOT,
                                  capture_output=True, text=True, timeout=120, check=True)
            listed, growth[path] = map(int, done.stdout.split())
            assert listed == count
    assert growth["c"] <= growth["python"] + 8, growth  # MiB


def test_the_first_batch_read_with_the_listing_is_the_same_on_both_paths(tmp_dir: Path, make_writer) -> None:
    """scan(directory, first) reads about ``first`` stores with the listing, never separating two stores of one
    pid (batch_end), in C as in the twin; a later batch is read by name."""
    seed = make_writer(agent_name="seed")
    template = seed.path.read_bytes()
    seed.close()
    seed.path.unlink()
    for pid, marker in ((7, 1), (7, 2), (7, 3), (70, 1), (8, 1), (8, 2), (9, 1)):
        (tmp_dir / f"nixl.{pid}.{marker}.0.mmap").write_bytes(template)
    for first in range(-1, 12):
        names, from_c = _c.scan(tmp_dir, first)
        python_names, from_python = S.scan_python(tmp_dir, first)
        assert names == python_names == sorted(names)
        assert [tuple(S.Entry._make(e)) for e in from_c] == [tuple(e) for e in from_python]
        assert len(from_c) == S.batch_end(names, 0, first)
    names = _c.scan(tmp_dir, 0)[0]
    # "nixl.7.1", "nixl.7.2", "nixl.7.3" | "nixl.70.1" | "nixl.8.1", "nixl.8.2" | "nixl.9.1"
    assert [S.batch_end(names, 0, n) for n in (1, 2, 3, 4, 5, 7, 8)] == [3, 3, 3, 4, 6, 7, 7]
    assert [tuple(S.Entry._make(e)) for e in _c.read(tmp_dir, names[3:6])] == \
        [tuple(e) for e in S.read_python(tmp_dir, names[3:6])]
