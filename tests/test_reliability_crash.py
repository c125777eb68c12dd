"""A crash storm: rounds of random SIGKILLs of writers and owners while the others record and a client
scrapes continuously.  Scrapes fail only right after an owner's death, the endpoint comes back every time,
and afterwards the directory holds one store, no staging file, and the very same lock file.

Both ways of serving.  From a thread, the owner is the serving rank.  With an address server, the owner is that
server (its death is the takeover: a standby rank starts the next one), and the ranks killed include the one that
started it, whose death must cost no scrape at all."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
from typing import Any

import pytest
from support import (
    DEADLINE_S,
    EXPORTER_RANK_SCRIPT,
    child_env,
    exporter_env,
    free_port,
    healthz,
    http_get,
    metrics_url,
    parse_exposition,
    reaper_fixture,  # noqa: F401  (a fixture)
    start_exporter_rank,
    wait_until,
)

from app import Exporter
from election import address_is_held

pytestmark = [pytest.mark.reliability, pytest.mark.usefixtures("serve_mode")]  # both ways of serving

ROUNDS = 5
RANKS = 4
TAKEOVER_WINDOW_S = 5.0  # scrape errors are tolerated only this long after an owner's death


class Scraper(threading.Thread):
    """Scrapes /metrics back to back; records (monotonic end time, error or None)."""

    def __init__(self, port: int) -> None:
        super().__init__(name="storm-scraper", daemon=True)
        self.port = port
        self.stop = threading.Event()
        self.results: list[tuple[float, str | None]] = []

    def run(self) -> None:
        while not self.stop.is_set():
            error = None
            try:
                response = http_get(metrics_url(self.port), timeout=2.0)
                if response.status != 200:
                    error = f"status {response.status}"
                else:
                    parse_exposition(response.text)  # every answer is a well-formed exposition
            except Exception as exc:  # connection refused/reset during the takeover gap
                error = repr(exc)
            self.results.append((time.monotonic(), error))
            self.stop.wait(0.02)


def serving(port: int) -> dict[str, Any]:
    """/healthz's owner, once something answers it."""
    return wait_until(lambda: healthz(port, timeout=2.0)["owner"], timeout=TAKEOVER_WINDOW_S + DEADLINE_S,
                      message="an owner serving /healthz")


def kill_server(pid: int) -> None:
    """SIGKILL an address server and reap it: this process is a subreaper (conftest), the server its orphan."""
    os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


@pytest.mark.timeout(150)
def test_crash_storm_loses_only_the_takeover_gap(tmp_dir, reaper, serve_mode):
    port = free_port()
    rng = random.Random(20240611)
    extra = {"NIXL_TELEMETRY_MP_STALE_TTL": "1"}  # short: dead ranks are reaped while the storm goes on
    helper = serve_mode == "helper"

    def spawn():
        return start_exporter_rank(reaper, tmp_dir, port, agent="storm", extra_env=extra, tick_hz=100)

    ranks = [spawn() for _ in range(RANKS)]
    serving(port)
    lock = tmp_dir / f"nixl-owner.127.0.0.1:{port}.lock"
    lock_inode = lock.stat().st_ino
    scraper = Scraper(port)
    scraper.start()
    owner_deaths: list[float] = []
    killed_servers: set[int] = set()
    try:
        for _ in range(ROUNDS):
            owner = serving(port)["server_pid"]
            by_pid = {r.pid: r for r in ranks}
            if helper:  # any rank may die, the one that started the server included: that costs no scrape
                assert owner not in by_pid and owner not in killed_servers, (owner, list(by_pid))
                victims = rng.sample(list(by_pid), rng.randint(1, 2))
            else:
                assert owner in by_pid, (owner, list(by_pid))
                victims = rng.sample([p for p in by_pid if p != owner], rng.randint(1, 2))
            doomed = list(victims)
            if rng.random() < 0.8:
                doomed.append(owner)
            rng.shuffle(doomed)
            for pid in doomed:
                if pid == owner:
                    owner_deaths.append(time.monotonic())
                if pid in by_pid:
                    os.kill(pid, signal.SIGKILL)
                    by_pid[pid].kill()  # waits
                else:
                    kill_server(pid)
                    killed_servers.add(pid)
                time.sleep(rng.uniform(0, 0.05))
            # A rank killed while it starts (creating its store, maybe winning the election): it might have
            # been serving, or starting a server, so its death opens a takeover window too.
            newborn = reaper.start(EXPORTER_RANK_SCRIPT, child_env({**exporter_env(tmp_dir, port), **extra,
                                                                    "RANK_TICK_HZ": "100"}))
            time.sleep(rng.uniform(0.0, 0.4))
            owner_deaths.append(time.monotonic())
            newborn.kill()
            ranks = [r for r in ranks if r.pid not in doomed]
            ranks += [spawn() for _ in range(RANKS - len(ranks))]
            back = serving(port)  # the endpoint is back
            if helper:
                assert back["serving"] == "helper" and back["server_pid"] not in killed_servers, back
            else:
                assert back["pid"] in {r.pid for r in ranks}, back
            time.sleep(rng.uniform(0.3, 1.0))
    finally:
        scraper.stop.set()
        scraper.join(timeout=10)

    results = scraper.results
    errors = [(t, e) for t, e in results if e is not None]
    assert len(results) - len(errors) > 50, f"too few successful scrapes: {len(results)} total, {errors[:5]}"
    outside = [(round(t - results[0][0], 3), e) for t, e in errors
               if not any(d <= t <= d + TAKEOVER_WINDOW_S for d in owner_deaths)]
    assert not outside, f"scrape errors outside any takeover window: {outside[:5]}"
    print(f"storm: {len(results)} scrapes, {len(errors)} failed, {len(owner_deaths)} owner deaths")

    # Wind down: half the survivors exit cleanly, the others are killed.
    for n, rank in enumerate(ranks):
        if n % 2:
            rank.process.send('{"op": "exit"}')
            rank.process.proc.wait(timeout=10)
        else:
            rank.kill()
    assert not list(tmp_dir.glob("*.staging")), "a staging file leaked"
    # From a thread, the address goes with its last owner; an address server gives it up a TTL (1 s) after the
    # last rank's last update.
    wait_until(lambda: not address_is_held(tmp_dir, f"127.0.0.1:{port}"), message="the election free")
    # A fresh exporter with TTL 0 (the next run) reaps every departed store as it is scraped.
    final = Exporter("final", exporter_env(tmp_dir, port, NIXL_TELEMETRY_MP_STALE_TTL="0"))
    try:
        assert final.serving

        def published_pids() -> set[int]:
            body = http_get(metrics_url(port)).text
            return {int(v) for _, labels in parse_exposition(body) for k, v in labels if k == "pid"}

        wait_until(lambda: published_pids() == {os.getpid()}, message="only the new run's rank published")
        assert sorted(tmp_dir.glob("nixl.*.mmap")) == [final.store_path]
    finally:
        final.close()
    if helper:  # its server publishes the closed rank for the TTL (0), reaps its store and gives the address up
        wait_until(lambda: not address_is_held(tmp_dir, f"127.0.0.1:{port}"), message="the last server gone")
        left = []
    else:  # the one store a run leaves behind
        left = [final.store_path]
    assert sorted(tmp_dir.glob("nixl.*.mmap")) == left
    assert lock.stat().st_ino == lock_inode, "the owner lock file was replaced"
    assert not list(tmp_dir.glob("*.staging"))
    # (an address server whose starting rank died logs to a file of its own there: nixl-server.ADDRESS.log)
    leftovers = sorted(p.name for p in tmp_dir.iterdir() if not p.name.startswith(("nixl-owner.", "nixl-server.")))
    assert leftovers == [p.name for p in left]
