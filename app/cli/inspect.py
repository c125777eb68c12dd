"""``nixl-prometheus-mp inspect DIR``: every store of a directory, read without ever reaping or locking for long."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from app.cli.common import CliError, error_count
from store import EventType, native
from store.layout import STORE_PREFIX, STORE_SUFFIX, is_store_name
from store.reader import Snapshot, Unreadable, open_store, probe_alive, read_fd


def _store_like_names(directory: Path) -> tuple[list[str], list[str]]:
    """The directory's store names, and the names that only look like one (``nixl.*.mmap``, never opened)."""
    try:
        names = sorted(n for n in os.listdir(directory) if n.startswith(STORE_PREFIX) and n.endswith(STORE_SUFFIX))
    except OSError as exc:
        raise CliError(f"cannot list {directory}: {os.strerror(exc.errno or 0)}") from None
    return [n for n in names if is_store_name(n)], [n for n in names if not is_store_name(n)]


def _inspect_rows(directory: Path, names: list[str]) -> list[dict[str, Any]]:
    """Every store, read without ever reaping or locking for long."""
    now = time.monotonic_ns()
    rows: list[dict[str, Any]] = []
    for name in names:
        path = directory / name
        fd = open_store(path)
        if isinstance(fd, Unreadable):
            rows.append({"store": name, "problem": fd.reason})
            continue
        try:
            alive = probe_alive(fd)
            content = read_fd(fd, path)
        finally:
            os.close(fd)
        if not isinstance(content, Snapshot):
            rows.append({"store": name, "problem": content.reason, "alive": alive})
            continue
        c = content.counters
        rows.append({
            "store": name, "agent_name": content.agent_name, "pid": content.pid, "agent_instance": content.instance,
            "local_rank": content.local_rank or None, "hostname": content.hostname, "alive": alive,
            "age_s": round(max(0, now - content.last_update_ns) / 1e9, 1),
            "tx_bytes": c[EventType.AGENT_TX_BYTES], "rx_bytes": c[EventType.AGENT_RX_BYTES],
            "requests": c[EventType.AGENT_TX_REQUESTS_NUM] + c[EventType.AGENT_RX_REQUESTS_NUM],
            "errors": error_count(c),
        })
    return rows


def _print_table(table: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    for r in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())


def _speedups_line() -> str:
    """Which path this installation's hot paths take (as /healthz's ``speedups`` says for the serving process)."""
    status = native.status()
    forced = f" ({native.PURE_PYTHON_ENV} forces the Python path)" if status.pop("pure_python_forced") else ""
    paths = ", ".join(f"{name} {path}" for name, path in status.items())
    return f"speedups of this installation (c or python): {paths}{forced}"


def cmd_inspect(args: argparse.Namespace) -> int:
    directory = Path(args.directory)
    stores, lookalikes = _store_like_names(directory)
    rows = _inspect_rows(directory, stores)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    columns = ("agent_name", "pid", "agent_instance", "local_rank", "state", "age_s", "tx_bytes", "rx_bytes",
               "requests", "errors")
    table: list[tuple[str, ...]] = [
        ("AGENT", "PID", "INST", "RANK", "STATE", "AGE(s)", "TX BYTES", "RX BYTES", "REQUESTS", "ERRORS")]
    invalid: list[tuple[str, ...]] = [("INVALID STORE", "PROBLEM")]
    for row in rows:
        if "problem" in row:  # not a store's columns: listed apart, by file name
            invalid.append((row["store"], row["problem"]))
            continue
        row = {**row, "state": "alive" if row["alive"] else "departed"}
        table.append(tuple("-" if row[c] is None else str(row[c]) for c in columns))
    _print_table(table)
    if len(invalid) > 1:
        print()
        _print_table(invalid)
    if not rows:
        print(f"(no stores in {args.directory})")
    if lookalikes:
        # Readers only ever open names that parse: saying "too small" here would claim this file was read.
        print()
        print("NOT A STORE (not named nixl.<pid>.<run_marker>.<instance>.mmap: never read nor reaped)")
        print("\n".join(lookalikes))
    print()
    print(_speedups_line())
    return 0
