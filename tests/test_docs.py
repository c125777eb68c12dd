"""The documentation says what the code does: commands, links, tables checked against the source."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from support_e2e import REPO, procfile_web_command, shell_commands

from app import cli
from app.exposition import ENDPOINT_FAMILIES
from store import layout
from store.metrics import FAMILIES

README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
OPERATIONS = REPO / "docs" / "operations.md"


def test_readme_has_exactly_the_demo_and_the_test_commands() -> None:
    demo, tests = shell_commands(README.read_text(), "Try it")
    # The demo installs the project only: the test extra is ~260 MB, mostly kubernetes-validate.
    assert demo == "python3 -m venv .venv && .venv/bin/pip install -q -e . && .venv/bin/python -m app demo"
    assert tests == ("python3 -m venv .venv && .venv/bin/pip install -q -e '.[test]' && "
                     ".venv/bin/python -m pytest")


def test_readme_aggregator_command_is_the_procfiles_from_the_venv() -> None:
    (command,) = shell_commands(README.read_text(), "Running the aggregator")
    words = shlex.split(command.split("#")[0])
    while "=" in words[0]:
        words.pop(0)  # the environment assignments
    # After the README's set-up gunicorn is not on PATH: the venv's is named.
    assert words == [".venv/bin/gunicorn", *procfile_web_command()[1:]]


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.name)
def test_relative_links_resolve(page: Path) -> None:
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
        if "://" not in target:
            assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.name)
def test_docs_stand_on_their_own(page: Path) -> None:
    """No citation of planning documents that are not part of the repository."""
    assert "DESIGN.md" not in page.read_text() and "SPEC.md" not in page.read_text()


def test_readme_configuration_names_every_variable_the_code_reads() -> None:
    source = "".join(p.read_text() for d in ("app", "store", "election") for p in (REPO / d).rglob("*.py"))
    variables = set(re.findall(r'"((?:NIXL_TELEMETRY|GUNICORN)_[A-Z_]+)"', source))
    assert variables >= {"NIXL_TELEMETRY_MULTIPROC_DIR", "GUNICORN_WORKERS"}
    config = README.read_text().split("\n## Configuration\n", 1)[1].split("\n## ", 1)[0]
    assert sorted(v for v in variables if f"`{v}`" not in config) == []


def test_format_page_states_the_layout_and_metrics_of_the_code() -> None:
    text = (REPO / "docs" / "format.md").read_text()
    rows = re.findall(r"^\| (\d+) \| (\d+) \| ", text, re.M)
    assert [(int(o), int(s)) for o, s in rows] == list(layout.FIELDS)
    assert f"exactly {layout.STORE_SIZE} bytes" in text
    for family in FAMILIES:
        assert f"| `{family.name}` | {family.help} |" in text, family.name
    for name, doc in ENDPOINT_FAMILIES:  # the endpoint's own
        assert f"| `{name}` | {doc} |" in text, name


def test_operations_page_lists_every_deploy_file() -> None:
    text = (REPO / "docs" / "operations.md").read_text()
    table = text.split("\n## Kubernetes\n", 1)[1].split("\n```", 1)[0]
    for path in sorted((REPO / "deploy").iterdir()):
        assert f"`{path.name}`" in table, path.name



# -- what the code defines, listed in the docs ------------------------------------------------------------------

CODE = sorted(p for d in ("app", "store", "election") for p in (REPO / d).rglob("*.py"))
OPERATIONS = REPO / "docs" / "operations.md"


def healthz_warning_kinds() -> set[str]:
    """Every ``kind`` a /healthz warning can have: the literals of the ``{"kind": ...}`` documents in the code."""
    kinds: set[str] = set()
    for path in CODE:
        text = path.read_text()
        for value in re.findall(r'"kind": ([^,}]+)', text):
            if value.startswith('"'):
                kinds.add(value.strip('"'))
            else:  # a variable: only the collector's ``kind = "..."`` form is understood here
                assert value == "kind", f"{path.name}: a warning kind from {value!r}; teach this test to read it"
                kinds |= set(re.findall(r'\bkind = "([a-z-]+)"', text))
    return kinds


def test_operations_page_lists_exactly_the_healthz_warning_kinds() -> None:
    kinds = healthz_warning_kinds()
    assert {"duplicate-owners", "duplicate-labels", "directory-replaced", "transient-read-error"} <= kinds
    table = OPERATIONS.read_text().split("| warning `kind` | what it says |", 1)[1].split("\n\n", 1)[0]
    documented = re.findall(r"^\| `([a-z-]+)` \|", table, re.M)
    assert sorted(documented) == sorted(kinds)
    assert len(documented) == len(set(documented))


def doc_command_lines() -> list[tuple[str, str]]:
    """(page, line) for every command line of the sh and console blocks of the README and docs/."""
    out = []
    for page in (README, *DOCS):
        for block in re.findall(r"```(?:sh|console)\n(.*?)```", page.read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.strip().removeprefix("$ ")
                if line and not line.startswith("#"):
                    out.append((page.name, line))
    return out


def test_every_gunicorn_command_in_the_docs_names_the_projects_configuration() -> None:
    runs = [(page, line) for page, line in doc_command_lines()
            if any(Path(word).name == "gunicorn" for word in shlex.split(line.split(" #", 1)[0]))]
    assert len(runs) >= 3, runs  # the README's, operations' (plain and TLS), cpp-interop's
    for page, line in runs:
        words = shlex.split(line.split(" #", 1)[0])
        assert "-c" in words, (page, line)
        config = words[words.index("-c") + 1]
        assert config == "python:app.gunicorn_conf", (page, line)
        assert (REPO / "app" / "gunicorn_conf.py").is_file()


def test_performance_page_describes_the_pure_python_ci_run_of_ci_run() -> None:
    script = (REPO / ".ci" / "run").read_text().replace("\\\n", " ")
    (run,) = [line for line in script.splitlines()
              if line.startswith("NIXL_PROMETHEUS_MP_PURE_PYTHON=1 ") and " pytest" in line]
    args = shlex.split(run)[shlex.split(run).index("pytest") + 1:]
    elsewhere = re.search(r"^RUN_ELSEWHERE=\(([^)]*)\)$", script, re.M)
    assert elsewhere is not None and "${RUN_ELSEWHERE[@]/#/--ignore=}" in args, args
    ignored = set(elsewhere.group(1).split())
    assert all((REPO / path).is_file() for path in ignored), ignored
    # The suite but whole files left out: no test selected by path, keyword or marker. The parallel workers
    # (PARALLEL) only distribute the tests, whole files to each.
    parallel = re.search(r"^PARALLEL=\(([^)]*)\)$", script, re.M)
    assert parallel is not None and shlex.split(parallel.group(1)) == ["-n", "2", "--dist", "loadfile"], parallel
    assert [a for a in args if a not in ("${RUN_ELSEWHERE[@]/#/--ignore=}", "${PARALLEL[@]}")] == ["-q"], args
    text = " ".join((REPO / "docs" / "performance.md").read_text().split())
    sentence = text.split("CI (`.ci/run`) runs ", 1)[1].split(". ", 1)[0]
    assert sentence.startswith("the suite once more with `NIXL_PROMETHEUS_MP_PURE_PYTHON=1` but for the"), sentence
    assert set(re.findall(r"`(tests/[a-z0-9_]+\.py)`", sentence)) == ignored, sentence


def test_operations_page_documents_every_command_and_the_console_script() -> None:
    from app.cli import build_parser

    (sub,) = [a for a in build_parser()._actions if a.dest == "command"]
    commands = list(sub.choices)  # type: ignore[arg-type]  # in --help's order
    script = re.search(r"^\[project\.scripts\]\n([a-z-]+) = \"app\.cli:main\"$",
                       (REPO / "pyproject.toml").read_text(), re.M)
    assert script is not None and "inspect" in commands
    section = OPERATIONS.read_text().split(f"\n## The command line: `{script.group(1)}`\n", 1)[1].split("\n## ", 1)[0]
    assert re.findall(r"^\| `([a-z]+)[^`]*` \|", section, re.M) == commands


def test_top_help_and_the_operations_page_name_the_ttl_top_uses() -> None:
    """In the order the program takes them (tests/test_top.py proves it: --ttl over the variable, the owner's when
    neither is set): --ttl, the variable, the directory's owner's, 30 s."""
    from app.cli import build_parser

    (sub,) = [a for a in build_parser()._actions if a.dest == "command"]
    (ttl,) = [a for a in sub.choices["top"]._actions if a.dest == "ttl"]  # type: ignore[index]
    assert "$NIXL_TELEMETRY_MP_STALE_TTL, else the TTL the directory's owner applies (its /healthz), else 30;" \
        in ttl.help, ttl.help
    section = " ".join(OPERATIONS.read_text().split("\n## Watching the ranks", 1)[1].split("\n## ", 1)[0].split())
    assert "counted with `--ttl`, else `NIXL_TELEMETRY_MP_STALE_TTL`, else the TTL the directory's owner applies " \
        "(its `/healthz`), else the default 30 s; the title says which." in section
    assert "else 30 s" not in section, "a second, older account of the TTL"


def test_format_page_examples_of_names_that_are_not_stores_are_not() -> None:
    from store.layout import is_store_name, store_file_name

    text = " ".join((REPO / "docs" / "format.md").read_text().split())
    examples = re.findall(r"`([^`]+)`", text.split("Not stores, for instance: ", 1)[1].split(". ", 1)[0])
    assert len(examples) >= 4 and not any(is_store_name(name) for name in examples), examples
    assert is_store_name(store_file_name(12, 34, 0))


def test_migration_page_names_variables_and_hooks_that_exist() -> None:
    from prometheus_client import values
    from prometheus_client.metrics import Gauge

    text = (REPO / "docs" / "migrating-from-prometheus-client.md").read_text()
    ours = set(re.findall(r"\bNIXL_TELEMETRY_[A-Z_]+", text))
    config = (REPO / "app" / "config.py").read_text()
    assert ours >= {"NIXL_TELEMETRY_MULTIPROC_DIR", "NIXL_TELEMETRY_MP_STALE_TTL"}
    assert sorted(v for v in ours if f'"{v}"' not in config) == []
    assert "PROMETHEUS_MULTIPROC_DIR" in Path(values.__file__).read_text()  # what prometheus_client reads
    assert "`mark_process_dead(pid)`" in text and "child_exit" in text
    modes = {m for row in re.findall(r"^\| gauge (.*?) \|", text, re.M) for m in re.findall(r"`([a-z]+)`", row)}
    assert modes >= {"all", "livesum", "max"} and modes <= Gauge._MULTIPROC_MODES, modes


def test_migration_pages_example_serves_nixls_series_beside_your_own(tmp_path: Path) -> None:
    from store import EventType, StoreIdentity, StoreWriter

    text = (REPO / "docs" / "migrating-from-prometheus-client.md").read_text()
    (code,) = re.findall(r"```python\n(.*?)```", text, re.S)
    directory = tmp_path / "mp"
    directory.mkdir(mode=0o700)
    writer = StoreWriter(directory, StoreIdentity("agent-doc", "host-a", "0", 0, (10.0,)))
    try:
        writer.record(EventType.AGENT_TX_BYTES, 4096)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("NIXL_", "PROMETHEUS_"))}
        done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                              env={**env, "NIXL_TELEMETRY_MULTIPROC_DIR": str(directory), "PYTHONPATH": str(REPO)})
    finally:
        writer.close()
    assert done.returncode == 0, done.stderr
    assert "my_requests_served_total 1.0" in done.stdout, done.stdout
    assert re.search(r'^agent_tx_bytes_total\{[^}]*agent_name="agent-doc"[^}]*\} 4096\.0$', done.stdout, re.M), \
        done.stdout


def test_operations_aggregate_command_is_the_procfiles_through_the_console_script() -> None:
    """The command documented for a directory with its own app/ or store.py runs exactly the Procfile's web: line."""
    (command,) = [c for c in shell_commands(OPERATIONS.read_text(), "The standalone aggregator (gunicorn)")
                  if c.startswith(cli.PROG)]
    assert shlex.split(command.split("#")[0]) == [cli.PROG, cli.AGGREGATE_COMMAND]
    assert procfile_web_command() == ["gunicorn", "-c", cli.AGGREGATOR_CONFIG, cli.AGGREGATOR_APP]
    assert f"gunicorn -c {cli.AGGREGATOR_CONFIG} [GUNICORN OPTIONS] {cli.AGGREGATOR_APP}" in command


# -- what Prometheus is served ----------------------------------------------------------------------------------

# The Accept headers Prometheus sends on every scrape by default. 2.42's is fixed in its scraper; 3.x's is built
# from scrape_protocols' default (OpenMetricsText1.0.0, OpenMetricsText0.0.1, PrometheusText1.0.0,
# PrometheusText0.0.4), q from 0.6 down, then */*; its escaping parameter goes on the 1.0.0 formats, or, in the
# first 3.x releases, on every entry.
PROMETHEUS_DEFAULT_ACCEPT = {
    "2.42": ["application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
             "text/plain;version=0.0.4;q=0.5,*/*;q=0.1"],
    "3.x": ["application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,"
            "application/openmetrics-text;version=0.0.1;q=0.5,text/plain;version=1.0.0;escaping=allow-utf-8;q=0.4,"
            "text/plain;version=0.0.4;q=0.3,*/*;q=0.2",
            "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,"
            "application/openmetrics-text;version=0.0.1;escaping=allow-utf-8;q=0.5,"
            "text/plain;version=1.0.0;escaping=allow-utf-8;q=0.4,text/plain;version=0.0.4;escaping=allow-utf-8;q=0.3,"
            "*/*;q=0.2"],
}


def served_content_type(directory: Path, accept: str | None) -> str:
    """The Content-Type /metrics answers ``accept`` with (None: no Accept header), from the WSGI app itself."""
    from werkzeug.test import Client

    from app.collector import Collector
    from app.web import MetricsApp

    client = Client(MetricsApp(Collector(directory, 30), lambda: {"pid": os.getpid()}))
    response = client.get("/metrics", headers={} if accept is None else {"Accept": accept})
    assert response.status_code == 200
    return response.headers["Content-Type"]


def doc_section(text: str, title: str) -> str:
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_operations_page_states_the_format_prometheus_is_served(tmp_path: Path) -> None:
    """The negotiation decides what the HTTP and Prometheus compatibility sections say Prometheus gets."""
    from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
    from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST as CONTENT_TYPE_OPENMETRICS

    formats = {"text 0.0.4": CONTENT_TYPE_PLAIN_0_0_4, "OpenMetrics 1.0.0": CONTENT_TYPE_OPENMETRICS}
    text = OPERATIONS.read_text()
    compatibility = doc_section(text, "Prometheus compatibility")
    rows = re.findall(r"^ *\| ([0-9.x]+) \| `([^`]+)` \| ([^|]+?) \|$", compatibility, re.M)
    assert sorted(version for version, _, _ in rows) == sorted(PROMETHEUS_DEFAULT_ACCEPT), rows
    for version, accept, stated in rows:
        assert accept == PROMETHEUS_DEFAULT_ACCEPT[version][0], f"{version}: not its default Accept header"
        for header in PROMETHEUS_DEFAULT_ACCEPT[version]:
            assert served_content_type(tmp_path, header) == formats[stated], (version, header, stated)
    assert {stated for _, _, stated in rows} == {"text 0.0.4"}  # so no sentence may say Prometheus gets OpenMetrics
    assert "Prometheus is served the text format 0.0.4" in " ".join(compatibility.split())
    in_a_sentence = r"(?:[^.]|\.(?=\S))*"  # what follows within the sentence (a version's dots do not end it)
    claim = re.compile(rf"Prometheus{in_a_sentence}(?:scrapes|is served|gets){in_a_sentence}OpenMetrics")
    assert not claim.search(" ".join(text.split())), claim.search(" ".join(text.split()))

    # The HTTP section's list of what counts as accepting the text format, and what gets OpenMetrics.
    http = " ".join(doc_section(text, "HTTP").split("\n- ", 2)[1].split())
    assert http.startswith("`GET /metrics`: the Prometheus text format 0.0.4 to every client that accepts it"), http
    accepted = re.search(r"no `Accept` header, or one that lists (.*?) at any q above 0", http)
    assert accepted is not None, http
    listed = re.findall(r"`([^`]+)`", accepted.group(1))
    assert len(listed) == 4, listed
    for accept in [None, *listed, *(f"application/openmetrics-text;version=1.0.0, {a};q=0.1" for a in listed)]:
        assert served_content_type(tmp_path, accept) == CONTENT_TYPE_PLAIN_0_0_4, accept
    assert "OpenMetrics 1.0.0 only to a client that accepts `application/openmetrics-text` and not the text " \
           "format 0.0.4" in http
    assert served_content_type(tmp_path, "application/openmetrics-text") == CONTENT_TYPE_OPENMETRICS
    assert served_content_type(tmp_path, "application/openmetrics-text, text/plain;version=1.0.0") == \
        CONTENT_TYPE_OPENMETRICS


def test_cpp_interop_example_starts_the_ranks_once_the_aggregator_holds_the_address() -> None:
    """Started together, a C++ rank could win the address first; the example waits for the aggregator's /healthz."""
    text = (REPO / "docs" / "cpp-interop.md").read_text()
    (block,) = re.findall(r"```sh\n(.*?)```", doc_section(text, "The example: two real agents"), re.S)
    lines = [line.split(" #", 1)[0].strip() for line in block.replace("\\\n", " ").splitlines()]
    port = re.search(r"\bNIXL_TELEMETRY_PROMETHEUS_PORT=(\d+)\b", block)
    assert port is not None and port.group(1) != "9090", "Prometheus's own port"
    aggregator = next(i for i, line in enumerate(lines) if "gunicorn" in line)
    ranks = [i for i, line in enumerate(lines) if "examples/cpp_agents.py" in line]
    waits = [i for i, line in enumerate(lines)
             if re.fullmatch(rf"until curl -sf 127\.0\.0\.1:{port.group(1)}/healthz >/dev/null; do sleep [0-9.]+; done",
                             line)]
    assert len(ranks) == 2 and len(waits) == 1 and aggregator < waits[0] < min(ranks), lines
    assert lines[aggregator].endswith("&") and all(lines[i].endswith("&") for i in ranks)
    for address in re.findall(r"127\.0\.0\.1:(\d+)", block):
        assert address == port.group(1), "every command of the example uses its port"


def test_example_ports_are_not_prometheuss_own() -> None:
    """9090 is the ranks' default (the C++ plug-in's, a contract) but also Prometheus's own port: the examples that
    run on a host (the aggregator's, the C++ interop's) use another one, the same everywhere."""
    ports = set()
    for page, line in doc_command_lines():
        for port in re.findall(r"\bNIXL_TELEMETRY_PROMETHEUS_PORT=(\d+)", line):
            ports.add(port)
            assert port != "9090", (page, line)
    assert len(ports) == 1, ports  # README, operations.md and cpp-interop.md's examples
    config = README.read_text().split("\n## Configuration\n", 1)[1]
    assert "| `NIXL_TELEMETRY_PROMETHEUS_PORT` | scrape port, 1..65535 | 9090 |" in config  # the default stays


def _cited_tests(text: str) -> list[tuple[str, str]]:
    """(file, test) for every ``test_x.py::test_y`` and every ``::test_y`` (of the file named last) in ``text``."""
    cited, current = [], None
    for file, name in re.findall(r"`(?:tests/)?(test_\w+\.py)?(?:::(test_\w+))?", text):
        current = file or current
        if name and current is not None:
            cited.append((current, name))
    return cited


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.name)
def test_every_test_a_page_cites_exists(page: Path) -> None:
    """A guarantee names the test that shows it: that test must be there, under that name."""
    missing = [f"{file}::{name}" for file, name in _cited_tests(page.read_text())
               if not re.search(rf"^(?:async )?def {name}\(", (REPO / "tests" / file).read_text()
                                if (REPO / "tests" / file).exists() else "", re.MULTILINE)]
    assert missing == []
