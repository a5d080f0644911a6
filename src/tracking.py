"""Experiment tracking: which logger a job uses, the MLflow store, and what a run records.

MLflow is the default. Lightning's ``MLFlowLogger`` opens the run lazily from rank 0 only
(``rank_zero_experiment``) and ends it FINISHED or FAILED when fit/test succeed or raise.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import CSVLogger, Logger, MLFlowLogger
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf

SQLITE_PREFIX = "sqlite:///"


def build_loggers(cfg: DictConfig) -> list[Logger]:
    """The loggers chosen by ``logger=mlflow|csv|none``."""
    kind = cfg.logger.kind
    if kind == "none":
        return []
    if kind == "csv":
        return [CSVLogger(save_dir=cfg.paths.output_dir, name="csv", version="")]
    if kind == "mlflow":
        uri = cfg.logger.tracking_uri
        prepare_store(uri)
        return [
            MLFlowLogger(
                experiment_name=cfg.logger.experiment_name,
                run_name=cfg.logger.run_name,
                tracking_uri=uri,
                artifact_location=artifact_location(uri),
            )
        ]
    raise ValueError(f"logger.kind={kind!r} is not one of mlflow, csv, none")


def artifact_location(tracking_uri: str) -> str | None:
    """For a SQLite store, artifacts go to ``mlartifacts/`` beside the database (the folder
    ``mlflow server`` uses by default); a remote server decides for itself."""
    if not tracking_uri.startswith(SQLITE_PREFIX):
        return None
    return str(Path(tracking_uri.removeprefix(SQLITE_PREFIX)).resolve().parent / "mlartifacts")


@rank_zero_only
def prepare_store(tracking_uri: str) -> None:
    """Create the SQLite database and its schema once, in the launching process.

    Doing it here, before any DDP worker starts, avoids several ranks racing to create the schema.
    """
    from mlflow import MlflowClient

    if tracking_uri.startswith(SQLITE_PREFIX):
        Path(tracking_uri.removeprefix(SQLITE_PREFIX)).parent.mkdir(parents=True, exist_ok=True)
    MlflowClient(tracking_uri).search_experiments(max_results=1)


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"model": {"lr": 0.1}}`` → ``{"model.lr": 0.1}``: the keys people type as overrides."""
    if isinstance(tree, dict):
        flat: dict[str, Any] = {}
        for key, value in tree.items():
            flat.update(flatten(value, f"{prefix}{key}."))
        return flat
    return {prefix.rstrip("."): tree}


def log_config(loggers: list[Logger], cfg: DictConfig, world_size: int) -> None:
    """Record the resolved config (flattened) and the world size as run parameters."""
    params = flatten(OmegaConf.to_container(cfg, resolve=True))
    params["world_size"] = world_size
    for logger in loggers:
        logger.log_hyperparams(params)


@contextmanager
def failed_on_error(loggers: list[Logger]) -> Iterator[None]:
    """Mark the run FAILED if anything in the block raises, also outside ``fit``/``test``."""
    try:
        yield
    except BaseException:
        for logger in loggers:
            logger.finalize("failed")
        raise
