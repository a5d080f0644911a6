"""Trainer assembly: callbacks and loggers added by config alone, no machinery edit."""

from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping
from lightning.pytorch.loggers import CSVLogger, MLFlowLogger

from src.task import TASK
from src.template.tracking import build_loggers
from src.template.trainer import build_callbacks
from tests.conftest import run_entry, tiny_overrides
from tests.test_config import compose_config


def test_callbacks_and_loggers_come_from_config(tmp_path: Path) -> None:
    cfg = compose_config(
        "train",
        [
            "callbacks=early_stopping",
            "+logger.extra.csv._target_=lightning.pytorch.loggers.CSVLogger",
            f"+logger.extra.csv.save_dir={tmp_path}",
        ],
        tmp_path,
    )
    callbacks = build_callbacks(cfg, monitor=(TASK.monitor, TASK.mode))
    (stopping,) = [c for c in callbacks if isinstance(c, EarlyStopping)]
    assert stopping.monitor == "val/loss" and stopping.patience == 3
    mlflow, csv = build_loggers(cfg)
    assert isinstance(mlflow, MLFlowLogger) and isinstance(csv, CSVLogger)
    assert Path(csv.save_dir) == tmp_path


@pytest.mark.slow
def test_early_stopping_by_config_stops_training(tiny_root: Path, tmp_path: Path) -> None:
    run_entry(
        "train", *tiny_overrides(tiny_root), "trainer.max_epochs=6", "logger=none",
        "callbacks=early_stopping", "callbacks.extra.early_stopping.patience=0",
        "callbacks.extra.early_stopping.min_delta=10",  # no epoch improves val/loss by 10
        f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path,
    )  # fmt: skip
    saved = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["epoch"] == 1, "stopped after the second epoch, of six"
