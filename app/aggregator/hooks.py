"""The standalone aggregator: ``gunicorn app:wsgi`` (or ``python -m app serve``).

The gunicorn master holds the address's owner election for as long as it
runs (hooks in app/gunicorn_conf.py), exactly as an in-process owner would: the
ranks of the pod stay quiet writers, and if the aggregator dies the kernel
drops its lock and a rank takes the address over in-process.  Workers serve
the same directory; concurrent scrapes and reaping are safe because every
reader only probes, and reaping re-checks under an exclusive lock.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import Any

from app.collector import Collector
from app.config import LOCAL_ENV, PORT_ENV, Config, ConfigError, ascii_int, prepare_directory
from app.endpoint import RETRY_NS
from app.health import OwnerWatch, health_warnings, owner_doc
from app.probe import die_with_parent, get_healthz, lock_holder_pid
from app.web import MetricsApp
from election import Outcome, OwnerElection, lock_file_name

try:
    from gunicorn.errors import AppImportError as _AppLoadError
except ImportError:  # gunicorn is a run-time dependency, but the app must not need it to import
    class _AppLoadError(Exception):  # type: ignore[no-redef]
        pass

log = logging.getLogger("nixl_prometheus_mp.standalone")


class AggregatorConfigError(ConfigError, _AppLoadError):
    """A ConfigError that gunicorn reports as one line (it is an AppImportError), not a traceback."""


class _MasterState:
    """Set in the process that holds the election; inherited by forked workers."""

    election: OwnerElection | None = None
    pid: int | None = None
    since: float | None = None


_master = _MasterState()
_app: MetricsApp | None = None
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


def hold_election(config: Config) -> Outcome:
    """Block until this process owns ``config.address`` (or the lock is unusable).

    While another process holds the election (a rank serving in-process,
    another aggregator), the aggregator waits rather than fight it for the
    port, and names it: again whenever another process takes the address over.
    """
    election = OwnerElection(config.directory, config.address)
    lock_path = config.directory / lock_file_name(config.address)
    holder_pid: int | None = None
    logged = named = False
    while (outcome := election.try_win()) is Outcome.LOST:
        pid = lock_holder_pid(lock_path)
        if pid is not None and pid != holder_pid:  # None: between two holders, or in another pid namespace
            if holder_pid is not None:
                logged = named = False  # a new holder: say who it is
            holder_pid = pid
        # The holder binds only after winning, so it may not answer yet: say so, then name it once it does.
        if not named:
            holder, named = describe_holder(config, holder_pid)
            if named or not logged:
                logged = True
                log.warning("%s holds the owner election of %s; the aggregator waits for the address (until "
                            "that process exits)", holder, config.address)
        time.sleep(RETRY_NS / 1e9)
    _master.election, _master.pid, _master.since = election, os.getpid(), time.time()
    return outcome


def describe_holder(config: Config, pid: int | None) -> tuple[str, bool]:
    """Who holds ``config.address``'s election, and whether that is final.

    Its /healthz says pid, host, mode and agent. A holder without /healthz
    (NIXL's C++ plug-in serves none) or not serving yet is named by ``pid``,
    the pid the kernel reports for the lock (/proc/locks).
    """
    host = "127.0.0.1" if config.host == "0.0.0.0" else config.host
    answer = get_healthz(host, config.port)
    owner = answer.owner
    if owner is not None:
        what = f"pid {owner.get('pid')} on {owner.get('hostname')} ({owner.get('mode')}"
        return what + (f", agent {owner['agent_name']})" if owner.get("agent_name") else ")"), True
    serving = answer.status is not None  # it answers HTTP, without our /healthz; else nothing answers (yet)
    who = f"pid {pid}" if pid else "another process"
    if serving:
        return f"{who} (serving {config.address} without /healthz: NIXL's C++ plug-in?)", True
    return f"{who} (its /healthz does not answer yet)", False


def refuse_reexec(config: Config) -> None:
    """In the child gunicorn forks for a USR2 upgrade: exit instead of exec'ing a new master.

    The old master holds the owner election until it exits, and the
    operator only stops it once the new master serves: the new master
    would wait for the election forever.
    """
    log.error("USR2 upgrade refused: this master (pid %d) holds the owner election of %s until it exits, so a "
              "new master could never take over; restart the aggregator instead (a rank that exports serves "
              "the address in the gap)", os.getppid(), config.address)
    os._exit(1)


def release_election() -> None:
    if _master.election is not None and _master.pid == os.getpid():
        _master.election.release()


def worker_forked() -> None:
    """In a gunicorn worker: drop the inherited election descriptor, never unlocking it.

    And die with the master: gunicorn's workers only notice a dead master
    about a second later, and until they exit they keep listening on the
    address, so the rank that wins the released election could not bind it
    and would back off for seconds.
    """
    if _master.election is not None and _master.pid != os.getpid():
        _master.election.forget_after_fork()
        die_with_parent(_master.pid)


def _owner_info(config: Config) -> dict[str, Any]:
    election = _master.election
    return owner_doc(pid=_master.pid if _master.pid is not None else os.getpid(), agent_name=None,
                     address=config.address, mode="standalone", flock=election is not None and not election.problem,
                     since=_master.since, server_pid=os.getpid(), serving="gunicorn")


def _warnings(config: Config, owners: OwnerWatch) -> list[dict[str, Any]]:
    election = _master.election or OwnerElection(config.directory, config.address)
    warnings = health_warnings(owners, election)
    if _master.election is None:
        warnings.append({"kind": "unusable-lock", "message": (
            "this aggregator holds no owner election (gunicorn was started without "
            "-c python:app.gunicorn_conf): ranks configured for the same address would fight it for the port"),
            "details": {"address": config.address}})
    return warnings


def build_app(config: Config) -> MetricsApp:
    owners = OwnerWatch(config.directory, config.address)
    return MetricsApp(Collector(config.directory, config.stale_ttl_s), lambda: _owner_info(config),
                      lambda: _warnings(config, owners), on_scrape=owners.poll)


def standalone_app() -> MetricsApp:
    """``app.wsgi``: one app per process, configured from the environment."""
    global _app
    if _app is None:
        try:
            config = Config.from_env()
        except ConfigError as exc:
            raise AggregatorConfigError(str(exc)) from None
        _app = build_app(config)
    return _app
