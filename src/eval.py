"""``python -m src.eval ckpt_path=PATH [split=test|val]``: evaluate a checkpoint and report.

With MLflow, the evaluation is a run of its own, tagged with (and, in the same store, nested
under) the training run the checkpoint came from.
"""

from pathlib import Path

import hydra
import lightning.pytorch as L
from lightning.fabric.utilities.exceptions import MisconfigurationException as ConfigError
from omegaconf import DictConfig, OmegaConf, open_dict

from src.task.data import datamodule_class
from src.task.model import ImageClassifier
from src.task.nets import UnknownNetwork
from src.template import reporting, tracking
from src.template.checkpoint import CheckpointError, load_for_inference
from src.template.config import check_choice, check_keys, run_entry_point, typed_keys
from src.template.data import DataError, ImageDataModule
from src.template.distributed import job_scope
from src.template.shutdown import RankFailed, run_lifecycle
from src.template.trainer import build_trainer, check_settings


def from_checkpoint(cfg: DictConfig) -> tuple[ImageClassifier, ImageDataModule, dict | None]:
    """The checked settings, then the checkpoint's model, its data (``cfg.data`` becomes what
    is used) and its MLflow run: what ``src.eval`` and ``src.predict`` start from."""
    check_settings(cfg, fitting=False)
    check_keys("data", cfg.data, datamodule_class(cfg.data.name))
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    data = OmegaConf.to_container(cfg.data, resolve=True)
    model, datamodule, source = load_for_inference(
        cfg.ckpt_path, data, typed_keys("data"), datamodule_class, ImageClassifier
    )
    with open_dict(cfg):
        cfg.data = OmegaConf.create(dict(datamodule.hparams))
    return model, datamodule, source


def evaluate(cfg: DictConfig) -> dict[str, float]:
    check_choice("split", cfg.split, ("test", "val"))
    model, datamodule, source = from_checkpoint(cfg)
    datamodule.prepare_data()
    datamodule.load({"test": "test", "val": "validate"}[cfg.split])  # bad data fails now
    reporting.show_config(cfg)
    tags = tracking.source_tags(source, cfg.ckpt_path, cfg.logger.get("tracking_uri", ""))
    loggers = tracking.build_loggers(cfg, extra_tags=tags)
    trainer = build_trainer(cfg, loggers, fitting=False)
    run_loop = {"test": trainer.test, "val": trainer.validate}[cfg.split]
    with tracking.sending(loggers, cfg.logger.get("send_timeout_s", 0)), run_lifecycle(trainer):
        tracking.log_config(loggers, cfg, trainer)
        metrics = run_loop(model, datamodule=datamodule)[0]
        reporting.report_metrics(metrics, Path(cfg.paths.output_dir))
    return metrics


# Errors that mean bad input or a failed rank: shown as one line, no traceback.
EXPECTED = (
    DataError,
    CheckpointError,
    tracking.TrackingError,
    ConfigError,
    RankFailed,
    UnknownNetwork,
)


@hydra.main(version_base="1.3", config_path="../conf", config_name="eval")
def main(cfg: DictConfig) -> dict[str, float]:
    with reporting.short_errors(*EXPECTED), job_scope():
        return evaluate(cfg)


if __name__ == "__main__":
    run_entry_point(main, EXPECTED)
