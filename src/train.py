"""``python -m src.train [overrides]``: fit, test the best checkpoint, report.

Returns the metric named by ``optimized_metric`` so Hydra sweepers can optimise it.
"""

from pathlib import Path

import hydra
import lightning.pytorch as L
from lightning.fabric.utilities.exceptions import MisconfigurationException as ConfigError
from omegaconf import DictConfig, OmegaConf

from src import reporting, tracking
from src.data import DataError, MNISTDataModule
from src.distributed import in_multirun, job_scope, run_sweep_job_in_own_process
from src.model import ImageClassifier
from src.trainer import build_trainer


def train(cfg: DictConfig) -> float | None:
    if in_multirun() and build_trainer(cfg, [], fitting=False).world_size > 1:
        return run_sweep_job_in_own_process(cfg.optimized_metric)  # see src/distributed.py
    reporting.show_config(cfg)
    L.seed_everything(cfg.seed, workers=True)
    datamodule = MNISTDataModule(**cfg.data)
    model = ImageClassifier(
        num_classes=datamodule.num_classes, **OmegaConf.to_container(cfg.model, resolve=True)
    )
    loggers = tracking.build_loggers(cfg)
    extra = tracking.callbacks(loggers, cfg)  # records the MLflow run in checkpoints
    trainer = build_trainer(cfg, loggers, fitting=True, extra_callbacks=extra)
    out = Path(cfg.paths.output_dir)
    with tracking.run_lifecycle(loggers):
        tracking.log_config(loggers, cfg, trainer)
        trainer.fit(model, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
        metrics = {name: float(value) for name, value in trainer.callback_metrics.items()}
        best = trainer.checkpoint_callback.best_model_path
        metrics.update(trainer.test(model, datamodule=datamodule, ckpt_path=best)[0])
        reporting.report_metrics(metrics, out)
        test_set, classes = datamodule.test_set, datamodule.classes
        figures = reporting.save_test_figures(model, test_set, classes, out / "figures")
        tracking.log_outcome(loggers, datamodule, out, best, figures)
    return metrics.get(cfg.optimized_metric)


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    with reporting.short_errors(DataError, tracking.TrackingError, ConfigError), job_scope():
        return train(cfg)


if __name__ == "__main__":
    main()
