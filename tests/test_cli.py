"""``python -m app``: demo, serve and inspect, run as an operator would.

Errors must be one line on stderr with a non-zero exit status and never a
traceback.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import Proc, Reaper, can_bind, children_of, free_port, get_json, http_get, listening_socket, wait_until
from support_e2e import REPO, by_rank, expected, parse_text, procfile_web_command, rank_env, spawn_rank, wait_ready

from store import EventType, StoreIdentity, StoreWriter

CLI = [sys.executable, "-m", "app"]


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def assert_one_line_error(done: subprocess.CompletedProcess[str], *words: str) -> None:
    assert done.returncode != 0, done
    assert "Traceback" not in done.stderr + done.stdout, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("nixl-prometheus-mp"), lines
    assert "error:" in lines[0], lines
    for word in words:
        assert word in lines[0], (word, lines[0])


# -- demo -------------------------------------------------------------------

def test_demo_serves_every_rank_then_exits_cleanly(tmp_path: Path) -> None:
    """At the end of its --duration the demo waits for the address server to give the port up (the TTL after the
    ranks' last update: Prometheus gets their final values), then prints the totals last."""
    port = free_port()
    # The demo's own temp dir lands in tmp_path. The TTL is how long the demo has, once its ranks ended, to see
    # their server still serving (and say so): a bound only a hang reaches (with 1 s, a loaded host missed it).
    env = rank_env(tmp_path / "unused", port, TMPDIR=str(tmp_path), NIXL_TELEMETRY_MP_STALE_TTL="10")
    del env["NIXL_TELEMETRY_MULTIPROC_DIR"]
    with Reaper() as r:
        demo = r.spawn([*CLI, "demo", "--ranks", "3", "--port", str(port), "--duration", "3"], env)

        def three_ranks() -> dict[str, float] | None:
            response = http_get(f"http://127.0.0.1:{port}/metrics", timeout=2)
            ranks = by_rank(parse_text(response.body), "agent_tx_requests_num_total") if response.status == 200 else {}
            return ranks if set(ranks) == {"0", "1", "2"} else None

        wait_until(three_ranks, 10, "/metrics to show the demo's three ranks")
        health = get_json(f"http://127.0.0.1:{port}/healthz")
        assert health["owner"]["mode"] == "in-process"
        assert sorted(rank["local_rank"] for rank in health["live"]) == ["0", "1", "2"]
        assert demo.popen.wait(timeout=60) == 0, demo.output
    # The server gave the port up before the demo ended: nothing listens (a refused connection would not tell a
    # server too slow to answer from none).
    assert can_bind(port), f"something still listens on port {port}"

    out = demo.output.splitlines()
    assert any(f"http://127.0.0.1:{port}/metrics" in line and "3 ranks recording into" in line for line in out), out
    directory = next(line for line in out if "ranks recording into" in line).split(" into ")[1].split(";")[0]
    assert Path(directory).parent == tmp_path
    summaries = [line for line in out if line.startswith("ranks live ")]
    assert len(summaries) >= 3, out  # one a second while the ranks run, and the final one
    assert any(line.startswith("ranks live 3 departed 0") for line in summaries), summaries
    assert summaries[-1].startswith("ranks live 0 departed 3 | transfers "), summaries
    assert out[-1] == summaries[-1]  # the last line
    assert any(line.startswith("the ranks are done: their final values stay on") for line in out), out
    assert "Traceback" not in demo.output


# A proxy nothing listens on (port 9, discard): whatever goes through it fails, as from a shell whose http_proxy
# names a corporate proxy that cannot reach this host's loopback.
DEAD_PROXY = "http://127.0.0.1:9"
PROXY_VARIABLES = ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY")


def with_dead_proxy(env: dict[str, str]) -> dict[str, str]:
    """``env`` with every proxy variable naming DEAD_PROXY, and nothing exempt from it (no no_proxy)."""
    env = {k: v for k, v in env.items() if k.lower() != "no_proxy"}
    return {**env, **dict.fromkeys(PROXY_VARIABLES, DEAD_PROXY)}


def test_demo_serves_with_http_proxy_set(tmp_path: Path) -> None:
    """The demo asks its ranks' /healthz which one started the server, and whether it still serves at the end:
    straight to 127.0.0.1, never through http_proxy (with urlopen it waited 20 s, then named its own rank and
    helper as the port's holders)."""
    port = free_port()
    # The TTL: the time the demo has to see the server at the end (see the test above).
    env = with_dead_proxy(rank_env(tmp_path / "unused", port, TMPDIR=str(tmp_path), NIXL_TELEMETRY_MP_STALE_TTL="10"))
    del env["NIXL_TELEMETRY_MULTIPROC_DIR"]
    done = run_cli("demo", "--ranks", "2", "--port", str(port), "--duration", "2", env=env, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    first = done.stdout.splitlines()[0]
    assert re.search(rf"rank pid \d+ started the server of http://127.0.0.1:{port}/metrics", first), done.stdout
    assert "the ranks are done: their final values stay on" in done.stdout, done.stdout  # (it saw the server)
    assert done.stdout.splitlines()[-1].startswith("ranks live 0 departed 2 | "), done.stdout
    assert "Traceback" not in done.stdout + done.stderr


def timed_demo(r: Reaper, tmp_path: Path, ranks: int, ttl: str = "1") -> tuple[Proc, int, int]:
    """A demo of ``ranks`` ranks that ends by itself after a few seconds (and a 1 s TTL), the pid of the rank that
    started its address server, and its port."""
    port = free_port()
    env = rank_env(tmp_path / "unused", port, TMPDIR=str(tmp_path), NIXL_TELEMETRY_MP_STALE_TTL=ttl)
    del env["NIXL_TELEMETRY_MULTIPROC_DIR"]
    # cwd: where a core dump of a crashed rank would land
    demo = r.spawn([*CLI, "demo", "--ranks", str(ranks), "--port", str(port), "--duration", "8", "--rate", "50"],
                   env, cwd=tmp_path)
    line = demo.wait_line(lambda line: "ranks recording into" in line, 30)
    match = re.search(r"rank pid (\d+) started the server of ", line)
    assert match, line
    return demo, int(match.group(1)), port


def test_a_rank_the_user_kills_is_named_and_is_not_a_failure(tmp_path: Path) -> None:
    """``kill -9`` of the rank that started the server, as the README invites, ended the demo in "error: 1 demo
    rank(s) failed".  Nothing moves: the same address server serves on."""
    with Reaper() as r:
        demo, owner, port = timed_demo(r, tmp_path, ranks=3)
        server = get_json(f"http://127.0.0.1:{port}/healthz")["owner"]["server_pid"]
        os.kill(owner, signal.SIGKILL)
        demo.wait_line(lambda line: f"(pid {owner}) was killed by SIGKILL" in line, 15)
        assert get_json(f"http://127.0.0.1:{port}/healthz")["owner"]["server_pid"] == server
        assert demo.popen.wait(timeout=30) == 0, demo.output
    assert re.search(rf"^rank [0-2] \(pid {owner}\) was killed by SIGKILL$", demo.output, re.M), demo.output
    assert "error:" not in demo.output and "Traceback" not in demo.output, demo.output
    assert demo.output.splitlines()[-1].startswith("ranks live 0 departed 3 | "), demo.output


def test_an_address_server_the_user_kills_is_replaced_and_the_demo_carries_on(tmp_path: Path) -> None:
    """``kill -9`` of the address server, as the README invites: a rank starts another, the demo ends cleanly."""
    with Reaper() as r:
        demo, _, port = timed_demo(r, tmp_path, ranks=3)
        owner = get_json(f"http://127.0.0.1:{port}/healthz")["owner"]
        os.kill(owner["server_pid"], signal.SIGKILL)
        ranks = set(children_of(demo.pid))

        def replaced() -> dict | None:
            new = get_json(f"http://127.0.0.1:{port}/healthz", timeout=2)["owner"]
            return new if new["server_pid"] != owner["server_pid"] else None

        assert wait_until(replaced, 20, "a new address server")["started_by"] in ranks
        assert demo.popen.wait(timeout=30) == 0, demo.output
    assert "error:" not in demo.output and "Traceback" not in demo.output, demo.output
    assert not re.search(r"^rank \d", demo.output, re.M), demo.output  # no rank ended but by its duration
    assert demo.output.splitlines()[-1].startswith("ranks live 0 departed 3 | "), demo.output


def test_a_rank_that_crashes_fails_the_demo_naming_the_signal(tmp_path: Path) -> None:
    """A failed run's final values are published as any run's (they tell what went wrong): the demo fails once
    its server has served them until the TTL, the crashed rank's included."""
    with Reaper() as r:
        # A TTL beyond the run (8 s): the rank that crashed at its start is still published at the end.
        demo, owner, port = timed_demo(r, tmp_path, ranks=2, ttl="12")
        (victim,) = [pid for pid in children_of(demo.pid) if pid != owner]
        os.kill(victim, signal.SIGSEGV)  # what a crash in native code would end the rank with
        demo.wait_line(lambda line: line.startswith("the ranks are done: their final values stay on"), 30)
        health = get_json(f"http://127.0.0.1:{port}/healthz", timeout=5)
        assert health["live"] == [] and len(health["stale"]) == 2, health
        served = {s["agent_name"]: s["pid"] for s in health["stale"]}
        assert victim in served.values(), (victim, served)  # the crashed rank's final values too
        assert demo.popen.wait(timeout=30) == 1, demo.output
    assert can_bind(port), "the server left by itself, at the TTL"
    errors = [line for line in demo.output.splitlines() if "error:" in line]
    assert len(errors) == 1 and re.fullmatch(rf"nixl-prometheus-mp: error: 1 of 2 demo ranks failed: rank [01] "
                                             rf"\(pid {victim}\) was killed by SIGSEGV", errors[0]), demo.output
    assert demo.output.splitlines()[-2].startswith("ranks live 0 departed 2 | "), demo.output  # then the error
    assert "Traceback" not in demo.output


def test_a_rank_someone_else_sigterms_is_named_and_is_not_a_failure(tmp_path: Path) -> None:
    """A demo rank exited 0 on SIGTERM, so the demo could not tell it from one that ran its --duration out: a
    rank now ends by the signal that stopped it, after closing its store."""
    with Reaper() as r:
        demo, owner, _ = timed_demo(r, tmp_path, ranks=2)
        (victim,) = [pid for pid in children_of(demo.pid) if pid != owner]
        os.kill(victim, signal.SIGTERM)
        demo.wait_line(lambda line: f"(pid {victim}) was killed by SIGTERM" in line, 15)
        assert demo.popen.wait(timeout=30) == 0, demo.output
    assert re.search(rf"^rank [01] \(pid {victim}\) was killed by SIGTERM$", demo.output, re.M), demo.output
    assert "error:" not in demo.output and "Traceback" not in demo.output, demo.output
    assert demo.output.splitlines()[-1].startswith("ranks live 0 departed 2 | "), demo.output


def test_a_crash_before_ctrl_c_still_fails_the_demo(tmp_path: Path) -> None:
    """The stop ends every rank; what ended before it is still reported, a crash as the demo's failure, once the
    final values were published (a 3 s TTL)."""
    port = free_port()
    with Reaper() as r:
        demo = r.spawn([*CLI, "demo", "--ranks", "2", "--port", str(port), "--dir", str(tmp_path / "mp")],
                       rank_env(tmp_path / "mp", port, NIXL_TELEMETRY_MP_STALE_TTL="3"), cwd=tmp_path)
        owner = int(demo.wait_line(lambda line: "ranks recording into" in line, 30).split("rank pid ")[1].split()[0])
        (victim,) = [pid for pid in children_of(demo.pid) if pid != owner]
        os.kill(victim, signal.SIGABRT)
        demo.wait_line(lambda line: f"(pid {victim}) was killed by SIGABRT" in line, 15)
        demo.killpg(signal.SIGINT)
        assert demo.popen.wait(timeout=30) == 1, demo.output
    assert re.fullmatch(rf"nixl-prometheus-mp: error: 1 of 2 demo ranks failed: rank [01] \(pid {victim}\) was "
                        "killed by SIGABRT", demo.output.splitlines()[-1]), demo.output
    assert any(line.startswith("the ranks are done: their final values stay on") for line in demo.lines), demo.output
    assert not re.search(r"was killed by SIGINT", demo.output), demo.output  # the stop's own ends are not news


@pytest.mark.parametrize("value", ["0", "-2"])
def test_demo_rejects_a_rank_count_below_one(value: str) -> None:
    assert_one_line_error(run_cli("demo", "--ranks", value, "--duration", "1"), "--ranks", value)


def test_demo_rejects_a_rank_count_that_is_not_a_number() -> None:
    assert_one_line_error(run_cli("demo", "--ranks", "three"), "--ranks", "three")


def test_unknown_command_is_one_line() -> None:
    assert_one_line_error(run_cli("frobnicate"), "frobnicate")


# -- rank: ranks only ---------------------------------------------------------

def test_ranks_only_feed_a_standalone_aggregator_on_its_port_and_bind_scope(tmp_path: Path) -> None:
    """What ``demo --dir D --port P`` cannot do beside the aggregator of the README (it wants the port free and
    binds 127.0.0.1): ``rank`` processes configured as the aggregator is, every interface included (its default),
    which it serves; no rank starts a server.  A rank SIGTERMed ends by the signal, its store departed."""
    port, directory = free_port(), tmp_path / "mp"
    env = rank_env(directory, port)
    del env["NIXL_TELEMETRY_PROMETHEUS_LOCAL"]  # the aggregator's default and the ranks' alike: 0.0.0.0
    with Reaper() as r:
        aggregator = r.spawn(procfile_web_command(), env)
        wait_until(lambda: get_json(f"http://127.0.0.1:{port}/healthz", timeout=2)["owner"]["mode"] == "standalone",
                   30, lambda: f"the aggregator to serve:\n{aggregator.output}")
        ranks = [r.spawn([*CLI, "rank", "--name", f"agent-{i}", "--rate", "50"], {**env, "LOCAL_RANK": str(i)})
                 for i in range(2)]

        def both() -> bool:
            body = http_get(f"http://127.0.0.1:{port}/metrics", timeout=2).body
            return set(by_rank(parse_text(body), "agent_tx_requests_num_total")) == {"0", "1"}

        wait_until(both, 30, lambda: f"both ranks on the aggregator's /metrics:\n{ranks[0].output}")
        health = get_json(f"http://127.0.0.1:{port}/healthz")
        assert health["owner"]["mode"] == "standalone" and health["owner"]["address"] == f"0.0.0.0:{port}", health
        assert sorted(rank["local_rank"] for rank in health["live"]) == ["0", "1"], health
        assert all(children_of(rank.pid) == [] for rank in ranks)  # writers: no address server of theirs
        os.kill(ranks[0].pid, signal.SIGTERM)
        assert ranks[0].popen.wait(timeout=15) == -signal.SIGTERM, ranks[0].output
        wait_until(lambda: [s["agent_name"] for s in get_json(f"http://127.0.0.1:{port}/healthz")["stale"]]
                   == ["agent-0"], 10, "rank 0's store departed")
    for proc in (aggregator, *ranks):
        assert "Traceback" not in proc.output, proc.output


# -- serve ------------------------------------------------------------------

def test_serve_aggregates_a_directory(tmp_path: Path) -> None:
    directory, port = tmp_path / "mp", free_port()
    with Reaper() as r:
        serve = r.spawn([*CLI, "serve"], rank_env(directory, port))
        wait_until(lambda: http_get(f"http://127.0.0.1:{port}/healthz", timeout=2).status == 200, 15,
                   "python -m app serve to answer /healthz")
        assert directory.is_dir() and (directory.stat().st_mode & 0o777) == 0o700
        ranks = [spawn_rank(r, directory, port, rank) for rank in range(2)]
        assert [wait_ready(rank) for rank in ranks] == [False, False]  # the aggregator holds the address

        health = get_json(f"http://127.0.0.1:{port}/healthz")
        assert health["owner"]["mode"] == "standalone"
        assert health["owner"]["serving"] == "werkzeug"  # its own server, not gunicorn's
        assert health["owner"]["pid"] == serve.pid
        assert health["owner"]["election"] == "flock"
        assert sorted(rank["pid"] for rank in health["live"]) == sorted(rank.pid for rank in ranks)
        samples = parse_text(http_get(f"http://127.0.0.1:{port}/metrics").body)
        assert by_rank(samples, "agent_tx_bytes_total") == {str(i): expected(i)["agent_tx_bytes_total"]
                                                            for i in range(2)}

        serve.killpg(signal.SIGTERM)
        assert serve.popen.wait(timeout=10) == 0, serve.output
        assert "Traceback" not in serve.output


def test_serve_on_a_port_held_outside_the_run_names_the_holder(tmp_path: Path) -> None:
    port = free_port()
    foreign = listening_socket(port)
    try:
        done = run_cli("serve", env=rank_env(tmp_path / "mp", port))
    finally:
        foreign.close()
    assert_one_line_error(done, f"127.0.0.1:{port}", f"in use by pid {os.getpid()}")


def test_serve_without_the_directory_is_one_line(tmp_path: Path) -> None:
    env = rank_env(tmp_path, free_port())
    del env["NIXL_TELEMETRY_MULTIPROC_DIR"]
    assert_one_line_error(run_cli("serve", env=env), "NIXL_TELEMETRY_MULTIPROC_DIR")


def test_serve_with_a_bad_port_is_one_line(tmp_path: Path) -> None:
    env = rank_env(tmp_path / "mp", 9, NIXL_TELEMETRY_PROMETHEUS_PORT="ninety")
    assert_one_line_error(run_cli("serve", env=env), "NIXL_TELEMETRY_PROMETHEUS_PORT", "ninety")


# -- inspect ----------------------------------------------------------------

@pytest.fixture
def stores(tmp_path: Path):
    """A directory with one live store (rank 0, held here) and one departed one (rank 1)."""
    directory = tmp_path / "mp"
    directory.mkdir(mode=0o700)
    live = StoreWriter(directory, StoreIdentity("agent-live", "host-a", "0", 0, (10.0, 100.0)))
    gone = StoreWriter(directory, StoreIdentity("agent-gone", "host-b", "1", 3, (10.0, 100.0)))
    live.record(EventType.AGENT_TX_BYTES, 4096)
    live.record(EventType.AGENT_TX_REQUESTS_NUM, 2)
    live.record(EventType.AGENT_ERR_BACKEND, 1)
    gone.record(EventType.AGENT_RX_BYTES, 512)
    gone.record(EventType.AGENT_RX_REQUESTS_NUM, 1)
    gone.close()
    try:
        yield directory
    finally:
        live.close()


def test_inspect_prints_a_table(stores: Path) -> None:
    done = run_cli("inspect", str(stores))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split() == ["AGENT", "PID", "INST", "RANK", "STATE", "AGE(s)", "TX", "BYTES", "RX", "BYTES",
                                "REQUESTS", "ERRORS"]
    rows = {line.split()[0]: line.split() for line in lines[1:lines.index("")]}
    assert set(rows) == {"agent-live", "agent-gone"}
    live, gone = rows["agent-live"], rows["agent-gone"]
    assert (live[2], live[3], live[4], live[6], live[7], live[8], live[9]) == ("0", "0", "alive", "4096", "0", "2",
                                                                               "1")
    assert (gone[2], gone[3], gone[4], gone[6], gone[7], gone[8], gone[9]) == ("3", "1", "departed", "0", "512",
                                                                               "1", "0")
    assert len(list(stores.iterdir())) == 2  # inspect never reaps


def test_inspect_json(stores: Path) -> None:
    done = run_cli("inspect", "--json", str(stores))
    assert done.returncode == 0, done.stderr
    rows = {row["agent_name"]: row for row in json.loads(done.stdout)}
    assert set(rows) == {"agent-live", "agent-gone"}
    live, gone = rows["agent-live"], rows["agent-gone"]
    assert live["alive"] is True and gone["alive"] is False
    assert (live["tx_bytes"], live["requests"], live["errors"], live["local_rank"]) == (4096, 2, 1, "0")
    assert (gone["rx_bytes"], gone["requests"], gone["agent_instance"], gone["hostname"]) == (512, 1, 3, "host-b")
    for row in rows.values():
        assert row["store"].startswith("nixl.") and row["store"].endswith(".mmap")
        assert isinstance(row["pid"], int) and row["age_s"] >= 0


def test_inspect_an_empty_directory(tmp_path: Path) -> None:
    done = run_cli("inspect", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert f"(no stores in {tmp_path})" in done.stdout
    assert json.loads(run_cli("inspect", "--json", str(tmp_path)).stdout) == []


def test_inspect_a_missing_directory_is_one_line(tmp_path: Path) -> None:
    assert_one_line_error(run_cli("inspect", str(tmp_path / "nope")), "cannot list", "nope")


def test_inspect_without_a_directory_is_one_line() -> None:
    assert_one_line_error(run_cli("inspect"), "directory")


@pytest.mark.parametrize("extra", [["-c", "other_conf.py"], ["myproject:app"]], ids=["config", "app"])
def test_aggregate_takes_gunicorn_options_only(extra: list[str]) -> None:
    """``aggregate`` passes -c python:app.gunicorn_conf and app:wsgi itself: another of either is refused."""
    done = run_cli("aggregate", "--log-level", "warning", *extra)
    assert done.returncode == 2
    assert_one_line_error(done, "aggregate runs gunicorn -c python:app.gunicorn_conf [OPTIONS] app:wsgi",
                          f"give it gunicorn options only, not {' '.join(extra)}")


def test_ctrl_c_lets_the_server_publish_the_final_values_until_the_ttl(tmp_path: Path) -> None:
    """Ctrl-C (SIGINT to the foreground group) stops the ranks; their server goes on publishing their final
    values until the TTL, as at the end of a --duration (it was stopped at once, and Prometheus lost them)."""
    port, ttl = free_port(), 5.0
    with Reaper() as r:
        demo = r.spawn([*CLI, "demo", "--ranks", "2", "--port", str(port), "--dir", str(tmp_path / "mp")],
                       rank_env(tmp_path / "mp", port, NIXL_TELEMETRY_MP_STALE_TTL=f"{ttl:g}"))
        wait_until(lambda: len(get_json(f"http://127.0.0.1:{port}/healthz", timeout=2)["live"]) == 2, 15,
                   "two demo ranks")
        demo.killpg(signal.SIGINT)
        stopped = time.monotonic()
        demo.wait_line(lambda line: line.startswith("the ranks are done: their final values stay on"), 15)
        health = get_json(f"http://127.0.0.1:{port}/healthz", timeout=5)
        assert health["live"] == [] and len(health["stale"]) == 2, health
        final = by_rank(parse_text(http_get(f"http://127.0.0.1:{port}/metrics", timeout=5).body),
                        "agent_tx_requests_num_total")
        assert set(final) == {"0", "1"}, final
        assert demo.popen.wait(timeout=ttl + 20) == 0, demo.output
        assert time.monotonic() - stopped > ttl - 1.5, "the server left before the TTL"  # (last update: ~ the stop)
    assert can_bind(port), f"something still listens on port {port}"  # the server left by itself
    out = demo.output.splitlines()
    assert "stopping the ranks (Ctrl-C again to stop at once)" in out, out
    assert out[-1].startswith("ranks live 0 departed 2 | "), out  # the totals, last
    assert "Traceback" not in demo.output and "was killed by" not in demo.output, demo.output


def test_a_second_ctrl_c_stops_the_demo_and_its_server_at_once(tmp_path: Path) -> None:
    """With the default TTL (30 s) to wait out: the second Ctrl-C ends the wait, and the server with it."""
    port = free_port()
    with Reaper() as r:
        demo = r.spawn([*CLI, "demo", "--ranks", "2", "--port", str(port), "--dir", str(tmp_path / "mp")],
                       rank_env(tmp_path / "mp", port))
        wait_until(lambda: len(get_json(f"http://127.0.0.1:{port}/healthz", timeout=2)["live"]) == 2, 15,
                   "two demo ranks")
        demo.killpg(signal.SIGINT)
        demo.wait_line(lambda line: line.startswith("the ranks are done: their final values stay on") and
                       "until 30 s" in line, 15)
        demo.killpg(signal.SIGINT)
        assert demo.popen.wait(timeout=10) == 0, demo.output
    assert "Traceback" not in demo.output, demo.output
    # The second stop stops the ranks' address server too, at once: nothing listens on the port.
    assert can_bind(port), f"something still listens on port {port}"


@pytest.mark.parametrize("command", [["inspect", "{dir}"], ["inspect", "--json", "{dir}"],
                                     ["top", "--once", "--interval", "0.2", "{dir}"],
                                     ["top", "--json", "--interval", "0.2", "{dir}"],
                                     ["demo", "--ranks", "2", "--duration", "2", "--port", "{port}"]],
                         ids=["inspect", "inspect --json", "top --once", "top --json", "demo"])
def test_a_closed_pipe_ends_a_subcommand_quietly_as_a_unix_tool(tmp_path: Path, command: list[str]) -> None:
    """``... | head -1``, ``... | true``: the reader is gone; the command ends at its next write, with no
    traceback and the status a shell gives a tool that SIGPIPE ended (128 + 13)."""
    directory = tmp_path / "mp"
    directory.mkdir(mode=0o700)
    StoreWriter(directory, StoreIdentity("a", "host", "", 0, (10.0,))).close()  # something to print
    args = [arg.format(dir=directory, port=free_port()) for arg in command]
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write fails with EPIPE (Python ignores SIGPIPE)
    try:
        done = subprocess.run([*CLI, *args], stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60,
                              env=rank_env(tmp_path / "unused", free_port(), TMPDIR=str(tmp_path)))
    finally:
        os.close(write_end)
    assert done.returncode == 128 + signal.SIGPIPE, done.stderr
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("nixl-metrics-demo-")] == []
