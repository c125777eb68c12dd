"""The aggregator's settings: gunicorn's worker and thread counts, its directory, and the gunicorn options
that would contradict the ranks' configuration (checked by app/gunicorn_conf.py once gunicorn has read them).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from app.config import LOCAL_ENV, PORT_ENV, Config, ConfigError, ascii_int, prepare_directory

log = logging.getLogger("nixl_prometheus_mp.standalone")

_COUNTS = (("GUNICORN_WORKERS", 2, 64), ("GUNICORN_THREADS", 4, 256))  # variable, default, maximum


def gunicorn_counts(environ: Mapping[str, str] | None = None) -> tuple[int, int]:
    """(workers, threads) from GUNICORN_WORKERS and GUNICORN_THREADS.

    Refused rather than passed to gunicorn: with 0 workers its master wins
    the election and serves nothing (scrapes hang while the ranks stay
    quiet), and a non-number fails deep inside gunicorn with a traceback.
    """
    env = os.environ if environ is None else environ
    counts = []
    for name, default, maximum in _COUNTS:
        text = env.get(name, "").strip()
        if not text:
            counts.append(default)
            continue
        count = ascii_int(text)
        if count is None or not 1 <= count <= maximum:
            raise ConfigError(f"{name}={env[name]!r} is not a whole number in 1..{maximum}")
        counts.append(count)
    return counts[0], counts[1]


def prepare_standalone(config: Config) -> None:
    """Create the aggregator's directory 0700 if missing; warn about an existing one that is not private.

    The master elects before any rank may have created the directory (a
    sidecar usually starts first): without it, the lock file could not be
    opened and the election would fall back to the bind.
    """
    for problem in prepare_directory(config.directory):
        log.warning("%s", problem)


def gunicorn_overrides(cfg: Any, config: Config, workers: int, threads: int) -> str | None:
    """Why gunicorn's final settings (``cfg``: its command line and GUNICORN_CMD_ARGS applied) cannot run.

    app/gunicorn_conf.py derives these from the ranks' environment, and the
    master holds the election of ``config.address``: another bind would
    serve an address nobody elects for while its ranks wait for an owner that
    never serves; --reuse-port lets another server share the port; 0 workers
    hold the election and serve nothing.
    """
    (workers_env, _, most_workers), (threads_env, _, most_threads) = _COUNTS
    ours: dict[str, tuple[object, str, str]] = {  # setting: (what it must be, why, what to set instead)
        "bind": ([config.address], f"the aggregator serves the address its ranks elect an owner for, "
                                   f"{config.address}", f"{PORT_ENV} and {LOCAL_ENV}"),
        "workers": (workers, f"the aggregator takes its workers from {workers_env} (now {workers}, 1..{most_workers})",
                    workers_env),
        "threads": (threads, f"the aggregator takes its threads from {threads_env} (now {threads}, 1..{most_threads})",
                    threads_env),
        "reuse_port": (False, f"it would let another server share {config.address} and answer its scrapes without "
                              "holding the owner election", ""),
    }
    for name, (wanted, why, instead) in ours.items():
        value = getattr(cfg, name)
        if value != wanted:
            flag = cfg.settings[name].cli[-1]
            shown = "" if isinstance(value, bool) else f" {','.join(value) if isinstance(value, list) else value}"
            return (f"gunicorn's {flag}{shown} (its command line or GUNICORN_CMD_ARGS) is refused: {why}; drop {flag}"
                    + (f" and set {instead}" if instead else ""))
    return None
