"""``python -m src.train [overrides]``: fit, test the best checkpoint, report.

Returns the metric named by ``optimized_metric`` so Hydra sweepers can optimise it.
"""

import re
import warnings
from pathlib import Path

import lightning.pytorch as L
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
    out = Path(cfg.paths.output_dir)
    earlier = sweeps.earlier_run(out, cfg.ckpt_path)  # the same job run again in its folder
    if earlier and "result" in earlier:
        print(f"{out}: this job finished in an earlier run; its result is read back")
        return earlier["result"]
    if in_multirun() and world_size > 1 and not srun_starts_ranks(world_size):
        return run_sweep_job_in_own_process(cfg.optimized_metric)  # see src/template/sweeps.py
    seed = L.seed_everything(cfg.seed, workers=True, verbose=False)
    # Everything that can be checked is checked before a run or a rank process exists.
    datamodule = data_class(**OmegaConf.to_container(cfg.data, resolve=True))
    datamodule.prepare_data()
    datamodule.load()  # train, validation and test splits
    with as_config_error("model"):
        model = task.build_model(model_cfg, datamodule)
    # ckpt_path=auto: last.ckpt, if any; a sweep job run again resumes so by default.
    requested = cfg.ckpt_path or ("auto" if earlier is not None else None)
    ckpt_path = checkpoint.resume_path(requested, out)
    if ckpt_path and Path(ckpt_path).parent == out / "checkpoints":  # Lightning's warning: moot
        warnings.filterwarnings("ignore", f"Checkpoint directory {re.escape(str(out))}.* is not")
    resume = checkpoint.read_checkpoint(ckpt_path) if ckpt_path else None
    if resume:
        checkpoint.check_fits(resume, model, datamodule, ckpt_path)
    continue_run = tracking.run_to_continue(resume, cfg, auto=requested == "auto")
    loggers = tracking.build_loggers(cfg, continue_run=continue_run)
    sweeps.record_job(out, cfg.ckpt_path)  # it starts: run again in its folder, it resumes
    reporting.show_config(cfg)
    callbacks = build_callbacks(cfg, monitor=(task.monitor, task.mode))
    callbacks += [SeedEachBatch(seed), *tracking.callbacks(loggers, cfg)]
    sync_bn = use_sync_batchnorm(cfg.strategy.sync_batchnorm, model, cfg.accelerator)
    trainer = build_trainer(cfg, loggers, callbacks, fitting=True, sync_batchnorm=sync_bn)
    with tracking.sending(loggers, cfg), run_lifecycle(trainer):
        tracking.log_config(loggers, cfg, trainer)
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
    sweeps.record_job(out, cfg.ckpt_path, result=metrics.get(cfg.optimized_metric))
    sweep_run.summarize(cfg, task.mode)  # a sweep job: the sweep's parent run, updated
    return metrics.get(cfg.optimized_metric)


if __name__ == "__main__":
    entry.main("train", train, TASK)
