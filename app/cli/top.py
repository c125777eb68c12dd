"""``python -m app top``: a live per-rank view of a telemetry directory.

What ``nvidia-smi`` and ``htop`` give for GPUs and processes, for the ranks of
a NIXL job: which one moves how many bytes, how fast its transfers complete,
which one errors, which one went quiet.

It is an onlooker.  It reads the stores with the collector's own scan and
rules (liveness by the writer's lock, the stale TTL, duplicate label sets),
but with reaping switched off: it never elects, serves, creates, locks for
longer than a probe, nor changes anything in the directory, and it works
whether or not an owner is serving.

Every figure is over one interval, between two reads of the same store:
rates are the counters' increase divided by the time between the reads
(wrapping at 2**64 as the writers' counters do), p50/p99 are interpolated in
the increase of the ``agent_xfer_time_us`` buckets exactly as Prometheus'
``histogram_quantile`` does, and errors are the increase of the twelve
``agent_errors_total`` counters.  A store that appeared during the interval
has no rates yet (how long it existed is not known), but its errors and
percentiles are exact: a store starts at zero, so all it holds happened in
the interval.

The figures (``Sampler``, ``Row``, ``render``) are apart from the drawing
(``run_live``), which only lays ``render``'s lines out on the terminal.
"""

from __future__ import annotations

import contextlib
import json
import locale
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from app.cli.common import CliError, stale_ttl_of
from app.cli.table import HEADER, align, wrap
from app.collector import Collector, RankView
from app.config import DIR_ENV
from store import EventType
from store import layout as L
from store.metrics import ERROR_EVENTS
from store.reader import Snapshot

if TYPE_CHECKING:
    import curses

_E = EventType
_WRAP = 2**64
_NO_COUNTERS = (0,) * L.SLOT_COUNT
INPUT_POLL_MS = 100  # how long the live view waits for a key before it looks at the clock again


def histogram_quantile(q: float, bounds: Sequence[float], counts: Sequence[int]) -> float | None:
    """The ``q`` quantile of a histogram as Prometheus' ``histogram_quantile`` computes it.

    ``counts`` are per bucket (not cumulative), one per bound then the +Inf
    bucket.  Linear interpolation within the bucket the rank falls in (the
    first bucket's lower bound is 0); a rank in the +Inf bucket gives the
    highest finite bound.  None when there is no observation or no finite
    bucket (where Prometheus answers NaN).
    """
    total = sum(counts)
    if not total or not bounds:
        return None
    rank = q * total
    below = 0
    for i, upper in enumerate(bounds):
        if below + counts[i] >= rank:
            lower = bounds[i - 1] if i else 0.0
            return lower + (upper - lower) * (rank - below) / counts[i]
        below += counts[i]
    return bounds[-1]


@dataclass(frozen=True, slots=True)
class Row:
    """One store's line: who it is, whether it lives, and its figures over the last interval (None: unknown)."""

    store: str
    agent_name: str
    pid: int
    agent_instance: int
    local_rank: str | None
    hostname: str
    state: str  # "live" or "departed"
    ttl_left_s: float | None  # departed only: until an owner reaps it
    seconds_since_update: float
    tx_bytes_per_s: float | None
    rx_bytes_per_s: float | None
    tx_requests_per_s: float | None
    rx_requests_per_s: float | None
    xfer_time_p50_us: float | None
    xfer_time_p99_us: float | None
    errors: int | None
    # For the totals line, not printed: the interval's agent_xfer_time_us bucket increases, and their bounds.
    xfer_counts: tuple[int, ...] | None
    bounds: tuple[float, ...]

    def to_json(self) -> dict[str, Any]:
        """The row for ``--json``: figures to a thousandth (a float's last digits are noise)."""
        doc = asdict(self)
        del doc["xfer_counts"], doc["bounds"]
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in doc.items()}


def make_row(view: RankView, before: Snapshot | None, seconds: float | None) -> Row:
    """``view``'s row, its figures from ``before`` (the same store one interval earlier, None if it is new).

    ``seconds`` is the interval; None on the first look at the directory, when there are no figures yet.
    """
    snap = view.snapshot
    tx = rx = tx_requests = rx_requests = p50 = p99 = None
    errors = counts = None
    if seconds is not None:
        increase = [(new - old) % _WRAP for new, old in zip(snap.counters, before.counters if before
                                                             else _NO_COUNTERS, strict=True)]
        if before is not None:
            tx, rx, tx_requests, rx_requests = (increase[ev] / seconds for ev in (
                _E.AGENT_TX_BYTES, _E.AGENT_RX_BYTES, _E.AGENT_TX_REQUESTS_NUM, _E.AGENT_RX_REQUESTS_NUM))
        errors = sum(increase[ev] for ev in ERROR_EVENTS)
        now_h = snap.histogram(_E.AGENT_XFER_TIME)
        counts = tuple((new - old) % _WRAP for new, old in zip(
            now_h, before.histogram(_E.AGENT_XFER_TIME) if before else (0,) * len(now_h), strict=True))
        p50, p99 = (histogram_quantile(q, snap.bounds, counts) for q in (0.5, 0.99))
    return Row(snap.name, snap.agent_name, snap.pid, snap.instance, snap.local_rank or None, snap.hostname,
               "live" if view.alive else "departed", view.reap_in_s, view.age_s, tx, rx, tx_requests, rx_requests,
               p50, p99, errors, counts, snap.bounds)


_RATE_FIELDS = ("tx_bytes_per_s", "rx_bytes_per_s", "tx_requests_per_s", "rx_requests_per_s")


def totals(rows: Sequence[Row]) -> dict[str, Any]:
    """The totals line: rates and errors summed over the rows that have them; p50/p99 over every row's
    transfers together, when all share one set of bucket bounds (otherwise no common quantile exists)."""
    doc: dict[str, Any] = {"live": sum(r.state == "live" for r in rows),
                           "departed": sum(r.state != "live" for r in rows)}
    for name in (*_RATE_FIELDS, "errors"):
        values = [getattr(r, name) for r in rows if getattr(r, name) is not None]
        doc[name] = sum(values) if values else None
    measured = [r for r in rows if r.xfer_counts is not None]
    doc["xfer_time_p50_us"] = doc["xfer_time_p99_us"] = None
    if measured and len({r.bounds for r in measured}) == 1:
        merged = [sum(column) for column in zip(*(r.xfer_counts or () for r in measured), strict=True)]
        doc["xfer_time_p50_us"], doc["xfer_time_p99_us"] = (
            histogram_quantile(q, measured[0].bounds, merged) for q in (0.5, 0.99))
    return doc


@dataclass(frozen=True)
class Frame:
    """One refresh: the rows, the interval their figures cover, and what is wrong in the directory."""

    directory: Path
    rows: list[Row]
    interval_s: float | None  # None on the first look: no figures yet
    warnings: list[str]  # stores skipped, and why
    problem: str | None  # why no row is shown: the directory cannot be listed, or holds no store
    listing_failed: bool = False
    ttl: str = ""  # the stale TTL the departed ranks' time left is counted with, and where it comes from


class Sampler:
    """Reads a directory again and again; each ``sample`` is a Frame over the time since the previous one."""

    def __init__(self, directory: Path, stale_ttl_s: float, ttl_source: str = "") -> None:
        self.directory = directory
        self.collector = Collector(directory, stale_ttl_s, reap=False)
        self.ttl = f"TTL {stale_ttl_s:g} s" + (f" ({ttl_source})" if ttl_source else "")
        self._previous: dict[str, Snapshot] | None = None
        self._previous_at = 0.0

    def sample(self) -> Frame:
        collection = self.collector.collect()
        at = time.monotonic()
        if collection.scan_error:
            # The last good read stays the baseline: the next figures span the outage.
            return Frame(self.directory, [], None, [], collection.scan_error, listing_failed=True)
        views = collection.live + collection.stale
        seconds = None if self._previous is None else at - self._previous_at
        previous = self._previous or {}
        rows = [make_row(view, previous.get(view.snapshot.name), seconds) for view in views]
        self._previous = {view.snapshot.name: view.snapshot for view in views}
        self._previous_at = at
        warnings = [str(w["message"]) for w in collection.warnings]
        return Frame(self.directory, rows, seconds, warnings, None if rows else self._no_stores(warnings),
                     ttl=self.ttl)

    def _no_stores(self, warnings: list[str]) -> str:
        if warnings:
            more = f" (and {len(warnings) - 1} more)" if len(warnings) > 1 else ""
            return f"no readable store in {self.directory}: {warnings[0]}{more}"
        try:
            others = len(os.listdir(self.directory))
        except OSError:
            others = 0
        files = (f" ({others} other file{'s' if others != 1 else ''}; a store is named "
                 "nixl.<pid>.<run_marker>.<instance>.mmap)") if others else ""
        return f"no stores in {self.directory}{files}: no rank of a job exporting with prometheus_mp writes here yet"


# -- ordering ---------------------------------------------------------------

def _rank_order(row: Row) -> tuple[int, int, str, str, int, int]:
    """Local rank numerically where it is a number, then by name; ranks without one last."""
    rank = row.local_rank
    position = (0, int(rank), "") if rank and rank.isascii() and rank.isdigit() else (1, 0, rank or "\uffff")
    return (*position, row.agent_name, row.pid, row.agent_instance)


def _requests(row: Row) -> float | None:
    if row.tx_requests_per_s is None or row.rx_requests_per_s is None:
        return None
    return row.tx_requests_per_s + row.rx_requests_per_s


# (name, key, largest first): the live view's `s` cycles through them in this order.
SORTS: tuple[tuple[str, Callable[[Row], Any], bool], ...] = (
    ("rank", _rank_order, False),
    ("tx", lambda r: r.tx_bytes_per_s, True),
    ("rx", lambda r: r.rx_bytes_per_s, True),
    ("requests", _requests, True),
    ("p99", lambda r: r.xfer_time_p99_us, True),
    ("errors", lambda r: r.errors, True),
    ("age", lambda r: r.seconds_since_update, True),
    ("pid", lambda r: r.pid, False),
)


def sort_rows(rows: Sequence[Row], sort: str = "rank", reverse: bool = False) -> list[Row]:
    """``rows`` in ``sort`` order (a name in SORTS); rows without that figure always come last, by rank."""
    _, key, largest_first = next(s for s in SORTS if s[0] == sort)
    known = sorted((r for r in rows if key(r) is not None), key=key, reverse=largest_first != reverse)
    return known + sorted((r for r in rows if key(r) is None), key=_rank_order)


# -- text -------------------------------------------------------------------

def _si(value: float | None) -> str:
    """A rate in 3-4 significant digits with a decimal prefix: 1.23G, 512k, 7.0."""
    if value is None:
        return "-"
    for prefix in ("", "k", "M", "G", "T", "P"):
        if abs(value) < 999.5 or prefix == "P":
            return f"{value:.1f}" if not prefix and value < 100 else f"{value:.3g}{prefix}"
        value /= 1000
    raise AssertionError("unreachable")


def _duration_us(us: float | None) -> str:
    if us is None:
        return "-"
    if us < 1000:
        return f"{us:.0f}us"
    if us < 1_000_000:
        return f"{us / 1000:.3g}ms"
    return f"{us / 1_000_000:.3g}s"


def _cells(row: Row) -> tuple[str, ...]:
    state = row.state if row.ttl_left_s is None else f"{row.state} {row.ttl_left_s:.0f}s"
    return (row.agent_name, str(row.pid), str(row.agent_instance), row.local_rank or "-", state,
            f"{row.seconds_since_update:.1f}", _si(row.tx_bytes_per_s), _si(row.rx_bytes_per_s),
            _si(row.tx_requests_per_s), _si(row.rx_requests_per_s), _duration_us(row.xfer_time_p50_us),
            _duration_us(row.xfer_time_p99_us), "-" if row.errors is None else str(row.errors))


def _total_cells(doc: dict[str, Any]) -> tuple[str, ...]:
    return ("TOTAL", "", "", "", f"{doc['live']} live", "", _si(doc["tx_bytes_per_s"]), _si(doc["rx_bytes_per_s"]),
            _si(doc["tx_requests_per_s"]), _si(doc["rx_requests_per_s"]), _duration_us(doc["xfer_time_p50_us"]),
            _duration_us(doc["xfer_time_p99_us"]), "-" if doc["errors"] is None else str(doc["errors"]))


# Styles of render()'s lines, for the live view's attributes.
TITLE, HEADING, ROW, DEPARTED, ERRORS, TOTAL, NOTE = range(7)


def render(frame: Frame, sort: str = "rank", reverse: bool = False,
           width: int | None = None) -> list[tuple[str, int]]:
    """The view as (text, style) lines: a title, the table with its totals line, then the warnings.

    ``width``: the terminal's; no line is longer.  Columns that do not fit are hidden (AGENT, PID, P50, P99 and
    ERRORS never: long agent names are shortened instead), and named on a line of their own.
    """
    rows = sort_rows(frame.rows, sort, reverse)
    live = sum(r.state == "live" for r in rows)
    over = "waiting for a second read" if frame.interval_s is None else f"over {frame.interval_s:.1f} s"
    title = f"{frame.directory}: {live} live, {len(rows) - live} departed; {over}" + (
        f"; {frame.ttl}" if frame.ttl else "")
    lines = wrap(title, TITLE, width)
    if frame.problem:
        return [*lines, *wrap(frame.problem, NOTE, width)]
    table = [HEADER, *map(_cells, rows), _total_cells(totals(rows))]
    text, hidden = align(table, width)
    lines.append((text[0], HEADING))
    lines += [(line, DEPARTED if r.state != "live" else ERRORS if r.errors else ROW)
              for line, r in zip(text[1:-1], rows, strict=True)]
    lines.append((text[-1], TOTAL))
    if hidden:
        lines += wrap(f"hidden at this width: {', '.join(hidden)} (widen the terminal to see them)", NOTE, width)
    return lines + [line for w in frame.warnings for line in wrap(f"warning: {w}", NOTE, width)]


# -- the command --------------------------------------------------------------

def _directory(given: str | None) -> Path:

    text = given or os.environ.get(DIR_ENV, "")
    if not text:
        raise CliError(f"which directory? Give one (python -m app top DIR) or set {DIR_ENV}")
    return Path(text)


def run(directory: str | None, once: bool, as_json: bool, interval: float, ttl: float | None) -> int:
    """``python -m app top``; the arguments as parsed (``ttl`` None: from the environment, as ranks read it)."""

    path = _directory(directory)
    sampler = Sampler(path, *stale_ttl_of(path, ttl))
    # The collector's and reader's warnings describe the files it skips: they
    # are the view's own warning lines, and must not scribble over the screen.
    logging.getLogger("nixl_prometheus_mp").setLevel(logging.ERROR)
    first = sampler.sample()
    if first.listing_failed:
        raise CliError(str(first.problem))
    if once or as_json:
        time.sleep(interval)
        frame = sampler.sample()
        if frame.problem:
            raise CliError(frame.problem)
        if as_json:
            print(json.dumps([r.to_json() for r in sort_rows(frame.rows)], indent=1))
            for warning in frame.warnings:
                print(f"warning: {warning}", file=sys.stderr)
        else:
            print("\n".join(text for text, _ in render(frame)))
        return 0
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise CliError("the live view needs a terminal; print one snapshot with --once (or --json)")
    return run_live(sampler, first, interval)


class _Stopped(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _stop_on_signals(received: list[int]) -> Iterator[None]:
    """SIGTERM and SIGHUP unwind like Ctrl-C does, so curses gives the terminal back whatever ends the view."""
    def stop(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        raise _Stopped(signum)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_live(sampler: Sampler, first: Frame, interval: float) -> int:
    """The full-screen view until `q` (0), Ctrl-C (130), SIGTERM or SIGHUP (128 + the signal)."""
    import curses


    locale.setlocale(locale.LC_ALL, "")  # agent names are UTF-8: let curses draw them as such
    view = _LiveView(sampler, first, interval)
    received: list[int] = []
    try:
        with _stop_on_signals(received):
            curses.wrapper(view.loop)
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    except _Stopped as exc:
        return 128 + exc.signum
    except curses.error as exc:
        if received:  # the terminal hung up: restoring it failed, and there is nobody left to tell
            return 128 + received[0]
        raise CliError(f"cannot draw on this terminal ({exc}, TERM={os.environ.get('TERM')!r}); "
                       "print one snapshot with --once instead") from None
    return 0


class _LiveView:
    def __init__(self, sampler: Sampler, first: Frame, interval: float) -> None:
        self.sampler, self.frame, self.interval = sampler, first, interval
        self.sort, self.reverse = 0, False

    def loop(self, screen: curses.window) -> None:
        import curses

        with contextlib.suppress(curses.error):  # a terminal without an invisible cursor keeps it
            curses.curs_set(0)
        styles = {TITLE: curses.A_BOLD, HEADING: curses.A_REVERSE, ROW: curses.A_NORMAL, DEPARTED: curses.A_DIM,
                  ERRORS: curses.A_BOLD, TOTAL: curses.A_BOLD, NOTE: curses.A_NORMAL}
        screen.timeout(INPUT_POLL_MS)
        due = time.monotonic() + self.interval
        while True:
            self.draw(screen, styles)
            key = screen.getch()
            if key in (ord("q"), ord("Q")):
                return
            if key == ord("s"):
                self.sort = (self.sort + 1) % len(SORTS)
            elif key == ord("r"):
                self.reverse = not self.reverse
            self.follow_size(screen, key == curses.KEY_RESIZE)
            now = time.monotonic()
            if now >= due:
                self.frame = self.sampler.sample()
                due = max(due + self.interval, now)

    @staticmethod
    def follow_size(screen: curses.window, resized: bool) -> None:
        """Follow the terminal's size by asking it: ncurses believes LINES and COLUMNS over the terminal
        when they are in the environment (a shell that exported them once), at start and on every resize."""
        import curses

        try:
            size = os.get_terminal_size(sys.__stdout__.fileno() if sys.__stdout__ else 1)
        except OSError:
            return
        if curses.is_term_resized(size.lines, size.columns):
            curses.resizeterm(size.lines, size.columns)  # queues a KEY_RESIZE: cleared on the next round
        elif resized:
            screen.clear()  # everything moved: repaint the whole screen, not the difference

    def draw(self, screen: curses.window, styles: dict[int, int]) -> None:
        import curses

        height, width = screen.getmaxyx()
        name = SORTS[self.sort][0]
        keys = f"sort: {name}{' reversed' if self.reverse else ''} (s: next, r: reverse)  q: quit"
        lines = render(self.frame, name, self.reverse, width - 1)
        below_title = sum(style == TITLE for _, style in lines)  # the title's lines come first
        lines[below_title:below_title] = wrap(keys, NOTE, width - 1)
        if len(lines) > height:  # keep the title and header, and the totals and warnings when they fit
            hidden = len(lines) - height + 1
            lines = [*lines[:height - 1], (f"... {hidden} more line(s): enlarge the terminal", NOTE)]
        screen.erase()
        for y, (text, style) in enumerate(lines):
            # Up to the last column but one: writing the bottom-right cell
            # raises curses.error, as any write past a too-narrow edge would.
            with contextlib.suppress(curses.error):
                screen.addnstr(y, 0, text, max(0, width - 1), styles[style])
        screen.refresh()


def cmd_top(args: Any) -> int:
    """``nixl-prometheus-mp top [DIR]`` (its parser is app.cli's)."""
    return run(args.directory, args.once, args.json, args.interval, args.ttl)
