"""The application: collector, exposition, WSGI app, endpoint, Exporter, CLI.

``app.wsgi`` is the WSGI application for ``gunicorn app:wsgi``.  It is built
on first access (from NIXL_TELEMETRY_MULTIPROC_DIR), so that importing
``Exporter`` in a rank never needs the standalone aggregator's setup.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any


def _check_installation() -> None:
    """Refuse a ``store`` or ``election`` that is not installed beside this ``app``.

    The three are top-level packages, and ``python -c``, ``python -m`` and gunicorn put the working
    directory first on sys.path: a project's own store.py there would be imported instead, and fail
    far from here (``cannot import name 'EventType' from 'store'``).
    """
    home = Path(__file__).resolve().parent.parent
    for name in ("store", "election"):
        module = sys.modules.get(name)
        origin = getattr(module, "__file__", None) if module is not None else \
            getattr(importlib.util.find_spec(name), "origin", None)
        if origin is None or Path(origin).resolve().parent == home / name:
            continue  # not found at all (the import below says so), or ours
        raise ImportError(
            f"cannot import app: the module {name!r} resolves to {origin}, not to this installation's "
            f"{home / name}, so a file or package named {name} in the working directory (or earlier on sys.path) "
            f"shadows it. Rename it, or run from another directory; the nixl-prometheus-mp command (and "
            f"'nixl-prometheus-mp aggregate' for the gunicorn aggregator) runs from any directory",
            name=name, path=origin)


_check_installation()

from app.config import Config, ConfigError  # noqa: E402 (after the check: these import store and election)
from app.exporter import Exporter, NullExporter, create_exporter  # noqa: E402

__all__ = ["Config", "ConfigError", "Exporter", "NullExporter", "create_exporter", "wsgi"]


def __getattr__(name: str) -> Any:
    if name == "wsgi":
        from app.standalone import standalone_app

        return standalone_app()
    raise AttributeError(f"module 'app' has no attribute {name!r}")
