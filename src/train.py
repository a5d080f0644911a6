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
from src.template.distributed import check_shardable, srun_starts_ranks, use_sync_batchnorm
from src.template.resume import SeedEachBatch
from src.template.shutdown import run_lifecycle
from src.template.start import say, where_to_start
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
    start = where_to_start(cfg, out, ran_before=earlier is not None)
    if start.read_back:  # a finished job with nothing left to train
        return start.result
    seed = L.seed_everything(cfg.seed, workers=True, verbose=False)
    # Everything that can be checked is checked before a run or a rank process exists.
    datamodule = data_class(**OmegaConf.to_container(cfg.data, resolve=True))
    datamodule.prepare_data()
    datamodule.load()  # train, validation and test splits
    with as_config_error("model"):
        model = task.build_model(model_cfg, datamodule)
    check_shardable(cfg.strategy.name, model, task.sharded_blocks)
    if weights:
        checkpoint.load_weights(model, weights, Path(cfg.weights_from).name)
    if start.ckpt_path and Path(start.ckpt_path).parent == out / "checkpoints":  # moot warning
        warnings.filterwarnings("ignore", f"Checkpoint directory {re.escape(str(out))}.* is not")
    if start.saved:
        checkpoint.check_fits(start.saved, model, datamodule, start.ckpt_path)
    if start.finished_run is None:
        continue_run = tracking.run_to_continue(start.saved, cfg, auto=start.auto)
        loggers = tracking.build_loggers(cfg, continue_run=continue_run)
    else:
        say(
            f"{Path(start.ckpt_path).parent.parent}: this job finished; it trains on into a new "
            f"MLflow run (tag "
            f"continues_run={start.finished_run}), its finished run left as it was"
        )
        tags = {"continues_run": start.finished_run} if start.finished_run else {}
        loggers = tracking.build_loggers(cfg, extra_tags=tags)
    sweeps.record_job(out)  # it starts: run again in its folder, it resumes
    reporting.show_config(cfg)
    callbacks = build_callbacks(cfg, monitor=(task.monitor, task.mode))
    callbacks += [SeedEachBatch(seed), *tracking.callbacks(loggers, cfg)]
    settings = checkpoint.settings_to_record(cfg, seed, start.saved)
    callbacks.append(checkpoint.JobRecord(settings, checkpoint.job_overrides()))
    sync_bn = use_sync_batchnorm(cfg.strategy.sync_batchnorm, model, cfg.accelerator)
    trainer = build_trainer(cfg, loggers, callbacks, fitting=True, sync_batchnorm=sync_bn)
    with tracking.sending(loggers, cfg), run_lifecycle(trainer):
        tracking.log_config(loggers, cfg, trainer)
        if start.finished_run and cfg.logger.get("continue_run", True):  # false: its own epochs
            epochs = checkpoint.epochs_done(start.saved)
            tracking.copy_history(loggers, cfg, start.finished_run, epochs)
        trainer.fit(model, datamodule=datamodule, ckpt_path=start.ckpt_path)
        metrics = {name: float(value) for name, value in trainer.callback_metrics.items()}
        # The best checkpoint by the monitored metric; without validation, the last one.
        best = trainer.checkpoint_callback.best_model_path or str(out / "checkpoints/last.ckpt")
        tested = trainer.test(model, datamodule=datamodule, ckpt_path=best, verbose=False)[0]
        metrics.update(tested)
        reporting.report_metrics(metrics, out, best_checkpoint=best)
        model = checkpoint.whole_model(model, best, task)  # rank 0: FSDP's weights, gathered
        figures = reporting.figures(task, model, datamodule, out / "figures")
        tracking.log_outcome(loggers, datamodule, out, best, figures)
        # The test metrics' step (the epoch count): MLflow links them to the model.
        tracking.log_model(
            loggers,
            cfg.logger,
            task,
            model,
            datamodule,
            out,
            trainer.current_epoch,
            list(tested),
        )
    sweeps.record_job(out, result=metrics.get(cfg.optimized_metric))
    sweep_run.summarize(cfg, task.mode)  # a sweep job: the sweep's parent run, updated
    return metrics.get(cfg.optimized_metric)


if __name__ == "__main__":
    entry.main("train", train, TASK)
