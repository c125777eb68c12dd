"""gunicorn configuration for the standalone aggregator (``gunicorn app:wsgi``).

gunicorn reads ./gunicorn.conf.py by default, so a plain ``gunicorn app:wsgi``
run from the project directory picks this up; the Procfile names it
explicitly.  It binds the address the ranks are configured with and holds
that address's owner election in the master; the workers only serve.
"""

import logging
import os
import sys

from app.config import ConfigError
from app.standalone import hold_election, prepare_standalone, release_election, worker_forked

if not logging.getLogger("nixl_prometheus_mp").handlers:  # our log lines, formatted like gunicorn's
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("[%(asctime)s] [%(process)d] [%(levelname)s] %(message)s",
                                            "%Y-%m-%d %H:%M:%S %z"))
    logging.getLogger("nixl_prometheus_mp").addHandler(_handler)
    logging.getLogger("nixl_prometheus_mp").setLevel(logging.INFO)

try:
    _config = prepare_standalone()
except ConfigError as _exc:
    # One line naming the variable, not gunicorn's "Failed to read config file" traceback
    # (SystemExit is the one exception gunicorn lets through here).
    print(f"nixl-prometheus-mp: error: {_exc}", file=sys.stderr)
    raise SystemExit(1) from None

bind = [f"{_config.host}:{_config.port}"]
worker_class = "gthread"
workers = int(os.environ.get("GUNICORN_WORKERS", "2"))
threads = int(os.environ.get("GUNICORN_THREADS", "4"))
timeout = 30
graceful_timeout = 5
accesslog = None
control_socket_disable = True  # gunicorn >= 25: no gunicorn.ctl in $HOME (nor a thread in the master)


def on_starting(server):
    # Before gunicorn binds: the election, not the bind, decides who serves.
    try:
        hold_election(_config)
    except KeyboardInterrupt:  # Ctrl-C while a rank serves the address and we wait for it
        raise SystemExit(1) from None


def post_fork(server, worker):
    worker_forked()


def on_exit(server):
    release_election()
