"""The aggregator under readOnlyRootFilesystem: no writable temporary directory, /dev/shm a tmpfs of its own.

gunicorn gives each worker a heartbeat file in worker_tmp_dir, by default the
temporary directory; with none usable the workers never booted ("No usable
temporary directory found"). A private mount namespace stands in for the
container: /tmp, /var/tmp and the working directory read-only, TMPDIR a
directory that does not exist, the telemetry directory (an emptyDir) and
/dev/shm writable, as a container runtime mounts them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from support import Proc, Reaper, children_of, free_port, http_get, wait_until
from support_e2e import by_rank, parse_text, procfile_web_command, rank_env, spawn_rank, wait_ready

# Runs as root in a new mount namespace: every mount below is that namespace's alone.
READ_ONLY_ROOT = """
set -e
for d in /tmp /var/tmp /usr/tmp; do
  [ -d "$d" ] || continue
  mount --rbind "$d" "$d"; mount -o remount,bind,ro "$d"
done
mount --bind "$CWD" "$CWD"; mount -o remount,bind,ro "$CWD"  # tempfile's last resort
mount --bind "$DATA" "$DATA"; mount -o remount,bind,rw "$DATA"  # the emptyDir
if [ -n "$SHM_READ_ONLY" ]; then mount -t tmpfs -o ro tmpfs /dev/shm; fi
cd "$CWD"
exec "$@"
"""


def _can_unshare_mounts() -> bool:
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return False
    done = subprocess.run(["unshare", "--mount", "true"], capture_output=True, timeout=30)
    return done.returncode == 0


pytestmark = pytest.mark.skipif(not _can_unshare_mounts(), reason="needs unshare --mount (root, or CAP_SYS_ADMIN) "
                                                                  "to make the temporary directories read-only")


def contained(tmp_path: Path, shm_read_only: bool = False) -> tuple[list[str], dict[str, str]]:
    """The command prefix and the variables that run a command in the stand-in container."""
    (tmp_path / "cwd").mkdir(exist_ok=True)
    (tmp_path / "run").mkdir(exist_ok=True)
    env = {"CWD": str(tmp_path / "cwd"), "DATA": str(tmp_path / "run"), "SHM_READ_ONLY": "y" if shm_read_only else ""}
    return ["unshare", "--mount", "sh", "-c", READ_ONLY_ROOT, "sh"], env


def start_contained_aggregator(r: Reaper, tmp_path: Path, port: int, tmpdir: str, shm_read_only: bool) -> Proc:
    """The Procfile's web: command, two workers, in the stand-in container."""
    prefix, env = contained(tmp_path, shm_read_only)
    proc = r.spawn([*prefix, *procfile_web_command()],
                   rank_env(tmp_path / "run" / "mp", port, GUNICORN_WORKERS="2", TMPDIR=tmpdir, **env))
    wait_until(lambda: http_get(f"http://127.0.0.1:{port}/healthz", timeout=2).status == 200, 20,
               lambda: f"the aggregator to answer /healthz:\n{proc.output}")
    wait_until(lambda: len(heartbeat_files(proc.pid)) == 2, 10, lambda: f"2 booted workers:\n{proc.output}")
    return proc


def heartbeat_files(master: int) -> list[str]:
    """Where the workers' heartbeat files are (gunicorn unlinks them at once; the descriptors name them)."""
    found = []
    for worker in children_of(master):
        for fd in os.listdir(f"/proc/{worker}/fd"):
            try:
                target = os.readlink(f"/proc/{worker}/fd/{fd}")
            except OSError:
                continue
            if Path(target).name.startswith("wgunicorn-"):
                found.append(target)
    return found


def test_the_stand_in_has_no_usable_temporary_directory(tmp_path: Path) -> None:
    """What makes the test below able to fail: gunicorn's default location does not exist in there."""
    prefix, env = contained(tmp_path)
    done = subprocess.run([*prefix, "python3", "-c", "import tempfile; tempfile.gettempdir()"],
                          env={**os.environ, **env, "TMPDIR": "/nonexistent"}, capture_output=True, text=True,
                          timeout=30)
    assert done.returncode != 0 and "No usable temporary directory found" in done.stderr, done.stderr


def test_aggregator_serves_without_a_writable_temporary_directory(tmp_path: Path) -> None:
    port = free_port()
    with Reaper() as r:
        aggregator = start_contained_aggregator(r, tmp_path, port, "/nonexistent", shm_read_only=False)
        assert all(f.startswith("/dev/shm/wgunicorn-") for f in heartbeat_files(aggregator.pid)), \
            heartbeat_files(aggregator.pid)
        rank = spawn_rank(r, tmp_path / "run" / "mp", port, 0)
        assert wait_ready(rank) is False  # a writer: the aggregator serves the address
        wait_until(lambda: by_rank(parse_text(http_get(f"http://127.0.0.1:{port}/metrics").body),
                                   "agent_tx_bytes_total") != {}, 10, "the rank on /metrics")
    assert "Traceback" not in aggregator.output, aggregator.output


def test_aggregator_keeps_gunicorns_default_where_dev_shm_is_not_writable(tmp_path: Path) -> None:
    """Outside a container /dev/shm may be missing or read-only: then the temporary directory, as before."""
    port = free_port()
    with Reaper() as r:
        # A usable temporary directory (TMPDIR: the writable mount), /dev/shm read-only.
        aggregator = start_contained_aggregator(r, tmp_path, port, str(tmp_path / "run"), shm_read_only=True)
        files = heartbeat_files(aggregator.pid)
        assert all(f.startswith(f"{tmp_path / 'run'}/wgunicorn-") for f in files), files
