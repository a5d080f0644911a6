"""``python -m src.predict ckpt_path=PATH [split=test|val|train]``: write a predictions CSV.

The CSV has one row per sample (index in the official file, true label, predicted label,
confidence), in dataset order; its path is printed at the end.
"""

from pathlib import Path

import hydra
from lightning.fabric.utilities.exceptions import MisconfigurationException as ConfigError
from omegaconf import DictConfig

from src.eval import from_checkpoint
from src.task.nets import UnknownNetwork
from src.template import reporting, tracking
from src.template.checkpoint import CheckpointError
from src.template.config import check_choice, run_entry_point
from src.template.data import DataError
from src.template.distributed import job_scope
from src.template.trainer import build_trainer


def predict(cfg: DictConfig) -> Path:
    check_choice("split", cfg.split, ("test", "val", "train"))
    model, datamodule, source = from_checkpoint(cfg)  # shared with src.eval
    datamodule.predict_split = cfg.split
    datamodule.prepare_data()
    datamodule.load("predict")  # bad data fails now
    reporting.show_config(cfg)
    writer = reporting.PredictionWriter(Path(cfg.paths.output_dir) / f"predictions_{cfg.split}.csv")
    trainer = build_trainer(cfg, loggers=[], fitting=False, extra_callbacks=[writer])
    trainer.predict(model, datamodule=datamodule, return_predictions=True)
    reporting.report_metrics(writer.metrics, cfg.paths.output_dir)
    # The CSV also goes to the training run the checkpoint came from (if it was tracked).
    tracking.attach_to_source_run(source, writer.path, folder="predictions")
    return writer.path


# Errors that mean bad input: shown as one line, no traceback.
EXPECTED = (DataError, CheckpointError, ConfigError, UnknownNetwork)


@hydra.main(version_base="1.3", config_path="../conf", config_name="predict")
def main(cfg: DictConfig) -> Path:
    with reporting.short_errors(*EXPECTED), job_scope():
        return predict(cfg)


if __name__ == "__main__":
    run_entry_point(main, EXPECTED)
