"""Which implementation of the hot paths runs: the C speedups or their Python twins.

Each speedup (``store/_*.c``) is optional and has a pure-Python twin with the
same behaviour.  ``load`` returns the compiled module, or None where it was
not built (no compiler) or where NIXL_PROMETHEUS_MP_PURE_PYTHON=1 forces the
Python path (the test suite runs on both).
"""

from __future__ import annotations

import importlib
import logging
import os
from types import ModuleType
from typing import Final

log = logging.getLogger("nixl_prometheus_mp.store")

PURE_PYTHON_ENV: Final = "NIXL_PROMETHEUS_MP_PURE_PYTHON"


def pure_python_forced() -> bool:
    """True when NIXL_PROMETHEUS_MP_PURE_PYTHON asks for the Python path."""
    return os.environ.get(PURE_PYTHON_ENV, "").strip() not in ("", "0")


def load(name: str) -> ModuleType | None:
    """``store.<name>`` if it was built and is not switched off, else None."""
    if pure_python_forced():
        return None
    try:
        return importlib.import_module(f"store.{name}")
    except ImportError:
        log.debug("store.%s is not built; using its pure-Python twin", name)
        return None
