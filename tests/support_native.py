"""The C speedups under test: import one, or skip its tests where it is not built (a failure in CI); the
system-call shim that interrupts their calls.

Import from a test module with ``from support_native import c_speedup`` (pytest puts ``tests/`` on ``sys.path``).
"""

from __future__ import annotations

import importlib
import os
import shlex
import subprocess
import sysconfig
from pathlib import Path
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


SYSCALL_SHIM_SOURCE = Path(__file__).with_name("syscall_shim.c")


def syscall_shim(directory: Path) -> Path:
    """tests/syscall_shim.c built into ``directory``: an LD_PRELOAD library that interrupts system calls.

    No C compiler: the calling test is skipped, unless CI_REQUIRE_SPEEDUPS=1 (CI), where that fails.
    """
    compiler = shlex.split(sysconfig.get_config_var("CC") or "cc")
    library = directory / "syscall_shim.so"
    try:
        subprocess.run([*compiler, "-shared", "-fPIC", "-O1", "-o", str(library), str(SYSCALL_SHIM_SOURCE), "-ldl"],
                       check=True, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.CalledProcessError) as exc:
        if os.environ.get("CI_REQUIRE_SPEEDUPS") == "1":
            raise RuntimeError(f"cannot build {SYSCALL_SHIM_SOURCE.name} but CI_REQUIRE_SPEEDUPS=1: {exc}") from exc
        pytest.skip(f"no C compiler to build {SYSCALL_SHIM_SOURCE.name}: {exc}")
    return library


def preloading(library: Path) -> dict[str, str]:
    """The environment with ``library`` preloaded ahead of what LD_PRELOAD holds (a sanitizer's runtime)."""
    env = dict(os.environ)
    env["LD_PRELOAD"] = " ".join(filter(None, [str(library), env.get("LD_PRELOAD", "")]))
    # AddressSanitizer insists on coming first; here the shim must, to see the calls before its interceptors.
    env["ASAN_OPTIONS"] = ":".join(filter(None, [env.get("ASAN_OPTIONS", ""), "verify_asan_link_order=0"]))
    return env
