"""``python -m bench --check``: an unmet target is a failing exit status, not only a table row.

The bench's measurements take seconds to minutes and depend on the machine's
load, so the takeover scenario is replaced here by one that reports a fixed
time (two seconds: the target is under half a second); the rest is the real
``python -m bench`` entry point, its report and its exit status.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from support_e2e import REPO

SCRIPT = """
import sys
import bench.__main__ as bench_main
from bench import scenarios

def takeover(settings, results):
    results.takeover.extend([float(sys.argv[1])] * settings.takeover_repeats)

scenarios.takeover = takeover
sys.exit(bench_main.main(sys.argv[2:]))
"""


def _bench(seconds: float, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", SCRIPT, str(seconds), "--scenarios", "takeover", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(("seconds", "args", "status"), [
    (2.0, ("--check",), 1),
    (2.0, (), 0),  # without --check the report is the whole answer
    (0.1, ("--check",), 0),
], ids=["unmet-checked", "unmet-unchecked", "met-checked"])
def test_check_fails_the_run_on_an_unmet_target(seconds: float, args: tuple[str, ...], status: int) -> None:
    done = _bench(seconds, *args)
    assert done.returncode == status, done.stderr
    row = next(line for line in done.stdout.splitlines() if line.startswith("| takeover < 0.5 s"))
    assert ("NOT met" in row) is (seconds >= 0.5), row
    named = "--check: 1 target(s) NOT met: takeover < 0.5 s" in done.stderr
    assert named is (status == 1), done.stderr

