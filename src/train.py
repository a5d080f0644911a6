"""``python -m src.train [overrides]``: fit, test the best checkpoint, report.

Returns the metric named by ``optimized_metric`` so Hydra sweepers can optimise it.
"""

import re
import warnings
from pathlib import Path

import lightning.pytorch as L
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from src.task import TASK
from src.template import checkpoint, entry, reporting, sweep_run, sweeps, tracking
from src.template.config import as_config_error, check_keys, check_sections
from src.template.distributed import srun_starts_ranks, use_sync_batchnorm
from src.template.resume import SeedEachBatch
from src.template.shutdown import run_lifecycle
from src.template.sweeps import in_multirun, run_sweep_job_in_own_process
from src.template.task import Task
from src.template.trainer import build_callbacks, build_trainer, check_settings


def train(cfg: DictConfig, task: Task) -> float | None:
    world_size = check_settings(cfg, fitting=True)
    data_class = task.datamodule_class(cfg.data.name)
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    check_keys("data", cfg.data, data_class)
    check_sections(cfg, task.config_targets(model_cfg))
    weights = checkpoint.read_weights(cfg)  # weights_from=: a new job from a checkpoint's weights
    out = Path(cfg.paths.output_dir)
    earlier = sweeps.earlier_run(out, cfg.ckpt_path)  # the same job run again in its folder
    if earlier and "result" in earlier:
        print(f"{out}: this job finished in an earlier run; its result is read back")
        return earlier["result"]
    if in_multirun() and world_size > 1 and not srun_starts_ranks(world_size):
        return run_sweep_job_in_own_process(cfg.optimized_metric)  # see src/template/sweeps.py
    # ckpt_path=auto: last.ckpt, if any; a sweep job run again resumes so by default.
    requested = cfg.ckpt_path or ("auto" if earlier is not None else None)
    ckpt_path = checkpoint.resume_path(requested, out)
    resume = checkpoint.read_checkpoint(ckpt_path) if ckpt_path else None
    finished_run = None  # a finished job's run: never reopened
    if resume:  # the same job, or refused; a finished one is read back or lengthened
        checkpoint.check_same_job(resume, cfg, ckpt_path)
        finished_run = finished_job_run(resume, cfg, ckpt_path)
        if finished_run is not None and checkpoint.nothing_left_to_train(resume, cfg.trainer):
            folder = Path(ckpt_path).parent.parent
            say(
                f"{folder}: this job finished; its result is read back (metrics.json). "
                "To train it longer, raise trainer.max_epochs"
            )
            reporting.remove_attempt_record()  # a folder Hydra made for nothing
            return sweeps.finished_result(folder, cfg.optimized_metric)
    elif requested == "auto":
        say_auto_started_fresh(out)
    seed = L.seed_everything(cfg.seed, workers=True, verbose=False)
    # Everything that can be checked is checked before a run or a rank process exists.
    datamodule = data_class(**OmegaConf.to_container(cfg.data, resolve=True))
    datamodule.prepare_data()
    datamodule.load()  # train, validation and test splits
    with as_config_error("model"):
        model = task.build_model(model_cfg, datamodule)
    if weights:
        checkpoint.load_weights(model, weights, Path(cfg.weights_from).name)
    if ckpt_path and Path(ckpt_path).parent == out / "checkpoints":  # Lightning's warning: moot
        warnings.filterwarnings("ignore", f"Checkpoint directory {re.escape(str(out))}.* is not")
    if resume:
        checkpoint.check_fits(resume, model, datamodule, ckpt_path)
    if finished_run is None:
        continue_run = tracking.run_to_continue(resume, cfg, auto=requested == "auto")
        loggers = tracking.build_loggers(cfg, continue_run=continue_run)
    else:
        say(
            f"{Path(ckpt_path).parent.parent}: this job finished; it trains on into a new MLflow "
            f"run (tag continues_run={finished_run}), its finished run left as it was"
        )
        tags = {"continues_run": finished_run} if finished_run else {}
        loggers = tracking.build_loggers(cfg, extra_tags=tags)
    sweeps.record_job(out)  # it starts: run again in its folder, it resumes
    reporting.show_config(cfg)
    callbacks = build_callbacks(cfg, monitor=(task.monitor, task.mode))
    callbacks += [SeedEachBatch(seed), *tracking.callbacks(loggers, cfg)]
    settings = checkpoint.settings_to_record(cfg, seed, resume)
    callbacks.append(checkpoint.JobRecord(settings, checkpoint.job_overrides()))
    sync_bn = use_sync_batchnorm(cfg.strategy.sync_batchnorm, model, cfg.accelerator)
    trainer = build_trainer(cfg, loggers, callbacks, fitting=True, sync_batchnorm=sync_bn)
    with tracking.sending(loggers, cfg), run_lifecycle(trainer):
        tracking.log_config(loggers, cfg, trainer)
        if finished_run and cfg.logger.get("continue_run", True):  # false: only its own epochs
            tracking.copy_history(loggers, cfg, finished_run, checkpoint.epochs_done(resume))
        trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
        metrics = {name: float(value) for name, value in trainer.callback_metrics.items()}
        # The best checkpoint by the monitored metric; without validation, the last one.
        best = trainer.checkpoint_callback.best_model_path or str(out / "checkpoints/last.ckpt")
        tested = trainer.test(model, datamodule=datamodule, ckpt_path=best, verbose=False)[0]
        metrics.update(tested)
        reporting.report_metrics(metrics, out)
        figures = reporting.figures(task, model, datamodule, out / "figures")
        tracking.log_outcome(loggers, datamodule, out, best, figures)
        # The test metrics' step (the epoch count): MLflow links them to the model.
        tracking.log_model(
            loggers, cfg.logger, task, model, datamodule, out, trainer.current_epoch, list(tested)
        )
    sweeps.record_job(out, result=metrics.get(cfg.optimized_metric))
    sweep_run.summarize(cfg, task.mode)  # a sweep job: the sweep's parent run, updated
    return metrics.get(cfg.optimized_metric)


def finished_job_run(saved: dict, cfg: DictConfig, ckpt_path: str) -> str | None:
    """If the checkpoint's job finished: its run's id ("" if unknown); else None (the job goes on
    in its own run). Its folder's job.json says (the result is written last); a folder without
    one (a checkpoint moved, or older than job.json) asks whether its MLflow run FINISHED."""
    folder = Path(ckpt_path).parent.parent
    if (folder / sweeps.JOB_FILE).is_file():
        if not sweeps.job_finished(folder):
            return None  # Lightning ends the run FINISHED after fit, before testing: not done
        return (saved.get("mlflow") or {}).get("run_id", "")
    return tracking.finished_run(saved, cfg)


@rank_zero_only
def say(line: str) -> None:
    """One line on stdout, from rank 0 only (rank processes run this module again)."""
    print(line)


@rank_zero_only
def say_auto_started_fresh(out: Path) -> None:
    """``ckpt_path=auto`` in a folder Hydra just made finds nothing: say so, and how to continue
    this job next time (the same folder)."""
    if sweeps.sweep_job() is None and not any(
        override.startswith("hydra.run.dir=") for override in HydraConfig.get().overrides.hydra
    ):
        last = out / "checkpoints" / "last.ckpt"
        print(
            f"ckpt_path=auto: {out} is a new folder, with no last.ckpt: this job starts fresh. "
            f"To continue it after a stop, add hydra.run.dir={out} ckpt_path=auto "
            f"(or ckpt_path={last})"
        )


if __name__ == "__main__":
    entry.main("train", train, TASK)
