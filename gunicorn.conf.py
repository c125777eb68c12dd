"""gunicorn configuration for the standalone aggregator (``gunicorn app:wsgi``).

gunicorn reads ./gunicorn.conf.py by default, so a plain ``gunicorn app:wsgi``
run from the project directory picks this up; the Procfile names it
explicitly.  It binds the address the ranks are configured with and holds
that address's owner election in the master.
"""

import os

from app.standalone import hold_election, release_election, standalone_config, worker_forked

_config = standalone_config()  # fails the start, naming the variable, when the directory is unset

bind = [f"{_config.host}:{_config.port}"]
worker_class = "gthread"
workers = int(os.environ.get("GUNICORN_WORKERS", "2"))
threads = int(os.environ.get("GUNICORN_THREADS", "4"))
timeout = 30
graceful_timeout = 5
accesslog = None


def on_starting(server):
    # Before gunicorn binds: the election, not the bind, decides who serves.
    hold_election(_config)


def post_fork(server, worker):
    worker_forked()


def on_exit(server):
    release_election()
