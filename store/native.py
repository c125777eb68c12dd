"""Which implementation of the hot paths runs: the C speedups or their Python twins.

Each speedup (``store/_*.c``) is optional and has a pure-Python twin with the
same behaviour.  ``load`` returns the compiled module, or None where it was
not built (no compiler) or where NIXL_PROMETHEUS_MP_PURE_PYTHON (a yes/no word,
store/flags.py) forces the Python path (the test suite runs on both).
"""

from __future__ import annotations

import importlib
import logging
import os
from types import ModuleType
from typing import Final

from store.flags import parse_flag

log = logging.getLogger("nixl_prometheus_mp.store")

PURE_PYTHON_ENV: Final = "NIXL_PROMETHEUS_MP_PURE_PYTHON"


def pure_python_forced() -> bool:
    """True when NIXL_PROMETHEUS_MP_PURE_PYTHON is a yes word; unset or empty is no.

    Any other value is a ValueError naming it, not a guess: "false" and "no" once forced the Python path.
    """
    return parse_flag(PURE_PYTHON_ENV, os.environ.get(PURE_PYTHON_ENV) or None)


def load(name: str) -> ModuleType | None:
    """``store.<name>`` if it was built and is not switched off, else None."""
    if pure_python_forced():
        return None
    try:
        return importlib.import_module(f"store.{name}")
    except ImportError:
        log.debug("store.%s is not built; using its pure-Python twin", name)
        return None
