"""The MLflow store a job logs to: a SQLite file made ready once (its schema, the experiment),
or a server checked to answer, before any work starts; and URIs safe to store and show."""

import fcntl
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from src.template.distributed import launch_rank, requested_processes
from src.template.environment import environment

SQLITE_PREFIX = "sqlite:///"
MASK = "***"
SECRET_KEY = re.compile(r"password|token|secret|key", re.IGNORECASE)  # values logged as ***
EXPERIMENT_KIND, TRAINING = "mlflow.experimentKind", "custom_model_development"  # MLflow 3 UI
EXPERIMENT_TAGS = {EXPERIMENT_KIND: TRAINING}
# For a caller that must know within seconds whether the server answers (the job's start-up
# check, src.sync), instead of after MLflow's minutes of retries: one retry, 30 s per request
# (an upload of a large checkpoint is one request).
FAIL_FAST = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}
URL_CREDENTIALS = re.compile(r"(\w+://[^/:@\s]+):[^@\s]+@")


class TrackingError(RuntimeError):
    """The tracking store cannot be used: the message says why and what to do."""


def talks_to_store(cfg: DictConfig) -> bool:
    """Only rank 0 opens the MLflow store: ranks started together (torchrun, srun) would race
    to create a fresh store's schema."""
    return launch_rank(requested_processes(cfg.accelerator, cfg.devices, 1)) == 0


def sqlite_file(tracking_uri: str) -> Path | None:
    """The database file of a SQLite store; None for a server."""
    if not tracking_uri.startswith(SQLITE_PREFIX):
        return None
    return Path(tracking_uri.removeprefix(SQLITE_PREFIX))


def artifact_location(tracking_uri: str) -> str | None:
    """For a SQLite store, artifacts go to ``mlartifacts/`` beside the database (the folder
    ``mlflow server`` uses by default); a remote server decides for itself."""
    database = sqlite_file(tracking_uri)
    return str(database.resolve().parent / "mlartifacts") if database else None


def prepare_store(tracking_uri: str, experiment_name: str) -> None:
    """Create the SQLite schema and the experiment, or check the server answers, once (rank 0),
    before any work starts. Jobs that start together (a sweep's SLURM jobs) take turns: the
    store's folder is locked while its schema is created."""
    from mlflow import MlflowClient

    if database := sqlite_file(tracking_uri):
        try:
            folder = database.parent
            folder.mkdir(parents=True, exist_ok=True)
            with locked(folder):
                ensure_experiment(MlflowClient(tracking_uri), experiment_name, tracking_uri)
        except Exception as error:
            reason = str(error).strip().splitlines()[0][:200]
            raise TrackingError(
                f"MLflow store {tracking_uri} cannot be opened ({reason}). Set "
                "logger.tracking_uri=sqlite:///<a folder you can write to>/mlflow.db"
            ) from error
        return
    # A remote server: fail now, in seconds, rather than retrying for minutes mid-training.
    try:
        with environment(**FAIL_FAST):  # only for this check
            ensure_experiment(MlflowClient(tracking_uri), experiment_name, tracking_uri)
    except Exception as error:
        reason = str(error).splitlines()[0][:200]
        raise TrackingError(
            f"MLflow server {mask_text(tracking_uri)} is not reachable ({reason}). Start it "
            "(docs/mlflow.md: MLflow server) or log locally with logger.tracking_uri=sqlite:///mlflow.db"
        ) from error


@contextmanager
def locked(folder: Path) -> Iterator[None]:
    """An exclusive lock on ``folder`` between processes (flock: released if one dies)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def ensure_experiment(client: Any, name: str, tracking_uri: str) -> None:
    """The experiment exists (created here, one job at a time, not by Lightning's logger in every
    job), tagged as model training: MLflow 3's kind for it (its 3.17 UI does not follow the tag
    yet, mlflow/mlflow#24498)."""
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        try:
            client.create_experiment(
                name, artifact_location=artifact_location(tracking_uri), tags=EXPERIMENT_TAGS
            )
        except Exception:
            if client.get_experiment_by_name(name) is None:  # not another job's creation
                raise
    elif EXPERIMENT_KIND not in experiment.tags:
        client.set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND, TRAINING)


def mask_override(override: str) -> str:
    """``db.password=x`` → ``db.password=***``; other overrides keep their value, URLs masked."""
    key, sep, value = override.partition("=")
    return f"{key}{sep}{MASK}" if sep and SECRET_KEY.search(key) else mask_text(override)


def mask_text(text: str) -> str:
    """Hide the password of ``scheme://user:password@host`` URLs."""
    return URL_CREDENTIALS.sub(rf"\1:{MASK}@", text)


def without_password(uri: str) -> str:
    """``scheme://user:password@host`` → ``scheme://user@host``: safe to store in a checkpoint."""
    return URL_CREDENTIALS.sub(r"\1@", uri)
