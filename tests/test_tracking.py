"""Tracking set-up against a real SQLite MLflow store."""

from pathlib import Path

import pytest
from lightning.pytorch.loggers import CSVLogger, MLFlowLogger
from mlflow import MlflowClient
from omegaconf import OmegaConf

from src.tracking import (
    artifact_location,
    build_loggers,
    failed_on_error,
    flatten,
    log_config,
    prepare_store,
)


def test_flatten_uses_override_style_keys() -> None:
    tree = {"model": {"lr": 0.1, "net": {"channels": [8, 16]}}, "seed": 0}
    assert flatten(tree) == {"model.lr": 0.1, "model.net.channels": [8, 16], "seed": 0}


def test_artifacts_go_beside_a_sqlite_store(tmp_path: Path) -> None:
    assert artifact_location(f"sqlite:///{tmp_path}/mlflow.db") == str(tmp_path / "mlartifacts")
    assert artifact_location("http://127.0.0.1:5000") is None


def test_prepare_store_creates_the_schema_once(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path}/nested/mlflow.db"
    prepare_store(uri)
    assert (tmp_path / "nested" / "mlflow.db").is_file()
    assert [e.name for e in MlflowClient(uri).search_experiments()] == ["Default"]
    prepare_store(uri)  # an existing store is left as it is


def cfg_for(kind: str, tmp_path: Path):
    return OmegaConf.create(
        {
            "paths": {"output_dir": str(tmp_path / "out")},
            "model": {"lr": 0.5},
            "logger": {
                "kind": kind,
                "tracking_uri": f"sqlite:///{tmp_path}/mlflow.db",
                "experiment_name": "exp",
                "run_name": "train-x",
            },
        }
    )


def test_logger_kinds(tmp_path: Path) -> None:
    assert build_loggers(cfg_for("none", tmp_path)) == []
    assert isinstance(build_loggers(cfg_for("csv", tmp_path))[0], CSVLogger)
    assert isinstance(build_loggers(cfg_for("mlflow", tmp_path))[0], MLFlowLogger)
    with pytest.raises(ValueError, match="logger.kind='wandb'"):
        build_loggers(cfg_for("wandb", tmp_path))


def test_config_becomes_params_and_errors_fail_the_run(tmp_path: Path) -> None:
    cfg = cfg_for("mlflow", tmp_path)
    loggers = build_loggers(cfg)
    with pytest.raises(RuntimeError, match="boom"), failed_on_error(loggers):
        log_config(loggers, cfg, world_size=1)
        raise RuntimeError("boom")
    run = MlflowClient(cfg.logger.tracking_uri).get_run(loggers[0].run_id)
    assert run.info.status == "FAILED"
    assert run.info.run_name == "train-x"
    assert run.data.params["model.lr"] == "0.5"
    assert run.data.params["world_size"] == "1"
    assert run.info.artifact_uri.startswith(str(tmp_path / "mlartifacts"))
