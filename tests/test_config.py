"""Bad settings and arguments are refused before anything is created, in one line naming them.

Through what a rank touches: the environment handed to ``Exporter`` /
``create_exporter``, and the directory on disk.  Permission paths run in a
forked child that dropped to uid/gid 65534, as an unprivileged rank would.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import socket
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
from support import exporter_env, free_port, make_exporter_fixture  # noqa: F401 (the make_exporter fixture)

import app.config
from app import ConfigError, Exporter, create_exporter

NOBODY = 65534


@pytest.mark.parametrize(("name", "value"), [
    ("NIXL_TELEMETRY_PROMETHEUS_PORT", "١٩١١١"),  # Arabic-Indic digits: int() takes them
    ("NIXL_TELEMETRY_PROMETHEUS_PORT", "1_9111"),  # int() takes the underscore
    ("NIXL_TELEMETRY_PROMETHEUS_PORT", "+9111"),
    ("NIXL_TELEMETRY_PROMETHEUS_PORT", "\uff19\uff11\uff11\uff11"),  # fullwidth digits
    ("NIXL_TELEMETRY_MP_STALE_TTL", "1e300"),  # OverflowError once the store existed
    ("NIXL_TELEMETRY_MP_STALE_TTL", "9300000000"),  # just past int64 nanoseconds
])
def test_bad_value_is_refused_before_anything_is_created(tmp_dir: Path, name: str, value: str) -> None:
    env = exporter_env(tmp_dir, free_port(), **{name: value})
    with pytest.raises(ConfigError) as info:
        Exporter("a", env)
    message = str(info.value)
    assert name in message and repr(value) in message and "\n" not in message, message
    assert os.listdir(tmp_dir) == []


def test_the_ttl_limit_is_named_and_the_limit_itself_is_accepted(tmp_dir: Path, make_exporter) -> None:
    with pytest.raises(ConfigError, match="at most 9223372036 seconds"):
        Exporter("a", exporter_env(tmp_dir, free_port(), NIXL_TELEMETRY_MP_STALE_TTL="1e300"))
    exp = make_exporter("a", exporter_env(tmp_dir, free_port(), NIXL_TELEMETRY_MP_STALE_TTL="9223372036"))
    assert exp.serving and exp.store_path.exists()


@pytest.mark.parametrize("value", [" 9111 ", "09111"])
def test_ascii_port_with_spaces_or_leading_zero_is_accepted(tmp_dir: Path, make_exporter, value: str) -> None:
    env = exporter_env(tmp_dir, 0, NIXL_TELEMETRY_PROMETHEUS_PORT=value)
    assert app.config.Config.from_env(env).port == 9111


@pytest.mark.parametrize("value", ["A=B", "1RANK", "LOCAL RANK", " LOCAL_RANK"])
def test_rank_env_that_no_process_can_set_is_warned_about(tmp_dir: Path, make_exporter,
                                                          caplog: pytest.LogCaptureFixture, value: str) -> None:
    """Not refused (the C++ plug-in starts without a label under it), but never silent."""
    with caplog.at_level(logging.WARNING, logger="nixl_prometheus_mp"):
        exp = make_exporter("a", exporter_env(tmp_dir, free_port(), NIXL_TELEMETRY_RANK_ENV=value, LOCAL_RANK="3"))
    assert exp.config.local_rank == ""
    warnings = [r.getMessage() for r in caplog.records if "NIXL_TELEMETRY_RANK_ENV" in r.getMessage()]
    assert len(warnings) == 1 and repr(value) in warnings[0] and "LOCAL_RANK" in warnings[0], warnings


def test_rank_env_names_the_variable_holding_the_rank(tmp_dir: Path, make_exporter) -> None:
    exp = make_exporter("a", exporter_env(tmp_dir, free_port(), NIXL_TELEMETRY_RANK_ENV="SLURM_LOCALID",
                                          SLURM_LOCALID="3"))
    assert exp.config.local_rank == "3"


@pytest.mark.parametrize("value", ["mp", "./mp", "run/nixl_metrics"])
def test_relative_directory_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as info:
        Exporter("a", {**exporter_env(tmp_path, free_port()), "NIXL_TELEMETRY_MULTIPROC_DIR": value})
    message = str(info.value)
    assert "NIXL_TELEMETRY_MULTIPROC_DIR" in message and repr(value) in message and "absolute path" in message
    assert os.listdir(tmp_path) == []


# -- a directory this user cannot write ---------------------------------------------------------------------------


def run_as_nobody(body: Callable[[], dict[str, object]]) -> dict[str, object]:
    """``body()`` in a forked child running as uid/gid 65534; its JSON-able result."""
    # Binding the endpoint imports encodings.idna lazily; where the interpreter's library is not readable by
    # uid 65534 (a pyenv under /root), the child could not import it, so it is imported here, before the fork.
    importlib.import_module("encodings.idna")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read)
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            out = body()
        except BaseException as exc:
            out = {"unexpected": f"{type(exc).__name__}: {exc}"}
        os.write(write, json.dumps(out).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        data = pipe.read()
    os.waitpid(pid, 0)
    return json.loads(data)


def exporter_error(env: dict[str, str]) -> Callable[[], dict[str, object]]:
    def body() -> dict[str, object]:
        try:
            Exporter("a", env).close()
        except Exception as exc:
            return {"type": type(exc).__name__, "message": str(exc)}
        return {"type": None}
    return body


def test_unwritable_existing_directory_is_a_config_error(root_owned_dir: Path) -> None:
    out = run_as_nobody(exporter_error(exporter_env(root_owned_dir, free_port())))
    assert out["type"] == "ConfigError", out
    message = str(out["message"])
    assert "NIXL_TELEMETRY_MULTIPROC_DIR" in message and repr(str(root_owned_dir)) in message, message
    assert "not writable" in message and "uid 65534" in message and "0755" in message, message
    assert os.listdir(root_owned_dir) == []


def test_refusal_at_store_creation_is_a_config_error_too(root_owned_dir: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """What the up-front check cannot see (an ACL, a security module, a mode changed since) is still named."""
    monkeypatch.setattr(app.config.os, "access", lambda *args, **kwargs: True)
    out = run_as_nobody(exporter_error(exporter_env(root_owned_dir, free_port())))
    assert out["type"] == "ConfigError", out
    assert "NIXL_TELEMETRY_MULTIPROC_DIR" in str(out["message"]) and "not writable" in str(out["message"]), out
    assert os.listdir(root_owned_dir) == []


def test_the_owner_of_the_directory_may_still_use_it(root_owned_dir: Path) -> None:
    os.chown(root_owned_dir, NOBODY, NOBODY)
    root_owned_dir.chmod(0o700)

    def body() -> dict[str, object]:
        with Exporter("a", exporter_env(root_owned_dir, free_port())) as exp:
            return {"serving": exp.serving, "mode": stat.S_IMODE(os.stat(exp.store_path).st_mode)}
    assert run_as_nobody(body) == {"serving": True, "mode": 0o600}


# -- agent_name -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "error", "words"), [
    (None, TypeError, "NoneType"),
    (123, TypeError, "int 123"),
    (b"agent", TypeError, "bytes"),
    ("", ValueError, "empty"),
    ("agent\0x", ValueError, "NUL"),
])
def test_bad_agent_name_consumes_no_instance_number(tmp_dir: Path, make_exporter, name: object,
                                                   error: type[Exception], words: str) -> None:
    env = exporter_env(tmp_dir, free_port())
    first = make_exporter("first", env)
    with pytest.raises(error) as info:
        Exporter(name, env)  # type: ignore[arg-type]
    assert "agent_name" in str(info.value) and words in str(info.value)
    second = make_exporter("second", env)
    instance = [int(p.name.split(".")[3]) for p in (first.store_path, second.store_path)]
    assert instance[1] == instance[0] + 1  # store names end .<agent_instance>.mmap
    assert len(os.listdir(tmp_dir)) == 3  # two stores and the election's lock file, nothing of the bad one


# -- NIXL_TELEMETRY_EXPORTER ------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["PROMETHEUS_MP", "Prometheus_MP", "prometheus_MP"])
def test_exporter_name_in_another_case_is_an_error(tmp_dir: Path, value: str) -> None:
    """NIXL loads libtelemetry_exporter_<name>.so case-sensitively and refuses the agent when it is missing."""
    env = exporter_env(tmp_dir, free_port(), NIXL_TELEMETRY_ENABLE="y", NIXL_TELEMETRY_EXPORTER=value)
    with pytest.raises(ConfigError) as info:
        create_exporter("a", env)
    message = str(info.value)
    assert "NIXL_TELEMETRY_EXPORTER" in message and repr(value) in message and "'prometheus_mp'" in message
    assert os.listdir(tmp_dir) == []


def free_privileged_port() -> int:
    """A port below the unprivileged range that was free on 127.0.0.1 a moment ago (bound as root to find it)."""
    start = int(Path("/proc/sys/net/ipv4/ip_unprivileged_port_start").read_text())
    for port in range(min(start, 1024) - 1, 0, -1):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    pytest.skip(f"no port below net.ipv4.ip_unprivileged_port_start={start} to bind as another user")


def test_a_privileged_port_as_non_root_is_named_a_permission_not_a_foreign_service(root_owned_dir: Path) -> None:
    """EACCES on the bind: what grants it, not "a foreign service takes it over once the port is free"."""
    directory = root_owned_dir / "nobody"
    directory.mkdir(mode=0o700)
    os.chown(directory, NOBODY, NOBODY)
    port = free_privileged_port()

    def body() -> dict[str, object]:
        records: list[logging.LogRecord] = []
        handler = logging.Handler(logging.WARNING)
        handler.emit = records.append  # type: ignore[method-assign]
        logging.getLogger("nixl_prometheus_mp").addHandler(handler)
        with Exporter("a", exporter_env(directory, port)) as exp:
            return {"serving": exp.serving, "warnings": [r.getMessage() for r in records]}

    out = run_as_nobody(body)
    assert out.get("serving") is False, out
    (warning,) = out["warnings"]  # type: ignore[misc]
    assert f"won the election for 127.0.0.1:{port} but cannot bind it: permission denied: ports below 1024 need " \
           "root or CAP_NET_BIND_SERVICE (or a lower net.ipv4.ip_unprivileged_port_start)" in warning, warning
    assert "foreign service" not in warning and "port is free" not in warning, warning
