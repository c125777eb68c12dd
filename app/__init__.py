"""The application: collector, exposition, WSGI app, endpoint, Exporter, CLI.

``app.wsgi`` is the WSGI application for ``gunicorn app:wsgi``.  It is built
on first access (from NIXL_TELEMETRY_MULTIPROC_DIR), so that importing
``Exporter`` in a rank never needs the standalone aggregator's setup.
"""

from __future__ import annotations

from typing import Any

from app.config import Config, ConfigError
from app.exporter import Exporter, NullExporter, create_exporter

__all__ = ["Config", "ConfigError", "Exporter", "NullExporter", "create_exporter", "wsgi"]


def __getattr__(name: str) -> Any:
    if name == "wsgi":
        from app.standalone import standalone_app

        return standalone_app()
    raise AttributeError(f"module 'app' has no attribute {name!r}")
