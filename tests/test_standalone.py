"""The standalone aggregator: the Procfile's ``web:`` command (gunicorn) with real ranks.

The gunicorn master holds the owner election, so ranks configured for the
same address stay writers; its workers serve and must never keep the
election locked; killing the aggregator hands the address to a rank (which
starts an address server for it).  A rank that was first holds the address
through its job's address server: the aggregator waits for that server to go.
"""

from __future__ import annotations

import http.client
import os
import re
import shutil
import signal
import ssl
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from support import (
    Reaper,
    can_bind,
    children_of,
    free_port,
    get_json,
    http_get,
    listening_socket,
    lock_is_free,
    open_direct,
    pids_alive,
    wait_until,
)
from support_e2e import (
    REPO,
    SAY_CODE,
    VENV_BIN,
    by_rank,
    expected,
    parse_text,
    procfile_web_command,
    rank_env,
    spawn_rank,
    wait_ready,
)

from election import address_is_held, lock_file_name

OPENMETRICS = "application/openmetrics-text;version=1.0.0"  # a client that accepts nothing else


def start_aggregator(r, directory: Path, port: int, workers: int = 2, **extra: str):
    """The Procfile's web: command with the venv's gunicorn first on PATH, run from outside the repository."""
    command = procfile_web_command()
    assert command[0] == "gunicorn", command
    env = rank_env(directory, port, GUNICORN_WORKERS=str(workers), GUNICORN_THREADS="4", **extra)
    proc = r.spawn(command, env, cwd=directory.parent)
    wait_until(lambda: http_get(f"http://127.0.0.1:{port}/healthz", timeout=2).status == 200, 20,
               "gunicorn to answer /healthz")
    wait_until(lambda: len(children_of(proc.pid)) == workers, 10, f"{workers} gunicorn workers")
    # A worker holds the inherited election descriptor from fork() until its post_fork hook drops it.
    lock_path = directory / lock_file_name(f"127.0.0.1:{port}")
    wait_until(lambda: holders_of(lock_path, children_of(proc.pid)) == [], 10,
               lambda: f"the workers to drop the election descriptor ({holders_of(lock_path, children_of(proc.pid))})")
    return proc


def address_server_of(port: int) -> dict:
    """/healthz's owner once the address server a rank started answers on ``port``."""
    def answered() -> dict | None:
        owner = get_json(f"http://127.0.0.1:{port}/healthz", timeout=2)["owner"]
        return owner if owner["serving"] == "helper" else None

    return wait_until(answered, 20, "the rank's address server to answer")


def holders_of(path: Path, pids: list[int]) -> list[int]:
    """Those of ``pids`` with a descriptor open on ``path``."""
    holders = []
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == str(path):
                    holders.append(pid)
                    break
            except OSError:
                continue
    return holders


def test_procfile_web_serves_ranks_to_concurrent_scrapers(tmp_path: Path) -> None:
    directory, port = tmp_path / "mp", free_port()
    with Reaper() as r:
        master = start_aggregator(r, directory, port, workers=2)
        assert (directory.stat().st_mode & 0o777) == 0o700  # created private by the aggregator
        ranks = [spawn_rank(r, directory, port, i) for i in range(3)]
        assert [wait_ready(rank) for rank in ranks] == [False] * 3  # quiet writers: the master holds the address

        health = get_json(f"http://127.0.0.1:{port}/healthz")
        assert health["owner"]["mode"] == "standalone"
        assert health["owner"]["pid"] == master.pid
        assert health["owner"]["election"] == "flock"
        assert health["owner"]["address"] == f"127.0.0.1:{port}"
        assert sorted(rank["pid"] for rank in health["live"]) == sorted(rank.pid for rank in ranks)
        assert health["warnings"] == []

        want = {str(i): expected(i) for i in range(3)}
        failures: list[str] = []
        served = [0]
        lock = threading.Lock()

        def scraper(n: int) -> None:
            for i in range(12):
                try:
                    if i % 4 == 3:
                        doc = get_json(f"http://127.0.0.1:{port}/healthz")
                        ok = len(doc["live"]) == 3 and doc["owner"]["pid"] == master.pid
                    else:
                        headers = {"Accept": OPENMETRICS} if i % 4 == 1 else {}
                        response = http_get(f"http://127.0.0.1:{port}/metrics", headers)
                        if i % 4 == 1:
                            ok = response.status == 200 and response.headers["content-type"].startswith(
                                "application/openmetrics-text")
                            ok = ok and response.body.endswith(b"# EOF\n")
                        else:
                            samples = parse_text(response.body)
                            ok = response.status == 200 and all(
                                by_rank(samples, name) == {rank: values[name] for rank, values in want.items()}
                                for name in ("agent_tx_bytes_total", "agent_xfer_time_us_count"))
                    with lock:
                        served[0] += 1
                    if not ok:
                        failures.append(f"scraper {n} request {i}: unexpected response")
                except Exception as exc:  # collected, asserted below
                    failures.append(f"scraper {n} request {i}: {exc!r}")

        threads = [threading.Thread(target=scraper, args=(n,)) for n in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads)
        assert failures == [] and served[0] == 12 * 12, failures[:5]

        # The ranks stayed quiet writers throughout (not a line beyond "ready"); the aggregator answered all.
        assert [len(rank.lines) for rank in ranks] == [1, 1, 1], [rank.output for rank in ranks]
        assert "Traceback" not in master.output, master.output


def test_workers_reap_departed_ranks_under_concurrent_scrapes(tmp_path: Path) -> None:
    """Several workers scrape and reap the same directory at once: every scrape succeeds, each store goes once."""
    directory, port = tmp_path / "mp", free_port()
    with Reaper() as r:
        master = start_aggregator(r, directory, port, workers=3, NIXL_TELEMETRY_MP_STALE_TTL="0.3")
        ranks = [spawn_rank(r, directory, port, i) for i in range(4)]
        assert [wait_ready(rank) for rank in ranks] == [False] * 4
        stop = threading.Event()
        results: list[int | str] = []

        def scraper() -> None:
            while not stop.is_set():
                try:
                    results.append(http_get(f"http://127.0.0.1:{port}/metrics").status)
                except Exception as exc:  # collected, asserted below
                    results.append(repr(exc))

        threads = [threading.Thread(target=scraper) for _ in range(8)]
        for t in threads:
            t.start()
        try:
            ranks[1].stop()
            ranks[2].killpg(signal.SIGKILL)
            ranks[3].stop()

            def only_rank_0_left() -> bool:
                health = get_json(f"http://127.0.0.1:{port}/healthz")
                return [v["pid"] for v in health["live"]] == [ranks[0].pid] and health["stale"] == []

            wait_until(only_rank_0_left, 10, "the departed ranks to be reaped")
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=30)
        assert results and set(results) == {200}, [x for x in results if x != 200][:5]
        assert sorted(p.name for p in directory.glob("nixl.*.mmap")) == [
            v["store"] for v in get_json(f"http://127.0.0.1:{port}/healthz")["live"]]
        assert "Traceback" not in master.output and "ERROR" not in master.output, master.output


def test_workers_never_hold_the_election(tmp_path: Path) -> None:
    directory, port = tmp_path / "mp", free_port()
    lock_path = directory / lock_file_name(f"127.0.0.1:{port}")
    with Reaper() as r:
        master = start_aggregator(r, directory, port, workers=3)  # waits for the workers to drop it
        for _ in range(20):  # ... and they never take it back, whatever they serve
            assert http_get(f"http://127.0.0.1:{port}/healthz").status == 200
        workers = children_of(master.pid)
        assert len(workers) == 3
        assert holders_of(lock_path, [master.pid, *workers]) == [master.pid]
        assert not lock_is_free(lock_path)


def test_master_sigkill_takes_the_workers_and_frees_the_address(tmp_path: Path) -> None:
    """SIGKILL of the master alone: the workers go at once, the lock is free, a rank serves."""
    directory, port = tmp_path / "mp", free_port()
    lock_path = directory / lock_file_name(f"127.0.0.1:{port}")
    with Reaper() as r:
        master = start_aggregator(r, directory, port, workers=2)
        workers = children_of(master.pid)
        os.kill(master.pid, signal.SIGKILL)
        master.popen.wait(timeout=10)
        wait_until(lambda: pids_alive(workers) == [], 5, "the orphaned workers to exit")
        assert lock_is_free(lock_path)

        # ... and with a rank running, the rank takes the address over (its claims run as it records) and
        # starts an address server: the workers no longer listen on it, so its first bind after winning succeeds.
        master = start_aggregator(r, directory, port, workers=2)
        rank = spawn_rank(r, directory, port, 0)
        assert wait_ready(rank) is False
        os.kill(master.pid, signal.SIGKILL)
        rank.wait_line(lambda s: s == "serving=True", 20)
        owner = address_server_of(port)
        assert (owner["mode"], owner["started_by"]) == ("in-process", rank.pid)
        assert owner["server_pid"] not in (rank.pid, master.pid)
        assert "cannot bind" not in rank.output, rank.output


def test_killing_the_aggregator_hands_the_address_to_a_rank(tmp_path: Path) -> None:
    directory, port = tmp_path / "mp", free_port()
    with Reaper() as r:
        master = start_aggregator(r, directory, port, workers=2)
        ranks = [spawn_rank(r, directory, port, i) for i in range(2)]
        assert [wait_ready(rank) for rank in ranks] == [False, False]

        master.killpg(signal.SIGKILL)  # master and workers, as a container runtime would
        master.popen.wait(timeout=10)

        def new_owner() -> dict | None:
            status = http_get(f"http://127.0.0.1:{port}/metrics", timeout=1).status
            health = get_json(f"http://127.0.0.1:{port}/healthz", timeout=1) if status == 200 else None
            return health if health and health["owner"]["mode"] == "in-process" else None

        # (a bound only a hang reaches: a fresh interpreter starts the address server; bench has the figures)
        health = wait_until(new_owner, 20, "a rank to serve the address")
        assert health["owner"]["serving"] == "helper"
        assert health["owner"]["started_by"] in {rank.pid for rank in ranks}
        samples = parse_text(http_get(f"http://127.0.0.1:{port}/metrics").body)
        assert by_rank(samples, "agent_tx_bytes_total") == {str(i): expected(i)["agent_tx_bytes_total"]
                                                            for i in range(2)}


def test_missing_directory_fails_the_start_in_one_line(tmp_path: Path) -> None:
    env = rank_env(tmp_path, free_port())
    del env["NIXL_TELEMETRY_MULTIPROC_DIR"]
    with Reaper() as r:
        proc = r.spawn(procfile_web_command(), env, cwd=tmp_path)
        assert proc.popen.wait(timeout=30) != 0
    out = proc.output
    assert "Traceback" not in out, out
    assert out.strip().splitlines() == [out.strip().splitlines()[0]], out
    assert out.startswith("nixl-prometheus-mp: error: NIXL_TELEMETRY_MULTIPROC_DIR is required"), out


def test_bad_port_fails_the_start_in_one_line(tmp_path: Path) -> None:
    env = rank_env(tmp_path / "mp", 1, NIXL_TELEMETRY_PROMETHEUS_PORT="99999")
    with Reaper() as r:
        proc = r.spawn(procfile_web_command(), env, cwd=tmp_path)
        assert proc.popen.wait(timeout=30) != 0
    assert "Traceback" not in proc.output, proc.output
    assert proc.output.strip() == ("nixl-prometheus-mp: error: NIXL_TELEMETRY_PROMETHEUS_PORT='99999' is outside "
                                   "1..65535"), proc.output


def test_a_port_held_outside_the_run_fails_the_start_in_one_line_naming_the_holder(tmp_path: Path) -> None:
    """A local Prometheus on its own 9090, say: one line naming the process, not gunicorn's five retries."""
    port = free_port()
    foreign = listening_socket(port)
    try:
        with Reaper() as r:
            proc = r.spawn(procfile_web_command(), rank_env(tmp_path / "mp", port), cwd=tmp_path)
            assert proc.popen.wait(timeout=30) != 0
    finally:
        foreign.close()
    out = proc.output.strip()
    assert "Traceback" not in out and "Connection in use" not in out, out
    assert out.splitlines()[-1] == (f"nixl-prometheus-mp: error: cannot bind 127.0.0.1:{port}: the port is in use "
                                    f"by pid {os.getpid()} ({Path('/proc/self/comm').read_text().strip()}): stop "
                                    "it, or give the aggregator and the ranks another NIXL_TELEMETRY_PROMETHEUS_PORT"
                                    ), out
    assert not address_is_held(tmp_path / "mp", f"127.0.0.1:{port}")  # the election was given back


def test_app_wsgi_without_the_config_file_names_the_variable(tmp_path: Path) -> None:
    """``gunicorn app:wsgi`` without ``-c python:app.gunicorn_conf``: the worker fails to load, in one line."""
    env = rank_env(tmp_path, free_port())
    del env["NIXL_TELEMETRY_MULTIPROC_DIR"]
    with Reaper() as r:
        proc = r.spawn([str(Path(sys.executable).parent / "gunicorn"), "--no-control-socket", "-b",
                        f"127.0.0.1:{free_port()}", "app:wsgi"], env, cwd=tmp_path)
        assert proc.popen.wait(timeout=30) != 0
    assert "Traceback" not in proc.output, proc.output
    assert "NIXL_TELEMETRY_MULTIPROC_DIR is required" in proc.output
    assert "App failed to load" in proc.output


@pytest.mark.parametrize(("variable", "value"), [("GUNICORN_WORKERS", "0"), ("GUNICORN_WORKERS", "two"),
                                                 ("GUNICORN_WORKERS", "-1"), ("GUNICORN_WORKERS", "\u0663"),
                                                 ("GUNICORN_WORKERS", "1000"), ("GUNICORN_THREADS", "0"),
                                                 ("GUNICORN_THREADS", "4.5")])
def test_bad_worker_or_thread_count_fails_the_start_in_one_line(tmp_path: Path, variable: str, value: str) -> None:
    """0 workers would win the election and serve nothing; a non-number was a gunicorn traceback."""
    directory = tmp_path / "mp"
    env = rank_env(directory, free_port(), **{variable: value})
    with Reaper() as r:
        proc = r.spawn(procfile_web_command(), env, cwd=tmp_path)
        assert proc.popen.wait(timeout=30) == 1
    assert proc.output.strip() == (f"nixl-prometheus-mp: error: {variable}={value!r} is not a whole number in "
                                   f"1..{64 if variable == 'GUNICORN_WORKERS' else 256}"), proc.output
    assert not directory.exists()  # refused before anything was created


OVERRIDES = {  # gunicorn flags that would strand the address: (arguments, what the one line must say)
    "bind": (["-b", "127.0.0.1:{other}"], "gunicorn's --bind 127.0.0.1:{other} (its command line or "
             "GUNICORN_CMD_ARGS) is refused: the aggregator serves the address its ranks elect an owner for, "
             "127.0.0.1:{port}; drop --bind and set NIXL_TELEMETRY_PROMETHEUS_PORT and "
             "NIXL_TELEMETRY_PROMETHEUS_LOCAL"),
    "no-workers": (["-w", "0"], "gunicorn's --workers 0 (its command line or GUNICORN_CMD_ARGS) is refused: the "
                   "aggregator takes its workers from GUNICORN_WORKERS (now 1, 1..64); drop --workers and set "
                   "GUNICORN_WORKERS"),
    "more-workers": (["--workers", "3"], "gunicorn's --workers 3 (its command line or GUNICORN_CMD_ARGS) is refused"),
    "no-threads": (["--threads", "0"], "gunicorn's --threads 0 (its command line or GUNICORN_CMD_ARGS) is refused: "
                   "the aggregator takes its threads from GUNICORN_THREADS (now 4, 1..256)"),
    "reuse-port": (["--reuse-port"], "gunicorn's --reuse-port (its command line or GUNICORN_CMD_ARGS) is refused: it "
                   "would let another server share 127.0.0.1:{port} and answer its scrapes without holding the owner "
                   "election; drop --reuse-port"),
}


# Every flag on gunicorn's command line; two through the other ways gunicorn takes them.
@pytest.mark.parametrize(("override", "how"), [*((o, "gunicorn") for o in OVERRIDES), ("bind", "GUNICORN_CMD_ARGS"),
                                               ("no-workers", "aggregate")])
def test_gunicorn_flag_that_would_strand_the_address_is_refused_before_anything_is_held(
        tmp_path: Path, override: str, how: str) -> None:
    """-b served another port while the master held the ranks' election; -w 0 held it and served nothing."""
    directory, port, other = tmp_path / "mp", free_port(), free_port()
    flags, wanted = OVERRIDES[override]
    flags = [f.format(other=other) for f in flags]
    env = rank_env(directory, port, GUNICORN_WORKERS="1")
    web = procfile_web_command()
    if how == "gunicorn":
        command = [*web[:-1], *flags, web[-1]]
    elif how == "GUNICORN_CMD_ARGS":
        command, env["GUNICORN_CMD_ARGS"] = web, " ".join(flags)
    else:
        command = [str(VENV_BIN / "nixl-prometheus-mp"), "aggregate", *flags]
    with Reaper() as r:
        proc = r.spawn(command, env, cwd=tmp_path)
        assert proc.popen.wait(timeout=30) == 1
    ours = [line for line in proc.lines if "Starting gunicorn" not in line]  # gunicorn's own INFO line comes first
    assert len(ours) == 1 and ours[0].startswith("nixl-prometheus-mp: error: "), proc.output
    assert wanted.format(port=port, other=other) in ours[0], ours[0]
    assert not directory.exists()  # refused before the directory, the lock file or the election
    for served in (port, other):
        assert can_bind(served), f"something listens on port {served}"


def test_the_aggregators_lines_follow_gunicorns_log_level(tmp_path: Path) -> None:
    """--log-level warning: its warnings stay, its INFO lines (a reaped rank) go, like gunicorn's own."""
    directory, port = tmp_path / "mp", free_port()
    with Reaper() as r:
        rank = spawn_rank(r, directory, port, 0)
        assert wait_ready(rank) is True
        web = procfile_web_command()
        agg = r.spawn([*web[:-1], "--log-level", "warning", web[-1]],
                      rank_env(directory, port, GUNICORN_WORKERS="1", NIXL_TELEMETRY_MP_STALE_TTL="0"), cwd=tmp_path)
        agg.wait_line(lambda s: "holds the owner election" in s and "[WARNING]" in s, 20)
        server = address_server_of(port)["server_pid"]
        assert rank.stop() == 0
        # The job's address server would serve the departed rank until its TTL (a SIGTERM too, which lets it
        # finish): an operator stops it at once instead.
        os.kill(server, signal.SIGINT)
        (store,) = directory.glob("nixl.*.mmap")  # the departed rank's, left for the aggregator to reap
        health = wait_until(lambda: (d := get_json(f"http://127.0.0.1:{port}/healthz", timeout=1))["owner"][
            "mode"] == "standalone" and d, 20, "the aggregator to serve")
        assert health["owner"]["pid"] == agg.pid
        wait_until(lambda: http_get(f"http://127.0.0.1:{port}/metrics").status == 200 and not store.exists(), 10,
                   lambda: f"{store.name} to be reaped")
        assert agg.stop() == 0
    assert not [line for line in agg.lines if "[INFO]" in line], agg.output  # "reaped ...", "Starting gunicorn"


def test_waiting_aggregator_names_the_rank_that_holds_the_address(tmp_path: Path) -> None:
    directory, port = tmp_path / "mp", free_port()
    with Reaper() as r:
        rank = spawn_rank(r, directory, port, 0, NIXL_TELEMETRY_MP_STALE_TTL="1")
        assert wait_ready(rank) is True
        server = address_server_of(port)["server_pid"]
        agg = r.spawn(procfile_web_command(), rank_env(directory, port, GUNICORN_WORKERS="1"), cwd=tmp_path)
        line = agg.wait_line(lambda s: "holds the owner election" in s and "pid " in s, 20)
        # The holder is the job's address server: named, with the rank that started it.
        assert f"the address server pid {server} on " in line, line
        assert f"(started by rank pid {rank.pid}, agent agent-0)" in line, line
        assert f"of 127.0.0.1:{port}; the aggregator waits for the address" in line, line
        # ... and once the job is over (its rank gone, and the server's TTL past), it takes the address over.
        rank.stop()

        def aggregator_owner() -> dict[str, object] | None:
            owner = get_json(f"http://127.0.0.1:{port}/healthz", timeout=1)["owner"]
            return owner if owner["mode"] == "standalone" else None

        assert wait_until(aggregator_owner, 20, "the aggregator to serve")["pid"] == agg.pid


def test_waiting_aggregator_names_the_aggregator_that_holds_the_address(tmp_path: Path) -> None:
    directory, port = tmp_path / "mp", free_port()
    with Reaper() as r:
        first = start_aggregator(r, directory, port, workers=1)
        second = r.spawn(procfile_web_command(), rank_env(directory, port, GUNICORN_WORKERS="1"), cwd=tmp_path)
        line = second.wait_line(lambda s: "holds the owner election" in s, 20)
        assert f"pid {first.pid} on " in line and "(standalone)" in line, line


def test_usr2_upgrade_is_refused_and_the_old_master_keeps_serving(tmp_path: Path) -> None:
    """A new master could never win the election its old master holds: refused at once, with the reason."""
    directory, port = tmp_path / "mp", free_port()
    with Reaper() as r:
        master = start_aggregator(r, directory, port, workers=1)
        workers = children_of(master.pid)
        os.kill(master.pid, signal.SIGUSR2)
        line = master.wait_line(lambda s: "USR2 upgrade refused" in s, 20)
        assert f"this master (pid {master.pid}) holds the owner election of 127.0.0.1:{port}" in line, line
        assert "restart the aggregator instead" in line
        # The refused child is gone (reaped by the master), the old master and its worker still serve.
        wait_until(lambda: children_of(master.pid) == workers, 10,
                   lambda: f"only the worker {workers} left ({children_of(master.pid)})")
        health = get_json(f"http://127.0.0.1:{port}/healthz")
        assert (health["owner"]["mode"], health["owner"]["pid"]) == ("standalone", master.pid)
        assert "Traceback" not in master.output, master.output


def test_aggregator_serves_over_tls_with_gunicorns_certificate_options(tmp_path: Path) -> None:
    """docs/operations.md's TLS recipe: the web: command plus --certfile/--keyfile, a throwaway self-signed pair."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("the openssl command is not installed")
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    directory, port = tmp_path / "mp", free_port()
    with Reaper() as r:
        rank = spawn_rank(r, directory, port, 0)
        assert wait_ready(rank) is True  # its address server serves until the aggregator takes over below
        server = address_server_of(port)["server_pid"]
        rank.stop()
        os.kill(server, signal.SIGINT)  # (else it serves the departed rank until the TTL, and the aggregator waits)
        command = [*procfile_web_command()[:-1], "--certfile", str(cert), "--keyfile", str(key),
                   procfile_web_command()[-1]]
        agg = r.spawn(command, rank_env(directory, port, GUNICORN_WORKERS="1"), cwd=tmp_path)
        trusted = ssl.create_default_context(cafile=str(cert))

        def scrape(context: ssl.SSLContext) -> bytes:
            with open_direct(f"https://127.0.0.1:{port}/metrics", 5, context) as response:
                assert response.status == 200
                return response.read()

        body = wait_until(lambda: scrape(trusted), 20, lambda: f"a TLS scrape; output:\n{agg.output}")
        assert by_rank(parse_text(body), "agent_tx_bytes_total") == {"0": expected(0)["agent_tx_bytes_total"]}
        # Verified against the certificate as CA; a client that does not trust it is refused, plain HTTP fails.
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            scrape(ssl.create_default_context())
        with pytest.raises((ConnectionError, http.client.HTTPException, urllib.error.URLError)):
            http_get(f"http://127.0.0.1:{port}/metrics", timeout=5)

        # A second aggregator waits, naming the TLS holder as the page says (it asks /healthz over plain HTTP).
        page = " ".join((REPO / "docs" / "operations.md").read_text().split())
        quoted = re.search(r"names a TLS holder by the pid of its lock: `pid N \(([^)`]*)\)`", page)
        assert quoted is not None, "docs/operations.md no longer says how a TLS holder is named"
        waiting = r.spawn(procfile_web_command(), rank_env(directory, port, GUNICORN_WORKERS="1"), cwd=tmp_path)
        line = waiting.wait_line(lambda s: "holds the owner election" in s, 20)
        assert re.search(rf"pid \d+ \({re.escape(quoted.group(1))}\) holds the owner election", line), line


def test_hup_replaces_the_workers_and_the_master_keeps_the_election(tmp_path: Path) -> None:
    directory, port = tmp_path / "mp", free_port()
    lock_path = directory / lock_file_name(f"127.0.0.1:{port}")
    with Reaper() as r:
        master = start_aggregator(r, directory, port, workers=2)
        old = sorted(children_of(master.pid))
        os.kill(master.pid, signal.SIGHUP)
        new = wait_until(lambda: (lambda c: c if len(c) == 2 and not set(c) & set(old) else None)(
            sorted(children_of(master.pid))), 20, "two new workers")
        wait_until(lambda: holders_of(lock_path, [master.pid, *new]) == [master.pid], 10,
                   "the new workers to drop the election descriptor")
        assert not lock_is_free(lock_path)
        health = get_json(f"http://127.0.0.1:{port}/healthz")
        assert (health["owner"]["mode"], health["owner"]["pid"]) == ("standalone", master.pid)
        assert "Traceback" not in master.output, master.output


# Holds an address's election lock like NIXL's C++ plug-in would: flock, then (with a port) serve HTTP without
# /healthz (every request an HTTP error). Prints "ready", exits when stdin closes.
HOLDER_CODE = SAY_CODE + """
import fcntl, http.server, os, sys, threading
fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
if len(sys.argv) > 2:
    server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[2])), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
say("ready")  # http.server logs each request to stderr from its thread meanwhile
sys.stdin.read()
"""


@pytest.mark.parametrize("serves", [True, False], ids=["serving-without-healthz", "not-serving"])
def test_waiting_aggregator_names_a_holder_without_healthz_by_its_lock(tmp_path: Path, serves: bool) -> None:
    """A C++ owner serves no /healthz: the pid comes from the kernel's lock table."""
    directory, port = tmp_path / "mp", free_port()
    directory.mkdir(mode=0o700)
    lock_path = directory / lock_file_name(f"127.0.0.1:{port}")
    with Reaper() as r:
        args = [sys.executable, "-c", HOLDER_CODE, str(lock_path), *([str(port)] if serves else [])]
        holder = r.spawn(args, rank_env(directory, port), stdin=True)
        holder.wait_line(lambda s: s == "ready", 20)
        agg = r.spawn(procfile_web_command(), rank_env(directory, port, GUNICORN_WORKERS="1"), cwd=tmp_path)
        line = agg.wait_line(lambda s: "holds the owner election" in s, 20)
        state = f"serving 127.0.0.1:{port} without /healthz" if serves else "its /healthz does not answer yet"
        assert f"pid {holder.pid} ({state}" in line, line


def blocked_on_flock(pid: int) -> bool:
    """Whether ``pid`` waits in flock(LOCK_EX) for a lock another process holds (/proc/locks' "->" lines)."""
    return any(fields[1:3] == ["->", "FLOCK"] and fields[5] == str(pid)
               for fields in (line.split() for line in Path("/proc/locks").read_text().splitlines())
               if len(fields) > 5)


def test_waiting_aggregator_names_each_new_holder(tmp_path: Path) -> None:
    """The holder it named exits and another process takes the address: the aggregator says who, again."""
    directory, port = tmp_path / "mp", free_port()
    lock_path = directory / lock_file_name(f"127.0.0.1:{port}")
    with Reaper() as r:
        first = spawn_rank(r, directory, port, 0, NIXL_TELEMETRY_MP_STALE_TTL="1")
        assert wait_ready(first) is True
        server = address_server_of(port)["server_pid"]
        agg = r.spawn(procfile_web_command(), rank_env(directory, port, GUNICORN_WORKERS="1"), cwd=tmp_path)
        agg.wait_line(lambda s: f"the address server pid {server} on " in s and "holds the owner election" in s, 20)
        # The next holder waits in flock(LOCK_EX), so the kernel hands it the lock the moment the address server
        # drops it (the aggregator only polls), then serves the port without /healthz, as NIXL's C++ plug-in would.
        second = r.spawn([sys.executable, "-c", HOLDER_CODE, str(lock_path), str(port)], rank_env(directory, port),
                         stdin=True)
        wait_until(lambda: blocked_on_flock(second.pid), 20, "the second holder to wait for the lock")
        first.stop()  # the job ends: its address server gives the address up once the rank's TTL is past
        second.wait_line(lambda s: s == "ready", 20)
        line = agg.wait_line(lambda s: f"pid {second.pid} (serving 127.0.0.1:{port} without /healthz" in s, 20)
        assert f"holds the owner election of 127.0.0.1:{port}; the aggregator waits" in line, line
        # ... and once that one is gone too, the aggregator serves.
        assert second.popen.stdin is not None
        second.popen.stdin.close()
        health = wait_until(lambda: get_json(f"http://127.0.0.1:{port}/healthz", timeout=1), 20,
                            "the aggregator to serve")
        assert (health["owner"]["mode"], health["owner"]["pid"]) == ("standalone", agg.pid)
