"""``python -m src.train [overrides]``: fit, test the best checkpoint, report.

Returns the metric named by ``optimized_metric`` so Hydra sweepers can optimise it.
"""

from pathlib import Path

import hydra
import lightning.pytorch as L
from lightning.fabric.utilities.exceptions import MisconfigurationException as ConfigError
from omegaconf import DictConfig, OmegaConf

from src.task.data import build_datamodule, datamodule_class
from src.task.model import ImageClassifier
from src.task.nets import UnknownNetwork
from src.template import checkpoint, reporting, tracking
from src.template.checkpoint import CheckpointError
from src.template.config import as_config_error, check_sections, run_entry_point
from src.template.data import DataError
from src.template.distributed import (
    SweepJobFailed,
    in_multirun,
    job_scope,
    run_sweep_job_in_own_process,
    srun_starts_ranks,
)
from src.template.shutdown import RankFailed, run_lifecycle
from src.template.trainer import build_trainer, check_settings


def train(cfg: DictConfig) -> float | None:
    world_size = check_settings(cfg, fitting=True)
    data_class = datamodule_class(cfg.data.name)
    check_sections(cfg, {"data": (data_class, ()), **ImageClassifier.config_targets(cfg.model.net)})
    if in_multirun() and world_size > 1 and not srun_starts_ranks(world_size):
        return run_sweep_job_in_own_process(cfg.optimized_metric)  # see src/template/distributed.py
    seed = L.seed_everything(cfg.seed, workers=True, verbose=False)
    # Everything that can be checked is checked before a run or a rank process exists.
    datamodule = build_datamodule(cfg.data)
    datamodule.prepare_data()
    datamodule.load()  # train, validation and test splits
    with as_config_error("model"):
        model = ImageClassifier(
            num_classes=datamodule.num_classes,
            image_shape=datamodule.image_shape,
            **OmegaConf.to_container(cfg.model, resolve=True),
        )
    resume = checkpoint.read_checkpoint(cfg.ckpt_path) if cfg.ckpt_path else None
    if resume:
        checkpoint.check_fits(resume, model, datamodule, cfg.ckpt_path)
    reporting.show_config(cfg)
    loggers = tracking.build_loggers(cfg, continue_run=tracking.run_to_continue(resume, cfg))
    extra = [checkpoint.SeedEachBatch(seed), *tracking.callbacks(loggers, cfg)]
    trainer = build_trainer(cfg, loggers, fitting=True, extra_callbacks=extra)
    out = Path(cfg.paths.output_dir)
    with tracking.sending(loggers, cfg.logger.get("send_timeout_s", 0)), run_lifecycle(trainer):
        tracking.log_config(loggers, cfg, trainer)
        trainer.fit(model, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
        metrics = {name: float(value) for name, value in trainer.callback_metrics.items()}
        # The best checkpoint by the monitored metric; without validation, the last one.
        best = trainer.checkpoint_callback.best_model_path or str(out / "checkpoints/last.ckpt")
        metrics.update(trainer.test(model, datamodule=datamodule, ckpt_path=best)[0])
        reporting.report_metrics(metrics, out)
        test_set, classes = datamodule.test_set, datamodule.classes
        figures = reporting.save_test_figures(model, test_set, classes, out / "figures")
        tracking.log_outcome(loggers, datamodule, out, best, figures)
        # The test metrics' step (the epoch count): MLflow links them to the model.
        tracking.log_model(loggers, cfg.logger, model.net, datamodule, out, trainer.current_epoch)
    return metrics.get(cfg.optimized_metric)


# Errors that mean bad input or a failed rank: shown as one line, no traceback.
EXPECTED = (
    DataError,
    CheckpointError,
    tracking.TrackingError,
    ConfigError,
    RankFailed,
    SweepJobFailed,
    UnknownNetwork,
)


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    with reporting.short_errors(*EXPECTED), job_scope():
        return train(cfg)


if __name__ == "__main__":
    run_entry_point(main, EXPECTED)
