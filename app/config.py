"""Configuration from the environment (the table in the README, "Configuration").

Bad values are fatal and named: a rank that selected this exporter and got
the directory wrong must fail loudly at startup, not run without telemetry.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import math
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from store import EventType, flags, native, parse_buckets

log = logging.getLogger("nixl_prometheus_mp")

DIR_ENV = "NIXL_TELEMETRY_MULTIPROC_DIR"
PORT_ENV = "NIXL_TELEMETRY_PROMETHEUS_PORT"
LOCAL_ENV = "NIXL_TELEMETRY_PROMETHEUS_LOCAL"
RANK_ENV_ENV = "NIXL_TELEMETRY_RANK_ENV"
TTL_ENV = "NIXL_TELEMETRY_MP_STALE_TTL"
ENABLED_ENV = "NIXL_TELEMETRY_ENABLED_METRICS"
ENABLE_ENV = "NIXL_TELEMETRY_ENABLE"
EXPORTER_ENV = "NIXL_TELEMETRY_EXPORTER"
SERVE_ENV = "NIXL_PROMETHEUS_MP_SERVE"
DRAIN_ENV = "NIXL_PROMETHEUS_MP_DRAIN_MAX"
SERVE_MODES = ("helper", "thread")  # the first is the default

DEFAULT_PORT = 9090
DEFAULT_TTL_S = 30.0
# How long a SIGTERMed server or aggregator may keep publishing departed ranks' final values (their TTL ends it
# sooner): within Kubernetes' default 30 s grace period once the ranks' own shutdown is counted.
DEFAULT_DRAIN_MAX_S = 20.0
DEFAULT_RANK_ENV = "LOCAL_RANK"
# The TTL is compared in int64 nanoseconds (as in the C++ plug-in): larger
# values cannot be represented, and nothing needs a TTL of centuries.
MAX_TTL_S = (2**63 - 1) // 1_000_000_000
EXPORTER_NAME = "prometheus_mp"


# The plug-in matches NIXL_TELEMETRY_ENABLED_METRICS with the C library's fnmatch(3) (flags 0: backslash escapes,
# [!...] and [^...] negate, [[:alpha:]] classes, a trailing backslash or an unclosed [ never matches), which
# Python's fnmatch does not reproduce; calling the same function makes every entry mean the same in both.
_fnmatch = ctypes.CDLL(None).fnmatch
_fnmatch.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int)
_fnmatch.restype = ctypes.c_int
# What the plug-in trims from each entry (absl::StripAsciiWhitespace); str.strip() would also trim Unicode spaces.
_ASCII_SPACE = " \t\n\v\f\r"


class ConfigError(ValueError):
    """A configuration value this exporter cannot run with; names the variable."""


def parse_flag(name: str, text: str | None) -> bool:
    """False when the variable is unset; otherwise one of NIXL's yes/no words, in any case."""
    try:
        return flags.parse_flag(name, text)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def ascii_int(text: str) -> int | None:
    """``text`` (spaces around it aside) as a whole number written in ASCII digits, else None.

    int() would also take "1_9111", "+5" and non-ASCII digits such as "١٩١١١": a number an operator
    writes in a setting or a flag is written in ASCII digits everywhere else.
    """
    digits = text.strip()
    return int(digits) if digits.isascii() and digits.isdigit() else None


def _port(text: str | None) -> int:
    if text is None or not text.strip():
        return DEFAULT_PORT
    port = ascii_int(text)
    if port is None:
        raise ConfigError(f"{PORT_ENV}={text!r} is not a port number (ASCII digits, 1..65535)")
    if not 1 <= port <= 65535:
        raise ConfigError(f"{PORT_ENV}={text!r} is outside 1..65535")
    return port


def stale_ttl(text: str | None, name: str = TTL_ENV) -> float:
    """The stale TTL in seconds from ``text`` (unset or blank: the default); ``name`` is what errors call it."""
    return seconds(text, name, DEFAULT_TTL_S)


def seconds(text: str | None, name: str, default: float) -> float:
    """A duration in seconds from ``text`` (unset or blank: ``default``); ``name`` is what errors call it."""
    if text is None or not text.strip():
        return default
    try:
        ttl = float(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r} is not a number of seconds") from None
    if not math.isfinite(ttl) or ttl < 0:
        raise ConfigError(f"{name}={text!r} must be a finite number of seconds >= 0")
    if ttl > MAX_TTL_S:
        raise ConfigError(f"{name}={text!r} is too large: at most {MAX_TTL_S} seconds (about 292 years)")
    return ttl


def _serve(text: str | None) -> str:
    if text is None or text == "":
        return SERVE_MODES[0]
    if text not in SERVE_MODES:
        raise ConfigError(f"{SERVE_ENV}={text!r} is not a serving mode: use helper (a process of its own serves the "
                          "address, the default) or thread (a thread of the elected rank serves it)")
    return text


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _rank_env_name(name: str) -> str:
    """The variable naming the local rank; warned about when no process could ever set it.

    Not refused: the C++ plug-in looks such a name up (finding nothing) and
    starts without a local_rank label, and one environment must mean the
    same for C++ and Python ranks.  Empty means no label, on purpose.
    """
    if name and not _ENV_NAME.fullmatch(name):
        log.warning("%s=%r is not an environment variable name (letters, digits and _, not starting with a digit), "
                    "so no process can set it and this rank exports no local_rank label; set it to the name of the "
                    "variable holding the local rank, for example LOCAL_RANK", RANK_ENV_ENV, name)
    return name


def _directory(text: str) -> Path:
    # Every rank must name the same directory: a relative path depends on
    # each process's working directory, so ranks would silently split.
    if not os.path.isabs(text):
        raise ConfigError(f"{DIR_ENV}={text!r} is a relative path: use an absolute path, the same for every rank "
                          "(for example /run/nixl_metrics)")
    return Path(text)


def _enabled(text: str | None) -> frozenset[EventType]:
    """NIXL's allowlist, read exactly as the C++ plug-in reads it, so one value records the same events in C++
    and Python ranks: comma-separated, each entry trimmed of ASCII whitespace, empty entries dropped (nothing
    left, as for unset, means every event), each entry a glob matched case-sensitively against the lower-case
    event names (``agent_tx_*``)."""
    patterns = dict.fromkeys(p.strip(_ASCII_SPACE) for p in (text or "").split(","))
    patterns.pop("", None)
    if not patterns:
        return frozenset(EventType)
    enabled: set[EventType] = set()
    for pattern in patterns:
        matched = {e for e in EventType if _fnmatch(os.fsencode(pattern), e.name.lower().encode(), 0) == 0}
        if not matched:
            log.warning("%s: the entry %r matches no event name, so it enables nothing (and when no entry matches, "
                        "this rank records nothing); match NIXL's lower-case event names, with the agent_ prefix (for "
                        "example agent_tx_*), case-sensitively: %s",
                        ENABLED_ENV, pattern, ", ".join(e.name.lower() for e in EventType))
        enabled |= matched
    return frozenset(enabled)


@dataclass(frozen=True)
class Config:
    directory: Path
    port: int = DEFAULT_PORT
    local: bool = False
    rank_env: str = DEFAULT_RANK_ENV
    local_rank: str = ""
    stale_ttl_s: float = DEFAULT_TTL_S
    buckets: tuple[float, ...] = ()
    enabled: frozenset[EventType] = frozenset(EventType)
    serve: str = SERVE_MODES[0]  # who serves an elected rank's address: the address server, or a thread of its own
    drain_max_s: float = DEFAULT_DRAIN_MAX_S  # the longest a SIGTERMed server goes on publishing final values

    @property
    def host(self) -> str:
        return "127.0.0.1" if self.local else "0.0.0.0"

    @property
    def address(self) -> str:
        """``host:port``, the election's and the lock file's name for this endpoint."""
        return f"{self.host}:{self.port}"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Config:
        env = os.environ if environ is None else environ
        problem = native.pure_python_problem()  # (the process's: the hot path it took at import)
        if problem is not None:
            raise ConfigError(problem)
        directory = env.get(DIR_ENV, "")
        if not directory.strip():
            raise ConfigError(f"{DIR_ENV} is required: set it to a directory shared by every rank of the run "
                              "(for example /run/nixl_metrics)")
        # Set but empty means "no local_rank label", as in the plug-in; only an unset variable defaults.
        rank_env = env.get(RANK_ENV_ENV, DEFAULT_RANK_ENV)
        try:
            buckets = parse_buckets(env.get("NIXL_TELEMETRY_HISTOGRAM_BUCKETS_US"))
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        return cls(
            directory=_directory(directory),
            port=_port(env.get(PORT_ENV)),
            local=parse_flag(LOCAL_ENV, env.get(LOCAL_ENV)),
            rank_env=_rank_env_name(rank_env),
            local_rank=env.get(rank_env, "") if rank_env else "",
            stale_ttl_s=stale_ttl(env.get(TTL_ENV)),
            buckets=buckets,
            enabled=_enabled(env.get(ENABLED_ENV)),
            serve=_serve(env.get(SERVE_ENV)),
            drain_max_s=seconds(env.get(DRAIN_ENV), DRAIN_ENV, DEFAULT_DRAIN_MAX_S),
        )


def prepare_directory(directory: Path, setting: str = DIR_ENV) -> list[str]:
    """Create the directory 0700 if missing; return warnings about an existing one.

    ``setting`` is what the messages name as the directory's source: the
    variable, or the command-line flag the user gave it with.

    An existing directory is left as it is: it may be a Kubernetes emptyDir
    whose mode the operator chose.
    """
    try:
        directory.mkdir(mode=0o700, parents=True)
        os.chmod(directory, 0o700)  # mkdir's mode is filtered by the umask
    except FileExistsError:
        pass
    except OSError as exc:
        raise ConfigError(f"{setting}={str(directory)!r} cannot be created: {os.strerror(exc.errno or 0)}") from None
    problems = directory_warnings(directory, setting)
    # Checked up front so that a directory this user cannot write is one
    # named error, not a PermissionError from deep inside store creation.
    if not os.access(directory, os.W_OK | os.X_OK, effective_ids=os.access in os.supports_effective_ids):
        raise unwritable_directory(directory, errno.EACCES, setting)
    return problems


def unwritable_directory(directory: Path, error: int, setting: str = DIR_ENV) -> ConfigError:
    """The ConfigError for a directory this process may not create files in (EACCES, EPERM, EROFS)."""
    try:
        st = os.stat(directory)
        read_only = bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
    except OSError:
        return ConfigError(f"{setting}={str(directory)!r} is not writable: {os.strerror(error)}")
    if read_only or error == errno.EROFS:
        reason = "it is on a read-only file system"
    else:
        reason = (f"{os.strerror(error).lower()} for uid {os.geteuid()} (the directory is owned by uid "
                  f"{st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o})")
    return ConfigError(f"{setting}={str(directory)!r} is not writable: {reason}; use a directory the run's user "
                       "can write")


def directory_warnings(directory: Path, setting: str = DIR_ENV) -> list[str]:
    """Why a directory is not private to this user (empty when it is)."""
    try:
        st = os.stat(directory)
    except OSError as exc:
        raise ConfigError(f"{setting}={str(directory)!r} is not accessible: {os.strerror(exc.errno or 0)}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{setting}={str(directory)!r} is not a directory")
    problems = []
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        problems.append(f"{directory} is group- or world-writable (mode {stat.S_IMODE(st.st_mode):04o}): another "
                        "user could plant files the owner would read, truncate or unlink; use a private 0700 "
                        f"directory for {setting}")
    if st.st_uid != os.geteuid():
        # Said where it matters: a server or aggregator running as that user publishes no store of another
        # user's, and its /healthz is not where a rank's operator looks.
        problems.append(f"{directory} is owned by uid {st.st_uid}, not this process's uid {os.geteuid()}: a server "
                        f"or aggregator running as uid {st.st_uid} skips the stores of other users, this process's "
                        "included, so nothing it records would be published there. Run every rank and the "
                        "aggregator as the same user (in Kubernetes, the same runAsUser in every container), with "
                        f"a directory owned by that user for {setting}")
    return problems
