"""``python -m src.eval ckpt_path=PATH [split=test|val]``: evaluate a checkpoint and report.

With MLflow, the evaluation is a run of its own, tagged with (and, in the same store, nested
under) the training run the checkpoint came from.
"""

from omegaconf import DictConfig

from src.task import TASK
from src.template import entry
from src.template.job import CheckpointJob
from src.template.task import Task


def evaluate(cfg: DictConfig, task: Task) -> dict[str, float]:
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


if __name__ == "__main__":
    entry.main("eval", evaluate, TASK)
