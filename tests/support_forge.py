"""Store files forged byte by byte (for the readers: any content, any name, any stamp); exposition lines parsed
without losing how their numbers are spelt; and how prometheus-cpp spells numbers, computed by the C library.

Import from a test module with ``from support_forge import ...`` (pytest puts ``tests/`` on ``sys.path``).
"""

from __future__ import annotations

import ctypes
import re
import time
from pathlib import Path

from app.exposition import reference_families, reference_render
from store import layout as L
from store.reader import Snapshot

SampleKey = tuple[str, frozenset[tuple[str, str]]]


def store_bytes(pid: int, instance: int, agent_name: str, hostname: str, local_rank: str,
                bounds: tuple[float, ...], counters: list[int], gauges: list[int], buckets: list[int],
                sums: list[int], last_update: int = 1) -> bytes:
    """A schema-1 store image, packed with the layout's own struct."""
    padded = list(bounds) + [0.0] * (L.MAX_BUCKETS - len(bounds))
    return L.STORE_STRUCT.pack(L.MAGIC, L.SCHEMA_VERSION, L.SLOT_COUNT, pid, last_update, instance, len(bounds),
                               agent_name.encode(), hostname.encode(), local_rank.encode(), *padded,
                               *counters, *gauges, *buckets, *sums)


def forge_store(directory: Path, *, pid: int, instance: int = 0, run_marker: int = 1, agent_name: str = "forged",
                hostname: str = "host-f", local_rank: str = "", bounds: tuple[float, ...] = (10.0, 100.0),
                value: int = 0, last_update: int | None = None, name: str | None = None) -> Path:
    """Write a departed (unlocked) store: ``value`` in every counter, gauge, bucket and sum; stamped now by default.

    Rewriting an existing store replaces its file (a new inode): a process holding the old one's lock does not
    hold the new one's.
    """
    slots = L.SLOT_COUNT
    data = store_bytes(pid, instance, agent_name, hostname, local_rank, bounds, [value] * slots, [value] * slots,
                       [value] * (slots * L.BUCKET_SLOTS), [value] * slots,
                       time.monotonic_ns() if last_update is None else last_update)
    path = directory / (name or L.store_file_name(pid, run_marker, instance))
    staging = path.with_name(f".{path.name}.forging")
    staging.write_bytes(data)
    staging.replace(path)  # whole or not at all, as writers publish: a reader never sees it half written
    return path


def stamp(path: Path, last_update: int) -> None:
    """Rewrite a store's last-update stamp in place, as its writer would (flock is advisory: any store will do)."""
    with path.open("r+b") as f:
        f.seek(L.LAST_UPDATE_FIELD[0])
        f.write(last_update.to_bytes(8, "little"))


_SAMPLE = re.compile(r'([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)",?')


def raw_samples(text: str, skip_prefix: str = "\0") -> tuple[dict[SampleKey, str], dict[str, tuple[str, ...]]]:
    """Samples as ``{(name, labels): value as spelt}`` and each family's ``# HELP``/``# TYPE`` lines.

    Label values stay escaped as written; samples and families whose name starts with ``skip_prefix`` are left
    out.  A sample written twice fails the parse (an exposition may never repeat a series).
    """
    samples: dict[SampleKey, str] = {}
    headers: dict[str, list[str]] = {}
    for line in text.split("\n"):
        if not line or line == "# EOF":
            continue
        if line.startswith("# "):
            family = line.split(" ", 3)[2]
            if not family.startswith(skip_prefix):
                headers.setdefault(family, []).append(line)
            continue
        match = _SAMPLE.fullmatch(line)
        assert match, f"not a sample line: {line!r}"
        name, labels, value = match.groups()
        if name.startswith(skip_prefix):
            continue
        pairs = _LABEL.findall(labels or "")
        assert "".join(f'{k}="{v}",' for k, v in pairs).rstrip(",") == (labels or ""), f"bad labels: {line!r}"
        key = (name, frozenset(pairs))
        assert key not in samples, f"series written twice: {line!r}"
        samples[key] = value
    return samples, {family: tuple(lines) for family, lines in headers.items()}


_libc = ctypes.CDLL(None)


def c_format(fmt: bytes, arg: ctypes.c_double | ctypes.c_ulonglong) -> str:
    """The C library's own ``snprintf(fmt, arg)``."""
    buf = ctypes.create_string_buffer(128)
    written = _libc.snprintf(buf, len(buf), fmt, arg)
    assert 0 < written < len(buf)
    return buf.value.decode("ascii")


def cpp_double(value: float) -> str:
    """prometheus-cpp's WriteValue for a finite double: ``out << value`` at precision 16, i.e. ``%.16g``."""
    return c_format(b"%.16g", ctypes.c_double(value))


def cpp_u64_as_double(value: int) -> str:
    """A u64 counter, gauge or histogram sum: ``static_cast<double>`` (round to nearest, as float()), then written."""
    return cpp_double(float(value))


def cpp_u64(value: int) -> str:
    """A histogram's bucket or count: a u64 written as an integer (``out << uint64_t``)."""
    assert 0 <= value < 1 << 64
    return c_format(b"%llu", ctypes.c_ulonglong(value))


def cpp_reference(snaps: list[Snapshot], openmetrics: bool = False) -> bytes:
    """prometheus_client's exposition with every sample value respelt as prometheus-cpp writes it.

    prometheus_client writes every value the Go way ("1e+06", "5.0"); the plug-in writes bucket and count values as
    integers and the rest as ``%.16g`` of the value converted to a double.  The exact value of each line is taken
    from the metric families the reference rendered, in the order it wrote them.  (Bucket counts are only bounded
    here by what a forged store can hold: beyond 2**64 prometheus-cpp would wrap, we keep the exact sum.)
    """
    text = reference_render(snaps, openmetrics).decode("utf-8")
    values = iter([sample for metric in reference_families(snaps) for sample in metric.samples])
    lines = []
    for line in text.split("\n"):
        if line and not line.startswith("#"):
            sample = next(values)
            head, _, go_spelt = line.rpartition(" ")
            assert float(go_spelt) == float(sample.value), (line, sample)
            exact = sample.name.endswith(("_bucket", "_count"))
            line = f"{head} {sample.value if exact else cpp_u64_as_double(sample.value)}"
        lines.append(line)
    assert next(values, None) is None, "the reference wrote fewer samples than its families hold"
    return "\n".join(lines).encode("utf-8")
