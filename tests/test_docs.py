"""The documentation says what the code does: commands, links, tables checked against the source."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from support_e2e import REPO, procfile_web_command, shell_commands

from app import cli
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
    source = "".join(p.read_text() for d in ("app", "store", "election") for p in (REPO / d).glob("*.py"))
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


def test_operations_page_lists_every_deploy_file() -> None:
    text = (REPO / "docs" / "operations.md").read_text()
    table = text.split("\n## Kubernetes\n", 1)[1].split("\n```", 1)[0]
    for path in sorted((REPO / "deploy").iterdir()):
        assert f"`{path.name}`" in table, path.name


def test_operations_aggregate_command_is_the_procfiles_through_the_console_script() -> None:
    """The command documented for a directory with its own app/ or store.py runs exactly the Procfile's web: line."""
    (command,) = [c for c in shell_commands(OPERATIONS.read_text(), "The standalone aggregator (gunicorn)")
                  if c.startswith(cli.PROG)]
    assert shlex.split(command.split("#")[0]) == [cli.PROG, cli.AGGREGATE_COMMAND]
    assert procfile_web_command() == ["gunicorn", "-c", cli.AGGREGATOR_CONFIG, cli.AGGREGATOR_APP]
    assert f"gunicorn -c {cli.AGGREGATOR_CONFIG} [GUNICORN OPTIONS] {cli.AGGREGATOR_APP}" in command
