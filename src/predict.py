"""``python -m src.predict ckpt_path=PATH [split=test|val|train]``: write a predictions CSV.

The CSV has one row per sample (index in the official file, true label, predicted label,
confidence), in dataset order; its path is printed at the end.
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
from src.template.data import DataError
from src.template.distributed import job_scope
from src.template.trainer import build_trainer, check_settings


def predict(cfg: DictConfig) -> Path:
    check_choice("split", cfg.split, ("test", "val", "train"))
    check_settings(cfg, fitting=False)
    check_keys("data", cfg.data, datamodule_class(cfg.data.name))
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    data = OmegaConf.to_container(cfg.data, resolve=True)
    model, datamodule, source = load_for_inference(
        cfg.ckpt_path, data, typed_keys("data"), datamodule_class, ImageClassifier
    )
    with open_dict(cfg):  # what was used: the checkpoint's data settings
        cfg.data = OmegaConf.create(dict(datamodule.hparams))
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
