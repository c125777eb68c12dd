"""What every command of ``nixl-prometheus-mp`` shares: its name, its one-line errors, its stop signals and
its argument parsers.

Errors are one line on stderr and a non-zero exit, never a traceback: the
people running this are operators reading a terminal or a pod log.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from app.config import TTL_ENV, ConfigError, ascii_int, stale_ttl
from app.probe import get_healthz
from election import held_addresses_except
from store.metrics import ERROR_EVENTS

PROG = "nixl-prometheus-mp"


class CliError(Exception):
    """A user-facing runtime failure: printed as one line, exit status 1.

    Bad arguments (argparse) and bad settings (ConfigError) exit with 2.
    """


def error_count(counters: Sequence[int]) -> int:
    """A store's errors: the sum of its twelve ``agent_errors_total`` counters (the AGENT_ERR_* events)."""
    return sum(counters[ev] for ev in ERROR_EVENTS)


def bounded(kind: Callable[[str], float], what: str, ok: Callable[[float], bool]) -> Callable[[str], Any]:
    """An argparse ``type``: refuses, naming the value, anything but ``what``."""
    def parse(text: str) -> Any:
        try:
            value = ascii_int(text) if kind is int else kind(text.strip())
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value
    return parse


RANKS = bounded(int, "a number of ranks >= 1", lambda v: v >= 1)
PORT = bounded(int, "a port number 1..65535", lambda v: 1 <= v <= 65535)
RATE = bounded(float, "a finite number of transfers per second > 0", lambda v: math.isfinite(v) and v > 0)
DURATION = bounded(float, "a finite number of seconds >= 0", lambda v: math.isfinite(v) and v >= 0)
INTERVAL = bounded(float, "a finite number of seconds > 0", lambda v: math.isfinite(v) and v > 0)


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line too (the usage is in --help)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def ttl_flag(text: str) -> float:
    try:
        return stale_ttl(text, "--ttl")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def stale_ttl_of(directory: Path, given: float | None) -> tuple[float, str]:
    """The TTL to count the departed ranks' time left with, and where it comes from: --ttl, else the
    environment (as ranks read it), else the one the directory's owner says it applies (its /healthz), else
    the ranks' default."""
    if given is not None:
        return given, "--ttl"
    if os.environ.get(TTL_ENV):
        return stale_ttl(os.environ[TTL_ENV]), f"${TTL_ENV}"
    for address in held_addresses_except(directory, ""):
        host, _, port = address.rpartition(":")
        doc = get_healthz("127.0.0.1" if host in ("0.0.0.0", "") else host.strip("[]"), int(port)).doc
        ttl = None if doc is None else doc.get("stale_ttl_s")
        if isinstance(ttl, (int, float)) and _same_directory(doc.get("directory"), directory):  # type: ignore[union-attr]
            return float(ttl), f"the owner's, on {address}"
    return stale_ttl(None), f"the default; no owner answers: set --ttl or ${TTL_ENV}"


def _same_directory(text: object, directory: Path) -> bool:
    try:
        return isinstance(text, str) and os.path.samefile(text, directory)
    except OSError:
        return False
