"""Exporter: the per-agent telemetry sink every rank creates.

Construction reads the environment, creates the agent's store and runs the
owner election; the winner starts the address server that serves every rank's
telemetry (app.rank.endpoint).  Every rank re-runs the election as it records,
as the C++ plug-in's ranks do.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from app.config import (
    ENABLE_ENV,
    EXPORTER_ENV,
    EXPORTER_NAME,
    Config,
    ConfigError,
    parse_flag,
    prepare_directory,
    unwritable_directory,
)
from app.health import OwnerWatch, WarningDoc, health_warnings
from app.logsink import reset_after_fork
from app.rank import endpoint as endpoint_module
from app.rank.claims import BACKOFF_NS, NEVER
from app.rank.endpoint import ScrapeEndpoint, ServerSpec
from app.rank.recording import Recording
from election import OwnerElection
from store import StoreIdentity, StoreWriter
from store.recorders import NullSink

if TYPE_CHECKING:
    from app.web import MetricsApp

log = logging.getLogger("nixl_prometheus_mp")

_instances = itertools.count()  # agent_instance: 0, 1, ... per process
_instances_lock = threading.Lock()
# How often an event checks that the store file is still on disk (the writers' re-election pace).
REVALIDATE_NS = 200_000_000


def _check_agent_name(agent_name: object) -> None:
    """NIXL refuses an empty agent name; the store's field is NUL-terminated."""
    if not isinstance(agent_name, str):
        raise TypeError(f"agent_name must be a str, got {type(agent_name).__name__} {agent_name!r}")
    if not agent_name:
        raise ValueError("agent_name must not be empty")
    if "\0" in agent_name:
        raise ValueError(f"agent_name {agent_name!r} contains a NUL character, which the store's "
                         "NUL-terminated name field cannot hold")


def _next_instance() -> int:
    with _instances_lock:
        return next(_instances)


def _start_endpoint(config: Config, agent_name: str, writer: StoreWriter) -> tuple[ScrapeEndpoint, OwnerWatch]:
    """The endpoint (not yet claimed) and the duplicate-owner watch of one Exporter.

    Nothing built here may refer to the Exporter: its finalizer keeps the endpoint alive.
    """
    election = OwnerElection(config.directory, config.address)
    owners = OwnerWatch(config.directory, config.address)

    def owner() -> dict[str, Any]:
        return endpoint.owner_info(agent_name, "in-process")

    def warnings() -> list[WarningDoc]:
        endpoint.watch()
        return endpoint.warnings() + health_warnings(owners, election)

    def make_app() -> MetricsApp:  # (thread mode only: see ScrapeEndpoint)
        from app.collector import Collector
        from app.web import MetricsApp

        return MetricsApp(Collector(config.directory, config.stale_ttl_s), owner, warnings,
                          on_scrape=lambda: endpoint.watch())

    spec = None if config.serve == "thread" else ServerSpec(config.directory, config.stale_ttl_s, config.drain_max_s,
                                                            config.address, agent_name)
    endpoint = ScrapeEndpoint(election, config.host, config.port, make_app, spec, on_watch=owners.poll,
                              has_store=lambda: writer.path.exists())
    return endpoint, owners


class _CloseState:
    """Who is closing an Exporter, and when it is done (shared by close() and the finalizer)."""

    def __init__(self) -> None:
        self.closer: int | None = None
        self.done = threading.Event()


def _release(endpoint: ScrapeEndpoint, writer: StoreWriter, state: _CloseState) -> _CloseState:
    """close()'s work; also run by the garbage collector and at exit for an Exporter nobody closed."""
    state.closer = threading.get_ident()
    # The endpoint first: a closing rank takes nothing over any more.  Then the store, with its final values,
    # which the address server (the job's: it stays) publishes as departed until the TTL.
    try:
        endpoint.close()
    except Exception:  # at exit or in the collector, a failure must cost the endpoint only
        log.warning("closing the telemetry endpoint of %s failed", writer.path.name, exc_info=True)
    finally:
        try:
            writer.close()
        finally:
            state.done.set()
    return state


class Exporter(Recording):
    """One agent's telemetry: its store, and possibly the run's endpoint.

    export_event, record_transfer, record_error and record_memory_* come from
    app.rank.recording (C entry points where store._recorder was built).
    """

    def __init__(self, agent_name: str, environ: Mapping[str, str] | None = None) -> None:
        _check_agent_name(agent_name)  # before an agent_instance number is consumed or a file created
        config = Config.from_env(environ)
        for problem in prepare_directory(config.directory):
            log.warning("%s", problem)
        self.config = config
        self.agent_name = agent_name
        identity = StoreIdentity(agent_name, socket.gethostname(), config.local_rank, _next_instance(),
                                 config.buckets)
        try:
            self._writer = StoreWriter(config.directory, identity, config.enabled)
        except OSError as exc:
            # The up-front check cannot see everything (an ACL, an LSM, a
            # mode changed since): refusal by the kernel is still named.
            if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise unwritable_directory(config.directory, exc.errno) from None
            raise
        self._bind_recording(self._writer)
        self._closed = False
        self._reclaim_failed = False
        try:
            self._endpoint, owners = _start_endpoint(config, agent_name, self._writer)
        except BaseException:
            self._writer.close()  # never leave a locked store behind a failed constructor
            raise
        # Dropped without close(), the Exporter is released by the garbage collector exactly as close()
        # would: its state holds the endpoint and the writer, neither of which refers back to the Exporter
        # (the web app's callbacks close over the endpoint, not self), or it could never be collected.
        self._finalizer_state = _CloseState()
        self._finalizer = weakref.finalize(self, _release, self._endpoint, self._writer, self._finalizer_state)
        # Registered before it claims: a child forked the instant its claim serves from a thread must find it.
        _exporters.add(self)
        try:
            # Finite even for the owner: events keep checking the store file (_on_deadline).
            self._claim_due_ns = self._endpoint.claim(constructing=True)
            self._next_claim_ns = min(self._claim_due_ns, time.monotonic_ns() + REVALIDATE_NS)
            # Said once, as the rank starts; from then on, whoever serves checks as it is scraped.  Never on the
            # export path: the check lists the directory (80 ms for 150 000 files), a pause in the host's thread.
            owners.check()
        except BaseException:
            _exporters.discard(self)
            self._finalizer()  # ... nor a bound port or a held election
            raise

    # -- properties -----------------------------------------------------

    @property
    def serving(self) -> bool:
        """True while this process serves its address."""
        return self._endpoint.serving

    @property
    def store_path(self) -> Path:
        return self._writer.path

    @property
    def address(self) -> str:
        return self.config.address

    # -- recording (the entry points are app.rank.recording's) ------------

    def _on_deadline(self) -> None:
        # The store-file check's pace (every 200 ms at most): the moment to notice that our store file was
        # removed from under us, at one fstat.  The election is re-run at its own pace (_claim_due_ns), which a
        # failed takeover stretches to seconds: the store check must not make it every 200 ms.
        self._writer.revalidate()
        now_ns = time.monotonic_ns()
        if now_ns >= self._claim_due_ns:
            self._reclaim()
        if not self._closed:
            self._next_claim_ns = min(self._claim_due_ns, now_ns + REVALIDATE_NS)

    def _reclaim(self) -> None:
        """Re-run the election (or, serving, check it); never raises: recording must go on regardless."""
        if self._closed:
            return
        try:
            self._claim_due_ns = self._endpoint.claim()
        except Exception:
            self._claim_due_ns = time.monotonic_ns() + BACKOFF_NS
            if not self._reclaim_failed:
                self._reclaim_failed = True
                log.warning("re-running the owner election for %s failed; recording goes on and the election "
                            "is retried every %d s", self.address, BACKOFF_NS // 1_000_000_000, exc_info=True)

    # -- life cycle -------------------------------------------------------

    def close(self) -> None:
        """Stop serving (port freed before the election), then close the store.

        Idempotent, safe from several threads at once, from a signal handler
        and from atexit.  When it returns the port is free and the election
        released, except in a signal handler that interrupted this same
        thread's takeover or close(): the interrupted code finishes the job
        when it resumes.  The store file stays, with its final values, until
        the owner reaps it after the stale TTL.
        """
        self._closed = True  # plain stores, no lock: a signal handler may interrupt anything below
        self._next_claim_ns = NEVER
        if self._finalizer() is None:  # closed, or being closed, already
            state = self._finalizer_state
            if state.closer != threading.get_ident():
                state.done.wait()  # a second closer waits for the first (whose close never waits for long)
        _exporters.discard(self)

    def __enter__(self) -> Exporter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        role = "serving" if self.serving else "writer"
        return f"<Exporter {self.agent_name!r} {role} {self.address} store={self.store_path.name}>"

    def _after_fork_in_child(self) -> None:
        # The writer has its own fork hook (store/); a child starts as a writer that may join the election on its
        # next export.
        self._endpoint.forget_after_fork()
        if not self._closed:
            self._next_claim_ns = self._claim_due_ns = 0
        else:
            # Forked while a parent thread was closing it: that thread does not exist here, so a close()
            # in the child must not wait for it (and the inherited Event's lock may be held for ever).
            self._finalizer_state = _CloseState()
            self._finalizer_state.done.set()


_exporters: weakref.WeakSet[Exporter] = weakref.WeakSet()


def _before_fork() -> None:
    endpoint_module.fork_lock.acquire()  # (no claim is between its win and its hand-over meanwhile)


def _after_fork_in_parent() -> None:
    endpoint_module.fork_lock.release()


def _after_fork_in_child() -> None:
    # The parent's other threads do not exist here: nobody else holds what the child drops.
    endpoint_module.fork_lock = threading.RLock()
    reset_after_fork()
    for exporter in list(_exporters):
        exporter._after_fork_in_child()


# The one fork hook of the rank's side (the store's is store.writer's).
os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)


class NullExporter(Recording):
    """The sink handed out when telemetry is disabled or another exporter is selected.

    Records nothing, but refuses exactly what an Exporter refuses (the same
    recorders, every event disabled), so code tested with telemetry off does
    not break when it is switched on.
    """

    serving = False
    store_path = None

    def __init__(self, agent_name: str = "", environ: Mapping[str, str] | None = None) -> None:
        self.agent_name = agent_name
        self._next_claim_ns = NEVER
        self._bind_recording(NullSink())

    def close(self) -> None:
        pass

    def __enter__(self) -> NullExporter:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


def create_exporter(agent_name: str, environ: Mapping[str, str] | None = None) -> Exporter | NullExporter:
    """An Exporter when NIXL_TELEMETRY_ENABLE is on and NIXL_TELEMETRY_EXPORTER is prometheus_mp.

    Otherwise a NullExporter, so callers need no branches.  Configuration
    errors of a selected exporter still raise ConfigError.
    """
    env = os.environ if environ is None else environ
    if not parse_flag(ENABLE_ENV, env.get(ENABLE_ENV)):
        return NullExporter(agent_name)
    selected = env.get(EXPORTER_ENV, "").strip()
    if selected.lower() == EXPORTER_NAME and selected != EXPORTER_NAME:
        # NIXL loads the plug-in file named after the value, case-sensitively,
        # and refuses to create the agent when there is none: a misspelt
        # selection is an error there, so it must not be silence here.
        raise ConfigError(f"{EXPORTER_ENV}={selected!r} names no exporter: exporter names are case-sensitive, "
                          f"write {EXPORTER_NAME!r}")
    if selected != EXPORTER_NAME:
        log.info("%s=%r selects another exporter; this one records nothing", EXPORTER_ENV, selected)
        return NullExporter(agent_name)
    return Exporter(agent_name, env)


