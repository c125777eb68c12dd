"""``python -m app`` / ``nixl-prometheus-mp``: demo, rank, serve, aggregate, inspect, top.

The dispatcher: the parsers and ``main`` (the console script's entry point).  Each command is a module of
this package; what they share is app.cli.common.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence

from app.cli.common import DURATION, INTERVAL, PORT, PROG, RANKS, RATE, CliError, Parser, ttl_flag
from app.cli.demo import DEMO_PORT, add_rank_parser, cmd_demo
from app.cli.inspect import cmd_inspect
from app.cli.serve import AGGREGATE_COMMAND, AGGREGATOR_APP, AGGREGATOR_CONFIG, cmd_aggregate, cmd_serve
from app.cli.top import cmd_top
from app.config import DIR_ENV, TTL_ENV, ConfigError
from store import native

__all__ = ["AGGREGATE_COMMAND", "AGGREGATOR_APP", "AGGREGATOR_CONFIG", "PROG", "build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog=PROG, description="NIXL multi-process Prometheus telemetry exporter")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run N rank processes recording NIXL-like transfers behind one endpoint")
    demo.add_argument("--ranks", type=RANKS, default=4, help="rank processes to start (default 4)")
    demo.add_argument("--port", type=PORT, default=DEMO_PORT,
                      help=f"scrape port, bound on 127.0.0.1 (default {DEMO_PORT})")
    demo.add_argument("--duration", type=DURATION, default=0, help="seconds to run (default 0: until Ctrl-C)")
    demo.add_argument("--rate", type=RATE, default=200, help="transfers per second per rank (default 200)")
    demo.add_argument("--dir", help="shared directory (default: a new private temporary directory, removed on exit)")
    demo.set_defaults(func=cmd_demo)
    add_rank_parser(sub)
    serve = sub.add_parser("serve", help=f"the standalone aggregator on werkzeug (configured by {DIR_ENV} etc.)")
    serve.set_defaults(func=cmd_serve)
    # Listed for --help; main() hands every argument after it to gunicorn unparsed.
    sub.add_parser(AGGREGATE_COMMAND, help=f"the standalone aggregator on gunicorn, from any working directory: "
                                           f"gunicorn -c {AGGREGATOR_CONFIG} [GUNICORN OPTIONS] {AGGREGATOR_APP}",
                   add_help=False)
    inspect = sub.add_parser("inspect", help="list every store in a directory (never reaps)")
    inspect.add_argument("directory")
    inspect.add_argument("--json", action="store_true", help="JSON instead of a table")
    inspect.set_defaults(func=cmd_inspect)
    top = sub.add_parser("top", help="a live per-rank view of a directory: rates, transfer time p50/p99, errors "
                                     "(never reaps)")
    top.add_argument("directory", nargs="?", help=f"the shared directory (default: ${DIR_ENV})")
    top.add_argument("--once", action="store_true", help="print one snapshot over --interval and exit")
    top.add_argument("--json", action="store_true", help="one snapshot (as --once) as a JSON list of stores")
    top.add_argument("--interval", type=INTERVAL, default=1.0, help="seconds per refresh (default 1)")
    top.add_argument("--ttl", type=ttl_flag, help=f"seconds a departed rank stays published (default: ${TTL_ENV}, "
                                                   "else the TTL the directory's owner applies (its /healthz), else "
                                                   "30; the title says which)")
    top.set_defaults(func=cmd_top)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    problem = native.pure_python_problem()
    if problem is not None:
        print(f"{PROG}: error: {problem}", file=sys.stderr)
        return 2
    run: Callable[[], int]
    if argv[:1] == [AGGREGATE_COMMAND]:  # gunicorn's options and gunicorn's logging, not ours
        run = functools.partial(cmd_aggregate, argv[1:])
    else:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        args = build_parser().parse_args(argv)
        run = functools.partial(args.func, args)
    try:
        return int(run())
    except ConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except CliError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C before a command installed its own handling (serve's wait for the address)
        return 128 + signal.SIGINT
    except BrokenPipeError:
        # Whoever read our output went away (``| head -1``, ``| true``): end quietly with the status a Unix tool
        # killed by SIGPIPE gets from a shell.  Our stdout goes to /dev/null first, or the interpreter's own flush
        # at exit would fail on the closed pipe and print a traceback after all.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + signal.SIGPIPE
