"""The store a job logs to, against a real MLflow server with its basic-auth app: an account
that may not write, or wrong credentials, end the job in one line that says which; a password
typed in the tracking URI reaches no file, printed line, param or artifact."""

import os
import shlex
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest
from lightning_exact.tracking.store import (
    CERTIFICATE,
    CREDENTIALS,
    TrackingError,
    cause,
    credentials_moved,
    credentials_to_environment,
    refusal,
    refuse_password_in_config,
)
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import PERMISSION_DENIED, UNAUTHENTICATED
from mlflow.server.auth.client import AuthServiceClient

from tests.conftest import (
    files_holding,
    local_server_argv,
    mlflow_server,
    one_error_line,
    run_entry,
    tiny_overrides,
)
from tests.test_outbox import assert_complete_run, slow_job_env, sync, wait_for

ADMIN_PASSWORD = "admin-pass-0123"
USERS = {"ann": "ann-pass-89ab", "reader": "reader-pass-4567"}


def test_a_password_typed_in_the_uri_moves_to_mlflows_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in CREDENTIALS:
        monkeypatch.delenv(name, raising=False)
    typed = ["data=synthetic", "logger.tracking_uri=https://ann%40lab:p%3Ass@mlflow.lab:8443/x"]
    assert credentials_to_environment(typed) == [
        "data=synthetic",
        "logger.tracking_uri=https://mlflow.lab:8443/x",
    ]
    assert [os.environ[name] for name in CREDENTIALS] == ["ann@lab", "p:ss"]
    unchanged = ["logger.tracking_uri=http://ann@host:5000", "logger.run_name=a:b@c"]
    assert credentials_to_environment(unchanged) == unchanged


def test_a_password_in_a_tools_tracking_uri_moves_to_mlflows_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """src.sync and src.register take --tracking-uri: a password typed there goes the same way."""
    for name in CREDENTIALS:
        monkeypatch.delenv(name, raising=False)
    assert credentials_moved("http://ann:s3cret@h:5000/") == "http://h:5000/"
    assert [os.environ[name] for name in CREDENTIALS] == ["ann", "s3cret"]
    assert credentials_moved("sqlite:///mlflow.db") == "sqlite:///mlflow.db"


def test_a_password_in_a_config_file_is_refused_with_where_it_belongs() -> None:
    with pytest.raises(TrackingError, match="MLFLOW_TRACKING_PASSWORD in the environment") as e:
        refuse_password_in_config("http://ann:hunter2@host:5000")
    assert "hunter2" not in str(e.value)
    refuse_password_in_config("http://host:5000")  # no password: nothing to say


def test_a_servers_no_is_told_apart_from_an_unreachable_server() -> None:
    wrong = MlflowException("failed with error code 401", error_code=UNAUTHENTICATED)
    assert "refused the credentials (HTTP 401)" in refusal("http://h:1", "synthetic", wrong)
    denied = MlflowException("failed with error code 403", error_code=PERMISSION_DENIED)
    assert "may not write runs into experiment synthetic" in refusal(
        "http://h:1", "synthetic", denied
    )
    assert refusal("http://h:1", "synthetic", ConnectionError("refused")) is None


@pytest.fixture
def auth_server(tmp_path: Path) -> Iterator[str]:
    """``mlflow server --app-name basic-auth`` with an admin and two users, ann and reader. A new
    user may create experiments; on others' experiments MLflow gives READ (its default)."""
    folder = tmp_path / "auth-server"
    folder.mkdir()
    config = folder / "basic_auth.ini"
    config.write_text(
        "[mlflow]\ndefault_permission = READ\n"
        f"database_uri = sqlite:///{folder / 'users.db'}\nadmin_username = admin\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [*local_server_argv(port, folder), "--app-name", "basic-auth"]
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MLFLOW_AUTH_CONFIG_PATH", str(config))
        env.setenv("MLFLOW_AUTH_ADMIN_PASSWORD", ADMIN_PASSWORD)
        env.setenv("MLFLOW_FLASK_SERVER_SECRET_KEY", "test-only-secret")
        with mlflow_server(argv, port, folder) as url:
            env.setenv(CREDENTIALS[0], "admin")
            env.setenv(CREDENTIALS[1], ADMIN_PASSWORD)
            for user, password in USERS.items():
                AuthServiceClient(url).create_user(user, password)
            env.delenv(CREDENTIALS[0])
            env.delenv(CREDENTIALS[1])
            yield url


@pytest.mark.slow
def test_a_team_server_with_accounts_as_docs_mlflow_md_shows(
    auth_server: str, tiny_root: Path, tmp_path: Path
) -> None:
    """The page's command (ann's account in MLflow's variables) logs her run; her password typed
    in the URI instead reaches no file, printed line, param, tag or artifact; an account that
    may only read her experiment, and a wrong password, end in one line each, leaving nothing."""
    # docs/mlflow.md's command, as the page shows it (tests/template/test_readme.py leaves it to
    # this test), its URI the test's server
    tokens = shlex.split(
        "MLFLOW_TRACKING_USERNAME=ann MLFLOW_TRACKING_PASSWORD=<password> python -m src.train "
        "logger.tracking_uri=http://127.0.0.1:5000"
    )
    assignments = [token.partition("=") for token in tokens[: tokens.index("python")]]
    env = {name: value.replace("<password>", USERS["ann"]) for name, _, value in assignments}
    host = auth_server.removeprefix("http://")
    job = [*tiny_overrides(tiny_root, model=True), "trainer.max_epochs=1"]
    typed = [f"logger.tracking_uri={auth_server}"]
    run_entry("train", *typed, *job, "hydra.run.dir=page", cwd=tmp_path, env=env)

    ann = f"logger.tracking_uri=http://ann:{USERS['ann']}@{host}"
    proc = run_entry("train", *job, ann, "hydra.run.dir=run", cwd=tmp_path)
    printed = proc.stdout + proc.stderr
    assert USERS["ann"] not in printed, "printed"
    assert "View run" not in printed, "MLflow's own link lines: the job prints its run page once"
    assert printed.count("MLflow run: ") == 1, printed[-2000:]
    assert files_holding(USERS["ann"], tmp_path / "run") == []
    with pytest.MonkeyPatch.context() as login:
        login.setenv(CREDENTIALS[0], "ann")
        login.setenv(CREDENTIALS[1], USERS["ann"])
        client = MlflowClient(auth_server)
        runs = client.search_runs([client.get_experiment_by_name("synthetic").experiment_id])
        assert [run.info.status for run in runs] == ["FINISHED", "FINISHED"]
        run = runs[0]  # the newer (search_runs: the latest start first)
        assert all(USERS["ann"] not in value for value in run.data.params.values())
        assert all(USERS["ann"] not in value for value in run.data.tags.values())
        config = Path(client.download_artifacts(run.info.run_id, "config.yaml", str(tmp_path)))
        assert USERS["ann"] not in config.read_text()

    (tmp_path / "refused").mkdir()
    reader = f"logger.tracking_uri=http://reader:{USERS['reader']}@{host}"
    proc = run_entry("train", *job, reader, cwd=tmp_path / "refused", check=False)
    assert proc.returncode == 1
    line = one_error_line(proc.stderr)
    assert "reader may not write runs into experiment synthetic (HTTP 403)" in line, line
    assert "logger.experiment_name=" in line and USERS["reader"] not in line
    wrong = f"logger.tracking_uri=http://reader:not-the-password@{host}"
    proc = run_entry("train", *job, wrong, cwd=tmp_path / "refused", check=False)
    assert proc.returncode == 1
    line = one_error_line(proc.stderr)
    assert "refused the credentials (HTTP 401)" in line and "not reachable" not in line, line
    assert list((tmp_path / "refused").iterdir()) == [], "a refused job leaves no folder"


def test_an_untrusted_certificate_is_told_apart_from_an_unreachable_server() -> None:
    untrusted = MlflowException(
        "API request to https://h:1/api/2.0/mlflow/experiments/get-by-name failed with exception "
        "HTTPSConnectionPool(host='h', port=1): Max retries exceeded (Caused by SSLError("
        "SSLCertVerificationError(1, '[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify "
        "failed: self-signed certificate (_ssl.c:1006)')))"
    )
    line = refusal("https://h:1", "synthetic", untrusted)
    assert "does not trust (self-signed certificate)" in line and CERTIFICATE in line


def ssl_error(reason: str) -> MlflowException:
    """MLflow's error for an HTTPS request whose TLS handshake failed with ``reason``."""
    return MlflowException(
        "API request to https://h:1/api/2.0/mlflow/experiments/get-by-name failed with exception "
        "HTTPSConnectionPool(host='h', port=1): Max retries exceeded (Caused by SSLError("
        f"SSLError(1, '{reason} (_ssl.c:1006)')))"
    )


def test_each_tls_failure_is_told_apart_from_an_unreachable_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plain-HTTP server asked in HTTPS, a certificate or a TLS proxy for other names, and a
    CA certificate path that is no file: each says so, not "not reachable"."""
    plain = ssl_error("[SSL: WRONG_VERSION_NUMBER] wrong version number")
    assert refusal("https://h:1", "synthetic", plain) == (
        "MLflow server https://h:1 answers only plain HTTP: use logger.tracking_uri=http://h:1"
    )
    other_names = "serves other names than h ({}): use the URL its admin gives you"
    proxy = ssl_error("[SSL: TLSV1_ALERT_INTERNAL_ERROR] tlsv1 alert internal error")
    assert other_names.format("tlsv1 alert internal error") in refusal("https://h:1", "m", proxy)
    mismatch = ssl_error(
        "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: Hostname mismatch, "
        "certificate is not valid for 'h'."
    )
    words = other_names.format("Hostname mismatch, certificate is not valid for 'h'")
    assert words in refusal("https://h:1", "m", mismatch)
    monkeypatch.setenv(CERTIFICATE, str(tmp_path / "ca.crt"))
    nowhere = MlflowException("Could not find a suitable TLS CA certificate bundle, invalid path")
    assert refusal("https://h:1", "m", nowhere) == (
        f"{CERTIFICATE}={tmp_path / 'ca.crt'} is not a file. Set it to the CA certificate the "
        "server's admin gives you (docs/mlflow.md: A server with accounts)"
    )


def test_an_unreachable_server_says_the_innermost_cause() -> None:
    refused = MlflowException(
        "API request to http://h:1/api/2.0/mlflow/experiments/get-by-name failed with exception "
        "HTTPConnectionPool(host='h', port=1): Max retries exceeded with url: /api/2.0/mlflow/"
        'experiments/get-by-name?experiment_name=x (Caused by NewConnectionError("HTTPConnection'
        "(host='h', port=1): Failed to establish a new connection: [Errno 111] Connection "
        'refused"))'
    )
    assert cause(refused) == "[Errno 111] Connection refused"
    assert cause(ValueError("first line\nsecond")) == "first line"


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """``mlflow server`` serving HTTPS only (uvicorn's TLS options), with a self-signed
    certificate for 127.0.0.1: (its https URL, the certificate)."""
    folder = tmp_path / "tls-server"
    folder.mkdir()
    key, certificate = folder / "key.pem", folder / "cert.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(certificate),
        ],
        check=True,
        capture_output=True,
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # uvicorn's shutdown waited the fixture's 30 s for the test's open TLS connections: 3 s.
    tls = f"--ssl-keyfile {key} --ssl-certfile {certificate} --timeout-graceful-shutdown 3"
    argv = [*local_server_argv(port, folder), "--uvicorn-opts", tls]
    with mlflow_server(argv, port, folder, certificate) as url:
        yield url, certificate


@pytest.mark.slow
def test_a_tls_server_untrusted_or_asked_in_plain_http_ends_in_one_line(
    tls_server: tuple[str, Path], tiny_root: Path, tmp_path: Path
) -> None:
    """Against an HTTPS-only server: its certificate not trusted, its address given as http://,
    a name its certificate is not for, a CA certificate path that is no file, or one set but
    empty (MLflow would check no certificate at all): each ends the job in one line naming the
    cause and the fix, with no output folder and no run; with MLFLOW_TRACKING_SERVER_CERT_PATH
    set the job logs a FINISHED run."""
    url, certificate = tls_server
    job = [*tiny_overrides(tiny_root, model=True), "trainer.max_epochs=1"]
    plain = url.replace("https://", "http://")
    by_name = url.replace("127.0.0.1", "localhost")  # the certificate is for 127.0.0.1 only
    trusted = {CERTIFICATE: str(certificate)}
    missing = {CERTIFICATE: str(tmp_path / "ca.crt")}
    cases = [
        (url, {}, f"does not trust (self-signed certificate). Set {CERTIFICATE}"),
        (plain, {}, f"answers only HTTPS: use logger.tracking_uri={url}"),
        (by_name, trusted, "serves other names than localhost (Hostname mismatch"),
        (url, missing, f"{CERTIFICATE}={missing[CERTIFICATE]} is not a file"),
        (url, {CERTIFICATE: ""}, f"{CERTIFICATE} is set but empty, which would turn certificate"),
    ]
    for uri, env, words in cases:
        proc = run_entry(
            "train", *job, f"logger.tracking_uri={uri}", cwd=tmp_path, env=env, check=False
        )
        assert proc.returncode == 1
        assert words in one_error_line(proc.stderr)
        assert not (tmp_path / "outputs").exists(), "no folder for a job that never started"
    run_entry("train", *job, f"logger.tracking_uri={url}", cwd=tmp_path, env=trusted)
    with pytest.MonkeyPatch.context() as env:
        env.setenv(CERTIFICATE, str(certificate))
        client = MlflowClient(url)
        runs = client.search_runs([client.get_experiment_by_name("synthetic").experiment_id])
        assert [run.info.status for run in runs] == ["FINISHED"]


@contextmanager
def logged_in(user: str, password: str) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv(CREDENTIALS[0], user)
        env.setenv(CREDENTIALS[1], password)
        yield


def give_ann(url: str, experiment_id: str, permission: str) -> None:
    """As the admin, ann's permission on the experiment becomes ``permission``."""
    with logged_in("admin", ADMIN_PASSWORD):
        admin = AuthServiceClient(url)
        with suppress(MlflowException):  # none yet
            admin.revoke_user_permission("ann", "experiment", experiment_id)
        admin.grant_user_permission("ann", "experiment", experiment_id, permission)


@pytest.mark.slow
def test_records_refused_for_rights_mid_job_are_kept_and_sent_once_rights_are_back(
    auth_server: str, job_factory, tmp_path: Path
) -> None:
    """ann may write to the team's experiment when her job starts; mid-job the admin makes her a
    reader. Her job still trains to the end, keeps the refused records, says so in one line;
    once she may write again, src.sync sends them: one complete, FINISHED run."""
    with logged_in("admin", ADMIN_PASSWORD):
        team = MlflowClient(auth_server).create_experiment("team")
    give_ann(auth_server, team, "EDIT")
    ann = {CREDENTIALS[0]: "ann", CREDENTIALS[1]: USERS["ann"]}
    job = job_factory(
        "trainer.max_epochs=3",
        f"logger.tracking_uri={auth_server}",
        "logger.experiment_name=team",
        "logger.send_timeout_s=3",
        env={**slow_job_env(), **ann},
    )
    wait_for(lambda: (job.run_dir / "mlflow_run_id.txt").exists(), "the run")
    give_ann(auth_server, team, "READ")
    job.wait(timeout=300)
    assert job.proc.returncode == 0, job.stderr[-3000:]
    assert (job.run_dir / "metrics.json").exists(), "training went on"
    log = (job.run_dir / "train.log").read_text()  # and the console
    assert log.count("refused this run's records for the account's rights") == 1, log[-3000:]
    (line,) = [line for line in job.stderr.splitlines() if "python -m src.sync" in line]
    assert "Once the account may write to the run's experiment again" in line, line
    assert USERS["ann"] not in job.stderr

    with logged_in("ann", USERS["ann"]):
        refused = sync(job.run_dir)
        assert refused.returncode == 1, refused.stdout
        assert "Run this again once the account may write to it" in refused.stderr
        give_ann(auth_server, team, "EDIT")
        run_id = (job.run_dir / "mlflow_run_id.txt").read_text().strip()
    # Her password typed in src.sync's --tracking-uri: used, never printed or stored.
    typed = auth_server.replace("http://", f"http://ann:{USERS['ann']}@")
    done = sync(job.run_dir, "--tracking-uri", typed)
    assert done.returncode == 0, done.stderr
    assert USERS["ann"] not in done.stdout + done.stderr
    assert files_holding(USERS["ann"], job.run_dir) == []
    with logged_in("ann", USERS["ann"]):
        assert_complete_run(MlflowClient(auth_server), run_id, 3, "FINISHED")


@pytest.mark.slow
def test_a_sweep_and_its_register_with_a_password_in_the_uri_write_it_nowhere(
    auth_server: str, tiny_root: Path, tmp_path: Path
) -> None:
    """A sweep of 2 jobs whose tracking URI holds ann's password, then ``src.register`` given the
    same URI: every job and its sweep parent are logged as ann, the best model is registered,
    and the password is in no printed line, no file under the launch folder (the sweep's
    folders, configs, logs, outboxes, checkpoints; the server's artifacts), no param or tag."""
    host = auth_server.removeprefix("http://")
    uri = f"http://ann:{USERS['ann']}@{host}"
    sweep = tmp_path / "sweep"
    job = [*tiny_overrides(tiny_root, model=True), "trainer.max_epochs=1", "model.lr=0.01,0.02"]
    proc = run_entry(
        "train", "-m", *job, f"logger.tracking_uri={uri}", f"hydra.sweep.dir={sweep}", cwd=tmp_path
    )
    registered = run_entry(
        "register", str(sweep), "--name", "ann-synthetic", "--tracking-uri", uri, cwd=tmp_path
    )
    assert registered.stdout.startswith("registered ann-synthetic version 1: "), registered.stdout
    printed = proc.stdout + proc.stderr + registered.stdout + registered.stderr
    assert USERS["ann"] not in printed, "printed"
    files = [path for path in tmp_path.rglob("*") if path.is_file()]
    assert len(files) > 20 and any(path.suffix == ".ckpt" for path in files)
    assert files_holding(USERS["ann"], tmp_path) == []
    with pytest.MonkeyPatch.context() as login:
        login.setenv(CREDENTIALS[0], "ann")
        login.setenv(CREDENTIALS[1], USERS["ann"])
        client = MlflowClient(auth_server)
        runs = client.search_runs([client.get_experiment_by_name("synthetic").experiment_id])
        assert len(runs) == 3, "2 jobs and their sweep's parent"
        for run in runs:
            assert run.info.status == "FINISHED"
            values = [*run.data.params.values(), *run.data.tags.values()]
            assert all(USERS["ann"] not in value for value in values), run.info.run_name
