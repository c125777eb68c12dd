"""Pods and containers: real PID namespaces (``unshare --pid --fork --mount-proc``), as a container runtime
makes them, scraped from outside (the network namespace is the host's, as a pod's port is reachable).

A container is a PID namespace: when its first process exits, the kernel kills every other one in it, and a
first process that is not an init reaps nobody.  What that means for the address server is said where it
happens (its log, /healthz); the image's init (tini) reaps what a server leaves.  Every wait is on the state
it checks, bounded by a deadline only a hang reaches.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import time
from pathlib import Path

import pytest
from support import (
    DEADLINE_S,
    START_DEADLINE_S,
    Proc,
    Reaper,
    Scraper,
    children_of,
    free_port,
    get_json,
    kill_server_and_spare,
    wait_until,
)
from support_e2e import (
    RANK_CODE,
    XFER_COUNT,
    XFER_US,
    by_rank,
    kubelet_stop,
    parse_text,
    procfile_web_command,
    rank_env,
    wait_ready,
)
from test_e2e_prometheus import PROMETHEUS, Prometheus, shipped_static_config

from app import Exporter
from app.probe import SERVER_COMM, SPARE_COMM, is_address_server, listening_pids
from bench.pods import COUNTING_RANK, POD_TTL_S, SCRAPERS  # (the bench's pod, measured there 10 times)
from store import EventType, Snapshot, read_snapshot

CONTAINER_MESSAGE = "runs in a PID namespace of its own (a container)"
CONTAINER = ("unshare", "--pid", "--fork", "--mount-proc", "tini", "--")  # a container, under the image's init
NEEDS_NAMESPACES = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                                      reason="a PID namespace needs root and unshare(1)")


def _container(r: Reaper, directory: Path, port: int, init: tuple[str, ...] = (), **extra: str):
    """A rank as a container's main process (``init``: the init it runs under, as the image's entrypoint)."""
    command = ["unshare", "--pid", "--fork", "--mount-proc", *init, sys.executable, "-c", RANK_CODE, "agent-0", "0",
               str(XFER_US[0]), str(XFER_COUNT)]
    return r.spawn(command, rank_env(directory, port, LOCAL_RANK="0", **extra), stdin=True)


def _server(port: int, not_pid: int = 0) -> int:
    def answered() -> int | None:
        owner = get_json(f"http://127.0.0.1:{port}/healthz", timeout=2)["owner"]
        pid = owner["server_pid"] if owner["serving"] == "helper" else None
        return pid if pid != not_pid else None
    return wait_until(answered, START_DEADLINE_S, "an address server answering")


def _host_pid_of_server(port: int) -> int:
    """The address server's pid as this (the host's) namespace sees it: /healthz gives the container's."""
    return wait_until(lambda: next((pid for pid in listening_pids(port)
                                    if is_address_server(pid, f"127.0.0.1:{port}", (SERVER_COMM,))), None),
                      DEADLINE_S, "the address server listening")


def _state_and_parent(pid: int) -> tuple[str, int]:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return fields[0], int(fields[1])


def _zombies_of(parent: int) -> list[int]:
    zombies = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                state, ppid = _state_and_parent(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
            if state == "Z" and ppid == parent:
                zombies.append(int(entry.name))
    return zombies


@NEEDS_NAMESPACES
def test_a_server_in_a_container_says_it_ends_with_the_container_and_does(tmp_path: Path) -> None:
    directory, port = tmp_path / "mp", free_port()
    with Reaper() as r:
        rank = _container(r, directory, port)
        wait_ready(rank, START_DEADLINE_S)
        _server(port)
        server = _host_pid_of_server(port)
        warnings = wait_until(lambda: [w for w in get_json(f"http://127.0.0.1:{port}/healthz")["warnings"]
                                       if w["kind"] == "pid-namespace"], DEADLINE_S, "the /healthz warning")
        assert warnings[0]["details"]["namespace"] == os.readlink(f"/proc/{server}/ns/pid")
        assert warnings[0]["details"]["namespace"] != os.readlink("/proc/self/ns/pid")  # (the host's: not said)
        assert "sidecar" in warnings[0]["message"]
        # Said once in the rank's own log, where its operator looks.
        wait_until(lambda: CONTAINER_MESSAGE in rank.output, DEADLINE_S, "the warning in the rank's log")
        assert rank.output.count(CONTAINER_MESSAGE) == 1, rank.output
        # And so it is: the rank, the namespace's first process, ends; the server goes with it, at once, where on
        # a host it would publish the rank's final values until their TTL (here an hour).
        assert rank.stop() == 0, rank.output
        wait_until(lambda: not Path(f"/proc/{server}").exists() or _state_and_parent(server)[0] in "ZX",
                   DEADLINE_S, "the server's end with its container")


@NEEDS_NAMESPACES
@pytest.mark.skipif(shutil.which("tini") is None, reason="tini (the image's init) is not installed")
@pytest.mark.parametrize("init", ["tini", "the rank itself"])
def test_server_deaths_leave_zombies_only_without_an_init_that_reaps(tmp_path: Path, init: str) -> None:
    directory, port = tmp_path / "mp", free_port()
    with Reaper() as r:
        rank = _container(r, directory, port, ("tini", "--") if init == "tini" else ())
        wait_ready(rank, START_DEADLINE_S)
        (first,) = wait_until(lambda: children_of(rank.pid) or None, DEADLINE_S, "the namespace's first process")
        server = _server(port)
        for _ in range(5):  # server and spare killed together: the recording rank starts another
            kill_server_and_spare(port)
            server = _server(port, not_pid=server)
        if init == "tini":
            wait_until(lambda: _zombies_of(first) == [], DEADLINE_S, lambda: f"zombies {_zombies_of(first)} reaped")
        else:  # a first process that is not an init reaps nobody: each server and spare killed stays a zombie
            wait_until(lambda: len(_zombies_of(first)) >= 5, DEADLINE_S, "the zombies of the servers killed")


# Three jobs in a row in one container, each a rank that records once and closes, more than the TTL apart: each
# job's address server publishes its final values until the TTL, then exits (a child of the container's init by
# then); the container's main process goes on (a shell that sleeps, as a long-lived container's would).
THREE_JOBS = """
for job in 1 2 3; do
  "$PYTHON" -c 'from app import Exporter; e = Exporter("job"); e.export_event(3, 1); e.close()'
  echo "job $job done"
  sleep 2
done
exec sleep 600
"""


def _ours_under(parent: int) -> list[str]:
    """The address servers and spares whose parent is ``parent``, running or zombies (which keep their name)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                comm = (entry / "comm").read_text().strip()
                state, ppid = _state_and_parent(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
            if ppid == parent and comm in (SERVER_COMM, SPARE_COMM):
                found.append(f"{entry.name} {comm} {state}")
    return found


@NEEDS_NAMESPACES
@pytest.mark.skipif(shutil.which("tini") is None, reason="tini (the image's init) is not installed")
def test_three_jobs_in_a_row_leave_no_zombie_under_the_images_init(tmp_path: Path) -> None:
    directory, port = tmp_path / "mp", free_port()
    with Reaper() as r:
        container = r.spawn([*CONTAINER, "sh", "-c", THREE_JOBS],
                            rank_env(directory, port, PYTHON=sys.executable, NIXL_TELEMETRY_MP_STALE_TTL="1"))
        (first,) = wait_until(lambda: children_of(container.pid) or None, DEADLINE_S, "the container's init")
        container.wait_line(lambda line: line == "job 3 done", 3 * START_DEADLINE_S)
        # Every job's server gone once its TTL passed, and reaped: no zombie keeps its name under the init.
        wait_until(lambda: _ours_under(first) == [], 3 * DEADLINE_S, lambda: f"left: {_ours_under(first)}")
        # (and there were three: each job's server, started after the last one's TTL, said where it runs)
        assert (directory / f"nixl-server.127.0.0.1:{port}.log").read_text().count(CONTAINER_MESSAGE) >= 3


@NEEDS_NAMESPACES
@pytest.mark.e2e
@pytest.mark.skipif(shutil.which("tini") is None or PROMETHEUS is None, reason="needs tini and Debian's prometheus")
def test_a_pods_end_with_the_sidecar_leaves_every_final_value_in_real_prometheus_servers(tmp_path: Path) -> None:
    """The same pod's end, scraped by real Prometheus servers: an HA pair every 1 s, and one every 3 s (the
    shipped plain-host configuration, its pace scaled with the TTL); each stores every rank's final value."""
    directory, port = tmp_path / "mp", free_port()
    target = f"127.0.0.1:{port}"
    slow = shipped_static_config([target])
    slow["global"].update(scrape_interval="3s", scrape_timeout="2s", evaluation_interval="3s")
    slow["scrape_configs"][0].update(scrape_interval="3s", scrape_timeout="2s")
    with Reaper() as r:
        servers = [Prometheus(r, tmp_path / "ha-0", target), Prometheus(r, tmp_path / "ha-1", target),
                   Prometheus(r, tmp_path / "slow", config=slow)]
        sidecar, ranks = _pod(r, directory, port, tmp_path)
        wait_until(lambda: all(len(server.by_rank('agent_rx_requests_num_total{job="nixl"}')) == 3
                               for server in servers), START_DEADLINE_S, "every Prometheus scraping three ranks")
        truth: dict[str, int] = {}
        kubelet_stop(ranks, [sidecar], between=lambda: truth.update(_final_counts(directory)))
        assert sorted(truth) == ["0", "1", "2"]
        for server in servers:
            stored = server.by_rank('last_over_time(agent_rx_requests_num_total{job="nixl"}[5m])')
            assert stored == {rank: float(value) for rank, value in truth.items()}, (server.url, stored, truth)


@pytest.mark.skipif(os.geteuid() != 0, reason="a directory of another user's that this process may write: root")
def test_a_rank_of_another_user_than_the_directorys_is_told_its_store_goes_unpublished(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A root rank in a pod whose aggregator runs as uid 1000 (an image without ``USER``): the aggregator skips
    its store; the rank's own log says so, not only the aggregator's /healthz."""
    directory = tmp_path / "mp"
    directory.mkdir(mode=0o700)
    os.chown(directory, 12345, 12345)
    env = rank_env(directory, free_port(), NIXL_PROMETHEUS_MP_SERVE="thread")
    with caplog.at_level(logging.WARNING, logger="nixl_prometheus_mp"), Exporter("root-rank", env) as exporter:
        assert exporter.store_path.parent == directory
    said = [r.getMessage() for r in caplog.records if "owned by uid 12345" in r.getMessage()]
    assert len(said) == 1 and "skips the stores of other users" in said[0] and "runAsUser" in said[0], said


def _requests_by_rank(text: str) -> dict[str, float]:
    return by_rank(parse_text(text.encode()), "agent_rx_requests_num_total")


def _pod(r: Reaper, directory: Path, port: int, cwd: Path) -> tuple[Proc, list[Proc]]:
    """deploy/nixl-ranks.yaml's shape: the aggregator in a container of its own, started first (it holds the
    address); then three ranks counting requests, one per container; every container under tini."""
    env = {"NIXL_TELEMETRY_MP_STALE_TTL": str(POD_TTL_S)}
    sidecar = r.spawn([*CONTAINER, *procfile_web_command()],
                      rank_env(directory, port, GUNICORN_WORKERS="1", **env), cwd=cwd)
    wait_until(lambda: get_json(f"http://127.0.0.1:{port}/healthz", timeout=2)["owner"]["mode"] == "standalone",
               START_DEADLINE_S, "the sidecar serving")
    ranks = [r.spawn([*CONTAINER, sys.executable, "-c", COUNTING_RANK], rank_env(directory, port,
                                                                             LOCAL_RANK=str(i), **env))
             for i in range(3)]
    return sidecar, ranks


def _final_counts(directory: Path) -> dict[str, int]:
    """What each rank's store holds once the ranks are gone, by local rank: the truth every scraper must see."""
    snaps = [read_snapshot(path) for path in directory.glob("nixl.*.mmap")]
    return {s.local_rank: s.counters[EventType.AGENT_RX_REQUESTS_NUM] for s in snaps if isinstance(s, Snapshot)}


@NEEDS_NAMESPACES
@pytest.mark.skipif(shutil.which("tini") is None, reason="tini (the image's init) is not installed")
@pytest.mark.parametrize("trial", range(2))
def test_a_pods_end_with_the_sidecar_gives_every_scraper_every_ranks_final_value(tmp_path: Path,
                                                                                 trial: int) -> None:
    """deploy/nixl-ranks.yaml's shape: the aggregator in a container of its own, started first; three ranks, one
    per container; every container under tini, in a PID namespace of its own.  The pod ends in the kubelet's
    order; an HA pair (1 s apart) and a slower Prometheus (every 3 s) each see every rank's final value."""
    directory, port = tmp_path / "mp", free_port()
    with Reaper() as r:
        sidecar, ranks = _pod(r, directory, port, tmp_path)
        wait_until(lambda: len(_final_counts(directory)) == 3, START_DEADLINE_S, "three ranks recording")
        scrapers = [Scraper(port, interval, offset, _requests_by_rank) for interval, offset in SCRAPERS]
        ended = time.monotonic()
        truth: dict[str, int] = {}
        try:  # (the ranks' final values are read before the sidecar reaps their stores after the TTL)
            kubelet_stop(ranks, [sidecar], between=lambda: truth.update(_final_counts(directory)))
        finally:
            for scraper in scrapers:
                scraper.close()
        assert sorted(truth) == ["0", "1", "2"]
        for scraper in scrapers:
            assert scraper.saw_since(ended, truth), (scraper.interval_s, truth, scraper.scrapes[-3:])
