"""The MLflow store a job logs to, made ready (or checked to answer) before any work starts, and
URIs and values safe to store and show."""

import fcntl
import os
import re
import socket
import ssl
import urllib.parse
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lightning_exact.environment import environment
from lightning_exact.files import folder_kept_if_used

MASK = "***"
SECRET_KEY = re.compile(r"password|token|secret|key", re.IGNORECASE)  # values logged as ***
URL_CREDENTIALS = re.compile(r"(\w+://[^/:@\s]+):[^@\s]+@")
# Where MLflow's client reads a server's basic-auth account (docs/mlflow.md).
CREDENTIALS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")
# MLflow 3's experiment kind for model training (its 3.17 UI ignores it yet, mlflow/mlflow#24498)
EXPERIMENT_KIND = "mlflow.experimentKind"
TRAINING = "custom_model_development"
EXPERIMENT_TAGS = {EXPERIMENT_KIND: TRAINING}
# Where MLflow's client reads the CA certificate of a TLS server (docs/mlflow.md).
CERTIFICATE = "MLFLOW_TRACKING_SERVER_CERT_PATH"
# OpenSSL's words for a certificate chain it could not verify, and its reason.
UNTRUSTED_CERTIFICATE = re.compile(
    r"CERTIFICATE_VERIFY_FAILED\] certificate verify failed: ([^(]+)"
)
# OpenSSL's words for any other TLS failure: its code and reason.
TLS_FAILURE = re.compile(r"\[SSL: (\w+)\] ([^'\"(]+)")
# The innermost cause of a network error, in the words of requests and urllib3.
ERRNO = re.compile(r"\[Errno -?\d+\] [^'\"()]+")
# What MLflow's client says when a server kept answering HTTP 429 (its retries spent).
TOO_MANY_REQUESTS = "too many 429 error responses"
# Whether a server answers, in seconds rather than after MLflow's minutes of retries.
FAIL_FAST = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}


class TrackingError(RuntimeError):
    """The tracking store cannot be used: the message says why and what to do."""


def sqlite_file(tracking_uri: str) -> Path | None:
    prefix = "sqlite:///"
    return Path(tracking_uri.removeprefix(prefix)) if tracking_uri.startswith(prefix) else None


def artifact_location(tracking_uri: str) -> str | None:
    """Beside a SQLite store, ``mlartifacts/`` (as ``mlflow server``); a server decides itself."""
    database = sqlite_file(tracking_uri)
    return str(database.resolve().parent / "mlartifacts") if database else None


def prepare_store(tracking_uri: str, experiment_name: str) -> None:
    """Create the SQLite schema (jobs starting together take turns: its folder is locked) or check
    that the server answers, and the experiment, tagged as model training. A SQLite store that
    fails leaves no file or folder it made."""
    database = sqlite_file(tracking_uri)
    refuse_empty_certificate_path(tracking_uri)
    try:
        if database:
            with (
                folder_kept_if_used(database.parent),
                locked(database.parent),
                file_kept_if_used(database),
            ):
                open_experiment(tracking_uri, experiment_name)
        else:
            with environment(**FAIL_FAST):
                open_experiment(tracking_uri, experiment_name)
    except Exception as error:
        reason = cause(error)
        if refused := refusal(tracking_uri, experiment_name, error):
            raise TrackingError(refused) from error
        raise TrackingError(
            f"MLflow store {tracking_uri} cannot be opened ({reason}). Set "
            "logger.tracking_uri=sqlite:///<a folder you can write to>/mlflow.db"
            if database
            else f"MLflow server {mask_text(tracking_uri)} is not reachable ({reason}). Start it "
            "(docs/mlflow.md: MLflow server) or log locally with logger.tracking_uri=sqlite:///mlflow.db"
        ) from error


def refusal(tracking_uri: str, experiment_name: str, error: Exception) -> str | None:
    """A server that answered, but not as asked, in one line saying which and what to do (None
    for any other error): wrong credentials (HTTP 401) are not an unreachable server, an account
    that may read an experiment may not be allowed to write runs into it (403), and a TLS server
    may present a certificate this machine does not trust, or be asked in plain HTTP."""
    status = http_status(error)
    server = mask_text(tracking_uri)
    if tracking_uri.startswith("https://") and (refused := tls_refusal(tracking_uri, str(error))):
        return refused
    if tracking_uri.startswith("http://") and speaks_tls(tracking_uri):
        https = "https://" + without_password(tracking_uri).removeprefix("http://")
        return f"MLflow server {server} answers only HTTPS: use logger.tracking_uri={https}"
    if TOO_MANY_REQUESTS in str(error):
        return (
            f"MLflow server {server} refuses sign-ins for a while (HTTP 429: too many wrong "
            "passwords for this account or from this address). Wait, then check "
            f"{CREDENTIALS[0]} and {CREDENTIALS[1]}"
        )
    if status == 401:
        return (
            f"MLflow server {server} refused the credentials (HTTP 401). Set "
            f"{CREDENTIALS[0]} and {CREDENTIALS[1]} to your account on that server"
        )
    if status == 403:
        user = os.environ.get(CREDENTIALS[0], "this account")
        return (
            f"MLflow server {server}: {user} may not write runs into experiment "
            f"{experiment_name} (HTTP 403). Ask the server's admin for EDIT on it, or log to an "
            "experiment of your own: logger.experiment_name=<a new name>"
        )
    return None


def refuse_empty_certificate_path(tracking_uri: str) -> None:
    """MLflow gives an empty MLFLOW_TRACKING_SERVER_CERT_PATH (``export NAME=``, a common way to
    "unset" it) to requests as ``verify=''``, which checks no certificate at all: refused."""
    if tracking_uri.startswith("https://") and os.environ.get(CERTIFICATE) == "":
        raise TrackingError(
            f"{CERTIFICATE} is set but empty, which would turn certificate checks off: unset it "
            f"(unset {CERTIFICATE}) to check with this machine's CAs, or set it to the CA "
            "certificate the server's admin gives you (docs/mlflow.md: A server with accounts)"
        )


def tls_refusal(tracking_uri: str, error: str) -> str | None:
    """Why an HTTPS connection failed, when TLS is the cause (None otherwise): the CA certificate
    missing or not trusted, a certificate or a proxy for other names, a plain-HTTP server."""
    server = mask_text(tracking_uri)
    certificate = os.environ.get(CERTIFICATE)
    if certificate and not Path(certificate).is_file():
        return (
            f"{CERTIFICATE}={certificate} is not a file. Set it to the CA certificate the "
            "server's admin gives you (docs/mlflow.md: A server with accounts)"
        )
    untrusted = UNTRUSTED_CERTIFICATE.search(error)
    failed = TLS_FAILURE.search(error)
    if untrusted and "mismatch" not in untrusted.group(1):
        return (
            f"MLflow server {server} presented a certificate this machine does not trust "
            f"({untrusted.group(1).strip()}). Set {CERTIFICATE} to the CA certificate its admin "
            "gives you (docs/mlflow.md: A server with accounts)"
        )
    if failed and failed.group(1) == "WRONG_VERSION_NUMBER":
        http = "http://" + without_password(tracking_uri).removeprefix("https://")
        return f"MLflow server {server} answers only plain HTTP: use logger.tracking_uri={http}"
    if untrusted:  # a certificate for other names ("Hostname mismatch, ...")
        reason = untrusted.group(1)
    elif failed:  # a TLS proxy with no site for the name ("tlsv1 alert internal error")
        reason = failed.group(2)
    else:
        return None
    host = urllib.parse.urlsplit(tracking_uri).hostname
    return (
        f"MLflow server {server} serves other names than {host} ({reason.strip().rstrip('.')}): "
        "use the URL its admin gives you, with the name its certificate is for"
    )


def cause(error: BaseException) -> str:
    """A store's error in one line: for a network error its innermost cause
    ("[Errno 111] Connection refused"), not the retries and URL wrapped around it."""
    found = ERRNO.findall(str(error))
    return found[-1].strip() if found else first_line(error, 200)


def http_status(error: BaseException | None) -> int | None:
    """The HTTP status an MLflow server answered with (its RestException's), else None."""
    status = getattr(error, "get_http_status_code", None)
    return status() if status else None


def speaks_tls(url: str) -> bool:
    """Whether ``url``'s host and port complete a TLS handshake (any certificate): asked only
    once a plain-HTTP request has failed."""
    parts = urllib.parse.urlsplit(url)
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with (
            socket.create_connection((parts.hostname, parts.port or 80), timeout=5) as raw,
            context.wrap_socket(raw, server_hostname=parts.hostname),
        ):
            return True
    except OSError:
        return False


def credentials_to_environment(overrides: list[str]) -> list[str]:
    """A password typed in the tracking URI (``logger.tracking_uri=http://user:password@host``)
    moves to MLflow's own variables before Hydra records the command, so no config file, log,
    printed line or run artifact holds it: the overrides come back without it."""
    moved = []
    for override in overrides:
        key, sep, value = override.partition("=")
        if sep and key.lstrip("+") == "logger.tracking_uri":
            override = f"{key}={credentials_moved(value)}"
        moved.append(override)
    return moved


def credentials_moved(uri: str) -> str:
    """``http://user:password@host`` → ``http://host``, user and password in MLflow's variables
    (``--tracking-uri`` of src.sync and src.register, the tracking URI of a job's command); a URI
    without a password comes back as it is."""
    parts = urllib.parse.urlsplit(uri)
    if parts.password is None:
        return uri
    os.environ[CREDENTIALS[0]] = urllib.parse.unquote(parts.username or "")
    os.environ[CREDENTIALS[1]] = urllib.parse.unquote(parts.password)
    host = parts.netloc.rpartition("@")[2]
    return urllib.parse.urlunsplit(parts._replace(netloc=host))


def refuse_password_in_config(tracking_uri: str) -> None:
    """A password in a config file's tracking URI would be copied into every output folder
    (Hydra's record) and the run's config artifact: refused, with where it belongs."""
    if URL_CREDENTIALS.search(tracking_uri):
        raise TrackingError(
            f"logger.tracking_uri={mask_text(tracking_uri)} holds a password, which would be "
            f"written to the output folder and the run: set {CREDENTIALS[0]} and "
            f"{CREDENTIALS[1]} in the environment instead (on the command line it is moved there)"
        )


def open_experiment(tracking_uri: str, experiment_name: str) -> None:
    """The experiment in the store, created (by this job or one starting with it) if need be."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri)
    experiment = client.get_experiment_by_name(experiment_name)
    if experiment is None:
        try:
            client.create_experiment(
                experiment_name, artifact_location(tracking_uri), EXPERIMENT_TAGS
            )
        except Exception:
            if client.get_experiment_by_name(experiment_name) is None:  # not another job's
                raise
    elif EXPERIMENT_KIND not in experiment.tags:
        client.set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND, TRAINING)


@contextmanager
def file_kept_if_used(path: Path) -> Iterator[None]:
    """If the block fails, remove ``path`` if the block created it (call it under a lock that
    the other jobs creating ``path`` take too)."""
    existed = path.exists()
    try:
        yield
    except BaseException:
        if not existed:
            path.unlink(missing_ok=True)
        raise


@contextmanager
def locked(folder: Path) -> Iterator[None]:
    """An exclusive lock on ``folder`` between processes (flock: released if one dies)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def first_line(error: BaseException, limit: int = 120) -> str:
    """An error in one line, for a one-line message."""
    return (str(error).strip().splitlines() or [repr(error)])[0][:limit]


def run_page(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    """A run's page in the MLflow UI, and for a SQLite store how to start the UI."""
    return ui_page(tracking_uri, f"experiments/{experiment_id}/runs/{run_id}")


def ui_page(tracking_uri: str, route: str, query: str = "") -> str:
    """A page of the MLflow UI on its training side, and for a SQLite store how to start it."""
    database = sqlite_file(tracking_uri)
    ui = "http://127.0.0.1:5000" if database else without_password(tracking_uri).rstrip("/")
    page = f"{ui}/#/{route}?{query}"
    if database is None:
        how = ""
    elif database.resolve() == Path("mlflow.db").resolve():
        how = " (after `mlflow ui` here)"
    else:
        how = f" (after `mlflow ui --backend-store-uri {tracking_uri}`)"
    return f"{page}workflowType=machine_learning{how}"


def mask_secrets(values: Mapping[str, Any]) -> dict[str, Any]:
    """Values whose key looks like a credential become ``***``; URLs lose their password."""
    return {
        key: MASK if SECRET_KEY.search(key) else mask_text(v) if isinstance(v, str) else v
        for key, v in values.items()
    }


def mask_override(override: str) -> str:
    """``db.password=x`` → ``db.password=***``; other overrides keep their value, URLs masked."""
    key, sep, _ = override.partition("=")
    return f"{key}{sep}{MASK}" if sep and SECRET_KEY.search(key) else mask_text(override)


def mask_text(text: str) -> str:
    return URL_CREDENTIALS.sub(rf"\1:{MASK}@", text)


def without_password(uri: str) -> str:
    """``scheme://user:password@host`` → ``scheme://user@host``: safe to store in a checkpoint."""
    return URL_CREDENTIALS.sub(r"\1@", uri)
