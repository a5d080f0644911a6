"""``python -m src.predict ckpt_path=PATH [split=test|val|train]``: write a predictions CSV.

The CSV has one row per sample in dataset order, with the columns the task reports (here: index
in the official file, true label, predicted label, its class name, confidence); its path is
printed at the end. ``inputs=...`` hands new inputs (paths, a glob, a string: whatever the task
reads) to the task's own reader instead (``predictions_inputs.csv``); the image task also takes
them as ``images=DIR_OR_GLOB`` (path, predicted label, class name, confidence).
"""

from pathlib import Path

from omegaconf import DictConfig, ListConfig

from src.task import TASK
from src.template import entry, reporting
from src.template.config import ConfigError
from src.template.job import CheckpointJob
from src.template.task import Task


def predict(cfg: DictConfig, task: Task) -> Path:
    if cfg.get("inputs") is not None:  # new, unlabelled inputs: the task's own reader
        if cfg.get("images") is not None and cfg.inputs != cfg.images:
            raise ConfigError(
                f"images={cfg.images} and inputs={cfg.inputs} together: images= is the image "
                "task's name for inputs=; give one"
            )
        if task.predict_inputs is None:
            raise ConfigError(
                f"inputs={cfg.inputs}: this task predicts its data splits only (split=test, val "
                "or train); Task.predict_inputs in src/task/__init__.py would read new inputs"
            )
        if isinstance(cfg.inputs, ListConfig):
            raise ConfigError(
                f"inputs={list(cfg.inputs)} is a list; give one value, as the task's reader "
                "takes it: a path, a folder, a glob or a string"
            )
        out = Path(cfg.paths.output_dir) / "predictions_inputs.csv"
        return task.predict_inputs(cfg.ckpt_path, str(cfg.inputs), out, task)
    if task.predictions is None:
        raise ConfigError(
            "this task writes no predictions of a data split (Task.predictions in "
            "src/task/__init__.py would)"
            + ("; give new inputs with inputs=..." if task.predict_inputs else "")
        )
    job = CheckpointJob.from_checkpoint(cfg, task, splits=("test", "val", "train"))
    job.load_data("predict")  # bad data fails now
    job.begin()  # config.yaml shown and written
    path = job.output_dir / f"predictions_{job.split}.csv"
    writer = reporting.PredictionWriter(path, task.predictions, job.datamodule)
    trainer = job.eval_trainer(loggers=[], callbacks=[writer])
    trainer.predict(job.model, datamodule=job.datamodule, return_predictions=True)
    job.report_results(writer.metrics)
    reporting.show_written("predictions", writer.path)
    # The CSV also goes to the training run the checkpoint came from (if it was tracked).
    job.attach_to_source_run(writer.path, folder="predictions")
    return writer.path


if __name__ == "__main__":
    entry.main("predict", predict, TASK)
