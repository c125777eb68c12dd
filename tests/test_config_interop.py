"""The values this project refuses, checked against the real C++ plug-in (``nixl-cu12`` wheel).

A value refused here but accepted by NIXL would make Python ranks fail
where C++ ranks start under one environment: each refusal is either shared
with the plug-in or listed as a known difference.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support import Reaper, free_port, listening_socket
from support_nixl import CppEnvProbe, nixl_required_fixture  # noqa: F401 (the nixl_required fixture)

from app.config import ConfigError
from app.rank.exporter import create_exporter

PORT = "NIXL_TELEMETRY_PROMETHEUS_PORT"
TTL = "NIXL_TELEMETRY_MP_STALE_TTL"


@pytest.fixture(scope="module")
def cpp_probe(nixl_required: None) -> Iterator[CppEnvProbe]:
    with Reaper() as reaper:
        yield CppEnvProbe(reaper)


def created_by_both(cpp_probe: CppEnvProbe, tmp_path: Path, variable: str, value: str) -> tuple[bool, bool]:
    """(C++ agent created, our exporter created) under the same environment, the port held by a listener."""
    port = free_port()

    def env(side: str) -> dict[str, str]:
        return {"NIXL_TELEMETRY_ENABLE": "y", "NIXL_TELEMETRY_EXPORTER": "prometheus_mp",
                "NIXL_TELEMETRY_MULTIPROC_DIR": str(tmp_path / side), PORT: str(port),
                "NIXL_TELEMETRY_PROMETHEUS_LOCAL": "y", variable: value}

    with listening_socket(port):
        theirs = bool(cpp_probe.create("agent", env("cpp"), ["LOCAL_RANK"])["created"])
        try:
            create_exporter("agent", env("ours")).close()
            ours = True
        except ConfigError:
            ours = False
    return theirs, ours


@pytest.mark.parametrize(("variable", "value"), [
    pytest.param("NIXL_TELEMETRY_EXPORTER", "PROMETHEUS_MP", id="exporter-other-case"),
    pytest.param(PORT, "1_9111", id="port-underscore"),
    pytest.param(PORT, "+9111", id="port-plus"),
    pytest.param(PORT, "\u0661\u0669\u0661\u0661\u0661", id="port-arabic-indic-digits"),
    pytest.param(TTL, "1e300", id="ttl-1e300"),
])
def test_refused_by_both(cpp_probe: CppEnvProbe, tmp_path: Path, variable: str, value: str) -> None:
    assert created_by_both(cpp_probe, tmp_path, variable, value) == (False, False)


def test_a_rank_env_no_process_can_set_starts_both(cpp_probe: CppEnvProbe, tmp_path: Path) -> None:
    """Warned about here, not refused: the plug-in starts too (without a local_rank label)."""
    assert created_by_both(cpp_probe, tmp_path, "NIXL_TELEMETRY_RANK_ENV", "A=B") == (True, True)


def test_a_ttl_beyond_int64_nanoseconds_is_a_known_difference(cpp_probe: CppEnvProbe, tmp_path: Path) -> None:
    """The plug-in takes any uint64 of seconds; here the TTL must fit int64 nanoseconds (about 292 years)."""
    assert created_by_both(cpp_probe, tmp_path, TTL, str(2**64 - 1)) == (True, False)
    assert created_by_both(cpp_probe, tmp_path, TTL, "9223372036") == (True, True)
