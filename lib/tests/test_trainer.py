"""Trainer assembly: callbacks and loggers added by config alone, no machinery edit; the
progress bars."""

import inspect
import warnings
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import CSVLogger, MLFlowLogger
from lightning_exact.job.entry import LIBRARY_CONF
from lightning_exact.job.settings import JobSettings
from lightning_exact.tracking.run import build_loggers
from lightning_exact.training.trainer import (
    SET_BY_TEMPLATE,
    NoProfiler,
    RichBar,
    TqdmBar,
    build_callbacks,
    build_trainer,
    check_settings,
)
from omegaconf import OmegaConf

from src.task import TASK
from tests.conftest import run_entry, tiny_overrides
from tests.test_config import compose_config

TRAINER_ARGUMENTS = inspect.signature(L.Trainer).parameters
# conf/trainer/default.yaml's values that are not the Trainer's signature defaults: what
# Lightning does with its None default, written out, and the template's own number of epochs.
NOT_THE_SIGNATURE_DEFAULT = {
    "max_epochs": 3,
    "precision": "32-true",
    "limit_train_batches": 1.0,
    "limit_val_batches": 1.0,
    "limit_test_batches": 1.0,
    "limit_predict_batches": 1.0,
    "num_sanity_val_steps": 2,
    "log_every_n_steps": 50,
    "deterministic": False,
}


def test_every_trainer_argument_is_a_trainer_key_at_its_default() -> None:
    """A Lightning upgrade that adds, renames or drops a Trainer argument fails here: every one
    is either in conf/trainer/default.yaml (so trainer.KEY=VALUE works without +) or set by the
    template from other config."""
    listed = OmegaConf.to_container(OmegaConf.load(LIBRARY_CONF / "trainer" / "default.yaml"))
    assert set(SET_BY_TEMPLATE) <= set(TRAINER_ARGUMENTS)
    assert sorted(listed) == sorted(set(TRAINER_ARGUMENTS) - set(SET_BY_TEMPLATE))
    for key, value in listed.items():
        expected = NOT_THE_SIGNATURE_DEFAULT.get(key, TRAINER_ARGUMENTS[key].default)
        assert value == expected, f"trainer.{key}: {value!r}, Lightning's default {expected!r}"


def test_any_trainer_argument_reaches_the_trainer(tmp_path: Path) -> None:
    overrides = ["trainer.accumulate_grad_batches=2", "trainer.val_check_interval=0.5"]
    cfg = compose_config("train", overrides, tmp_path)  # no +: the key is there
    settings = check_settings(cfg, fitting=True)
    trainer = build_trainer(cfg, settings, [], [], fitting=True)
    assert (trainer.accumulate_grad_batches, trainer.val_check_interval) == (2, 0.5)
    assert isinstance(trainer.profiler, NoProfiler)  # trainer.profiler=null: no cost per hook
    cfg = compose_config("train", ["debug=profiler"], tmp_path)
    profiler = build_trainer(cfg, settings, [], [], fitting=True).profiler
    assert type(profiler).__name__ == "SimpleProfiler"


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
    callbacks = build_callbacks(
        cfg.callbacks, Path(cfg.paths.output_dir), monitor=(TASK.monitor, TASK.mode)
    )
    (stopping,) = [c for c in callbacks if isinstance(c, EarlyStopping)]
    assert stopping.monitor == "val/loss" and stopping.patience == 3
    mlflow, csv = build_loggers(cfg, JobSettings.from_config(cfg))
    assert isinstance(mlflow, MLFlowLogger) and isinstance(csv, CSVLogger)
    assert Path(csv.save_dir) == tmp_path


@pytest.mark.slow
def test_early_stopping_by_config_stops_training(tiny_root: Path, tmp_path: Path) -> None:
    run_entry(
        "train",
        *tiny_overrides(tiny_root, logger="none"),
        "trainer.max_epochs=6",
        "callbacks=early_stopping",
        "callbacks.extra.early_stopping.patience=0",
        "callbacks.extra.early_stopping.min_delta=10",  # no epoch improves val/loss by 10
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
    )
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
        default_root_dir=tmp_path,
        max_epochs=3,
        limit_train_batches=2,
        limit_val_batches=1,
        callbacks=[shown],
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
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
    both = ["trainer.deterministic=true", "trainer.benchmark=true"]
    cfg = compose_config("train", ["accelerator=cpu", *both], tmp_path)
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        build_trainer(cfg, check_settings(cfg, fitting=True), [], [], fitting=True)
    ignored = [w for w in shown if "PyTorch ignores torch.backends.cudnn" in str(w.message)]
    assert len(ignored) == 1, [str(w.message) for w in shown]


@pytest.mark.parametrize(
    ("setting", "steps_its_own", "found"),
    [(None, False, False), (None, True, True), (True, False, True), (False, True, False)],
)
def test_ddp_finds_unused_parameters_for_a_model_stepping_its_own_optimizers(
    setting: bool | None,
    steps_its_own: bool,
    found: bool,
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
) -> None:
    """strategy.find_unused_parameters=null (the default) decides from the model: one that steps
    its own optimizers toggles them, and DDP must find the parameters a backward left out (else
    Lightning's RuntimeError on every rank); set, it is honoured, false for such a model named."""
    value = "null" if setting is None else str(setting).lower()
    overrides = ["strategy=ddp", "devices=2", f"strategy.find_unused_parameters={value}"]
    cfg = compose_config("train", overrides, tmp_path)
    settings = check_settings(cfg, fitting=True)
    trainer = build_trainer(cfg, settings, [], [], fitting=True, steps_its_own=steps_its_own)
    assert trainer.strategy._ddp_kwargs["find_unused_parameters"] is found
    named = [line for line in capsys.readouterr().out.splitlines() if "find_unused" in line]
    assert named == (
        [
            "Note: strategy.find_unused_parameters=false with a model that steps its own "
            "optimizers: DDP fails on every rank if a backward leaves a parameter without a "
            "gradient (an optimizer toggled); null (the default) finds them"
        ]
        if setting is False and steps_its_own
        else []
    )


def test_a_task_without_a_metric_keeps_its_last_checkpoint(tmp_path: Path) -> None:
    """Task.monitor=None: no best checkpoint by a metric; the job tests, logs and registers its
    last.ckpt (TrainingJob.best_checkpoint)."""
    from lightning_exact.checkpoints.checkpoint import BestCheckpoint, LastCheckpoint

    cfg = compose_config("train", [], tmp_path)
    callbacks = build_callbacks(cfg.callbacks, tmp_path, monitor=(None, "min"))
    assert not [c for c in callbacks if isinstance(c, BestCheckpoint)]
    assert [c for c in callbacks if isinstance(c, LastCheckpoint)]
