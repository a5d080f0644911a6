"""``python -m src.train [overrides]``: fit, test the best checkpoint, report.

Returns the metric named by ``optimized_metric`` so Hydra sweepers can optimise it.
"""

from omegaconf import DictConfig

from src.task import TASK
from src.template import entry
from src.template.job import TrainingJob
from src.template.task import Task


def train(cfg: DictConfig, task: Task) -> float | None:
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
        # The test metrics' step (the last global step): MLflow links them to the model.
        step = trainer.global_step
        run.record_outcome(task, model, datamodule, best, figures, step, list(tested))
    return job.record_result(metrics)


if __name__ == "__main__":
    entry.main("train", train, TASK)
