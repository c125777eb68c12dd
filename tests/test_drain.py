"""SIGTERM means finish, then go: an address server or an aggregator told to stop with no rank live goes on
publishing the departed ranks' final values (new connections included) until their TTL, at most
NIXL_PROMETHEUS_MP_DRAIN_MAX, and /healthz says until when; a second SIGTERM, or SIGINT, ends it at once; with a
rank live it goes at once.  An aggregator still waiting for its address ends at once on SIGTERM, as a
container's PID 1 too (real PID namespaces: ``unshare --pid --fork --mount-proc``).

Real processes and signals; every wait is on the state it checks, bounded by a deadline only a hang reaches.
"""

from __future__ import annotations

import datetime
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
from support import DEADLINE_S, Reaper, free_port, get_json, http_get, wait_until
from support_e2e import (
    by_rank,
    expected,
    kubelet_stop,
    parse_text,
    procfile_web_command,
    rank_env,
    spawn_rank,
    wait_ready,
)

from app.probe import SERVER_COMM, is_address_server

TTL_S = 4.0


def _healthz(port: int) -> dict:
    return get_json(f"http://127.0.0.1:{port}/healthz", timeout=2)


def _draining_until(port: int) -> float | None:
    """When /healthz says the server draining ``port`` exits (epoch seconds), None if it says nothing of it."""
    found = [w for w in _healthz(port)["warnings"] if w["kind"] == "draining"]
    return datetime.datetime.fromisoformat(found[0]["details"]["until"]).timestamp() if found else None


def _final_values(port: int, ranks: int) -> None:
    """The ranks' final values, all of them, on /metrics."""
    samples = parse_text(http_get(f"http://127.0.0.1:{port}/metrics").body)
    assert by_rank(samples, "agent_tx_bytes_total") == {str(i): expected(i)["agent_tx_bytes_total"]
                                                        for i in range(ranks)}


def _job_state(port: int) -> tuple[float, float, float]:
    """(live ranks, departed ranks, draining) as /metrics says them, in the endpoint's own families."""
    samples = parse_text(http_get(f"http://127.0.0.1:{port}/metrics").body)
    return (samples[("nixl_prometheus_mp_ranks", frozenset({("state", "live")}))],
            samples[("nixl_prometheus_mp_ranks", frozenset({("state", "departed")}))],
            samples[("nixl_prometheus_mp_draining", frozenset())])


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


def _job(r: Reaper, directory: Path, port: int, ranks: int, **extra: str) -> list:
    env = {"NIXL_TELEMETRY_MP_STALE_TTL": str(TTL_S), **extra}
    procs = [spawn_rank(r, directory, port, i, **env) for i in range(ranks)]
    for proc in procs:
        wait_ready(proc)
    return procs


def _server_pid(port: int) -> int:
    def answered() -> int | None:
        owner = _healthz(port)["owner"]
        return owner["server_pid"] if owner["serving"] == "helper" else None
    return wait_until(answered, DEADLINE_S, "the job's address server")


def test_a_sigtermed_server_publishes_the_final_values_until_their_ttl_then_goes(tmp_path: Path) -> None:
    directory, port = tmp_path / "mp", free_port()
    with Reaper() as r:
        procs = _job(r, directory, port, 2)
        server = _server_pid(port)
        kubelet_stop(procs)
        os.kill(server, signal.SIGTERM)
        until = wait_until(lambda: _draining_until(port), DEADLINE_S, "/healthz saying until when it drains")
        assert until - time.time() <= TTL_S  # the last departed store's TTL, not the drain's maximum
        _final_values(port, 2)  # served on, to new connections
        assert _job_state(port) == (0, 2, 1)  # what tells Prometheus the job ended (deploy/nixl.rules.yml)
        wait_until(lambda: _gone(server), TTL_S + DEADLINE_S, "the server's exit after the drain")
        assert time.time() >= until - 0.5, "it went before the departed ranks' TTL"
        assert not is_address_server(server, f"127.0.0.1:{port}", (SERVER_COMM,))


@pytest.mark.parametrize("second", ["SIGTERM", "SIGINT"])
def test_a_second_sigterm_or_a_sigint_ends_a_drain_at_once(tmp_path: Path, second: str) -> None:
    directory, port = tmp_path / "mp", free_port()
    with Reaper() as r:
        procs = _job(r, directory, port, 1, NIXL_PROMETHEUS_MP_DRAIN_MAX="600")
        server = _server_pid(port)
        kubelet_stop(procs)
        # A TTL this long would hold the server for minutes: the drain's maximum is what bounds it here.
        os.kill(server, signal.SIGTERM)
        wait_until(lambda: _draining_until(port), DEADLINE_S, "the drain")
        started = time.monotonic()
        os.kill(server, getattr(signal, second))
        wait_until(lambda: _gone(server), DEADLINE_S, "the server's exit")
        assert time.monotonic() - started < TTL_S  # (at once: not the drain's end)


def test_a_sigterm_with_a_rank_live_gives_the_address_up_at_once(tmp_path: Path) -> None:
    directory, port = tmp_path / "mp", free_port()
    with Reaper() as r:
        _job(r, directory, port, 1, NIXL_TELEMETRY_MP_STALE_TTL="600")
        server = _server_pid(port)
        assert _job_state(port) == (1, 0, 0)
        started = time.monotonic()
        os.kill(server, signal.SIGTERM)
        wait_until(lambda: _gone(server), DEADLINE_S, "the server's exit")
        assert time.monotonic() - started < TTL_S  # (at once: the live rank takes the address over as it records)


def test_a_sigtermed_aggregator_publishes_the_final_values_until_their_ttl_then_goes(tmp_path: Path) -> None:
    """The pod's end, in the kubelet's order: the rank containers are stopped and waited for, then the
    sidecar (the gunicorn aggregator) is SIGTERMed; it keeps every rank's final values up for the TTL."""
    directory, port = tmp_path / "mp", free_port()
    with Reaper() as r:
        aggregator = r.spawn(procfile_web_command(), rank_env(directory, port, GUNICORN_WORKERS="1",
                                                              NIXL_TELEMETRY_MP_STALE_TTL=str(TTL_S)),
                             cwd=tmp_path)
        wait_until(lambda: _healthz(port)["owner"]["mode"] == "standalone", DEADLINE_S, "the aggregator serving")
        ranks = _job(r, directory, port, 2)
        stopping = threading.Thread(target=kubelet_stop, args=(ranks, [aggregator], TTL_S + DEADLINE_S))
        stopping.start()
        until = wait_until(lambda: _draining_until(port), DEADLINE_S, "/healthz (a worker's) saying the drain")
        _final_values(port, 2)
        assert _job_state(port) == (0, 2, 1)  # a worker's /metrics too: the drain page is shared
        stopping.join(TTL_S + 2 * DEADLINE_S)
        assert aggregator.popen.poll() == 0, aggregator.output
        assert time.time() >= until - 0.5, "it went before the departed ranks' TTL"
        assert "Traceback" not in aggregator.output


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="a PID namespace needs root")
def test_an_aggregator_waiting_for_its_address_as_pid_1_ends_at_once_on_sigterm(tmp_path: Path) -> None:
    """As a container's PID 1 a process ignores every signal it has no handler for: a waiting aggregator has
    one (gunicorn's own are not installed yet)."""
    directory, port = tmp_path / "mp", free_port()
    with Reaper() as r:
        _job(r, directory, port, 1)
        _server_pid(port)
        container = r.spawn(["unshare", "--pid", "--fork", "--mount-proc", *procfile_web_command()],
                            rank_env(directory, port, GUNICORN_WORKERS="1"), cwd=tmp_path)
        container.wait_line(lambda s: "holds the owner election" in s, DEADLINE_S)
        pid_1 = wait_until(lambda: next(iter(_children(container.pid)), None), DEADLINE_S, "the namespace's PID 1")
        assert Path(f"/proc/{pid_1}/status").read_text().split("NSpid:")[1].split()[1] == "1"
        started = time.monotonic()
        os.kill(pid_1, signal.SIGTERM)  # (from the parent namespace, as the runtime sends it)
        assert container.popen.wait(DEADLINE_S) == 0, container.output
        assert time.monotonic() - started < 5.0
        assert "told to stop while waiting" in container.output


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []
