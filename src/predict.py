"""``python -m src.predict ckpt_path=PATH [split=test|val|train]``: write a predictions CSV.

The CSV has one row per sample in dataset order, with the columns the task reports (here: index
in the official file, true label, predicted label, its class name, confidence); its path is
printed at the end. ``images=DIR_OR_GLOB`` classifies new image files instead
(``predictions_images.csv``: path, predicted label, class name, confidence).
"""

from pathlib import Path

from omegaconf import DictConfig

from src.eval import from_checkpoint
from src.task import TASK
from src.template import entry, reporting, tracking
from src.template.config import ConfigError, check_choice
from src.template.task import Task
from src.template.trainer import build_callbacks, build_trainer


def predict(cfg: DictConfig, task: Task) -> Path:
    if cfg.get("images"):  # new, unlabelled files: the task's predict_files
        if task.predict_files is None:
            raise ConfigError(
                f"images={cfg.images}: this task predicts its data splits only (split=test, val "
                "or train); Task.predict_files in src/task/__init__.py would read new files"
            )
        out = Path(cfg.paths.output_dir) / "predictions_images.csv"
        return task.predict_files(cfg.ckpt_path, cfg.images, out, task)
    check_choice("split", cfg.split, ("test", "val", "train"))
    model, datamodule, source = from_checkpoint(cfg, task)  # shared with src.eval
    datamodule.predict_split = cfg.split
    datamodule.prepare_data()
    datamodule.load("predict")  # bad data fails now
    reporting.show_config(cfg)
    path = Path(cfg.paths.output_dir) / f"predictions_{cfg.split}.csv"
    writer = reporting.PredictionWriter(path, task.predictions, datamodule)
    callbacks = [*build_callbacks(cfg, monitor=None), writer]
    trainer = build_trainer(cfg, loggers=[], callbacks=callbacks, fitting=False)
    trainer.predict(model, datamodule=datamodule, return_predictions=True)
    reporting.report_metrics(writer.metrics, cfg.paths.output_dir)
    reporting.show_written("predictions", writer.path)
    # The CSV also goes to the training run the checkpoint came from (if it was tracked).
    tracking.attach_to_source_run(source, writer.path, folder="predictions")
    return writer.path


if __name__ == "__main__":
    entry.main("predict", predict, TASK)
