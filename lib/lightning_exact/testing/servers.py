"""Servers the tests and the tracking benchmark start on this machine: a free port for each,
moto's S3 server (a dev dependency), ``mlflow server`` and ``mlflow models serve``, each stopped
with its whole process group."""

import contextlib
import json
import os
import random
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def free_port() -> int:
    """A port free now (the OS picks it); the server that takes it binds it moments later."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_service_port() -> int:
    """A free port for the tracking service's caddy: as root, one under 1000 (tracking.sh refuses
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


SERVICE_USER = "mlflow-tracking"  # the user tracking.sh runs the service as, started as root


def let_the_service_user_reach(*paths: Path, user: str = SERVICE_USER) -> None:
    """Started as root, tracking.sh runs the service as ``user`` and refuses to start when
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


def local_server_argv(port: int, folder: Path) -> list[str]:
    """``mlflow server`` on 127.0.0.1:``port`` with its store and artifacts in ``folder``."""
    return [
        "mlflow",
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
        "--backend-store-uri",
        f"sqlite:///{folder / 'server.db'}",
        "--artifacts-destination",
        str(folder / "server-artifacts"),
    ]


@contextmanager
def mlflow_server(
    argv: Sequence[str], port: int, cwd: Path, certificate: Path | None = None
) -> Iterator[str]:
    """Run an ``mlflow server ...`` command until it answers ``/health``; yield its URL, then
    stop its whole process group (its workers share it, so one signal stops them all). With the
    ``certificate`` it serves with, its URL is https://."""
    # Tracking only, as docs/mlflow.md advises: without its GenAI job runners a server is 2
    # processes and 0.5 GB instead of 10 and 2 GB (with --workers 1), and answers 3 s sooner.
    tracking_only = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with started_server(argv, port, cwd, certificate, env=tracking_only) as (url, _):
        yield url


@contextmanager
def started_server(
    argv: Sequence[str],
    port: int,
    cwd: Path,
    certificate: Path | None = None,
    *,
    env: dict[str, str] | None = None,
) -> Iterator[tuple[str, subprocess.Popen]]:
    """:func:`mlflow_server` with the command's environment as given (``env`` adds to this
    one's), yielding its process too: the leader of its process group."""
    log = cwd / "mlflow-server.log"
    venv_bin = Path(sys.executable).parent  # the `mlflow` command of this environment
    env = {**os.environ, "PATH": f"{venv_bin}{os.pathsep}{os.environ['PATH']}", **(env or {})}
    with log.open("w") as out:
        server = subprocess.Popen(
            list(argv),
            cwd=cwd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"{'https' if certificate else 'http'}://127.0.0.1:{port}"
    try:
        wait_until_healthy(url, server, log, certificate)
        yield url, server
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def wait_until_healthy(
    url: str, server: subprocess.Popen, log: Path, certificate: Path | None
) -> None:
    """Until the server at ``url`` answers ``/health`` (fails if it ends, with its ``log``)."""
    trust = ssl.create_default_context(cafile=certificate) if certificate else None
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2, context=trust) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        assert server.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "mlflow server did not start in 120 s"
        time.sleep(0.5)


def invoke(url: str, inputs: Any) -> list[dict]:
    body = json.dumps({"inputs": inputs.tolist()}).encode()
    request = urllib.request.Request(
        f"{url}/invocations", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())["predictions"]


def served(model_uri: str, cwd: Path, inputs: Any) -> list[dict]:
    """Predictions of ``mlflow models serve -m model_uri --env-manager local``, run in ``cwd``
    (its default store is ./mlflow.db there) on 127.0.0.1, stopped afterwards."""
    port = free_port()
    argv = [
        "mlflow",
        "models",
        "serve",
        "-m",
        model_uri,
        "--env-manager",
        "local",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    with mlflow_server(argv, port, cwd) as url:
        return invoke(url, inputs)
