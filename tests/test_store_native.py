"""The C recording path (store._recorder) and its pure-Python twin: selected as documented, and equivalent.

Equivalence is proven on files: the same event sequence (valid events, bad
values and bad types, wrap-around, disabled metrics, odd bucket bounds,
transfers in both directions) is recorded by two real processes, one per
path, through StoreWriter and through Exporter; the stores must be byte for
byte identical (bar the pid and the heartbeat, which differ between any two
processes) and every refused call must raise the same error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import PROJECT_ROOT

import store.native
import store.recorders
from store import layout as L

REQUIRED = os.environ.get("CI_REQUIRE_SPEEDUPS") == "1"

# One process's recording; prints which path it ran and what each refused call raised.
_SCRIPT = textwrap.dedent("""
    import json, os, random, sys
    import store.recorders
    from store import EventType, StoreIdentity, StoreWriter
    from app import Exporter

    U64 = 2**64 - 1
    directory = sys.argv[1]
    enabled = {e for e in EventType if e not in (EventType.AGENT_RX_BYTES, EventType.AGENT_XFER_POST_TIME,
                                                  EventType.AGENT_ERR_BACKEND)}
    bounds = (0.5, 1.0, 10.5, 99.9, 1000.0, 2.0**64, 1e30)
    writers = [StoreWriter(directory, StoreIdentity("w-all", "h", "0", 10, bounds)),
               StoreWriter(directory, StoreIdentity("w-some", "h", "1", 11, bounds), enabled)]
    exp = Exporter("exp")
    rng = random.Random(int(sys.argv[2]))
    values = [0, 1, 2, 10, 11, 99, 100, 1000, 1001, 2**63, U64 - 3, U64,
              -1, 2**64, 1.0, True, "5", None, EventType.AGENT_RX_BYTES]
    events = list(EventType) + [int(e) for e in EventType] + [21, -1, True, 1.0, "AGENT_TX_BYTES", None]
    flags = [True, False, True, False, "no", 1, None]
    errors = []

    def attempt(call, *args):
        try:
            call(*args)
        except (TypeError, ValueError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")

    for _ in range(3000):
        for rec, transfer in [(w.record, w.record_transfer) for w in writers] + [
                (exp.export_event, exp.record_transfer)]:
            if rng.random() < 0.3:
                attempt(transfer, rng.choice(values), rng.choice(values), rng.choice(values), rng.choice(flags))
            else:
                attempt(rec, rng.choice(events), rng.choice(values))
    for w in writers:
        w.close()
    exp.close()
    print(json.dumps({"native": store.recorders.NATIVE is not None,
                      "exporter_store": type(exp._store).__name__ if hasattr(exp, "_store") else None,
                      "stores": sorted(os.listdir(directory)), "errors": errors}))
""")


def _run(directory: Path, pure_python: bool, seed: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NIXL_", "PROMETHEUS_"))}
    env.update(NIXL_TELEMETRY_MULTIPROC_DIR=str(directory), NIXL_TELEMETRY_PROMETHEUS_PORT="1",
               NIXL_TELEMETRY_PROMETHEUS_LOCAL="y",
               NIXL_TELEMETRY_ENABLED_METRICS="agent_tx_*,agent_rx_requests*,agent_xfer_time*,agent_err_*")
    if pure_python:
        env["NIXL_PROMETHEUS_MP_PURE_PYTHON"] = "1"
    done = subprocess.run([sys.executable, "-c", _SCRIPT, str(directory), str(seed)], cwd=PROJECT_ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def _comparable(path: Path) -> bytes:
    """The store without the pid and the heartbeat (they differ between any two processes)."""
    data = bytearray(path.read_bytes())
    for offset, size in (L.PID_FIELD, L.LAST_UPDATE_FIELD):
        data[offset:offset + size] = bytes(size)
    return bytes(data)


@pytest.mark.parametrize("seed", [1, 2])
def test_c_and_python_paths_write_identical_stores_and_raise_identical_errors(tmp_path: Path, seed: int) -> None:
    if store.recorders.NATIVE is None and not REQUIRED:
        pytest.skip("store._recorder is not built: nothing to compare the Python path with")
    c_dir, py_dir = tmp_path / "c", tmp_path / "py"
    c_dir.mkdir(mode=0o700)
    py_dir.mkdir(mode=0o700)
    c_run, py_run = _run(c_dir, False, seed), _run(py_dir, True, seed)
    assert c_run["native"] and c_run["exporter_store"] == "Store"
    assert not py_run["native"]
    assert c_run["errors"] == py_run["errors"]
    assert len(set(c_run["errors"])) > 10  # the sequence really exercised the refusals
    c_stores = sorted(c_dir.glob("*.mmap"), key=lambda p: p.name.rsplit(".", 2)[-2])  # by agent_instance
    py_stores = sorted(py_dir.glob("*.mmap"), key=lambda p: p.name.rsplit(".", 2)[-2])
    assert len(c_stores) == len(py_stores) == 3
    for c_store, py_store in zip(c_stores, py_stores, strict=True):
        assert _comparable(c_store) == _comparable(py_store), (c_store.name, py_store.name)
    wrapped = memoryview(c_stores[0].read_bytes()).cast("Q")
    assert any(wrapped[L.W_COUNTERS + ev] < 2**63 for ev in range(L.SLOT_COUNT))  # sanity: values were written


def test_pure_python_environment_forces_the_python_path(tmp_path: Path) -> None:
    directory = tmp_path / "d"
    directory.mkdir(mode=0o700)
    env = {k: v for k, v in os.environ.items() if not k.startswith("NIXL_")}
    env["NIXL_PROMETHEUS_MP_PURE_PYTHON"] = "1"
    code = ("import store.recorders, app.rank.recording as r; "
            "print(store.recorders.NATIVE is None, r.Recording is r.PyRecording)")
    done = subprocess.run([sys.executable, "-c", code], cwd=PROJECT_ROOT, env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.stdout.split() == ["True", "True"], done.stderr


def test_extension_is_loaded_where_ci_requires_it(tmp_path: Path) -> None:
    """CI (CI_REQUIRE_SPEEDUPS=1) fails here if the default run silently fell back to the Python path."""
    if not REQUIRED:
        pytest.skip("CI_REQUIRE_SPEEDUPS is not 1")
    assert not store.native.pure_python_forced()
    assert store.recorders.NATIVE is not None, "store._recorder was not built or not loadable"
    import app.rank.recording

    assert app.rank.recording.Recording is not app.rank.recording.PyRecording


@pytest.mark.parametrize("bounds", [(100.0, 10.0), (-5.0, 10.0)])
def test_bounds_the_c_table_cannot_hold_take_the_python_path(tmp_dir: Path, make_writer, bounds) -> None:
    """Unsorted or negative bounds (never from NIXL_TELEMETRY_HISTOGRAM_BUCKETS_US) still place like bisect_left."""
    from bisect import bisect_left

    writer = make_writer(bounds=bounds)
    assert writer.native is None
    for value in (0, 7, 50, 500):
        writer.record(store.recorders.EventType.AGENT_XFER_TIME, value)
    words = memoryview(writer.path.read_bytes()).cast("Q")
    base = L.W_BUCKETS + store.recorders.EventType.AGENT_XFER_TIME * L.BUCKET_SLOTS
    expected = [0] * L.BUCKET_SLOTS
    for value in (0, 7, 50, 500):
        expected[bisect_left([int(b // 1) for b in bounds], value)] += 1
    assert list(words[base:base + L.BUCKET_SLOTS]) == expected


# -- Memory safety of store._recorder under any caller --------------------------------------------
# Each case runs in its own interpreter: without the fix it crashes that interpreter (or leaks), and the
# test fails on its exit status instead of taking the suite down.

_C_PREAMBLE = textwrap.dedent("""
    import mmap, sys
    import store.recorders as W
    from store import EventType, layout as L
    R = W.NATIVE
    assert R is not None, "store._recorder is not loaded"

    def never(*args):
        raise AssertionError("the detached path was taken")

    def attached_store(enabled=EventType):
        buffer = mmap.mmap(-1, L.STORE_SIZE)
        store = R.Store((), W.kinds(set(enabled)), never, never)
        store.attach(buffer)
        return store, buffer
""")


def _run_c_path(code: str) -> str:
    """Run ``code`` (after _C_PREAMBLE) in a fresh interpreter on the C recording path; its stdout."""
    if store.recorders.NATIVE is None and not REQUIRED:
        pytest.skip("store._recorder is not built (or NIXL_PROMETHEUS_MP_PURE_PYTHON=1)")
    env = {k: v for k, v in os.environ.items() if k != "NIXL_PROMETHEUS_MP_PURE_PYTHON"}
    done = subprocess.run([sys.executable, "-c", _C_PREAMBLE + textwrap.dedent(code)], cwd=PROJECT_ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"exit status {done.returncode}\n{done.stderr}"
    return done.stdout


def test_rebinding_the_store_from_a_validator_keeps_the_bound_store_for_the_call() -> None:
    """A value's __index__ that rebinds _store (freeing the Store) and closes its mapping mid-call."""
    out = _run_c_path("""
        class Rec(R.Recording):
            def _on_deadline(self):
                pass

        rec = Rec()
        rec._next_claim_ns = 2**63
        rec._store, current = attached_store()
        recorded_into = []

        class Rebinds:
            def __index__(self):
                global current
                recorded_into.append(current)
                rec._store, current = attached_store()  # drops the last reference to the Store recording this
                try:
                    recorded_into[-1].close()  # and unmaps its buffer, unless that Store still exports it
                except BufferError:
                    pass
                return 5

        rec.export_event(EventType.AGENT_TX_BYTES, Rebinds())
        rec.record_transfer(Rebinds(), 1, 2, True)
        first, second = (memoryview(buffer).cast("Q") for buffer in recorded_into)
        print(first[L.W_COUNTERS + EventType.AGENT_TX_BYTES], second[L.W_SUMS + EventType.AGENT_XFER_TIME])
    """)
    assert out.split() == ["5", "5"]


def test_a_collection_while_a_recordings_store_is_dropped_frees_it_once() -> None:
    """A finalizer run by the Store's release starts a collection while the (heap-subclass) object dies."""
    out = _run_c_path("""
        import gc
        from app.rank.recording import Recording

        class Collects:
            def __del__(self):
                gc.collect()

        def dying():
            collects = Collects()

            def detached(*args, _held=collects):
                return 0

            rec = Recording()
            rec._store = R.Store((), W.kinds(()), detached, detached)
            return rec

        for _ in range(200):
            dying()
        gc.collect()
        print("freed")
    """)
    assert out.split() == ["freed"]


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="None is immortal from Python 3.12: no count to leak")
def test_stores_leak_no_reference_to_none() -> None:
    out = _run_c_path("""
        def cb(*args):
            return 0

        before = sys.getrefcount(None)
        for _ in range(10_000):
            R.Store((), W.kinds(()), cb, cb)  # created and freed
            try:
                R.Store((5, 1), W.kinds(()), cb, cb)  # refused: unsorted
            except ValueError:
                pass
        print(sys.getrefcount(None) - before)
    """)
    assert abs(int(out)) < 100  # a leak is one per Store: 20,000


def test_a_validator_that_returns_instead_of_raising_still_refuses_or_decides() -> None:
    """install() takes any callables: one that returns rather than raises must not leave C without an error."""
    out = _run_c_path("""
        def lenient_event_type(event):
            return 99  # not a slot

        def lenient_direction(is_write):
            return {1: True, 0: False}.get(is_write, is_write)

        R.install(lenient_event_type, W.event_value, lenient_direction)
        store, buffer = attached_store()
        results = []
        for call in (lambda: store.record(1.5, 1), lambda: store.transfer(1, 2, 3, 1),
                     lambda: store.transfer(1, 2, 3, "yes")):
            try:
                call()
                results.append("recorded")
            except Exception as exc:
                results.append(f"{type(exc).__name__}: {exc}")
        words = memoryview(buffer).cast("Q")
        results.append(f"tx={words[L.W_COUNTERS + EventType.AGENT_TX_BYTES]}")
        print("\\n".join(results))
    """)
    assert out.splitlines() == ["ValueError: unknown event type 1.5 (valid: slots 0..20)", "recorded",
                                "TypeError: is_write must be a bool, got str 'yes'", "tx=3"]


def test_a_bound_that_is_not_an_integer_is_refused_as_such() -> None:
    native = store.recorders.NATIVE
    if native is None:
        if REQUIRED:
            pytest.fail("store._recorder is not loaded but CI_REQUIRE_SPEEDUPS=1")
        pytest.skip("store._recorder is not built (or NIXL_PROMETHEUS_MP_PURE_PYTHON=1)")
    with pytest.raises(TypeError, match="'float' object cannot be interpreted as an integer"):
        native.Store((1, 2.5), store.recorders.kinds(()), print, print)
    with pytest.raises(ValueError, match="bounds must be non-negative"):
        native.Store((-1,), store.recorders.kinds(()), print, print)
