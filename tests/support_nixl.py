"""Real NIXL agents (the C++ library and its ``prometheus_mp`` telemetry plug-in) as test processes.

The plug-in comes from the public ``nixl-cu12`` wheel (``pip install --no-deps nixl-cu12==1.5.1 numpy``), which
runs on CPU. A *C++ rank* here is a subprocess running two agents of ``examples/cpp_agents.py`` (``<name>-tx``
WRITEs into ``<name>-rx`` over UCX) and obeying JSON commands on stdin, one JSON answer per command on stdout,
each answer being what the process did so far. It is started through a ``support.Reaper`` (SIGKILLed and waited
for at teardown); it has no children. The aggregator is the Procfile's ``web:`` command, started through one
too, ``Reaper.spawn`` (in a process group of its own, killed whole at teardown).

Without the wheel the tests using ``nixl_required`` skip, saying why; with ``NIXL_INTEROP_REQUIRED=1`` (set by
``.ci/run``) they fail instead, so CI never passes without having run them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import textwrap
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import support_e2e
from support import (
    DEADLINE_S,
    START_DEADLINE_S,
    Proc,
    RankProcess,
    Reaper,
    SeriesKey,
    http_get,
    metrics_url,
    start_rank,
    wait_until,
)

NIXL_MODULE = "nixl_cu12"
NIXL_WHEEL = "nixl-cu12==1.5.1"
REQUIRED_ENV = "NIXL_INTEROP_REQUIRED"
STALE_TTL_S = 60  # longer than any test: a killed rank stays published (stale) for the whole test


@pytest.fixture(name="nixl_required", scope="session")
def nixl_required_fixture() -> None:
    """Skip (or, with NIXL_INTEROP_REQUIRED=1, fail) unless the C++ plug-in's wheel is installed."""
    if importlib.util.find_spec(NIXL_MODULE) is not None:
        return
    reason = (f"the real NIXL plug-in is not installed: `pip install --no-deps {NIXL_WHEEL} numpy` "
              "runs these interoperability tests")
    if os.environ.get(REQUIRED_ENV) == "1":
        pytest.fail(f"{REQUIRED_ENV}=1 but {reason}")
    pytest.skip(reason)


def cpp_env(directory: Path, port: int, **extra: str) -> dict[str, str]:
    """What a C++ rank of a run needs: the plug-in selected, the run's directory and address (loopback)."""
    return {
        "NIXL_TELEMETRY_ENABLE": "y",
        "NIXL_TELEMETRY_EXPORTER": "prometheus_mp",
        "NIXL_TELEMETRY_MULTIPROC_DIR": str(directory),
        "NIXL_TELEMETRY_PROMETHEUS_PORT": str(port),
        "NIXL_TELEMETRY_PROMETHEUS_LOCAL": "y",
        "NIXL_TELEMETRY_MP_STALE_TTL": str(STALE_TTL_S),
        "UCX_NET_DEVICES": "lo",  # UCX's own listener otherwise binds every interface; the tests stay on loopback
        **extra,
    }


# -- the C++ rank ---------------------------------------------------------------------------------------------

# argv[1] names the agents (<name>-tx, <name>-rx). Commands: {"op": "write", "sizes": [...]} transfers each size
# once; {"op": "pump", "size": S, "interval": s} keeps transferring S bytes every s seconds in a thread (what
# re-runs the plug-in's election) until {"op": "unpump"}; {"op": "totals"}. Every answer is AgentPair.totals().
CPP_RANK_SCRIPT = textwrap.dedent("""
    import json, sys, threading
    answers, sys.stdout = sys.stdout, sys.stderr  # nixl logs to sys.stdout: keep its lines out of the answers
    from examples.cpp_agents import AgentPair

    pair = AgentPair(sys.argv[1])
    lock = threading.Lock()  # one transfer at a time: the pump and the commands share the agents
    stop = threading.Event()
    pump = None
    failures = []

    def reply(doc):
        answers.write(json.dumps(doc) + "\\n")
        answers.flush()

    def pumping(size, interval):
        try:
            while not stop.wait(interval):
                with lock:
                    pair.write(size)
        except Exception as exc:  # reported by the next answer, never lost
            failures.append(repr(exc))

    def totals(**extra):
        with lock:
            return {**pair.totals(), **({"error": "; ".join(failures)} if failures else {}), **extra}

    reply(totals(ready=True, create_s=pair.create_s))
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "write":
            with lock:
                for size in cmd["sizes"]:
                    pair.write(size)
            reply(totals())
        elif cmd["op"] == "pump":
            stop.clear()
            pump = threading.Thread(target=pumping, args=(cmd["size"], cmd["interval"]), daemon=True)
            pump.start()
            reply(totals())
        elif cmd["op"] == "unpump":
            stop.set()
            pump.join(10)
            reply(totals())
        elif cmd["op"] == "totals":
            reply(totals())
        else:
            reply({"error": f"unknown op {cmd['op']!r}"})
""")


@dataclass
class Totals:
    """What a C++ rank did: its tx agent's transfers; both agents registered ``registered_bytes``."""

    pid: int
    agents: tuple[str, str]
    transfers: int
    bytes: int
    last_bytes: int
    registered_bytes: int

    @classmethod
    def from_answer(cls, doc: Mapping[str, Any]) -> Totals:
        assert "error" not in doc, doc
        return cls(doc["pid"], (doc["agents"][0], doc["agents"][1]), doc["transfers"], doc["bytes"],
                   doc["last_bytes"], doc["registered_bytes"])

    def expected(self) -> dict[tuple[str, str], float]:
        """{(agent_name, sample name): value} the plug-in records, for both agents (everything else is 0)."""
        tx, rx = self.agents
        sent = {
            "agent_tx_bytes_total": self.bytes,
            "agent_tx_requests_num_total": self.transfers,
            "agent_tx_last_bytes": self.last_bytes,
            "agent_xfer_time_us_count": self.transfers,
            "agent_xfer_post_time_us_count": self.transfers,
            "agent_rx_bytes_total": 0,
            "agent_rx_requests_num_total": 0,
            "agent_memory_registered_total": self.registered_bytes,
            "agent_memory_registered_last_bytes": self.registered_bytes,
            "agent_memory_deregistered_total": 0,
        }
        received = {name: 0 for name in sent} | {"agent_memory_registered_total": self.registered_bytes,
                                                   "agent_memory_registered_last_bytes": self.registered_bytes}
        return ({(tx, name): float(v) for name, v in sent.items()}
                | {(rx, name): float(v) for name, v in received.items()})


class CppRank:
    """Handle on a running CPP_RANK_SCRIPT process."""

    def __init__(self, process: RankProcess) -> None:
        self.process = process
        ready = json.loads(process.readline(START_DEADLINE_S))
        assert ready.get("ready"), ready
        self.pid: int = ready["pid"]
        self.create_s: float = ready["create_s"]
        self.totals = Totals.from_answer(ready)

    def command(self, op: str, **fields: Any) -> Totals:
        self.process.send(json.dumps({"op": op, **fields}))
        self.totals = Totals.from_answer(json.loads(self.process.readline(DEADLINE_S)))
        return self.totals

    def write(self, *sizes: int) -> Totals:
        return self.command("write", sizes=list(sizes))

    def pump(self, size: int = 512, interval: float = 0.02) -> Totals:
        """Keep transferring in the background: a writer-only C++ rank re-runs the election on every event."""
        return self.command("pump", size=size, interval=interval)

    def unpump(self) -> Totals:
        return self.command("unpump")

    def kill(self) -> None:
        self.process.kill()


def in_own_pid_namespace(script: str) -> str:
    """``script`` run as pid 1 of a new pid namespace, as a container's main process runs (needs root).

    The started process execs ``unshare``, keeping its pid (the one the Reaper kills) and its pipes; unshare
    SIGKILLs the namespace's process when it dies itself.
    """
    return textwrap.dedent(f"""
        import os, sys
        os.execvp("unshare", ["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-c", {script!r},
                              *sys.argv[1:]])
    """)


def start_cpp_ranks(reaper: Reaper, directory: Path, port: int, names: list[str],
                    envs: list[Mapping[str, str]] | None = None, own_pid_namespace: bool = False) -> list[CppRank]:
    """Start one C++ rank per name (in parallel, in that order), then wait until each is ready.

    With ``own_pid_namespace`` each is pid 1 of a namespace of its own (its ``pid`` is then 1)."""
    script = in_own_pid_namespace(CPP_RANK_SCRIPT) if own_pid_namespace else CPP_RANK_SCRIPT
    processes = [start_rank(reaper, script, cpp_env(directory, port, **(extra or {})), args=(name,))
                 for name, extra in zip(names, envs or [{}] * len(names), strict=True)]
    return [CppRank(p) for p in processes]


# -- one agent per environment -------------------------------------------------------------------------------

# One process, one agent per command: {"unset": [names], "env": {name: value}, "name": agent} edits this process's
# environment (which the plug-in reads with getenv as each agent is created: every NIXL_TELEMETRY_* variable and
# those named are unset, then ``env`` is set), creates the agent with no backend
# and answers {"created": true} or {"created": false, "error": "..."}; the agent is dropped at once, its store and
# lock file stay in the directory for the test to read.
CPP_ENV_PROBE_SCRIPT = textwrap.dedent("""
    import gc, json, os, sys
    answers, sys.stdout = sys.stdout, sys.stderr  # nixl logs to sys.stdout: keep its lines out of the answers
    from nixl_cu12 import nixl_agent, nixl_agent_config

    print(json.dumps({"ready": True}), file=answers, flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        for name in [n for n in os.environ if n.startswith("NIXL_TELEMETRY_") or n in cmd["unset"]]:
            del os.environ[name]
        os.environ.update(cmd["env"])
        try:
            agent = nixl_agent(cmd["name"], nixl_agent_config(backends=[]))
        except Exception as exc:
            answer = {"created": False, "error": str(exc)}
        else:
            answer = {"created": True}
            del agent
            gc.collect()
        print(json.dumps(answer), file=answers, flush=True)
""")


class CppEnvProbe:
    """Creates C++ agents under given environments, in one long-lived process (an agent costs milliseconds)."""

    def __init__(self, reaper: Reaper) -> None:
        self.process = start_rank(reaper, CPP_ENV_PROBE_SCRIPT)
        assert json.loads(self.process.readline(START_DEADLINE_S)) == {"ready": True}

    def create(self, name: str, env: Mapping[str, str], unset: list[str]) -> dict[str, Any]:
        """Create agent ``name`` with exactly ``env`` set among NIXL_TELEMETRY_* and the variables ``unset`` names."""
        self.process.send(json.dumps({"name": name, "env": dict(env), "unset": unset}))
        return json.loads(self.process.readline(DEADLINE_S))


# -- the aggregator -------------------------------------------------------------------------------------------


def aggregator_command() -> list[str]:
    """How the standalone aggregator is started: the Procfile's ``web:`` command (the one place it is written)."""
    return support_e2e.procfile_web_command()


def start_aggregator(reaper: Reaper, directory: Path, port: int,
                     wait: bool = True) -> Proc:
    """The aggregator over ``directory`` on 127.0.0.1:port, one worker.

    With ``wait`` it returns once the aggregator answers /healthz; without, at once (it may be waiting for
    the address, which another process serves).
    """
    env = support_e2e.rank_env(directory, port, GUNICORN_WORKERS="1", GUNICORN_THREADS="2",
                               NIXL_TELEMETRY_MP_STALE_TTL=str(STALE_TTL_S))
    proc = reaper.spawn(aggregator_command(), env)
    if wait:
        wait_until(lambda: http_get(metrics_url(port, "/healthz"), timeout=2).status == 200, START_DEADLINE_S,
                   message=f"the aggregator to answer on port {port}")
    return proc


# -- who serves -----------------------------------------------------------------------------------------------


def listening_inodes(port: int) -> set[str]:
    """``socket:[inode]`` of every socket listening on 127.0.0.1:port or 0.0.0.0:port (Linux /proc)."""
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        address, _, hex_port = fields[1].partition(":")
        if fields[3] == "0A" and int(hex_port, 16) == port and address in ("0100007F", "00000000"):
            inodes.add(f"socket:[{fields[9]}]")
    return inodes


def listens(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds a socket listening on the port (False once it is gone)."""
    inodes = listening_inodes(port)
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):  # a descriptor closed while we looked
                if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                    return True
    except OSError:  # the process is gone
        return False
    return False


def wait_for_owner(port: int, pid: int, timeout: float = DEADLINE_S, since: float | None = None) -> float:
    """Seconds from ``since`` (a time.monotonic(), default now) until ``pid`` listens on the port and /metrics
    answers 200 there; fails after ``timeout`` s."""
    started = time.monotonic() if since is None else since

    def served() -> bool:
        return listens(pid, port) and http_get(metrics_url(port), timeout=2).status == 200

    wait_until(served, timeout, interval=0.01, message=f"pid {pid} to serve /metrics on port {port}")
    return time.monotonic() - started


# -- expositions, sample by sample ----------------------------------------------------------------------------

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
RawKey = tuple[str, frozenset[tuple[str, str]]]


@dataclass
class RawExposition:
    """A text exposition as written: label values and numbers as the strings on the wire."""

    samples: dict[RawKey, str]  # (name, {(label, raw value)}) -> raw value text
    help: dict[str, str]  # family -> raw HELP text
    types: dict[str, str]  # family -> TYPE


def parse_raw(text: str) -> RawExposition:
    """Split a text-format exposition line by line, keeping every spelling (no float normalisation)."""
    raw = RawExposition({}, {}, {})
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, _, doc = line[len("# HELP "):].partition(" ")
            raw.help[name] = doc
        elif line.startswith("# TYPE "):
            name, _, kind = line[len("# TYPE "):].partition(" ")
            raw.types[name] = kind
        elif line and not line.startswith("#"):
            match = _SAMPLE.match(line)
            assert match, f"unparseable sample line {line!r}"
            labels = frozenset(_LABEL.findall(match.group(2) or ""))
            key = (match.group(1), labels)
            assert key not in raw.samples, f"duplicate series {line!r}"
            raw.samples[key] = match.group(3)
    return raw


def samples_of(samples: Mapping[SeriesKey, float], pid: int, agent_name: str) -> dict[str, float]:
    """{sample name (with a status/le suffix when labelled so): value} of one agent of one process."""
    out = {}
    for (name, labels), value in samples.items():
        d = dict(labels)
        if d.get("pid") == str(pid) and d.get("agent_name") == agent_name:
            suffix = "".join(f"{{{k}={d[k]}}}" for k in ("status", "le") if k in d)
            out[name + suffix] = value
    return out

