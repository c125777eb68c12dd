"""``python -m bench``: ours vs prometheus_client's multiprocess mode, side by side, one run.

Prints a markdown report (stdout) ready for the README; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from app.config import SERVE_MODES
from bench import pods, scenarios, succession
from bench.common import fmt_ratio, log, machine, median, ratio, table
from bench.scenarios import ONE_CONNECTION_REQUESTS, PLUGIN_SIDES, Results, Settings

SCENARIOS = ("record", "threads", "scrape", "plugin", "busy", "takeover", "succession", "frozen", "respawn", "memory",
             "pods")
FLAT_LIMIT = 1.5
PLUGIN_TARGET = 1.5  # our scrape at least this much faster than the C++ plug-in's, at every size
EOF_LIMIT_S = 0.001  # with Connection: close, the server's EOF at most this long after the body's last byte
# The serving-mode targets judge the default mode; the other modes' figures are reported beside it, for comparison.
JUDGED_MODE = SERVE_MODES[0]
BUSY_LIMIT = 1.3  # a busy rank's scrape at most this much slower than its idle one
STALL_MARGIN_S = 0.002  # the recording loop's longest stall with scrapes at most this much longer than without
FROZEN_LIMIT_S = 1.0  # the worst scrape while the serving rank holds its GIL or is stopped
TAKEOVER_LIMIT_S = 0.5  # from the SIGKILL of the process holding the address to a 200 from another one
RESPAWN_LIMIT_S = 0.5  # from the helper's SIGKILL (its rank alive) to a 200 again


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS),
                        help=f"comma-separated subset of {', '.join(SCENARIOS)} (default: all)")
    parser.add_argument("--ranks", default=None, help="rank counts for the scrape (default 8,64,256,1024)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run that the bench works: 8 ranks, few short repeats (about 30 s; its "
                             "figures are too noisy to judge the targets by)")
    parser.add_argument("--check", action="store_true",
                        help="exit with status 1 when a target is NOT met (after printing the whole report)")
    parser.add_argument("--repeats", type=int, default=None, help="override every scenario's repeat count")
    parser.add_argument("--transfers", type=int, default=None,
                        help="transfers per recording repeat and thread (a multiple of 1000; default 10000)")
    parser.add_argument("--threads", type=int, default=4, help="threads for the concurrent recording (default 4)")
    parser.add_argument("--tmp", default=None, help="where to create the store directories (default: $TMPDIR)")
    parser.add_argument("--json", default=None, help="also write the raw measurements to this file")
    parser.add_argument("--markdown", default=None, help="also write the report to this file")
    return parser.parse_args(argv)


FULL_RANKS = [8, 64, 256, 1024]


def _settings(args: argparse.Namespace) -> Settings:
    ranks = [8] if args.quick else list(FULL_RANKS)
    if args.ranks:
        ranks = [int(r) for r in args.ranks.split(",") if r.strip()]
    s = Settings(ranks=ranks, threads=args.threads, tmp=args.tmp, quick=args.quick)
    if args.quick:
        # Most of a quick run is starting worker processes (about 20 of them): the repeats are as few as
        # still give a median, and prometheus_client's ~11 µs per transfer bounds the recording's length.
        s.record_repeats, s.record_transfers, s.scrape_repeats, s.inproc_repeats, s.takeover_repeats = 3, 1000, 3, 3, 1
        s.plugin_repeats = s.busy_repeats = 3
        s.thread_run_factor = 2
        # The serving-mode scenarios start a few ranks per repetition (and their helpers): one repetition,
        # shorter windows and freezes, still longer than the 1 s the endpoint is given to answer.
        s.busy_window_s, s.frozen_repeats, s.frozen_hold_s, s.frozen_stop_s, s.respawn_repeats = 0.1, 1, 1.5, 1.2, 1
    if args.repeats is not None:
        s.record_repeats = s.scrape_repeats = s.inproc_repeats = s.takeover_repeats = max(1, args.repeats)
        s.plugin_repeats = s.busy_repeats = s.frozen_repeats = s.respawn_repeats = max(1, args.repeats)
    if args.transfers is not None:
        s.record_transfers = max(1000, args.transfers // 1000 * 1000)
    return s


def _ns(value: float) -> str:
    return f"{value:,.0f}"


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:,.1f}" if ms >= 100 else f"{ms:.2f}" if ms >= 1 else f"{ms:.3f}"


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:,.1f}"


_OURS = ("ours: 4 x export_event", "ours: record_transfer", "pure Python: 4 x export_event",
         "pure Python: record_transfer")


def _record_section(results: Results, settings: Settings, threads: int) -> list[str]:
    data = results.record if threads == 1 else results.threads
    if not data:
        return []
    ref = median(data["prometheus_client mp"])
    rows = []
    for name in _OURS:
        ours = median(data[name])
        exact = results.exact.get(f"{name} x{threads}")
        rows.append([name.removeprefix("ours: "), _ns(ours), _ns(ref), fmt_ratio(ratio(ref, ours)),
                     "yes" if exact else "NO" if exact is not None else "-"])
    title = ("Recording one NIXL transfer" if threads == 1
             else f"Recording with {threads} threads at once (one exporter / one process, wall time / transfers)")
    n = len(data["prometheus_client mp"])
    transfers = settings.record_transfers * (1 if threads == 1 else settings.thread_run_factor)
    out = [f"**{title}** (ns per transfer, median of {n} interleaved runs of "
           f"{transfers:,} transfers{' per thread' if threads > 1 else ''}; C path unless "
           "marked pure Python)", "",
           table(["ours", "ours ns", "prometheus_client mp ns (4 inc, 3 set, 2 observe)", "ratio", "totals exact"],
                 rows), ""]
    if "no-op method" in data:
        one, floor = median(data["ours: 1 x export_event"]), median(data["no-op method"])
        out += ["**One call** (ns per call, loop included: `exp.export_event(ev, v)` vs a Python method "
                "`def export_event(self, event, value): pass` called the same way)", "",
                table(["exp.export_event", "no-op method", "ratio"], [[_ns(one), _ns(floor), f"{one / floor:.2f}x"]]),
                ""]
    return out


def _per_rank(entry: dict[str, Any], key: str, count: int) -> float:
    return median(entry[key]) / count


def _scrape_section(results: Results) -> list[str]:
    if not results.scrape:
        return []
    out: list[str] = []
    for mode, title in (("http", "Scrape over HTTP: one GET /metrics on a fresh connection, body read to the "
                                 "end, both apps under the same threaded werkzeug server (ours: MetricsApp; "
                                 "reference: make_wsgi_app over MultiProcessCollector)"),
                        ("inproc", "Scrape in-process: Collector.collect rendering each batch (Renderer.exposition) vs "
                                   "MultiProcessCollector.collect + generate_latest")):
        rows = []
        for count, entry in sorted(results.scrape.items()):
            if not entry[f"{mode}_ours"]:
                continue
            ours, ref = median(entry[f"{mode}_ours"]), median(entry[f"{mode}_ref"])
            rows.append([str(count), _ms(ours), _us(ours / count), _ms(ref), _us(ref / count),
                         fmt_ratio(ratio(ref, ours)), f"{entry['samples_ours']:,} / {entry['samples_ref']:,}",
                         f"{entry['bytes_ours']:,} / {entry['bytes_ref']:,}"])
        if rows:
            out += [f"**{title}** (median)", "",
                    table(["ranks", "ours ms", "ours µs/rank", "reference ms", "reference µs/rank", "ratio",
                           "samples ours / ref", "bytes ours / ref"], rows), ""]
    return out


_PLUGIN_SERVERS = {"ours": "ours: helper (its own process)", "thread": "ours: thread (in the rank)",
                   "cpp": "C++ plug-in"}


def _plugin_servers(entry: dict[str, Any]) -> list[str]:
    """The servers a plug-in entry measured, ours first (``ours``: the default serving mode)."""
    return [side for side in _PLUGIN_SERVERS if entry.get(f"prom_{side}")]


def _ms_or_dash(values: list[float] | None) -> str:
    good = [v for v in values or [] if v == v]  # (NaN: not measurable)
    return _ms(median(good)) if good else "-"


def _plugin_section(results: Results) -> list[str]:
    title = ("**Scrape vs the C++ plug-in** (nixl-cu12 1.5.1, prometheus-cpp/civetweb) over the same live stores, "
             "the servers scraped in turn: GET /metrics, body read to the end, as Prometheus sends it (its Accept "
             "header, Accept-Encoding: gzip) on a fresh connection each time and on one persistent connection per "
             "server (kept across the scrapes, as Prometheus keeps one per target; where a server closes it, the "
             "client connects again and that counts), and plain (no headers) on a fresh connection; ours is an "
             "idle rank's endpoint, in each serving mode (median, interleaved)")
    if results.plugin_missing:
        return [title, "", f"C++ plug-in: {results.plugin_missing}.", ""]
    if not results.plugin:
        return []
    rows, connections = [], []
    for count, e in sorted(results.plugin.items()):
        for side in _plugin_servers(e):
            versus = {kind: fmt_ratio(ratio(median(e[f"{kind}_cpp"]), median(e[f"{kind}_{side}"])))
                      if side != "cpp" and e.get(f"{kind}_{side}") and e.get(f"{kind}_cpp") else "-"
                      for kind in ("prom", "kept", "plain")}
            rows.append([str(count), _PLUGIN_SERVERS[side], _ms_or_dash(e[f"prom_{side}"]), versus["prom"],
                         _ms_or_dash(e.get(f"kept_{side}")), versus["kept"], _ms_or_dash(e[f"plain_{side}"]),
                         versus["plain"], f"{e[f'wire_{side}']:,}" + ("" if e.get(f"gzip_{side}", True)
                                                                      else " (no gzip)"),
                         f"{e[f'bytes_{side}']:,}", f"{e[f'samples_{side}']:,}"])
            if f"one_connection_{side}" in e:
                connections.append([str(count), _PLUGIN_SERVERS[side], f"{e[f'one_connection_{side}']} of "
                                    f"{ONE_CONNECTION_REQUESTS}", _ms_or_dash(e[f"eof_{side}"])])
    out = [title, "", table(["ranks", "server", "fresh: Prometheus ms", "plug-in / this", "persistent: Prometheus "
                             "ms", "plug-in / this", "plain ms", "plug-in / this", "bytes on the wire",
                             "bytes plain", "samples"], rows), ""]
    if connections:
        out += [f"**Connections**: of {ONE_CONNECTION_REQUESTS} GETs sent one after the other on one persistent "
                "client connection, how many the server answered on it before closing it; and, for a GET saying "
                "`Connection: close`, how long after the last byte of the body the client read the server's EOF "
                "(median)", "", table(["ranks", "server", "answered on one connection", "EOF after the body ms"],
                                      connections), ""]
    return out


def _plugin_targets(results: Results) -> list[list[str]]:
    rows = []
    for count, e in sorted(results.plugin.items()):
        ours = [side for side in _plugin_servers(e) if side != "cpp"]
        for kind, how in (("prom", "a fresh connection each"), ("kept", "one persistent connection per server")):
            if not all(e.get(f"{kind}_{side}") for side in ours):
                continue
            r = {_side_mode(side): ratio(median(e[f"{kind}_cpp"]), median(e[f"{kind}_{side}"])) for side in ours}
            name = f"scrape of {count} ranks >= {PLUGIN_TARGET}x faster than the C++ plug-in (Prometheus's GET, {how})"
            if len(r) == 1:
                rows.append([name, fmt_ratio(r[JUDGED_MODE]), "met" if r[JUDGED_MODE] >= PLUGIN_TARGET else "NOT met"])
            else:
                rows.append([name, _by_mode({mode: f"{x:.2f}x" for mode, x in r.items()}),
                             _verdict({mode: x >= PLUGIN_TARGET for mode, x in r.items()})])
    measured = [e for e in results.plugin.values() if "one_connection_ours" in e]
    if measured:
        ours = [side for side in _plugin_servers(measured[0]) if side != "cpp"]
        eof = {side: max(median(e[f"eof_{side}"]) for e in measured) for side in [*ours, "cpp"]}
        rows.append([f"the server closes <= {EOF_LIMIT_S * 1e3:g} ms after the body (Connection: close; median, "
                     "worst size)", _by_mode({_side_mode(side): f"{_ms(eof[side])} ms" for side in ours})
                     + f" (plug-in {_ms(eof['cpp'])} ms)",
                     _verdict({_side_mode(side): eof[side] <= EOF_LIMIT_S for side in ours})])
        kept = {side: min(e[f"one_connection_{side}"] for e in measured) for side in [*ours, "cpp"]}
        rows.append([f"{ONE_CONNECTION_REQUESTS} of {ONE_CONNECTION_REQUESTS} GETs answered on one persistent "
                     "connection (fewest, over the sizes)", _by_mode({_side_mode(side): str(kept[side])
                                                                     for side in ours})
                     + f" (plug-in {kept['cpp']})",
                     _verdict({_side_mode(side): kept[side] == ONE_CONNECTION_REQUESTS for side in ours})])
    return rows


def _side_mode(side: str) -> str:
    return next((mode for mode, key in PLUGIN_SIDES.items() if key == side), side)


def _ms_spread(values: list[float]) -> str:
    """Median / worst, in ms."""
    return f"{_ms(median(values))} / {_ms(max(values))}" if values else "-"


_MODE_LABELS = {"helper": "helper (its own process)", "thread": "thread (in the rank)"}


def _busy_section(results: Results, settings: Settings) -> list[str]:
    if not results.busy:
        return []
    rows = []
    for count, e in sorted(results.busy.items()):
        for mode in SERVE_MODES:
            idle, busy = median(e[f"idle_{mode}"]), median(e[f"busy_{mode}"])
            rss = f"{e['helper_rss_kib'] / 1024:,.1f}" if mode == "helper" and "helper_rss_kib" in e else "-"
            rows.append([str(count), _MODE_LABELS.get(mode, mode), _ms(idle), _ms(busy), f"{busy / idle:.1f}x",
                         _ms_spread(e[f"stall_{mode}"]), _ms_spread(e[f"quiet_{mode}"]), rss])
    return [f"**Busy rank**: the serving rank scraped (as Prometheus scrapes) while one thread of it calls "
            "record_transfer flat out, vs the same rank idle (alternating), in each serving mode; the stalls are "
            f"the recording loop's longest gap between two iterations in a {settings.busy_window_s:g} s window "
            f"with a scrape every {settings.busy_scrape_every_s * 1e3:g} ms, and in the equal window after it "
            "without scrapes (median / worst of the run)", "",
            table(["ranks", "serving", "idle ms", "busy ms", "busy / idle", "stall with scrapes ms",
                   "stall without ms", "helper RSS MiB"], rows), ""]


def _takeover_section(results: Results, settings: Settings) -> list[str]:
    if not results.takeover and not results.takeover_failures:
        return []
    rows = []
    for mode in SERVE_MODES:
        t = sorted(results.takeover.get(mode, []))
        failed = results.takeover_failures.get(mode, 0)
        rows.append([_MODE_LABELS.get(mode, mode), f"{len(t)} (+{failed} failed)" if failed else str(len(t)),
                     _ms(median(t)) if t else "-", _ms(t[0]) if t else "-", _ms(t[-1]) if t else "-"])
    return [f"**Takeover**: the process holding the address (the address server; in thread mode the serving rank) "
            f"is SIGKILLed while a writer exports {settings.takeover_rate:g} events/s; time from the kill to the "
            "first 200 on /metrics from another process (polled every ms)", "",
            table(["serving", "repetitions", "median ms", "min ms", "max ms"], rows), ""]


def _frozen_section(results: Results, settings: Settings) -> list[str]:
    if not results.frozen:
        return []
    rows = [[_MODE_LABELS.get(mode, mode), str(len(results.frozen[mode]["gil"])),
             _s_spread(results.frozen[mode]["gil"]), _s_spread(results.frozen[mode]["stop"])]
            for mode in SERVE_MODES if mode in results.frozen]
    return [f"**Frozen rank**: the slowest GET /metrics (scraped every {settings.frozen_scrape_every_s * 1e3:g} "
            "ms, as Prometheus scrapes) under way while the serving rank, exporting "
            f"{settings.takeover_rate:g} events/s, keeps its GIL in one {settings.frozen_hold_s:g} s C call in its "
            "main thread (ctypes.PyDLL usleep), and "
            f"while it is SIGSTOPped for {settings.frozen_stop_s:g} s; both modes frozen at once, each scraped "
            "from its own thread (median of the repetitions' worst / the worst of the run)", "",
            table(["serving", "repetitions", "GIL held: worst scrape s", "stopped: worst scrape s"], rows), ""]


def _s_spread(values: list[float]) -> str:
    """Median / worst, in s (inf: a scrape failed)."""
    return f"{median(values):.3f} / {max(values):.3f}" if values else "-"


def _respawn_section(results: Results, settings: Settings) -> list[str]:
    if not results.respawn and not results.respawn_failures:
        return []
    rows = [[f"{kind} ({settings.takeover_rate:g} events/s)" if kind == "recording" else kind,
             str(len(e["served"])), _ms_spread(e["served"]), _ms_spread(e["helper"])]
            for kind, e in results.respawn.items()]
    failed = f" ({results.respawn_failures} repetitions failed)" if results.respawn_failures else ""
    return [f"**Helper killed alone**: the serving helper is SIGKILLed while its rank lives; time from the kill to "
            f"the first 200 on /metrics (polled every {settings.respawn_scrape_every_s * 1e3:g} ms), and to a new "
            f"helper serving (/healthz: serving helper, another server_pid; median / worst){failed}", "",
            table(["rank", "repetitions", "served again ms", "new helper serving ms"], rows), ""]


def _helper_cost_section(results: Results) -> list[str]:
    if not results.helper_start:
        return []
    rows = [["start: an Exporter's construction to /healthz saying serving helper",
             f"{_ms(median(results.helper_start))} ms (min {_ms(min(results.helper_start))}, max "
             f"{_ms(max(results.helper_start))}, {len(results.helper_start)} starts)"]]
    if results.helper_rss_kib:
        rows.append(["RSS (VmRSS) serving one rank, after a scrape",
                     f"{median(results.helper_rss_kib) / 1024:,.1f} MiB ({len(results.helper_rss_kib)} helpers)"])
    rows += [[f"RSS (VmRSS) serving {count} ranks, after the busy scenario's scrapes",
              f"{e['helper_rss_kib'] / 1024:,.1f} MiB"]
             for count, e in sorted(results.busy.items()) if "helper_rss_kib" in e]
    return ["**The serving helper's cost** (medians over every helper the scenarios started)", "",
            table(["", "helper"], rows), ""]


def _memory_section(results: Results) -> list[str]:
    m = results.memory
    if not m:
        return []
    rows = [
        ["files per rank", "1", f"{m['ref_files_per_rank']:g}"],
        ["bytes per rank (st_size)", f"{m['ours_size_per_rank']:,.0f}", f"{m['ref_size_per_rank']:,.0f}"],
        ["bytes per rank on disk (st_blocks x 512)", f"{m['ours_blocks_per_rank']:,.0f}",
         f"{m['ref_blocks_per_rank']:,.0f}"],
        [f"serving process RSS after a scrape of {m['ranks']} ranks (idle before)",
         f"{m['ours_rss_kib'] / 1024:,.1f} MiB ({m['ours_rss_idle_kib'] / 1024:,.1f})",
         f"{m['ref_rss_kib'] / 1024:,.1f} MiB ({m['ref_rss_idle_kib'] / 1024:,.1f})"],
        ["serving process peak RSS (VmHWM)", f"{m['ours_hwm_kib'] / 1024:,.1f} MiB",
         f"{m['ref_hwm_kib'] / 1024:,.1f} MiB"],
    ]
    return [f"**Memory** (store directory on {results.fs})", "", table(["", "ours", "prometheus_client mp"], rows),
            ""]


def _verdict(ok: dict[str, bool]) -> str:
    """The judged mode's verdict, the other modes' in brackets (lower case: they never fail --check)."""
    others = ", ".join(f"{mode} mode: {'met' if good else 'not met'}" for mode, good in ok.items()
                       if mode != JUDGED_MODE)
    return ("met" if ok.get(JUDGED_MODE) else "NOT met") + (f" ({others})" if others else "")


def _by_mode(figures: dict[str, str]) -> str:
    return "; ".join(f"{mode} {figure}" for mode, figure in figures.items())


def _serving_targets(results: Results, settings: Settings) -> list[list[str]]:
    rows = []
    for count, e in sorted(results.busy.items()):
        r = {mode: median(e[f"busy_{mode}"]) / median(e[f"idle_{mode}"]) for mode in SERVE_MODES}
        rows.append([f"busy rank's scrape of {count} ranks <= {BUSY_LIMIT:g}x its idle time (median)",
                     _by_mode({mode: f"{x:.2f}x" for mode, x in r.items()}),
                     _verdict({mode: x <= BUSY_LIMIT for mode, x in r.items()})])
    for count, e in sorted(results.busy.items()):
        pairs = {mode: (median(e[f"stall_{mode}"]), median(e[f"quiet_{mode}"])) for mode in SERVE_MODES}
        rows.append([f"busy rank's recording stall with scrapes <= {STALL_MARGIN_S * 1e3:g} ms more than without "
                     f"({count} ranks, median)",
                     _by_mode({mode: f"{_ms(w)} vs {_ms(wo)} ms" for mode, (w, wo) in pairs.items()}),
                     _verdict({mode: w <= wo + STALL_MARGIN_S for mode, (w, wo) in pairs.items()})])
    for kind, label in (("gil", f"holds its GIL ({settings.frozen_hold_s:g} s C call)"),
                        ("stop", f"is SIGSTOPped ({settings.frozen_stop_s:g} s)")):
        if not results.frozen:
            break
        worst = {mode: max(results.frozen[mode][kind]) for mode in SERVE_MODES}
        rows.append([f"answers within {FROZEN_LIMIT_S:g} s while the serving rank {label} (worst scrape)",
                     _by_mode({mode: f"{x:.3f} s" for mode, x in worst.items()}),
                     _verdict({mode: x <= FROZEN_LIMIT_S for mode, x in worst.items()})])
    if results.takeover or results.takeover_failures:
        med = {mode: median(results.takeover[mode]) if results.takeover.get(mode) else float("inf")
               for mode in SERVE_MODES}
        worst = {mode: max(results.takeover.get(mode, [float("inf")])) for mode in SERVE_MODES}
        rows.append([f"takeover < {TAKEOVER_LIMIT_S:g} s (median; max in brackets)",
                     _by_mode({mode: f"{med[mode] * 1e3:.0f} ms ({worst[mode] * 1e3:.0f} ms)" + (
                         f", {results.takeover_failures[mode]} failed" if results.takeover_failures.get(mode) else "")
                         for mode in SERVE_MODES}),
                     _verdict({mode: med[mode] < TAKEOVER_LIMIT_S and not results.takeover_failures.get(mode)
                               for mode in SERVE_MODES})])
    for kind, e in results.respawn.items():
        served, replaced = median(e["served"]), median(e["helper"])
        ok = served < RESPAWN_LIMIT_S and not results.respawn_failures
        rows.append([f"helper killed alone, {kind} rank: served again < {RESPAWN_LIMIT_S:g} s (median; max in "
                     "brackets)", f"{served * 1e3:.0f} ms ({max(e['served']) * 1e3:.0f} ms); a new helper serves "
                     f"after {replaced * 1e3:.0f} ms" + (f"; {results.respawn_failures} repetitions failed"
                                                          if results.respawn_failures else ""),
                     "met" if ok else "NOT met"])
    if results.respawn_failures and not results.respawn:
        rows.append([f"helper killed alone: served again < {RESPAWN_LIMIT_S:g} s",
                     f"{results.respawn_failures} repetitions failed", "NOT met"])
    return rows


def _targets(results: Results, settings: Settings) -> list[list[str]]:
    rows = []
    if results.record:
        ref = median(results.record["prometheus_client mp"])
        for name, goal in (("ours: 4 x export_event", 25), ("ours: record_transfer", 60)):
            r = ratio(ref, median(results.record[name]))
            rows.append([f"recording a transfer >= {goal}x cheaper ({name.removeprefix('ours: ')})", fmt_ratio(r),
                         "met" if r >= goal else "NOT met"])
        if "no-op method" in results.record:
            r = median(results.record["ours: 1 x export_event"]) / median(results.record["no-op method"])
            rows.append(["one export_event <= 3x a no-op Python method", f"{r:.2f}x", "met" if r <= 3 else "NOT met"])
    if results.threads:
        # The median of each repetition's ratio (its threaded and 1-thread runs are adjacent in time), so
        # that the machine's load drifting over the run cancels out.
        scale = {path: median([many / one for many, one in zip(results.threads[f"{path}: record_transfer"],
                                                              results.threads[f"{path}: record_transfer, 1 thread"],
                                                              strict=True)])
                 for path in ("ours", "pure Python")}
        exact = all(results.exact.values())
        rows.append(["threads scale at least as well as the pure-Python path (record_transfer, "
                     "ns per transfer with N threads / with 1, interleaved), totals exact",
                     f"{scale['ours']:.2f} vs {scale['pure Python']:.2f}, exact: {'yes' if exact else 'NO'}",
                     "met" if scale["ours"] <= scale["pure Python"] and exact else "NOT met"])
    if 64 in results.scrape:
        entry = results.scrape[64]
        for mode, label in (("http", "over HTTP"), ("inproc", "in-process")):
            if entry[f"{mode}_ours"]:
                r = ratio(median(entry[f"{mode}_ref"]), median(entry[f"{mode}_ours"]))
                rows.append([f"scrape of 64 ranks >= 5x cheaper ({label})", fmt_ratio(r),
                             "met" if r >= 5 else "NOT met"])
    counts = sorted(results.scrape)
    if len(counts) >= 2:
        for mode, label in (("inproc", "in-process, max/min over the sizes"),
                            ("http", f"over HTTP, {counts[-1]} ranks vs {counts[0]}")):
            per = {c: _per_rank(results.scrape[c], f"{mode}_ours", c) for c in counts
                   if results.scrape[c][f"{mode}_ours"]}
            if len(per) < 2:
                continue
            spread = max(per.values()) / min(per.values()) if mode == "inproc" else per[counts[-1]] / per[counts[0]]
            rows.append([f"per-rank scrape cost flat within {FLAT_LIMIT}x ({label})", f"{spread:.2f}x",
                         "met" if spread <= FLAT_LIMIT else "NOT met"])
    rows += _plugin_targets(results)
    if results.plugin_missing:
        rows.append([f"scrape >= {PLUGIN_TARGET}x faster than the C++ plug-in", results.plugin_missing, "-"])
    rows += _serving_targets(results, settings)
    rows += succession.targets(results)
    rows += pods.targets(results)
    return rows


def quick_note(settings: Settings) -> str:
    """What a --quick run measured, and that the targets are judged by the full run."""
    sizes = ", ".join(str(r) for r in settings.ranks)
    return (f"A quick run (`--quick`): {sizes} ranks only, {settings.scrape_repeats} repeats per scrape figure, "
            f"{settings.record_transfers:,} transfers per recording repeat, one repetition of each serving-mode "
            "scenario. It shows that the bench works; its figures are too noisy to judge the targets by, and "
            "it measures none of the other sizes. The targets are judged by the full run (`python -m bench "
            f"--check`: {', '.join(str(r) for r in FULL_RANKS)} ranks, every repeat), which says NOT met "
            "wherever a target is missed; here each verdict says \"(quick run)\".")


def report(results: Results, settings: Settings, info: dict[str, str], command: str, elapsed: float,
           targets: list[list[str]]) -> str:
    lines = [
        f"Measured {info['date']} with `{command}` ({elapsed:.0f} s) on {info['nproc']} cores "
        f"({info['cpu']}), {info['implementation']} {info['python']}, Linux {info['kernel']}, "
        f"prometheus_client {info['prometheus_client']}, werkzeug {info['werkzeug']}. The machine was shared "
        f"with other jobs (load average at start {info['load_at_start']}): every figure is a median, ours and "
        "the reference interleaved in the same run, each in its own process.",
        "",
    ]
    if settings.quick:
        lines += [quick_note(settings), ""]
    lines += _record_section(results, settings, 1)
    lines += _record_section(results, settings, settings.threads)
    lines += _scrape_section(results)
    lines += _plugin_section(results)
    lines += _busy_section(results, settings)
    lines += _takeover_section(results, settings)
    lines += succession.section(results)
    lines += pods.section(results)
    lines += _frozen_section(results, settings)
    lines += _respawn_section(results, settings)
    lines += _helper_cost_section(results)
    lines += _memory_section(results)
    if targets:
        lines += ["**Targets**", ""]
        if settings.quick:
            lines += [f"Quick run: {', '.join(str(r) for r in settings.ranks)} ranks only, few repeats; the targets "
                      "are judged by the full run (see the top).", ""]
        lines += [table(["target", "measured", ""], targets), ""]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = _parse(argv)
    chosen = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = set(chosen) - set(SCENARIOS)
    if unknown:
        print(f"unknown scenario(s): {', '.join(sorted(unknown))} (choose from {', '.join(SCENARIOS)})",
              file=sys.stderr)
        return 2
    settings = _settings(args)
    info = machine()
    command = "python -m bench" + ("" if not argv else " " + shlex.join(argv))
    results = Results()
    start = time.monotonic()
    if "record" in chosen:
        scenarios.record(settings, results, threads=1)
    if "threads" in chosen:
        scenarios.record(settings, results, threads=settings.threads)
    if "scrape" in chosen:
        scenarios.scrape(settings, results)
    elif "memory" in chosen:
        settings.ranks = [max(settings.ranks)]
        settings.scrape_repeats = settings.inproc_repeats = 1
        scenarios.scrape(settings, results, with_http=False)
    if "plugin" in chosen:
        scenarios.plugin(settings, results)
    if "busy" in chosen:
        scenarios.busy(settings, results)
    if "takeover" in chosen:
        scenarios.takeover(settings, results)
    if "frozen" in chosen:
        scenarios.frozen(settings, results)
    if "succession" in chosen:
        succession.succession(settings, results)
    if "pods" in chosen:
        pods.pods(settings, results)
    if "respawn" in chosen:
        scenarios.respawn(settings, results)
    if "memory" not in chosen:
        results.memory = {}
    elapsed = time.monotonic() - start
    targets = _targets(results, settings)
    if settings.quick:  # still "NOT met ..." where missed, so that --check still fails on it
        targets = [[name, measured, verdict if verdict == "-" else f"{verdict} (quick run)"]
                   for name, measured, verdict in targets]
    text = report(results, settings, info, command, elapsed, targets)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, "command": command, "settings": asdict(settings),
                                               "results": asdict(results)}, indent=1) + "\n")
    log(f"done in {elapsed:.0f} s")
    unmet = [row[0] for row in targets if row[2].startswith("NOT met")]
    if args.check and unmet:
        log(f"--check: {len(unmet)} target(s) NOT met: {'; '.join(unmet)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
