"""Servers the tests and the tracking benchmark start on this machine: a free port for each, and
moto's S3 server (a dev dependency), stopped with its whole process group."""

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def free_port() -> int:
    """A port free now (the OS picks it); the server that takes it binds it moments later."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_service_port() -> int:
    """A free port for server/tracking.sh's caddy: as root, one under 1000 (tracking.sh refuses
    a port any local user may bind), drawn at random so that parallel runs seldom meet."""
    if os.getuid() != 0:
        return free_port()
    for port in random.sample(range(600, 1000), 400):
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("", port))
            return port
    raise RuntimeError("no free port under 1000")


def wait_for_port(port: int, proc: subprocess.Popen, what: str, timeout_s: float = 60) -> None:
    """Until ``proc`` accepts connections on ``port``; RuntimeError if it ends or takes longer."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not start") from None
            time.sleep(0.1)


@contextmanager
def moto_s3() -> Iterator[tuple[dict[str, str], subprocess.Popen]]:
    """moto's S3 server on a free port, and the environment that points boto3 and LitData at it
    (MLflow's server also needs ``MLFLOW_S3_ENDPOINT_URL``, the same address)."""
    port = free_port()
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    try:
        wait_for_port(port, proc, "moto's S3 server", timeout_s=30)
        yield env, proc
    finally:
        os.killpg(proc.pid, signal.SIGCONT)  # if a fault left it stopped (SIGSTOP)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


SERVICE_USER = "mlflow-tracking"  # the user server/tracking.sh runs the service as, started as root


def let_the_service_user_reach(*paths: Path, user: str = SERVICE_USER) -> None:
    """Started as root, server/tracking.sh runs the service as ``user`` and refuses to start when
    that user cannot enter a folder above its data, the project or its Python (a pyenv under
    /root, here and on CI). This gives ``user`` (made as tracking.sh makes it, if missing) the
    right to pass through each such folder above ``paths`` (setfacl's ``x``, nothing else), as
    its refusal says to. It stays given: tests on several workers share it."""
    if os.getuid() != 0:
        return  # the service runs as the caller, who reaches all of it
    if subprocess.run(["id", "-u", user], capture_output=True).returncode != 0:
        subprocess.run(
            [
                *("useradd", "--system", "--user-group", "--no-create-home"),
                *("--home-dir", "/var/lib/mlflow-tracking", "--shell", "/usr/sbin/nologin", user),
            ],
            check=True,
        )
    folders = [str(folder) for path in paths for folder in reversed(path.resolve().parents)]
    check = 'for d; do test -x "$d" || echo "$d"; done'
    closed = subprocess.run(
        ["runuser", "-u", user, "--", "bash", "-c", check, "_", *dict.fromkeys(folders)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for folder in closed.splitlines():
        subprocess.run(["setfacl", "-m", f"u:{user}:x", folder], check=True)
