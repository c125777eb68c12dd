"""The exposition's C fill (store/_render.c) against the Renderer's Python loop, byte for byte.

Stores are forged with every spelling a number can take (small, around 2**53,
up to 2**64 - 1, 16-digit roundings that carry), labels that need
escaping or hold a '%', no local_rank, no bucket at all, in both formats.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
from array import array
from pathlib import Path

import pytest
from conftest import PROJECT_ROOT
from support_forge import cpp_u64_as_double, store_bytes
from support_native import c_speedup

import app.exposition as X
from store import layout as L
from store.reader import Snapshot, decode

c_module = c_speedup("_render")
c_render = c_module.render

_EDGES = [0, 1, 999_999, 1_000_000, 2**53 - 1, 2**53, 2**53 + 1, 2**53 + 2, 10**16, 10**16 + 2, 2**63,
          2**64 - 2048, 2**64 - 1025, 2**64 - 1024, 2**64 - 1, 99_999_999_999_999_999, 9_999_999_999_999_999_999,
          12_345_678_901_234_567_168]


def forged(rng: random.Random, i: int, bucket_max: int = 2**48) -> Snapshot:
    bounds = () if i % 7 == 0 else tuple(float(b) * 2.5 for b in range(1, rng.randint(2, L.MAX_BUCKETS + 1)))
    slots = L.SLOT_COUNT

    def value() -> int:
        r = rng.random()
        return rng.choice(_EDGES) if r < 0.3 else rng.randint(0, 2**64 - 1) if r < 0.5 else rng.randint(0, 10**6)

    name = 'odd %d %s %% "quoted" back\\slash\nnewline' if i % 5 == 0 else f"rank-{i}"
    data = store_bytes(1000 + i, i, name, "host-%", "" if i % 3 == 0 else str(i % 8), bounds,
                       [value() for _ in range(slots)], [value() for _ in range(slots)],
                       [rng.randint(0, bucket_max) for _ in range(slots * L.BUCKET_SLOTS)],
                       [value() for _ in range(slots)])
    snap = decode(data, Path(f"/nowhere/nixl.{1000 + i}.1.{i}.mmap"))
    assert isinstance(snap, Snapshot)
    return snap


def render_with(native: object, snaps: list[Snapshot], openmetrics: bool, monkeypatch) -> bytes:
    """The Renderer with the C fill (``c_module``) or without it (None), whatever the environment chose."""
    with monkeypatch.context() as m:
        m.setattr(X, "_native", native)
        return X.Renderer().render(snaps, openmetrics)


@pytest.mark.parametrize("openmetrics", [False, True])
def test_c_and_python_render_the_same_bytes(openmetrics: bool, monkeypatch) -> None:
    rng = random.Random(12)
    snaps = [forged(rng, i) for i in range(40)]
    rendered = render_with(c_module, snaps, openmetrics, monkeypatch)
    assert rendered == render_with(None, snaps, openmetrics, monkeypatch)
    assert b'agent_name="odd %d %s %% \\"quoted\\" back\\\\slash\\nnewline"' in rendered


def test_every_u64_is_spelt_as_prometheus_cpp_spells_its_double() -> None:
    rng = random.Random(3)
    values = _EDGES + [rng.randint(2**53, 2**64 - 1) for _ in range(2000)]
    for value in values:
        words = array("Q", bytes(L.STORE_SIZE))
        words[0] = value
        out = c_render(((0, (0,)),), [words], [1], [(b"v %d\n",)])
        assert out == (f"v {cpp_u64_as_double(value)}\n".encode(),), value


def test_a_cumulative_count_past_2_64_is_left_to_the_python_loop(monkeypatch) -> None:
    rng = random.Random(5)
    snaps = [forged(rng, i, bucket_max=2**64 - 1) for i in range(1, 4)]
    words_of = [s.words for s in snaps]
    smalls = [X._RankLines(s).small for s in snaps]
    assert c_render(X._PLAN, words_of, [len(s.bounds) + 1 for s in snaps], smalls) is None
    rendered = render_with(c_module, snaps, False, monkeypatch)
    assert rendered == render_with(None, snaps, False, monkeypatch)
    assert any(int(line.rsplit(b" ", 1)[1]) >= 2**64 for line in rendered.splitlines() if b"_bucket{" in line)


def test_malformed_arguments_raise_instead_of_reading_past_a_store() -> None:
    words = array("Q", bytes(L.STORE_SIZE))
    with pytest.raises(ValueError):
        c_render(((1, (L.STORE_WORDS - 2, 0)),), [words], [4], [(b"%d %d %d %d %d %d\n",)])
    with pytest.raises(ValueError):
        c_render(((0, (L.STORE_WORDS,)),), [words], [1], [(b"%d\n",)])
    with pytest.raises(ValueError):
        c_render(((0, (0,)),), [array("Q", [1, 2])], [1], [(b"%d\n",)])
    # A template with more placeholders than values is a bug: the loop (which raises) is left to say so.
    assert c_render(((0, (0,)),), [words], [1], [(b"%d %d\n",)]) is None


def test_words_that_are_not_8_byte_aligned_are_refused() -> None:
    misaligned = memoryview(bytearray(L.STORE_SIZE + 8))[1:L.STORE_SIZE + 1]
    with pytest.raises(ValueError, match="a malformed store"):
        c_render(((0, (0,)),), [misaligned], [1], [(b"%d\n",)])


# Another thread drops the templates (the only references to them) while render() fills them without the
# GIL.  They are 256 KiB each, so that malloc maps each one apart and free unmaps it: a template read after
# its release is a crash, not stale bytes.
_DROPPED_TEMPLATES = textwrap.dedent("""
    import sys, threading
    from array import array
    from store import _render

    sys.setswitchinterval(5)  # the dropping thread runs when render() lets the GIL go, not before
    STORES, SIZE = 32, 256 * 1024
    words = [array("Q", bytes(6800)) for _ in range(STORES)]
    for i, w in enumerate(words):
        w[0] = i
    go = threading.Event()

    def drop(templates):
        go.wait()
        for i in reversed(range(len(templates))):
            templates[i] = None

    for _ in range(10):
        templates = [(b"x" * SIZE + b" %d\\n",) for _ in range(STORES)]
        thread = threading.Thread(target=drop, args=(templates,))
        thread.start()
        go.set()
        body = _render.render(((0, (0,)),), words, [1] * STORES, templates)
        thread.join()
        go.clear()
        assert body == (b"".join(b"x" * SIZE + b" %d\\n" % i for i in range(STORES)),)
    print("filled")
""")


def test_templates_dropped_by_another_thread_during_the_fill_are_not_freed_under_it() -> None:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
    done = subprocess.run([sys.executable, "-c", _DROPPED_TEMPLATES], cwd=PROJECT_ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout.strip()) == (0, "filled"), done.stderr


@pytest.mark.parametrize("native", [c_module, None], ids=["c", "python"])
@pytest.mark.parametrize("openmetrics", [False, True])
@pytest.mark.parametrize("piece_bytes", [1, 3000, X.Exposition.PIECE_BYTES])
def test_a_body_rendered_batch_by_batch_is_the_body_rendered_at_once(native: object, openmetrics: bool,
                                                                     piece_bytes: int, monkeypatch) -> None:
    """A scrape renders its stores a batch at a time, each batch into one piece per family (joined as they add
    up to ``piece_bytes``); joined, the pieces are the exposition of all the stores at once, whatever the cuts (a
    batch of one, of all, empty ones)."""
    rng = random.Random(21)
    snaps = [forged(rng, i) for i in range(30)]
    tail = b'nixl_prometheus_mp_ranks{state="live"} 30\n'
    monkeypatch.setattr(X, "_native", native)
    monkeypatch.setattr(X.Exposition, "PIECE_BYTES", piece_bytes)
    whole = X.Renderer().render(snaps, openmetrics, tail)
    assert whole.endswith(tail + (b"# EOF\n" if openmetrics else b""))
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(snaps) + 1), rng.randint(0, 8)))
        body = X.Renderer().exposition(openmetrics)
        for start, end in zip([0, *cuts], [*cuts, len(snaps)], strict=True):
            body.add(snaps[start:end])
        pieces = body.finish(tail)
        assert all(isinstance(piece, bytes) for piece in pieces)
        assert b"".join(pieces) == whole, cuts


def test_a_body_without_stores_is_the_tail_alone() -> None:
    """No store, no family header (as prometheus_client writes an empty registry)."""
    assert X.Renderer().exposition(False).finish(b"tail\n") == (b"tail\n",)
    assert X.Renderer().exposition(True).finish(b"tail\n") == (b"tail\n", b"# EOF\n")


def test_the_template_cache_keeps_what_the_last_scrape_saw_and_at_most_its_cap(monkeypatch) -> None:
    rng = random.Random(8)
    snaps = [forged(rng, i) for i in range(12)]
    renderer = X.Renderer()
    monkeypatch.setattr(renderer, "CACHE_MAX", 8)
    expected = renderer.render(snaps)
    assert len(renderer._cache) == 8  # the stores beyond the cap get templates made for the scrape alone
    assert renderer.render(snaps) == expected  # cached or not, the same lines
    renderer.render(snaps[:3])  # the others departed and were reaped: forgotten
    assert set(renderer._cache) == {snap.identity_key for snap in snaps[:3]}
