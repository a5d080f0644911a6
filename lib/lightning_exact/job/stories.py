"""What each entry point does, step by step: ``train`` (``python -m src.train``), ``evaluate``
(``python -m src.eval``) and ``predict`` (``python -m src.predict``). A project's entry points
hand their task to :func:`lightning_exact.job.entry.main`, which composes the config and runs
the story of that name; a project that needs another story passes its own function there."""

from pathlib import Path

from omegaconf import DictConfig, ListConfig

from lightning_exact.job import reporting
from lightning_exact.job.config import ConfigError
from lightning_exact.job.jobs import CheckpointJob, TrainingJob
from lightning_exact.task import Task
from lightning_exact.training import steps


def train(cfg: DictConfig, task: Task) -> float | None:
    """Fit, test the best checkpoint, report; the ``optimized_metric`` for Hydra's sweepers."""
    job = TrainingJob.plan(cfg, task)  # every check that needs no data; where the job starts
    if job.done:  # finished in an earlier run (its result read back), or run in its own process
        return job.result
    model, datamodule = job.build()  # bad data or a checkpoint of another job fails here
    run = job.tracked_run()  # the loggers: a new MLflow run, or the one the checkpoint continues
    job.begin()  # job.json (run again in its folder, it resumes); config.yaml shown and written
    trainer = job.fit_trainer(model, run)
    with run.recording(trainer):  # config as params; the run ends FINISHED, FAILED or KILLED
        trainer.fit(model, datamodule=datamodule, ckpt_path=job.ckpt_path)
        metrics = job.fitted_metrics(trainer)  # the last value of each metric logged
        best = job.best_checkpoint(trainer)
        tested = job.test(trainer, model, datamodule, best)
        metrics.update(tested)
        # metrics.json; on rank 0 the model whole (FSDP's weights gathered) and its figures
        model, figures = job.report_outcome(metrics, model, datamodule, best)
        # The test metrics' step (the job's last): MLflow links them to the model.
        step = steps.logged_step(trainer)
        run.record_outcome(task, model, datamodule, best, figures, step, list(tested))
    return job.record_result(metrics)


def evaluate(cfg: DictConfig, task: Task) -> dict[str, float]:
    """A checkpoint's test (or ``split=val``) metrics. With MLflow, a run of its own, tagged with
    (and, in the same store, nested under) the training run the checkpoint came from."""
    # Checked settings, then the checkpoint's model and data settings.
    job = CheckpointJob.from_checkpoint(cfg, task, splits=("test", "val"))
    job.load_data({"test": "test", "val": "validate"}[cfg.split])  # bad data fails now
    run = job.evaluation_run()  # a run of its own, linked to the checkpoint's training run
    job.begin()  # config.yaml shown and written
    trainer = job.eval_trainer(run.loggers)
    run_loop = {"test": trainer.test, "val": trainer.validate}[cfg.split]
    with run.recording(trainer):  # config as params; the run ends FINISHED, FAILED or KILLED
        metrics = run_loop(job.model, datamodule=job.datamodule, verbose=False)[0]
        job.report_results(metrics)
    return metrics


def predict(cfg: DictConfig, task: Task) -> Path:
    """A CSV of the task's predictions, one row per sample of a split in dataset order, or of
    new ``inputs=`` (paths, a glob, a string: whatever ``Task.predict_inputs`` reads); its path."""
    inputs_named_images(cfg)
    if cfg.get("inputs") is not None:  # new, unlabelled inputs: the task's own reader
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


def inputs_named_images(cfg: DictConfig) -> None:
    """``images=`` is ``inputs=`` by its name before 1.0: it still works through 1.x and says
    its new name in one line (removed in 2.0). Given both, neither is dropped quietly."""
    images = cfg.get("images")
    if images is None:
        return
    if cfg.get("inputs") is not None and cfg.inputs != images:
        raise ConfigError(f"images={images} and inputs={cfg.inputs} together: give inputs= only")
    reporting.show_warning(f"images= is now inputs= (images= goes in 2.0): inputs={images}")
    cfg.inputs = images


STORIES = {"train": train, "eval": evaluate, "predict": predict}  # config name -> its story
