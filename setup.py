"""Optional C speedups for the hot path (``store/_*.c``).

Every extension here has a pure-Python twin and is optional: where no C
compiler (or no Python headers) is available the build warns and the package
installs without it, only slower.  NIXL_PROMETHEUS_MP_PURE_PYTHON=1 (any of
NIXL's yes words) at build time skips the extensions altogether.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """Build what compiles; warn about (never fail on) what does not."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # no compiler at all
            print(f"WARNING: the C speedups were not built ({exc}); the pure-Python path is used",
                  file=sys.stderr)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # this one does not compile here
            print(f"WARNING: {ext.name} was not built ({exc}); its pure-Python twin is used", file=sys.stderr)


def pure_python() -> bool:
    """NIXL_PROMETHEUS_MP_PURE_PYTHON read as the package reads it at run time (store/native.py)."""
    # By path: importing the store package would import the very modules being built.
    parse_flag = runpy.run_path(str(Path("store") / "flags.py"))["parse_flag"]
    name = "NIXL_PROMETHEUS_MP_PURE_PYTHON"
    try:
        return bool(parse_flag(name, os.environ.get(name) or None))
    except ValueError as exc:
        sys.exit(f"error: {exc}")


def extensions() -> list[Extension]:
    if pure_python():
        return []
    return [Extension(f"store.{source.stem}", [str(source)], extra_compile_args=["-O2", "-std=c11"])
            for source in sorted(Path("store").glob("_*.c"))]


setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuildExt})
