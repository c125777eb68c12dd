"""The code base stays ruff- and mypy-clean (their configuration is in pyproject.toml)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_clean() -> None:
    result = subprocess.run([sys.executable, "-m", "ruff", "check", str(ROOT)], capture_output=True, text=True,
                            timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_clean() -> None:
    """The library packages type-check (the configuration in pyproject.toml)."""
    result = subprocess.run([sys.executable, "-m", "mypy", "store", "election", "app"], capture_output=True,
                            text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_store_imports_neither_app_nor_election() -> None:
    """The layering: store is the foundation and must not depend on the layers above it."""
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "store").glob("*.py")
                 if any(line.startswith(("from app", "import app", "from election", "import election"))
                        for line in p.read_text().splitlines())]
    assert offenders == []
