"""gunicorn configuration of the standalone aggregator.

Run it from any directory, installed or from a checkout::

    gunicorn -c python:app.gunicorn_conf app:wsgi
    nixl-prometheus-mp aggregate        # the same, whatever the working directory holds

It binds the address the ranks are configured with and holds that address's
owner election in the master (the hooks below); the workers only serve.
Its path is documented (the Procfile, the Containerfile, deploy/), so it stays
here; the hooks' work is app.aggregator's.
A configuration error stops the start with one line naming the variable:
gunicorn lets SystemExit through its config loading and its on_starting
hook, and prints a traceback for anything else.
"""

import logging
import os
import sys
from typing import NoReturn

from gunicorn.glogging import Logger

from app.aggregator.hooks import (
    drain_on_sigterm,
    hold_election,
    port_problem,
    refuse_reexec,
    release_election,
    worker_forked,
)
from app.aggregator.settings import gunicorn_counts, gunicorn_overrides, prepare_standalone
from app.config import Config, ConfigError
from app.http import MAX_HEADER_FIELDS, MAX_REQUEST_LINE
from app.stopsignals import StopSignals

_log = logging.getLogger("nixl_prometheus_mp")
if not _log.handlers:  # our log lines, formatted like gunicorn's
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("[%(asctime)s] [%(process)d] [%(levelname)s] %(message)s",
                                            "%Y-%m-%d %H:%M:%S %z"))
    _log.addHandler(_handler)
    _log.setLevel(logging.INFO)  # until on_starting knows gunicorn's --log-level


def _refuse(problem: object) -> NoReturn:
    print(f"nixl-prometheus-mp: error: {problem}", file=sys.stderr)
    raise SystemExit(1)


try:
    workers, threads = gunicorn_counts()
    _config = Config.from_env()
except ConfigError as _exc:
    _refuse(_exc)

bind = [_config.address]
worker_class = "gthread"
# The request bounds of the ranks' server (app.http): the request line and the number of header fields.  gunicorn
# bounds each field (here as long as a request line) where app.http bounds their total (MAX_HEADER_BYTES):
# gunicorn has no such setting, so a request here may hold up to 64 x 8 KiB of fields, in the operator's own
# worker process, not in a rank.
limit_request_line = MAX_REQUEST_LINE
limit_request_fields = MAX_HEADER_FIELDS
limit_request_field_size = MAX_REQUEST_LINE
timeout = 30
graceful_timeout = 5
accesslog = None
control_socket_disable = True  # gunicorn >= 25: no gunicorn.ctl in $HOME (nor a thread in the master)
# Each worker's heartbeat file goes in the temporary directory by default, which a container with
# readOnlyRootFilesystem has none of ("No usable temporary directory found"): /dev/shm, gunicorn's
# documented answer, is the runtime's own tmpfs there. Elsewhere, without it, gunicorn's default stays.
if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK | os.X_OK):
    worker_tmp_dir = "/dev/shm"


def on_starting(server):
    # gunicorn applies its command line after this module: only now are its final settings known.
    problem = gunicorn_overrides(server.cfg, _config, workers, threads)
    if problem:
        _refuse(problem)
    _log.setLevel(Logger.LOG_LEVELS.get(server.cfg.loglevel.lower(), logging.INFO))  # gunicorn's own mapping
    try:
        prepare_standalone(_config)
    except ConfigError as exc:
        _refuse(exc)
    # Before gunicorn binds: the election, not the bind, decides who serves.  gunicorn's signal handlers come
    # after this hook: the wait has its own (a stop signal, Ctrl-C included, ends it).
    stop = StopSignals()
    try:
        held = hold_election(_config, stop.wait)
    finally:
        stop.close()
    if held is None:
        raise SystemExit(0)
    problem = port_problem(_config)
    if problem:
        release_election()
        _refuse(problem)


def when_ready(server):
    drain_on_sigterm(server, _config)


def pre_exec(server):
    # In the child forked for a USR2 upgrade, before it execs a new master.
    refuse_reexec(_config)


def post_fork(server, worker):
    worker_forked()


def on_exit(server):
    release_election()
