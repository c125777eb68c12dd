"""Which path the hot paths take is visible where an operator looks: a warning, /healthz, ``inspect``.

pip hides the build's own warning, so an installation without a C compiler
(``pip install`` with ``CC=/bin/false``) looks like any other.  Here the
children run with the C speedups made unimportable (a ``sitecustomize`` that
refuses ``store._recorder``, ``store._scan`` and ``store._render``, as a
build without them would leave the package), through the command line and
HTTP.
"""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support import Reaper, free_port, get_json, http_get, wait_until
from support_e2e import REPO, rank_env

from store import native

BLOCKER = """
import sys

class _NoSpeedups:
    def find_spec(self, name, path=None, target=None):
        if name in ("store._recorder", "store._scan", "store._render"):
            raise ImportError(f"No module named {name!r} (refused by the test)", name=name)
        return None

sys.meta_path.insert(0, _NoSpeedups())
"""
WARNING = "the C speedups store._recorder, store._scan, store._render cannot be imported"


def _built() -> bool:
    try:
        for name in native.SPEEDUPS:
            importlib.import_module(f"store.{name}")
    except ImportError:
        return False
    return True


def _env(tmp_path: Path, port: int, *, blocked: bool, forced: bool) -> dict[str, str]:
    env = rank_env(tmp_path / "mp", port)
    env.pop(native.PURE_PYTHON_ENV, None)
    if forced:
        env[native.PURE_PYTHON_ENV] = "1"
    if blocked:
        site = tmp_path / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(BLOCKER)
        env["PYTHONPATH"] = f"{site}:{env['PYTHONPATH']}"
    return env


@pytest.mark.parametrize(("blocked", "forced"), [(True, False), (True, True), (False, False)],
                         ids=["not-built", "not-built-but-forced", "built"])
def test_the_path_in_use_is_a_warning_a_healthz_field_and_an_inspect_line(tmp_path: Path, blocked: bool,
                                                                         forced: bool) -> None:
    if not blocked and not _built():
        pytest.skip("the C speedups are not built here")  # CI_REQUIRE_SPEEDUPS=1 fails in test_store_native
    port = free_port()
    env = _env(tmp_path, port, blocked=blocked, forced=forced)
    path = "python" if blocked or forced else "c"
    warned = blocked and not forced
    with Reaper() as r:
        serve = r.spawn([sys.executable, "-m", "app", "serve"], env)
        wait_until(lambda: http_get(f"http://127.0.0.1:{port}/healthz", timeout=2).status == 200, 20,
                   lambda: f"python -m app serve to answer /healthz; output:\n{serve.output}")
        health = get_json(f"http://127.0.0.1:{port}/healthz")
        assert health["speedups"] == {"recorder": path, "scan": path, "render": path, "pure_python_forced": forced}
        http_get(f"http://127.0.0.1:{port}/metrics")  # the renderer and the scan have run, too
        output = serve.output
    # Once per process, however many speedups are missing and however often they are looked up.
    assert output.count("C speedups") == (1 if warned else 0), output
    if warned:
        assert WARNING in output and "NIXL_PROMETHEUS_MP_PURE_PYTHON=1" in output, output

    done = subprocess.run([sys.executable, "-m", "app", "inspect", str(tmp_path / "mp")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    last = done.stdout.splitlines()[-1]
    assert last.startswith(f"speedups of this installation (c or python): recorder {path}, scan {path}, "
                           f"render {path}"), done.stdout
    assert ("forces the Python path" in last) is forced, last
    assert done.stderr.count(WARNING) == (1 if warned else 0), done.stderr


def test_speedups_are_the_extensions_setup_py_builds() -> None:
    assert sorted(native.SPEEDUPS) == sorted(p.stem for p in (REPO / "store").glob("_*.c"))


def test_performance_page_quotes_what_the_code_says() -> None:
    text = " ".join((REPO / "docs" / "performance.md").read_text().split())
    section = text.split("### Which path runs", 1)[1].split("###", 1)[0]
    assert f"`{WARNING}" in section
    healthz = re.search(r'`"speedups": (\{[^`]*\})`', section)
    assert healthz is not None and set(json.loads(healthz.group(1))) == set(native.status())
    assert "`speedups of this installation (c or python): recorder c, scan c, render c`" in section
