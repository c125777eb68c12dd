"""The flake hunt: run chosen test files N times, beside processes that burn CPU, and report every failure.

A red CI lands nothing, and a test that fails one run in a hundred fails CI often (several pytest runs of
~1,500 tests each).  Run this over the files you changed before you stop, and over the whole suite before a
release::

    .venv/bin/python tests/flake_hunt.py --runs 5 --burners 1 tests/test_address_server.py tests/test_http.py
    .venv/bin/python tests/flake_hunt.py --runs 3 --burners 1 --workers 2      # the whole suite

Each run is one pytest process (``-n WORKERS --dist loadfile`` when asked, as .ci/run's are) with a JUnit
report; the burners are processes spinning on the CPU for as long as the runs last, as a loaded CI machine would.
The report names each test that failed, how many runs it failed in, and the start of its failure; the exit
status is 1 if any did.
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BURN = "while True:\n    pass"


def _failures(report: Path) -> dict[str, str]:
    """test id -> the start of its failure or error, from a JUnit report."""
    failed = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        for outcome in ("failure", "error"):
            found = case.find(outcome)
            if found is not None:
                test = f"{case.get('classname', '')}::{case.get('name', '')}"
                failed[test] = (found.get("message") or "") + "\n" + (found.text or "")[:1500]
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", help="test files or node ids (default: the whole suite)")
    parser.add_argument("--runs", type=int, default=5, help="how many times to run them (default 5)")
    parser.add_argument("--burners", type=int, default=1, help="CPU-burning processes beside the runs (default 1)")
    parser.add_argument("--workers", type=int, default=0,
                        help="pytest-xdist workers per run, each taking whole files as .ci/run's do (default: none)")
    args = parser.parse_args(argv)
    burners = [subprocess.Popen([sys.executable, "-c", BURN]) for _ in range(args.burners)]
    counts: collections.Counter[str] = collections.Counter()
    first: dict[str, str] = {}
    started = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="flake-hunt-") as tmp:
            for run in range(1, args.runs + 1):
                report = Path(tmp) / f"run-{run}.xml"
                command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
                           *(["-n", str(args.workers), "--dist", "loadfile"] if args.workers else []), *args.files]
                done = subprocess.run(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True)
                failed = _failures(report) if report.exists() else {"(pytest)": done.stdout[-3000:]}
                for test, text in failed.items():
                    counts[test] += 1
                    first.setdefault(test, text)
                print(f"run {run}/{args.runs}: {len(failed)} failed ({done.stdout.strip().splitlines()[-1:]})",
                      flush=True)
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    print(f"\n{args.runs} runs in {time.monotonic() - started:.0f} s beside {args.burners} CPU burner(s): "
          f"{len(counts)} test(s) failed")
    for test, times in counts.most_common():
        print(f"\n{test}: failed in {times} of {args.runs} runs\n{first[test]}")
    return 1 if counts else 0


if __name__ == "__main__":
    sys.exit(main())
