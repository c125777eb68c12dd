"""Helpers of the reliability suite (tests/test_reliability_*.py).

A *workload rank* records a deterministic mix of every kind of event from several threads and keeps, beside
the store, its own tally of what it recorded (counters, last gauge values, histogram buckets and sums),
computed independently of the store.  It answers each command with that tally, so a test can compare what a
scrape publishes with what was recorded, exactly, per process.

Commands, one JSON object per line on stdin, one JSON answer per line on stdout:

- ``{"op": "run", "threads": M, "k": K, "seed": S, "tag": T, "fork_k": F}``: M threads record K iterations
  each, then the main thread records one known final value per gauge event (tag T), so the last gauge values
  are deterministic.  With ``fork_k`` > 0 the process forks while its threads are recording; the child
  records F iterations on its own, answers ``{"child": pid, "tally": ...}`` and exits.
- ``{"op": "trickle", "hz": H}`` / ``{"op": "untrickle"}``: a thread exporting AGENT_TX_REQUESTS_NUM=1 at H Hz
  (what makes a writer re-run the election).
- ``{"op": "spin", "threads": M}`` / ``{"op": "unspin"}``: M threads recording as fast as they can.
- ``{"op": "status"}``, ``{"op": "exit"}``.
"""

from __future__ import annotations

import contextlib
import json
import os
import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from support import START_DEADLINE_S, RankProcess, Reaper, SeriesKey, start_rank

from app.exposition import format_bound
from store.metrics import COUNTER_FAMILIES, GAUGE_FAMILIES, HISTOGRAM_FAMILIES, error_status

IDENTITY_LABELS = frozenset({"hostname", "agent_name", "pid", "agent_instance", "local_rank"})

WORKLOAD_RANK_SCRIPT = textwrap.dedent("""
    import bisect, json, logging, os, sys, threading
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    from app import Exporter
    from store import EventType as E
    from store.metrics import ERROR_EVENTS, GAUGE_EVENTS, HISTOGRAM_EVENTS

    exp = Exporter(os.environ.get("RANK_AGENT", "agent"))
    BOUNDS = exp.config.buckets
    HIST = sorted(int(e) for e in HISTOGRAM_EVENTS)
    GAUGES = sorted(int(e) for e in GAUGE_EVENTS)
    out_lock = threading.Lock()

    class Tally:
        def __init__(self):
            self.counters = [0] * len(E)
            self.gauges = [0] * len(E)
            self.buckets = {ev: [0] * (len(BOUNDS) + 1) for ev in HIST}
            self.sums = {ev: 0 for ev in HIST}

        def add(self, ev, value):
            ev = int(ev)
            self.counters[ev] += value
            self.gauges[ev] = value
            if ev in self.sums:
                self.buckets[ev][bisect.bisect_left(BOUNDS, value)] += 1
                self.sums[ev] += value

        def merge(self, other):
            for i, v in enumerate(other.counters):
                self.counters[i] += v
            for ev in HIST:
                self.sums[ev] += other.sums[ev]
                for i, v in enumerate(other.buckets[ev]):
                    self.buckets[ev][i] += v

        def doc(self):
            return {"counters": self.counters, "gauges": self.gauges,
                    "buckets": {str(ev): b for ev, b in self.buckets.items()},
                    "sums": {str(ev): s for ev, s in self.sums.items()}}

    total = Tally()

    def reply(doc):
        data = (json.dumps(doc) + "\\n").encode()
        with out_lock:
            os.write(1, data)

    def work(tally, t, k, seed, progress=None):
        for i in range(k):
            x = seed * 1000003 + t * 7919 + i
            xfer, post, nbytes, write = x * 37 % 20011 + 1, x * 13 % 311, 1 + x * 7919 % 1048573, x % 2 == 0
            exp.record_transfer(xfer, post, nbytes, write)
            tally.add(E.AGENT_TX_BYTES if write else E.AGENT_RX_BYTES, nbytes)
            tally.add(E.AGENT_TX_REQUESTS_NUM if write else E.AGENT_RX_REQUESTS_NUM, 1)
            tally.add(E.AGENT_XFER_POST_TIME, post)
            tally.add(E.AGENT_XFER_TIME, xfer)
            if i % 16 == 0:
                ev = ERROR_EVENTS[x % len(ERROR_EVENTS)]
                exp.record_error(ev)
                tally.add(ev, 1)
            if i % 50 == 0:
                exp.record_memory_registered(4096 * (x % 97 + 1))
                tally.add(E.AGENT_MEMORY_REGISTERED, 4096 * (x % 97 + 1))
                exp.record_memory_deregistered(4096 * (x % 89 + 1))
                tally.add(E.AGENT_MEMORY_DEREGISTERED, 4096 * (x % 89 + 1))
            if i % 100 == 0:
                exp.export_event(E.AGENT_TELEMETRY_EVENTS_DROPPED, 3)
                tally.add(E.AGENT_TELEMETRY_EVENTS_DROPPED, 3)
            if progress is not None and i == k // 4:
                progress.set()

    def finals(tally, tag):
        # The last value of every gauge, recorded by one thread once the others are done: deterministic.
        for n, ev in enumerate(GAUGES):
            value = tag * 100 + n + 1
            exp.export_event(ev, value)
            tally.add(ev, value)

    def run(cmd):
        threads, k, seed, tag = cmd["threads"], cmd["k"], cmd["seed"], cmd["tag"]
        tallies = [Tally() for _ in range(threads)]
        progress = threading.Event()
        workers = [threading.Thread(target=work, args=(tallies[t], t, k, seed, progress if t == 0 else None))
                   for t in range(threads)]
        for w in workers:
            w.start()
        child = None
        if cmd.get("fork_k"):
            progress.wait(30)
            child = os.fork()
            if child == 0:  # the child: only this thread exists; record on our own, then leave
                try:
                    mine = Tally()
                    work(mine, 99, cmd["fork_k"], seed + 7)
                    finals(mine, tag + 50)
                    os.write(1, (json.dumps({"child": os.getpid(), "serving": exp.serving,
                                             "tally": mine.doc()}) + "\\n").encode())
                    exp.close()
                finally:
                    os._exit(0)
        for w in workers:
            w.join()
        for t in tallies:
            total.merge(t)
        finals(total, tag)
        answer = {"done": True, "pid": os.getpid(), "serving": exp.serving, "tally": total.doc()}
        if child is not None:
            _, status = os.waitpid(child, 0)
            answer["child_pid"], answer["child_status"] = child, status
        reply(answer)

    stop = threading.Event()
    helpers = []

    def trickle(hz, tally):
        while not stop.wait(1.0 / hz):
            exp.export_event(E.AGENT_TX_REQUESTS_NUM, 1)
            tally.add(E.AGENT_TX_REQUESTS_NUM, 1)

    def spin(t, tally):
        seed = 0
        while not stop.is_set():
            work(tally, t, 200, seed)
            seed += 1

    def stop_helpers():
        stop.set()
        for thread, tally in helpers:
            thread.join()
            total.merge(tally)
        helpers.clear()
        stop.clear()

    def start_helpers(target, count, *args):
        for t in range(count):
            tally = Tally()
            thread = threading.Thread(target=target, args=(*args, tally) if target is trickle else (t, tally))
            helpers.append((thread, tally))
            thread.start()

    reply({"ready": True, "pid": os.getpid(), "serving": exp.serving, "store": str(exp.store_path),
           "instance": exp._writer.identity.instance})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "run":
            run(cmd)
        elif op == "trickle":
            start_helpers(trickle, 1, cmd["hz"])
            reply({"trickling": True})
        elif op == "spin":
            start_helpers(spin, cmd["threads"])
            reply({"spinning": True})
        elif op in ("untrickle", "unspin"):
            stop_helpers()
            reply({"stopped": True, "pid": os.getpid(), "serving": exp.serving, "tally": total.doc()})
        elif op == "status":
            reply({"pid": os.getpid(), "serving": exp.serving, "tally": total.doc()})
        elif op == "exit":
            stop_helpers()
            exp.close()
            reply({"exited": True, "tally": total.doc()})
            break
""")


class WorkloadRank:
    """A running WORKLOAD_RANK_SCRIPT process."""

    def __init__(self, process: RankProcess, ready: dict[str, Any]) -> None:
        self.process = process
        self.pid: int = ready["pid"]
        self.serving_at_start: bool = ready["serving"]
        self.store = Path(ready["store"])
        self.instance: int = ready["instance"]

    def send(self, op: str, **fields: Any) -> None:
        self.process.send(json.dumps({"op": op, **fields}))

    def answer(self, timeout: float = 60.0) -> dict[str, Any]:
        return json.loads(self.process.readline(timeout))

    def command(self, op: str, timeout: float = 60.0, **fields: Any) -> dict[str, Any]:
        self.send(op, **fields)
        return self.answer(timeout)


def start_workload_ranks(reaper: Reaper, count: int, directory: Path, port: int,
                         extra_env: Mapping[str, str] | None = None) -> list[WorkloadRank]:
    """Start ``count`` workload ranks at once (they race for the election) and wait until all are ready."""
    processes = []
    for r in range(count):
        env = {"NIXL_TELEMETRY_MULTIPROC_DIR": str(directory), "NIXL_TELEMETRY_PROMETHEUS_PORT": str(port),
               "NIXL_TELEMETRY_PROMETHEUS_LOCAL": "y", "RANK_AGENT": f"rank-{r}", "LOCAL_RANK": str(r),
               **(extra_env or {})}
        processes.append(start_rank(reaper, WORKLOAD_RANK_SCRIPT, env))
    return [WorkloadRank(p, json.loads(p.readline(START_DEADLINE_S))) for p in processes]


# -- expected vs published ----------------------------------------------------------------------------------


def project(samples: Mapping[SeriesKey, float], pid: int) -> dict[SeriesKey, float]:
    """One process's series with the identity labels dropped (le and status kept)."""
    out: dict[SeriesKey, float] = {}
    for (name, labels), value in samples.items():
        if ("pid", str(pid)) in labels:
            key = (name, frozenset((k, v) for k, v in labels if k not in IDENTITY_LABELS))
            assert key not in out, f"pid {pid} published {key} twice"
            out[key] = value
    return out


def expected_series(tally: Mapping[str, Any], bounds: tuple[float, ...]) -> dict[SeriesKey, float]:
    """What a process that recorded ``tally`` must publish (same projection as ``project``)."""
    counters, gauges = tally["counters"], tally["gauges"]
    out: dict[SeriesKey, float] = {}
    for fam in COUNTER_FAMILIES:
        if len(fam.events) == 1:
            out[(fam.name, frozenset())] = counters[fam.events[0]]
        else:
            for ev in fam.events:
                out[(fam.name, frozenset({("status", error_status(ev))}))] = counters[ev]
    for fam in GAUGE_FAMILIES:
        out[(fam.name, frozenset())] = gauges[fam.events[0]]
    les = [format_bound(b) for b in bounds] + ["+Inf"]
    for fam in HISTOGRAM_FAMILIES:
        ev = str(int(fam.events[0]))
        running = 0
        for le, count in zip(les, tally["buckets"][ev], strict=True):
            running += count
            out[(f"{fam.name}_bucket", frozenset({("le", le)}))] = running
        out[(f"{fam.name}_count", frozenset())] = running
        out[(f"{fam.name}_sum", frozenset())] = tally["sums"][ev]
    return {k: float(v) for k, v in out.items()}


def diff(expected: Mapping[SeriesKey, float], actual: Mapping[SeriesKey, float], limit: int = 10) -> list[str]:
    """Human-readable differences between two projections (empty when equal)."""
    lines = []
    for key in sorted(set(expected) | set(actual), key=repr):
        if expected.get(key) != actual.get(key):
            lines.append(f"{key[0]}{dict(key[1])}: expected {expected.get(key)}, published {actual.get(key)}")
    return lines[:limit] + ([f"... {len(lines) - limit} more"] if len(lines) > limit else [])


def vm_status(pid: int) -> dict[str, int]:
    """VmRSS (kB), Threads and open descriptors of a live process."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "Threads"):
                out[key] = int(value.split()[0])
    with contextlib.suppress(OSError):
        out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    return out
