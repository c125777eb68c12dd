"""The C speedups under test: import one, or skip its tests where it is not built (a failure in CI).

Import from a test module with ``from support_native import c_speedup`` (pytest puts ``tests/`` on ``sys.path``).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest


def c_speedup(name: str) -> ModuleType:
    """``store.<name>``, imported even where NIXL_PROMETHEUS_MP_PURE_PYTHON=1 keeps the package from using it.

    Not built: the calling module's tests are skipped, unless CI_REQUIRE_SPEEDUPS=1 (CI), where that fails.
    """
    try:
        return importlib.import_module(f"store.{name}")
    except ImportError:
        if os.environ.get("CI_REQUIRE_SPEEDUPS") == "1":
            raise RuntimeError(f"store.{name} is not built but CI_REQUIRE_SPEEDUPS=1") from None
        pytest.skip(f"store.{name} is not built here", allow_module_level=True)
