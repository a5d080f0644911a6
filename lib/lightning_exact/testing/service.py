"""The team's tracking service (``lightning_exact/server/tracking.sh``) as a test runs it: the
script as an engineer types it, its environment, a data folder the service's user may reach
(ended and removed after the test), whether it answers."""

import contextlib
import os
import shutil
import ssl
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from lightning_exact.server import SCRIPT
from lightning_exact.testing.servers import let_the_service_user_reach

ADMIN_PASSWORD = "admin-pass-0123"
BUCKET_LOGIN = {
    "aws_access_key_id": "test",
    "aws_secret_access_key": "test",
    "region_name": "us-east-1",
}


def tracking(
    *command: str, env: dict[str, str], check: bool = True, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """``python -m lightning_exact.server COMMAND`` as a team's engineer types it (it runs
    tracking.sh)."""
    argv = [sys.executable, "-m", "lightning_exact.server", *command]
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=180)
    if check and proc.returncode != 0:
        pytest.fail(f"tracking.sh {' '.join(command)}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def service_env(data: Path, **settings: str) -> dict[str, str]:
    """The environment of the script: this venv's commands first, the settings given."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    return {**os.environ, "PATH": path, "TRACKING_DATA": str(data), **settings}


def group(pid: int) -> list[psutil.Process]:
    """The processes of process group ``pid`` (a supervisord program and what it started)."""
    return [p for p in psutil.process_iter() if _pgid(p.pid) == pid]


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def alive(process: psutil.Process) -> bool:
    """Running, not just a zombie left to an init that does not reap (as in some containers)."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def answers(url: str, cert: str) -> bool:
    """Whether the service answers ``/health`` through TLS, checked against ``cert`` (a
    certificate caddy is still writing is not one yet: ssl.SSLError is an OSError)."""
    try:
        tls = ssl.create_default_context(cafile=cert)
        with urllib.request.urlopen(f"{url}/health", timeout=5, context=tls) as response:
            return response.status == 200
    except OSError:
        return False


@pytest.fixture
def service_data() -> Iterator[Path]:
    """A data folder the service's user may reach (pytest's own are their owner's only), removed
    after the test; whatever the test left running there is ended first."""
    parent = Path(tempfile.mkdtemp(prefix="tracking-service-"))
    parent.chmod(0o711)
    let_the_service_user_reach(Path(sys.executable), SCRIPT, parent / "service")
    try:
        yield parent / "service"
    finally:
        end_what_is_left(parent / "service")
        shutil.rmtree(parent)


def end_what_is_left(data: Path) -> None:
    """After a failed test: supervisord and its programs, and the last mlflow server's process
    group (its uvicorn processes outlive a killed server)."""
    leftovers = []
    for pid_file in (data / "supervisord.pid", data / "mlflow.pgid"):
        if pid_file.exists():
            leftovers += group(int(pid_file.read_text()))
    supervisor_pid = data / "supervisord.pid"
    if supervisor_pid.exists() and psutil.pid_exists(int(supervisor_pid.read_text())):
        leftovers += psutil.Process(int(supervisor_pid.read_text())).children(recursive=True)
    for process in leftovers:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
