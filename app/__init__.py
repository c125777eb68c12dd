"""The application: the serving core (flat here), a rank's side (app.rank), the gunicorn aggregator
(app.aggregator) and the command line (app.cli); docs/layout.md has the table.

``app.wsgi`` is the WSGI application for ``gunicorn app:wsgi``.  It is built
on first access (from NIXL_TELEMETRY_MULTIPROC_DIR), so that importing
``Exporter`` in a rank never needs the standalone aggregator's setup, and
nothing here loads before it is asked for.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any


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

if TYPE_CHECKING:
    from app.config import Config, ConfigError
    from app.rank.exporter import Exporter, NullExporter, create_exporter

__all__ = ["Config", "ConfigError", "Exporter", "NullExporter", "create_exporter", "wsgi"]
# Loaded on first use (PEP 562), so that the address server and the gunicorn aggregator, which import this
# package too, never load a rank's code.
_LAZY = {"Config": "app.config", "ConfigError": "app.config", "Exporter": "app.rank.exporter",
         "NullExporter": "app.rank.exporter", "create_exporter": "app.rank.exporter"}


def __getattr__(name: str) -> Any:
    if name == "wsgi":
        from app.aggregator.wsgi import standalone_app

        return standalone_app()
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'app' has no attribute {name!r}")
