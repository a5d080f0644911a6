"""Servers the tests and the tracking benchmark start on this machine: a free port for each, and
moto's S3 server (a dev dependency), stopped with its whole process group."""

import os
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
