"""``nixl-prometheus-mp serve`` (the aggregator on werkzeug) and ``aggregate`` (the aggregator on gunicorn,
from any working directory).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time

from app.cli.common import PROG, CliError
from app.config import Config
from app.stopsignals import StopSignals

log = logging.getLogger("nixl_prometheus_mp.cli")


def cmd_serve(args: argparse.Namespace) -> int:
    from app.aggregator.hooks import drain_time, hold_election, port_problem, release_election
    from app.aggregator.settings import prepare_standalone
    from app.aggregator.wsgi import build_app
    from app.listener import bind_listener
    from app.server import serve_in_thread

    config = Config.from_env()
    prepare_standalone(config)
    stop = StopSignals()
    if hold_election(config, stop.wait) is None:
        stop.close()
        return 0
    try:
        try:
            sock = bind_listener(config.host, config.port)
        except OSError as exc:
            raise CliError(port_problem(config) or f"cannot bind {config.address}: {os.strerror(exc.errno or 0)}"
                           ) from None
        try:
            server, thread = serve_in_thread(sock, build_app(config, serving="werkzeug"), "nixl-aggregator")
        finally:
            sock.close()  # the server serves its own duplicate
        log.info("serving %s on http://%s/metrics", config.directory, config.address)
        drain_end: float | None = None
        while thread.is_alive() and (drain_end is None or time.monotonic() < drain_end):
            if not stop.wait(0.5 if drain_end is None else min(0.5, drain_end - time.monotonic())):
                continue
            if stop.signum != signal.SIGTERM or drain_end is not None or (left_s := drain_time(config)) is None:
                break  # SIGINT or SIGHUP, a second SIGTERM, or nothing to finish: at once
            drain_end = time.monotonic() + left_s
            stop.rearm()  # the next stop signal ends the drain
        server.shutdown()
        thread.join(timeout=5)
    finally:
        stop.close()
        release_election()
    return 0


AGGREGATE_COMMAND = "aggregate"
AGGREGATOR_CONFIG, AGGREGATOR_APP = "python:app.gunicorn_conf", "app:wsgi"


def cmd_aggregate(gunicorn_args: list[str]) -> int:
    """``gunicorn -c python:app.gunicorn_conf [ARGS] app:wsgi``, with this installation's packages.

    The gunicorn command puts its working directory first on sys.path before it imports the configuration
    and the app, so an app/ or store.py there is imported instead of these. Run from this console script,
    whose sys.path does not start with the working directory, app, store and election are already imported
    when gunicorn looks them up: no working directory changes what runs.
    """
    from gunicorn.app.wsgiapp import WSGIApplication
    from gunicorn.config import Config as GunicornConfig

    prog = f"{PROG} {AGGREGATE_COMMAND}"
    given = GunicornConfig(prog=prog).parser().parse_args(gunicorn_args)  # --help and bad options: gunicorn's
    if given.config or given.args:  # a usage error, as argparse's are: one line, exit status 2
        print(f"{PROG}: error: {prog} runs gunicorn -c {AGGREGATOR_CONFIG} [OPTIONS] {AGGREGATOR_APP}: give it "
              f"gunicorn options only, not {'-c ' + given.config if given.config else ' '.join(given.args)}",
              file=sys.stderr)
        return 2
    sys.argv = [prog, "-c", AGGREGATOR_CONFIG, *gunicorn_args, AGGREGATOR_APP]  # what gunicorn parses
    WSGIApplication("%(prog)s [GUNICORN OPTIONS]", prog=prog).run()  # exits: gunicorn's master ends with sys.exit
    return 0
