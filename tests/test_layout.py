"""The code's layout (docs/layout.md): dependencies point one way, no import cycle, no module over 500 lines,
the table lists exactly the modules there are, and the address server and the aggregator never load a rank's
code.

Imports are read with ``ast`` from every module, those inside functions and ``if TYPE_CHECKING:`` blocks
included: a cycle hidden by a function-local import is still a cycle.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support import free_port

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("store", "election", "app")
LAYOUT_PAGE = ROOT / "docs" / "layout.md"
MAX_LINES = 500
# The modules whose paths are named outside the code (docs, Procfile, Containerfile, deploy/): they may import
# anything, like the command line.
ENTRY_POINTS = {"app", "app.__main__", "app.gunicorn_conf"}
# layer -> the layers it may import
ALLOWED = {
    "store": {"store"},
    "election": {"election", "store"},
    "core": {"core", "election", "store"},
    "rank": {"rank", "core", "election", "store"},
    "address": {"address", "core", "election", "store"},
    "aggregator": {"aggregator", "core", "election", "store"},
    "cli": {"cli", "rank", "address", "aggregator", "core", "election", "store"},
    "entry": {"entry", "cli", "rank", "address", "aggregator", "core", "election", "store"},
}


def module_files() -> dict[str, Path]:
    """Every Python module of the packages, by dotted name (a package by its own name)."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


MODULES = module_files()
# A rank's own code, which the address server's program and the aggregator never load.
RANK_CODE = {m for m in MODULES if m.startswith("app.rank")}


def imported(path: Path) -> set[str]:
    """The project modules ``path`` imports, wherever the import statement is."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: a relative import (the project imports absolutely)"
            assert node.module is not None
            # ``from store import layout`` imports the module store.layout; ``from store import EventType``, store.
            names = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in MODULES else node.module
                     for alias in node.names]
        else:
            continue
        for name in names:
            # ``import store._recorder`` (a C extension) or ``import app.collector.x``: the nearest Python module.
            while name not in MODULES and "." in name:
                name = name.rpartition(".")[0]
            if name in MODULES:
                found.add(name)
    return found


GRAPH = {module: imported(path) - {module} for module, path in MODULES.items()}


def layer(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "app":
        return parts[0]
    if module in ENTRY_POINTS:
        return "entry"
    if len(parts) > 1 and parts[1] in ("rank", "address", "aggregator", "cli"):
        return parts[1]
    return "core"


def test_the_layers_are_the_ones_documented() -> None:
    """Every module belongs to one layer, and the core is flat in app/ (a package in app/ is a mode's)."""
    packages = {m for m, p in MODULES.items() if p.name == "__init__.py"}
    assert packages == {"store", "election", "app", "app.rank", "app.address", "app.aggregator", "app.cli"}, packages
    assert {layer(m) for m in MODULES} == set(ALLOWED)
    assert [m for m in MODULES if layer(m) == "core" and m.count(".") != 1] == []


def test_dependencies_point_one_way() -> None:
    """store imports nothing above it, election only store, the core no mode package, and rank and aggregator
    never each other; the command line and the entry points may import anything."""
    wrong = sorted(f"{module} ({layer(module)}) imports {target} ({layer(target)})"
                   for module, targets in GRAPH.items() for target in targets
                   if layer(target) not in ALLOWED[layer(module)])
    assert wrong == []


def test_the_address_servers_program_imports_no_rank_module() -> None:
    """The address server serves with the core alone: it never loads a rank's Exporter, endpoint or standby
    (it outlives the rank that started it, and must not depend on it)."""
    assert GRAPH["app.address.server"] & RANK_CODE == set()


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module, or of one that imports itself (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph.get(node, ()):
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_cycles_finds_a_cycle_hidden_in_a_function() -> None:
    """The checker itself: a function-local import counts."""
    source = "def f():\n    from app.cli import CliError\n"
    tree = ast.parse(source)
    assert any(isinstance(n, ast.ImportFrom) and n.module == "app.cli" for n in ast.walk(tree))
    assert cycles({"app.cli": {"app.cli.top"}, "app.cli.top": {"app.cli"}}) == [["app.cli", "app.cli.top"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_cycle() -> None:
    assert cycles(GRAPH) == []


@pytest.mark.parametrize("module", sorted(MODULES), ids=str)
def test_no_module_over_500_lines(module: str) -> None:
    lines = len(MODULES[module].read_text().splitlines())
    assert lines <= MAX_LINES, f"{MODULES[module].relative_to(ROOT)} has {lines} lines: split it by what it holds"


def test_the_layout_table_lists_exactly_the_modules() -> None:
    table = LAYOUT_PAGE.read_text().split("| module | what it holds |", 1)[1].split("\n\n", 1)[0]
    listed = re.findall(r"^\| `([^`]+)` \|", table, re.M)
    assert len(listed) == len(set(listed)), "a module listed twice"
    assert sorted(listed) == sorted(str(p.relative_to(ROOT)) for p in MODULES.values())


def test_the_layout_page_is_linked_from_the_readme() -> None:
    assert "(docs/layout.md)" in (ROOT / "README.md").read_text()


# -- what a process loads (each in an interpreter of its own) -------------------------------------------------

def loaded_after(code: str, env: dict[str, str] | None = None) -> list[str]:
    """The ``app`` modules an interpreter has loaded after running ``code`` (which may print nothing)."""
    script = code + "\nimport sys, json\nprint(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'app')))"
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env={**os.environ, **(env or {})},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return list(json.loads(done.stdout.splitlines()[-1]))


def test_importing_app_loads_nothing_until_asked() -> None:
    assert loaded_after("import app") == ["app"]
    exporter = loaded_after("from app import Exporter, ConfigError, NullExporter, create_exporter, Config")
    assert "app.rank.exporter" in exporter and not any(m.startswith(("app.aggregator", "app.cli")) for m in exporter)


def test_the_aggregators_app_loads_no_rank_code(tmp_path: Path) -> None:
    """``gunicorn app:wsgi``: the app and its configuration, without the rank's Exporter or endpoint."""
    env = {"NIXL_TELEMETRY_MULTIPROC_DIR": str(tmp_path), "NIXL_TELEMETRY_PROMETHEUS_PORT": str(free_port())}
    loaded = loaded_after("import app, app.gunicorn_conf\napp.wsgi", env)
    assert "app.aggregator.wsgi" in loaded
    assert [m for m in loaded if m.startswith("app.rank") or m.startswith("app.cli")] == []


def test_the_address_server_loads_no_rank_code(tmp_path: Path) -> None:
    """The address server's program serves /healthz (the owner, the warnings) with the core alone."""
    code = f"""
import os, socket, http.client, json, threading
from pathlib import Path
import app.address.server as program
from app.launch import ServerArgs
listener = socket.create_server(("127.0.0.1", 0))
args = ServerArgs(address="127.0.0.1:1", directory=Path({str(tmp_path)!r}), has_lock=False, problem=None,
                  started_by=os.getppid(), agent_name="a", stale_ttl_s=30.0, drain_max_s=20.0, serving_since=1.0,
                  replaced_at=1.0, log_level=30)
server = program._Server(args, listener, None, tell_starter=False)
connection = http.client.HTTPConnection(*listener.getsockname(), timeout=10)
connection.request("GET", "/healthz")
doc = json.loads(connection.getresponse().read())
assert doc["owner"]["serving"] == "helper" and doc["owner"]["started_by"] == os.getppid(), doc
assert doc["warnings"][0]["kind"] == "directory-replaced", doc
server.server.shutdown()
"""
    loaded = loaded_after(code)
    assert "app.web" in loaded and "app.health" in loaded
    assert [m for m in loaded if m in RANK_CODE or m.startswith(("app.aggregator", "app.cli"))] == []


def test_server_args_read_back_what_they_write() -> None:
    from app.launch import ServerArgs

    args = ServerArgs(address="127.0.0.1:9090", directory=Path("/run/x"), has_lock=False, problem="no lock",
                      started_by=12, agent_name=None, stale_ttl_s=2.5, drain_max_s=0.0, serving_since=1.5,
                      replaced_at=None, log_level=20)
    assert ServerArgs.from_json(json.loads(json.dumps(args.to_json()))) == args  # as the bootstrap carries it


# -- every loopback request goes straight to the address --------------------------------------------------------

def test_loopback_requests_ignore_proxy_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """The project's /healthz probe and the suite's own HTTP helpers, with every proxy variable naming a proxy
    nothing listens on (as in a shell whose http_proxy cannot reach this host's loopback)."""
    import http.server
    import threading
    import urllib.error
    import urllib.request

    import support

    from app.probe import get_healthz

    class Healthz(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps({"owner": {"pid": 1234}}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Healthz)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}/healthz"
    try:
        with pytest.raises(urllib.error.URLError):  # the control: urlopen goes through the dead proxy
            urllib.request.urlopen(url, timeout=5)
        assert get_healthz("127.0.0.1", server.server_port).owner == {"pid": 1234}
        assert support.http_get(url).json() == {"owner": {"pid": 1234}}
        assert support.get_json(url) == {"owner": {"pid": 1234}}
    finally:
        server.shutdown()
        server.server_close()
