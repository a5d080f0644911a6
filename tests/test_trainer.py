"""Trainer assembly: callbacks and loggers added by config alone, no machinery edit; the
progress bars."""

import warnings
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import CSVLogger, MLFlowLogger

from src.task import TASK
from src.template.tracking import build_loggers
from src.template.trainer import RichBar, TqdmBar, build_callbacks, build_trainer, check_settings
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


class EpochEndLogging(BoringModel):
    """Logs, as the template's task does, a per-epoch value in ``on_train_epoch_end``."""

    def on_train_epoch_end(self) -> None:
        self.log("train/epoch_value", float(self.current_epoch), prog_bar=True)


@pytest.mark.parametrize("bar", [TqdmBar, RichBar])
def test_the_progress_bar_ends_showing_the_last_epochs_metrics(bar: type, tmp_path: Path) -> None:
    """Not the epoch before's (Lightning#19322): the bar's metrics once training ends."""
    shown = bar()
    trainer = L.Trainer(
        default_root_dir=tmp_path, max_epochs=3, limit_train_batches=2, limit_val_batches=1,
        callbacks=[shown], logger=False, enable_checkpointing=False, enable_model_summary=False,
    )  # fmt: skip
    displayed: list[dict] = []
    get_metrics = shown.get_metrics
    shown.get_metrics = lambda *args: displayed.append(get_metrics(*args)) or displayed[-1]
    trainer.fit(EpochEndLogging())
    assert displayed[-1]["train/epoch_value"] == pytest.approx(2.0), "the last epoch's value"
    if isinstance(shown, TqdmBar):
        assert "train/epoch_value=2" in shown.train_progress_bar.postfix


def test_a_trainer_warning_is_shown_once_not_again_by_the_trial_build(tmp_path: Path) -> None:
    """check_settings builds a trial Trainer to run Lightning's checks: its warnings are the real
    build's, which shows them."""
    cfg = compose_config("train", ["accelerator=cpu", "trainer.precision=16-mixed"], tmp_path)
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        check_settings(cfg, fitting=True)
        build_trainer(cfg, [], [], fitting=True)
    amp = [w for w in shown if "AMP with fp16 is not supported on CPU" in str(w.message)]
    assert len(amp) == 1, [str(w.message) for w in shown]
