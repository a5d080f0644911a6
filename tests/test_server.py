"""server/tracking.sh, the team's tracking service (docs/tracking-server.md), run for real:
PostgreSQL, MLflow's basic-auth server with its artifacts proxied to a (moto) S3 bucket, caddy's
TLS in front, all kept running by supervisord."""

import contextlib
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import boto3
import psutil
import pytest
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from tests.conftest import PROJECT, files_holding, one_error_line, run_entry, tiny_overrides
from tests.test_readme import arguments, override, shown

SCRIPT = PROJECT / "server" / "tracking.sh"
UNIT = PROJECT / "server" / "mlflow-tracking.service"
ADMIN_PASSWORD = "admin-pass-0123"
BOB_PASSWORD = "bob-pass-456789"
BUCKET_LOGIN = {
    "aws_access_key_id": "test",
    "aws_secret_access_key": "test",
    "region_name": "us-east-1",
}


def tracking(
    *command: str, env: dict[str, str], check: bool = True, cwd: Path = PROJECT
) -> subprocess.CompletedProcess:
    """``bash server/tracking.sh COMMAND`` as a team's engineer types it."""
    argv = ["bash", str(SCRIPT), *command]
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=180)
    if check and proc.returncode != 0:
        pytest.fail(f"tracking.sh {' '.join(command)}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def on_page(command: str) -> list[str]:
    """The arguments of ``command`` (``bash server/tracking.sh ...``), which
    docs/tracking-server.md shows as typed (the test runs the page's commands)."""
    return list(shown(f"^{re.escape(command)}$").tokens[2:])


def service_env(data: Path, **settings: str) -> dict[str, str]:
    """The environment of the script: this venv's commands first, the settings given."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    return {**os.environ, "PATH": path, "TRACKING_DATA": str(data), **settings}


def test_a_first_start_without_a_bucket_is_refused_in_one_line_creating_nothing(
    tmp_path: Path,
) -> None:
    data = tmp_path / "service"
    env = service_env(data, MLFLOW_AUTH_ADMIN_PASSWORD=ADMIN_PASSWORD)
    env.pop("TRACKING_ARTIFACTS", None)
    proc = tracking("start", env=env, check=False)
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        "Error: TRACKING_ARTIFACTS is not set: set it to the bucket the server keeps artifacts "
        "in, e.g. TRACKING_ARTIFACTS=s3://team-bucket/mlflow"
    )
    assert not data.exists()


def test_a_first_start_without_the_admins_password_is_refused_creating_nothing(
    tmp_path: Path,
) -> None:
    data = tmp_path / "service"
    env = service_env(
        data, TRACKING_ARTIFACTS="s3://team/mlflow", MLFLOW_AUTH_ADMIN_PASSWORD="short"
    )
    proc = tracking("start", env=env, check=False)
    assert proc.returncode == 1
    assert "MLFLOW_AUTH_ADMIN_PASSWORD is not set or under 12 characters" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not data.exists()


def test_commands_on_a_folder_without_a_service_say_how_to_start_one(tmp_path: Path) -> None:
    env = service_env(tmp_path / "none", MLFLOW_AUTH_ADMIN_PASSWORD=ADMIN_PASSWORD)
    for command in (["stop"], ["status"], ["add-user", "ann"]):
        proc = tracking(*command, env=env, check=False)
        assert proc.returncode == 1
        assert "no tracking service in" in proc.stderr and "tracking.sh start" in proc.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def program_pids(env: dict[str, str]) -> dict[str, int]:
    """``status``: each RUNNING program's pid."""
    status = tracking(*on_page("bash server/tracking.sh status"), env=env, check=False).stdout
    return {m[1]: int(m[2]) for m in re.finditer(r"^(\w+)\s+RUNNING\s+pid (\d+)", status, re.M)}


def assert_a_checkpoint_goes_both_ways(
    client: MlflowClient, run_id: str, s3, folder: Path, size: int = 300 * 2**20
) -> None:
    """A checkpoint of a few hundred MB is logged into the bucket through caddy and the server,
    and loaded back (no body limit or timeout on the way: about 4 s each way here)."""
    checkpoint = folder / "big.ckpt"
    with checkpoint.open("wb") as out:
        out.truncate(size)
    client.log_artifact(run_id, str(checkpoint))
    checkpoint.unlink()
    stored = [
        o for o in s3.list_objects_v2(Bucket="team")["Contents"] if o["Key"].endswith("big.ckpt")
    ]
    assert [o["Size"] for o in stored] == [size]
    loaded = Path(client.download_artifacts(run_id, "big.ckpt", str(folder)))
    assert loaded.stat().st_size == size
    loaded.unlink()


def machine_name() -> str:
    """The name the service takes by default (``hostname -f``), as clients here resolve it."""
    name = subprocess.run(["hostname", "-f"], capture_output=True, text=True, check=True)
    return name.stdout.strip()


def host_check(port: int, host: str) -> str:
    """What the MLflow server (behind caddy, on 127.0.0.1:``port``) answers a request that names
    ``host``: its host check refuses names it does not serve (DNS rebinding)."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/api/2.0/mlflow/experiments/search", headers={"Host": host}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.read().decode()
    except urllib.error.HTTPError as error:
        return error.read().decode()


def cross_origin_write(port: int, host: str, origin: str) -> tuple[int, str]:
    """What the MLflow server answers a state-changing API call that a web page at ``origin``
    makes (its CORS check blocks origins it does not serve, before any sign-in)."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/api/2.0/mlflow/experiments/create",
        data=b'{"name": "from-a-page"}',
        headers={"Host": host, "Origin": origin, "Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def assert_a_restore_brings_back_the_backup(
    client: MlflowClient, env: dict[str, str], tmp_path: Path, run_id: str
) -> None:
    """What changed after the backup (an experiment, an account) is gone after ``restore``; the
    backed-up run is there, and the service answers again."""
    carl = {**env, "TRACKING_USER_PASSWORD": BOB_PASSWORD}
    client.create_experiment("after-the-backup")
    tracking("add-user", "carl", env=carl)
    restore = on_page("bash server/tracking.sh restore mlflow-backup")
    assert "Restored" in tracking(*restore, env=env, cwd=tmp_path).stdout
    assert client.get_experiment_by_name("after-the-backup") is None
    assert client.get_run(run_id).info.status == "FINISHED"
    assert "created" in tracking("add-user", "carl", env=carl).stdout, "carl is gone: made anew"


def assert_a_start_without_the_buckets_credentials_is_refused(
    env: dict[str, str], data: Path
) -> None:
    """A start in a shell without the bucket's credentials is refused before anything runs (the
    server would answer each upload with HTTP 500); a setting given again is said not applied."""
    bare = {name: value for name, value in env.items() if not name.startswith("AWS_")}
    proc = tracking("start", env={**bare, "TRACKING_PORT": "1"}, check=False)
    assert proc.returncode == 1
    kept = env["TRACKING_PORT"]
    assert proc.stderr.splitlines() == [
        f"Note: TRACKING_PORT=1 is not applied: this service keeps {kept} from its first start "
        f"(to change it: stop, edit {data}/settings.env, start).",
        "Error: no credentials for the bucket of s3://team/mlflow in this environment: set "
        "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or give the VM a role), and "
        "MLFLOW_S3_ENDPOINT_URL for an S3-compatible store, as at the first start",
    ]
    assert not (data / "supervisor.sock").exists(), "nothing was started"


def answers(url: str, cert: str) -> bool:
    """Whether the service answers ``/health`` through TLS, checked against ``cert`` (a
    certificate caddy is still writing is not one yet: ssl.SSLError is an OSError)."""
    try:
        tls = ssl.create_default_context(cafile=cert)
        with urllib.request.urlopen(f"{url}/health", timeout=5, context=tls) as response:
            return response.status == 200
    except OSError:
        return False


def unit_command() -> list[str]:
    """server/mlflow-tracking.service's ExecStart, with the project where this checkout is."""
    (line,) = [line for line in UNIT.read_text().splitlines() if line.startswith("ExecStart=")]
    command = line.removeprefix("ExecStart=").replace("/opt/lightning-ddp-template", str(PROJECT))
    return command.split()


def assert_the_units_command_serves_until_sigterm(env: dict[str, str], url: str, cert: str) -> None:
    """What systemd does with the unit: run its ExecStart (supervisord in the foreground, on the
    data the first start made) and, to stop it, SIGTERM that process (KillMode=mixed): all of
    the service ends."""
    service = subprocess.Popen(unit_command(), env=env, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 90
        while not answers(url, cert):
            assert service.poll() is None, "the unit's command ended"
            assert time.monotonic() < deadline, "the unit's command did not serve in 90 s"
            time.sleep(0.5)
        main = psutil.Process(service.pid)
        running = [main, *main.children(recursive=True)]
        service.send_signal(signal.SIGTERM)
        service.wait(timeout=60)
        assert not [p for p in running if alive(p)], "SIGTERM left processes running"
    finally:
        if service.poll() is None:
            service.kill()


@pytest.fixture
def service_data() -> Iterator[Path]:
    """A data folder PostgreSQL's user may reach (pytest's own are its owner's only), removed
    after the test; whatever the test left running there is ended first."""
    parent = Path(tempfile.mkdtemp(prefix="tracking-service-"))
    parent.chmod(0o711)
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


@pytest.mark.slow
def test_the_service_serves_a_users_job_over_tls_and_comes_back_after_a_crash(
    s3_server: dict[str, str],  # noqa: F811
    service_data: Path,
    tiny_root: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The page's commands: one start brings up the whole service under the machine's name; an
    account made by add-user logs a job over TLS with its artifacts proxied into the bucket (the
    job has no bucket credentials) and no password in its files; another account reads that run
    and may not write into its experiment until the admin grants it; a SIGKILLed mlflow server is
    restarted by supervisord; backup, restore, upgrade; stop leaves nothing running, and a start
    without the bucket's credentials is refused; the systemd unit's command serves the same data
    until SIGTERM."""
    s3 = boto3.client("s3", **BUCKET_LOGIN, endpoint_url=s3_server["AWS_ENDPOINT_URL"])
    s3.create_bucket(Bucket="team")
    env = service_env(
        service_data,
        **s3_server,
        MLFLOW_S3_ENDPOINT_URL=s3_server["AWS_ENDPOINT_URL"],
        TRACKING_PORT=str(free_port()),
        TRACKING_ARTIFACTS="s3://team/mlflow",
        TRACKING_WORKERS="2",
        MLFLOW_AUTH_ADMIN_PASSWORD=ADMIN_PASSWORD,
    )  # no TRACKING_HOST: the service takes this machine's name, as on a team's VM
    started = tracking(*on_page("bash server/tracking.sh start"), env=env).stdout
    url = re.search(r"logger\.tracking_uri=(https://\S+)", started)[1]
    cert = re.search(r"MLFLOW_TRACKING_SERVER_CERT_PATH=(\S+)", started)[1]
    served = url.removeprefix("https://")
    assert served == f"{machine_name()}:{env['TRACKING_PORT']}"
    settings = (service_data / "settings.env").read_text()
    server_port = int(re.search(r"^MLFLOW_PORT=(\d+)$", settings, re.M)[1])
    # MLflow's default list (localhost, 127.0.0.1, private addresses) is replaced by the name
    for other in ("evil.example", "localhost", "127.0.0.1", f"127.0.0.1:{env['TRACKING_PORT']}"):
        assert "DNS rebinding" in host_check(server_port, other), f"{other} is not served"
    assert "DNS rebinding" not in host_check(server_port, served)
    assert cross_origin_write(server_port, served, "https://evil.example") == (
        403,
        "Cross-origin request blocked",
    )
    status, _ = cross_origin_write(server_port, served, url)
    assert status == 401, "the page the service serves gets as far as the sign-in"
    added = tracking(*on_page("bash server/tracking.sh add-user ann"), env=env).stdout
    password = re.search(r"Its password \(shown once, give it to ann\): (\S+)", added)[1]

    tokens = list(shown(r"^MLFLOW_TRACKING_SERVER_CERT_PATH=ca\.crt ").tokens)
    assignments = [token.partition("=") for token in tokens[: tokens.index("python")]]
    login = {
        name: value.replace("<password>", password).replace("ca.crt", cert)
        for name, _, value in assignments
    }
    typed = [arg.replace(override(tokens, "logger.tracking_uri"), url) for arg in arguments(tokens)]
    job = [*tiny_overrides(tiny_root, model=True), "trainer.max_epochs=1", "hydra.run.dir=run"]
    elsewhere = url.replace(machine_name(), "localhost")  # caddy serves no site for that name
    asked = f"logger.tracking_uri={elsewhere}"
    refused = run_entry("train", *job, asked, cwd=tmp_path, env=login, check=False)
    assert "serves other names than localhost (tlsv1 alert internal error)" in one_error_line(
        refused.stderr
    )
    assert not (tmp_path / "run").exists(), "no folder for a job that never started"
    run_entry("train", *typed, *job, cwd=tmp_path, env=login)
    assert files_holding(password, tmp_path / "run") == []
    assert files_holding(ADMIN_PASSWORD, service_data, max_size=10**7) == []

    for name, value in login.items():
        monkeypatch.setenv(name, value)  # MlflowClient signs in with them
    client = MlflowClient(url)
    (run,) = client.search_runs([client.get_experiment_by_name("mnist").experiment_id])
    assert run.info.status == "FINISHED"
    stored = s3.list_objects_v2(Bucket="team", Prefix="mlflow/")["Contents"]
    keys = [item["Key"] for item in stored]
    assert any(key.endswith(f"{run.info.run_id}/artifacts/config.yaml") for key in keys), keys
    assert_a_checkpoint_goes_both_ways(client, run.info.run_id, s3, tmp_path)

    bob = tracking("add-user", "bob", env={**env, "TRACKING_USER_PASSWORD": BOB_PASSWORD})
    assert BOB_PASSWORD not in bob.stdout, "a password the admin chose is not printed"
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "bob")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", BOB_PASSWORD)
    assert client.get_run(run.info.run_id).info.status == "FINISHED", "bob reads ann's runs"
    with pytest.raises(MlflowException) as denied:
        client.create_run(run.info.experiment_id)
    assert denied.value.error_code == "PERMISSION_DENIED", "and writes none into her experiment"
    granted = tracking(*on_page("bash server/tracking.sh grant bob mnist"), env=env).stdout
    assert "bob has EDIT on experiment mnist" in granted
    client.set_terminated(client.create_run(run.info.experiment_id).info.run_id)  # bob's, now
    for name, value in login.items():
        monkeypatch.setenv(name, value)

    killed = program_pids(env)["mlflow"]
    crashed = group(killed)  # the `mlflow server` command and its uvicorn processes
    os.kill(killed, signal.SIGKILL)
    deadline = time.monotonic() + 90
    restarted = service_data / "mlflow.pgid"  # the pid of each mlflow program supervisord starts
    while restarted.read_text().strip() in ("", str(killed)):
        assert time.monotonic() < deadline, "supervisord did not restart the mlflow server"
        time.sleep(0.2)
    while not answers(url, cert):
        assert time.monotonic() < deadline, "the restarted server did not answer"
        time.sleep(0.5)
    assert client.get_run(run.info.run_id).info.status == "FINISHED"
    assert not [p for p in crashed if alive(p)], "the crashed server's workers linger"
    supervisor = psutil.Process(int((service_data / "supervisord.pid").read_text()))
    assert psutil.Process(int(restarted.read_text())).ppid() == supervisor.pid

    backup = on_page("bash server/tracking.sh backup mlflow-backup")
    tracking(*backup, env=env, cwd=tmp_path)
    for database in ("mlflow", "mlflow_auth"):
        dump = tmp_path / "mlflow-backup" / f"{database}.dump"
        assert dump.stat().st_size > 1000
        assert dump.stat().st_mode & 0o777 == 0o600, "the accounts' hashes are the owner's only"
    assert_a_restore_brings_back_the_backup(client, env, tmp_path, run.info.run_id)
    assert "Upgraded" in tracking(*on_page("bash server/tracking.sh upgrade"), env=env).stdout
    assert client.get_run(run.info.run_id).info.status == "FINISHED"

    running = [supervisor, *supervisor.children(recursive=True)]
    assert len(running) >= 5  # supervisord, postgres and its workers, mlflow and uvicorn, caddy
    assert "Stopped" in tracking(*on_page("bash server/tracking.sh stop"), env=env).stdout
    assert not [p for p in running if alive(p)], "stop left processes running"
    assert_a_start_without_the_buckets_credentials_is_refused(env, service_data)

    unit_env = {name: value for name, value in env.items() if name != "MLFLOW_AUTH_ADMIN_PASSWORD"}
    assert_the_units_command_serves_until_sigterm(unit_env, url, cert)
