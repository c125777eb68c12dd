"""A bounded differential fuzz of the C scan and render (store/_scan.c, store/_render.c) against their twins.

Random directories (stores whole, cut short, grown, corrupted, locked or not; empty files, links, FIFOs,
directories, files of another user, names that are not store names) are scanned by both paths, which must agree
entry for entry; what decodes is rendered by both, which must agree byte for byte; forged stores with every
spelling of a number, and malformed arguments, go to render() directly.  Some rounds scan while another thread
churns the directory, or render while another thread empties the lists render() was given: there only memory
safety is checked (the outcomes are the documented ones), since the two paths do not see the same moments.

The seed is fixed; a time budget bounds the run: NATIVE_FUZZ_SECONDS (3 s by default), which
tests/sanitize/run raises to a minute under AddressSanitizer and UndefinedBehaviorSanitizer.
"""

from __future__ import annotations

import fcntl
import os
import random
import shutil
import threading
import time
from array import array
from pathlib import Path

from test_render import c_module, c_render, forged, render_with
from test_scan import both, c_scan

import app.exposition as X
from store import layout as L
from store import scan as S
from store.reader import Snapshot, decode

SEED = 17
BUDGET_S = float(os.environ.get("NATIVE_FUZZ_SECONDS", "3"))
FOREIGN_UID = 12345
_SIZES = [0, 1, 7, 8, 100, L.STORE_SIZE - 1, L.STORE_SIZE, L.STORE_SIZE + 1, 2 * L.STORE_SIZE]


def _contents(rng: random.Random, template: bytes) -> bytes:
    """A store's bytes, cut, grown or corrupted, or noise."""
    r = rng.random()
    if r < 0.4:
        data = bytearray(template)
        for _ in range(rng.randint(0, 3)):  # in the header (rejected) or in the values (published)
            data[rng.randrange(len(data))] = rng.randrange(256)
        return bytes(data)
    if r < 0.7:
        size = rng.choice(_SIZES)
        return (template * 2)[:size]
    return rng.randbytes(rng.choice(_SIZES))


def random_directory(rng: random.Random, directory: Path, templates: list[bytes]) -> list[int]:
    """Fill ``directory`` with every kind of file a scan meets; the descriptors holding some stores' locks."""
    held = []
    for i in range(rng.randint(0, 24)):
        name = f"nixl.{rng.randint(0, 10**6)}.{rng.choice([1, 17, 10**18])}.{i}.mmap"
        path = directory / name
        kind = rng.random()
        if kind < 0.65:
            path.write_bytes(_contents(rng, rng.choice(templates)))
            if rng.random() < 0.3:
                fd = os.open(path, os.O_RDONLY)
                fcntl.flock(fd, fcntl.LOCK_EX)  # a live writer: the scan's LOCK_SH|LOCK_NB probe fails
                held.append(fd)
            if rng.random() < 0.1 and os.geteuid() == 0:
                os.chown(path, FOREIGN_UID, FOREIGN_UID)
        elif kind < 0.75:
            target = directory / rng.choice(["nixl.1.1.0.mmap", "absent", "."])
            os.symlink(target, path)
        elif kind < 0.85:
            os.mkfifo(path)
        elif kind < 0.92:
            path.mkdir()
        else:  # never a store name: never opened
            (directory / f"{name}{rng.choice(['.staging', 'x', ''])}-not").write_bytes(rng.choice(templates))
    return held


def _scan_and_render(rng: random.Random, directory: Path, templates: list[bytes], monkeypatch) -> None:
    held = random_directory(rng, directory, templates)
    try:
        entries = [S.Entry._make(e) for e in both(directory)]
    finally:
        for fd in held:
            os.close(fd)
    snaps = [snap for e in entries if e.data is not None
             and isinstance(snap := decode(e.data, directory / e.name), Snapshot)]
    for openmetrics in (False, True):
        assert render_with(c_module, snaps, openmetrics, monkeypatch) == \
            render_with(None, snaps, openmetrics, monkeypatch)


def _malformed_render(rng: random.Random) -> None:
    """render() on arguments no Renderer builds: a result or a ValueError/TypeError, never a fault."""
    families = rng.randint(0, 3)
    plan = tuple((rng.choice([0, 1, 1, 2]), tuple(rng.randint(-1, L.STORE_WORDS) for _ in range(rng.choice([1, 2, 3]))))
                 for _ in range(families))
    stores = rng.randint(0, 4)
    words = [array("Q", rng.randbytes(8 * rng.choice([0, 3, L.STORE_WORDS, L.STORE_WORDS]))) for _ in range(stores)]
    buckets = [rng.choice([-1, 0, 1, 5, 33, 62, 63]) for _ in range(stores)]
    pieces = [b"%d", b"%s", b"%%", b"%", b"x", b"\n", b"%x"]
    smalls = [tuple(b"".join(rng.choice(pieces) for _ in range(rng.randint(0, 40))) for _ in range(families))
              for _ in range(stores)]
    try:
        out = c_render(plan, words, buckets, smalls)
    except (ValueError, TypeError, OverflowError):
        return
    assert out is None or (isinstance(out, tuple) and len(out) == families
                           and all(isinstance(lines, bytes) for lines in out))


def _scan_under_churn(rng: random.Random, directory: Path, templates: list[bytes]) -> None:
    stop = threading.Event()

    def churn() -> None:
        churner = random.Random(rng.random())
        while not stop.is_set():
            path = directory / f"nixl.{churner.randint(0, 9)}.1.0.mmap"
            action = churner.random()
            try:
                if action < 0.4:  # as writers publish (never opening what may be a FIFO by now)
                    staging = directory / "staging"
                    staging.write_bytes(churner.choice(templates))
                    staging.replace(path)
                elif action < 0.6:
                    os.truncate(path, churner.choice(_SIZES))
                elif action < 0.8:
                    os.unlink(path)
                else:
                    os.mkfifo(path)
            except OSError:
                pass

    thread = threading.Thread(target=churn)
    thread.start()
    try:
        for _ in range(20):
            for entry in map(S.Entry._make, c_scan(directory)):
                assert entry.outcome in (S.OK, S.MISSING, S.NOT_REGULAR, S.SHORT), entry
                assert (entry.data is None) == (entry.outcome not in (S.OK, S.SHORT))
    finally:
        stop.set()
        thread.join(timeout=30)


def _render_while_the_lists_are_emptied(rng: random.Random) -> None:
    snaps = [forged(rng, i) for i in range(rng.randint(1, 6))]
    words_of = [s.words for s in snaps]
    buckets_of = [len(s.bounds) + 1 for s in snaps]
    smalls_of = [X._RankLines(s).small for s in snaps]
    expected = c_render(X._PLAN, list(words_of), list(buckets_of), list(smalls_of))
    go = threading.Event()

    def empty() -> None:
        go.wait()
        smalls_of.clear()
        words_of.clear()

    thread = threading.Thread(target=empty)
    thread.start()
    go.set()
    try:
        out = c_render(X._PLAN, words_of, buckets_of, smalls_of)
    except ValueError:  # emptied before render() took its copies
        out = expected
    finally:
        thread.join(timeout=30)
    assert out == expected


def test_c_scan_and_render_agree_with_their_twins_on_random_input(tmp_path: Path, monkeypatch) -> None:
    rng = random.Random(SEED)
    templates = [forged(rng, i).words.tobytes() for i in range(8)]
    rounds = {"scan": 0, "forged": 0, "malformed": 0, "churn": 0, "emptied": 0}
    deadline = time.monotonic() + BUDGET_S
    n = 0
    while time.monotonic() < deadline or n < 10:
        n += 1
        kind = rng.choices(list(rounds), weights=[5, 3, 5, 1, 1])[0]
        directory = tmp_path / f"round-{n}"
        directory.mkdir(mode=0o700)
        if kind == "scan":
            _scan_and_render(rng, directory, templates, monkeypatch)
        elif kind == "forged":
            snaps = [forged(rng, i, bucket_max=rng.choice([2**20, 2**48, 2**64 - 1])) for i in range(rng.randint(1, 8))]
            openmetrics = rng.random() < 0.5
            assert render_with(c_module, snaps, openmetrics, monkeypatch) == \
                render_with(None, snaps, openmetrics, monkeypatch)
        elif kind == "malformed":
            _malformed_render(rng)
        elif kind == "churn":
            _scan_under_churn(rng, directory, templates)
        else:
            _render_while_the_lists_are_emptied(rng)
        shutil.rmtree(directory)
        rounds[kind] += 1
    assert all(rounds.values()), rounds  # every kind of round ran at least once
