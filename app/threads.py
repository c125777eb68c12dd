"""Threads of ours: daemon threads named twice, for Python and for the kernel.

The Python name (``threading.enumerate()``, tracebacks) may say which address a thread serves; the kernel's
(``ps -T``, ``top -H``, ``/proc/PID/task/TID/comm``: at most 15 bytes) says what it does, so that an operator
looking at an address server, or at a rank serving from a thread, sees which threads are ours and what each is.
docs/architecture.md lists them; a test compares that list with what a running job has.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Callable
from typing import Any

_PR_SET_NAME = 15  # <linux/prctl.h>
OS_NAME_MAX = 15  # TASK_COMM_LEN less its NUL: the kernel cuts longer names
_libc: Any = None


def set_os_name(name: str) -> None:
    """Name the calling thread for the kernel (the main thread's name is the process's, in ``ps -e``)."""
    global _libc
    with contextlib.suppress(OSError, AttributeError):
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        _libc.prctl(_PR_SET_NAME, name.encode()[:OS_NAME_MAX], 0, 0, 0)


def new_thread(target: Callable[..., object], name: str, os_name: str, args: tuple[Any, ...] = ()) -> threading.Thread:
    """A daemon thread (not started) that names itself ``os_name`` for the kernel before it runs ``target``.

    Daemon: a thread of ours never holds up the exit of the process it lives in.
    """
    if len(os_name.encode()) > OS_NAME_MAX:
        raise ValueError(f"{os_name!r} is longer than the kernel's {OS_NAME_MAX} bytes")

    def run() -> None:
        set_os_name(os_name)
        target(*args)
    return threading.Thread(target=run, name=name, daemon=True)
