"""gunicorn configuration of the standalone aggregator.

Run it from any directory, installed or from a checkout::

    gunicorn -c python:app.gunicorn_conf app:wsgi

It binds the address the ranks are configured with and holds that address's
owner election in the master (the hooks below); the workers only serve.
A configuration error stops the start with one line naming the variable:
gunicorn lets SystemExit through its config loading, and prints a traceback
for anything else.
"""

import logging
import os
import sys

from app.config import ConfigError
from app.standalone import (
    gunicorn_counts,
    hold_election,
    prepare_standalone,
    refuse_reexec,
    release_election,
    worker_forked,
)

if not logging.getLogger("nixl_prometheus_mp").handlers:  # our log lines, formatted like gunicorn's
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("[%(asctime)s] [%(process)d] [%(levelname)s] %(message)s",
                                            "%Y-%m-%d %H:%M:%S %z"))
    logging.getLogger("nixl_prometheus_mp").addHandler(_handler)
    logging.getLogger("nixl_prometheus_mp").setLevel(logging.INFO)

try:
    workers, threads = gunicorn_counts()
    _config = prepare_standalone()
except ConfigError as _exc:
    print(f"nixl-prometheus-mp: error: {_exc}", file=sys.stderr)
    raise SystemExit(1) from None

bind = [f"{_config.host}:{_config.port}"]
worker_class = "gthread"
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
    # Before gunicorn binds: the election, not the bind, decides who serves.
    try:
        hold_election(_config)
    except KeyboardInterrupt:  # Ctrl-C while another process serves the address and we wait for it
        raise SystemExit(1) from None


def pre_exec(server):
    # In the child forked for a USR2 upgrade, before it execs a new master.
    refuse_reexec(_config)


def post_fork(server, worker):
    worker_forked()


def on_exit(server):
    release_election()
