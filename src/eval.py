"""``python -m src.eval ckpt_path=PATH [split=test|val]``: evaluate a checkpoint and report.

With MLflow, the evaluation is a run of its own, tagged with (and, in the same store, nested
under) the training run the checkpoint came from.
"""

from pathlib import Path

import lightning.pytorch as L
from omegaconf import DictConfig, OmegaConf, open_dict

from src.task import TASK
from src.template import entry, reporting, tracking
from src.template.checkpoint import load_for_inference
from src.template.config import check_choice, check_keys, typed_keys
from src.template.distributed import check_shardable
from src.template.shutdown import run_lifecycle
from src.template.task import Task
from src.template.trainer import build_callbacks, build_trainer, check_settings


def from_checkpoint(
    cfg: DictConfig, task: Task
) -> tuple[L.LightningModule, L.LightningDataModule, dict | None]:
    """The checked settings, then the checkpoint's model, its data (``cfg.data`` becomes what
    is used) and its MLflow run: what ``src.eval`` and ``src.predict`` start from."""
    check_settings(cfg, fitting=False)
    check_keys("data", cfg.data, task.datamodule_class(cfg.data.name))
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    data = OmegaConf.to_container(cfg.data, resolve=True)
    model, datamodule, source = load_for_inference(cfg.ckpt_path, data, typed_keys("data"), task)
    check_shardable(cfg.strategy.name, model, task.sharded_blocks)
    with open_dict(cfg):
        cfg.data = OmegaConf.create(dict(datamodule.hparams))
    return model, datamodule, source


def evaluate(cfg: DictConfig, task: Task) -> dict[str, float]:
    check_choice("split", cfg.split, ("test", "val"))
    model, datamodule, source = from_checkpoint(cfg, task)
    datamodule.prepare_data()
    datamodule.load({"test": "test", "val": "validate"}[cfg.split])  # bad data fails now
    tags = tracking.source_tags(source, cfg.ckpt_path, cfg.logger.get("tracking_uri", ""))
    loggers = tracking.build_loggers(cfg, extra_tags=tags)
    reporting.show_config(cfg)
    trainer = build_trainer(cfg, loggers, build_callbacks(cfg, monitor=None), fitting=False)
    run_loop = {"test": trainer.test, "val": trainer.validate}[cfg.split]
    with tracking.sending(loggers, cfg), run_lifecycle(trainer):
        tracking.log_config(loggers, cfg, trainer)
        metrics = run_loop(model, datamodule=datamodule, verbose=False)[0]
        reporting.report_metrics(metrics, Path(cfg.paths.output_dir))
    return metrics


if __name__ == "__main__":
    entry.main("eval", evaluate, TASK)
