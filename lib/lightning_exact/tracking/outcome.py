"""What a job's run records at its end, from rank 0: the data read (as MLflow datasets), config,
metrics, best checkpoint and figures as artifacts, the task's exported model; and the links of an
eval or predict run back to the training run of its checkpoint."""

import json
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn
from omegaconf import DictConfig

from lightning_exact.task import Task
from lightning_exact.tracking import mlflow_model
from lightning_exact.tracking.logger import mlflow_logger
from lightning_exact.tracking.outbox import encode
from lightning_exact.tracking.store import first_line, without_password


@rank_zero_only
def log_outcome(
    loggers: list[Logger],
    datamodule: Any,
    output_dir: Path,
    best_checkpoint: str,
    figures: list[Path],
) -> None:
    """After training: the data read (as MLflow dataset inputs: split, size, digest), the config,
    metrics, best checkpoint (it loads with ``weights_only=True``; a sharded one is a folder)
    and test figures."""
    if (logger := mlflow_logger(loggers)) is None:
        return
    from mlflow.entities import Dataset, DatasetInput, InputTag  # not imported by other loggers

    source = json.dumps({"uri": str(datamodule.source)})
    inputs = [
        DatasetInput(
            Dataset(f"{datamodule.name}/{split}", digest, source_type="local", source=source),
            tags=[InputTag("mlflow.data.context", split), InputTag("samples", str(samples))],
        )
        for split, (samples, digest) in datamodule.describe_splits().items()
    ]
    logger.experiment.log_inputs(logger.run_id, datasets=inputs)
    files = [(None, output_dir / "config.yaml"), (None, output_dir / "metrics.json")]
    files += [("checkpoints", Path(best_checkpoint))] if best_checkpoint else []
    files += [("figures", path) for path in figures]
    for folder, path in files:
        if path.is_dir():
            folder = f"{folder}/{path.name}"
            logger.experiment.log_artifacts(logger.run_id, str(path), artifact_path=folder)
        else:
            logger.experiment.log_artifact(logger.run_id, str(path), artifact_path=folder)


@rank_zero_only
def log_model(
    loggers: list[Logger],
    settings: DictConfig,
    task: Task,
    model: Any,
    datamodule: Any,
    output_dir: Path,
    step: int,
    metrics: Sequence[str],
) -> None:
    """The task's exported model (:func:`saved_model`) logged as the run's LoggedModel at the
    step of its final ``metrics``, registered if ``logger.registered_model_name``. ``model`` is
    whole (not sharded: see ``checkpoint.whole_model``)."""
    logger = mlflow_logger(loggers)
    if logger is None or not settings.get("log_model", True):
        return
    folder = saved_model(task, model, datamodule, output_dir / mlflow_model.MODEL_FOLDER)
    if folder is None:  # the task exports none, or exporting failed: said in one line
        return
    name = settings.get("registered_model_name")
    key = uuid.uuid4().hex
    if logger.outbox is not None:
        record = {"folder": folder, "step": step, "key": key, "metrics": list(metrics)}
        logger.outbox.append(encode("log_model", logger.run_id, registered_name=name, **record))
        then = f" and registered as a version of {name}" if name else ""
        print(
            f"MLflow model saved in {folder}; it is logged to run {logger.run_id}{then} "
            "when the run's records are sent"
        )
        return
    uri = logger.experiment.tracking_uri
    run_id = logger.run_id
    model_id, version = mlflow_model.log_model(uri, run_id, folder, step, key, name, metrics)
    served = f"models:/{name}/{version}" if name else f"models:/{model_id}"
    print(
        f"MLflow model {served} of run {run_id}. Serve it: "
        f"mlflow models serve -m {served} --env-manager local"
    )


def saved_model(task: Task, model: Any, datamodule: Any, folder: Path) -> Path | None:
    """The task's export of ``model`` saved as an MLflow model in ``folder``; None, said in one
    line, where the task exports none or exporting fails: it never costs the job's results."""
    if task.export is None:
        print("No MLflow model logged: the task has no export (Task.export, src/task/__init__.py)")
        return None
    try:
        return mlflow_model.save_model(task.export(model, datamodule), folder)
    except Exception as error:
        rank_zero_warn(
            f"the model was not logged as an MLflow model: exporting it failed "
            f"({first_line(error, 200)}). The checkpoint is logged as before; "
            "logger.log_model=false skips this step"
        )
        return None


def source_tags(source: Mapping[str, str] | None, ckpt_path: str, tracking_uri: str) -> dict:
    """Tags linking an eval run to the training run its checkpoint came from."""
    tags = {"source_checkpoint": str(Path(ckpt_path).resolve())}
    if source:
        tags["source_run_id"] = source["run_id"]
        if source["tracking_uri"] == without_password(tracking_uri):
            tags["mlflow.parentRunId"] = source["run_id"]  # the UI nests it under training
    return tags


@rank_zero_only
def attach_to_source_run(source: Mapping[str, str] | None, path: Path, folder: str) -> None:
    """Add a file (e.g. predictions) to the training run a checkpoint came from, if any."""
    if not source:
        return
    from mlflow import MlflowClient

    try:
        MlflowClient(source["tracking_uri"]).log_artifact(source["run_id"], str(path), folder)
    except Exception as error:  # the file is on disk; the run is a convenience
        rank_zero_warn(f"could not attach {path.name} to run {source['run_id']}: {error}")
