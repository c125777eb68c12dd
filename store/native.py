"""Which implementation of the hot paths runs: the C speedups or their Python twins.

Each speedup (``store/_*.c``) is optional and has a pure-Python twin with the
same behaviour.  ``load`` returns the compiled module, or None where it was
not built (no compiler) or where NIXL_PROMETHEUS_MP_PURE_PYTHON (a yes/no word,
store/flags.py) forces the Python path (the test suite runs on both).

pip hides a build's warnings, so an install without a compiler looks like any
other: a speedup that is missing although nobody asked for the Python path is
said once per process, at WARNING, and ``status()`` (``/healthz``'s
``speedups``, ``python -m app inspect``) tells which path each hot path takes.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from types import ModuleType
from typing import Final

from store.flags import parse_flag

log = logging.getLogger("nixl_prometheus_mp.store")

PURE_PYTHON_ENV: Final = "NIXL_PROMETHEUS_MP_PURE_PYTHON"
# Every extension setup.py builds (store/_<name>.c; a test checks the two agree), by the hot path it speeds up.
SPEEDUPS: Final = ("_recorder", "_scan", "_render")

_in_use: dict[str, bool] = {}  # extension -> whether its C module is what this process runs
_lock = threading.Lock()
_warned = False


def pure_python_forced() -> bool:
    """True when NIXL_PROMETHEUS_MP_PURE_PYTHON is a yes word; unset or empty is no, and so is a value that is no
    yes/no word, which is refused where the package is first used (pure_python_problem) rather than at import:
    an import error in every rank would be a traceback, not one line ("false" and "no" once forced the path)."""
    return pure_python_problem() is None and parse_flag(PURE_PYTHON_ENV, os.environ.get(PURE_PYTHON_ENV) or None)


def pure_python_problem() -> str | None:
    """What is wrong with NIXL_PROMETHEUS_MP_PURE_PYTHON, in one line naming its value; None if nothing is."""
    try:
        parse_flag(PURE_PYTHON_ENV, os.environ.get(PURE_PYTHON_ENV) or None)
    except ValueError as exc:
        return str(exc)
    return None


def _import(name: str) -> ModuleType:
    return importlib.import_module(f"store.{name}")


def load(name: str) -> ModuleType | None:
    """``store.<name>`` if it was built and is not switched off, else None."""
    if pure_python_forced():
        _in_use[name] = False
        return None
    try:
        module = _import(name)
    except ImportError as exc:
        _in_use[name] = False
        _warn_missing(exc)
        return None
    _in_use[name] = True
    return module


def refuse(name: str) -> None:
    """Record that ``store.<name>`` loaded but is not used (its caller said why)."""
    _in_use[name] = False


def _warn_missing(exc: ImportError) -> None:
    global _warned
    with _lock:
        if _warned:
            return
        _warned = True
    missing = []
    for name in SPEEDUPS:
        try:
            _import(name)
        except ImportError:
            missing.append(f"store.{name}")
    log.warning("the C speedups %s cannot be imported (%s): this process runs their pure-Python twins, about "
                "15x slower per recorded event. Reinstall the package (pip install) where a C compiler and "
                "the Python headers are present to get them back, or set %s=1 to choose the Python path on "
                "purpose (which silences this warning).", ", ".join(missing) or exc.name, exc,
                PURE_PYTHON_ENV)


def status() -> dict[str, object]:
    """/healthz's ``speedups``: ``"c"`` or ``"python"`` per hot path, and whether the Python path was forced.

    An extension no module of this process has loaded yet is loaded here:
    the answer is the path its hot path takes once it runs.
    """
    for name in SPEEDUPS:
        if name not in _in_use:
            load(name)
    paths = {name.removeprefix("_"): "c" if _in_use[name] else "python" for name in SPEEDUPS}
    return {**paths, "pure_python_forced": pure_python_forced()}
