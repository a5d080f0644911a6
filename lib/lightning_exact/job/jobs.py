"""A job from its config: checked once, planned (where it starts, or that it has nothing left to
do), built (its data and model), and given its Trainer. What the entry points speak to, so that
each reads as compose → plan → build → run → record (docs/layout.md)."""

import re
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger
from omegaconf import DictConfig, OmegaConf, open_dict

from lightning_exact.checkpoints import checkpoint
from lightning_exact.checkpoints.resume import LoggedSoFar, SeedEachBatch
from lightning_exact.job import reporting
from lightning_exact.job.config import (
    as_config_error,
    check_choice,
    check_keys,
    check_sections,
    typed_keys,
)
from lightning_exact.job.settings import JobSettings
from lightning_exact.job.start import Start, where_to_start
from lightning_exact.sweeps import jobs as sweeps
from lightning_exact.task import Task
from lightning_exact.tracking import sweep_run
from lightning_exact.tracking.tracked_run import TrackedRun
from lightning_exact.training import steps
from lightning_exact.training.distributed import check_shardable
from lightning_exact.training.exact import ExactTraining, make_exact
from lightning_exact.training.precision import model_init_context
from lightning_exact.training.trainer import build_callbacks, build_trainer, check_settings


class TrainingJob:
    """``python -m src.train``'s job: its checks, where it starts, its data, model and Trainer,
    and its result recorded in its folder (a job run again there resumes or reads it back)."""

    def __init__(
        self,
        cfg: DictConfig,
        task: Task,
        settings: JobSettings,
        model_cfg: dict[str, Any],
        weights: dict | None,
    ) -> None:
        self.cfg = cfg
        self.task = task
        self.settings = settings  # computed once: what lower layers take instead of ``cfg``
        self.model_cfg = model_cfg  # resolved: what the task builds the model from
        self.weights = weights  # weights_from=: a new job from a checkpoint's weights
        self.output_dir = settings.output_dir
        self.start = Start()
        self.done = False  # nothing left to do here: ``result`` is the job's
        self.result: float | None = None
        self.seed: int | None = None

    @classmethod
    def plan(cls, cfg: DictConfig, task: Task) -> "TrainingJob":
        """Every check that needs no data, then where the job starts: fresh, from a checkpoint of
        the same job, or nowhere (finished earlier, or run in a process of its own)."""
        settings = check_settings(cfg, fitting=True)
        check_keys("data", cfg.data, task.datamodule_class(cfg.data.name))
        model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
        check_sections(cfg, task.config_targets(model_cfg))
        job = cls(cfg, task, settings, model_cfg, checkpoint.read_weights(cfg))
        earlier = sweeps.earlier_run(job.output_dir, cfg.ckpt_path)  # the same job run again
        if earlier and "result" in earlier:
            print(f"{job.output_dir}: this job finished in an earlier run; its result is read back")
            return job.finished(earlier["result"])
        if sweeps.in_multirun() and settings.world_size > 1 and settings.launcher != "srun":
            # A DDP job of a local sweep: see lib/lightning_exact/sweeps/jobs.py
            return job.finished(sweeps.run_sweep_job_in_own_process(cfg.optimized_metric))
        job.start = where_to_start(cfg, settings, ran_before=earlier is not None)
        if job.start.read_back:  # a finished job with nothing left to train
            return job.finished(job.start.result)
        return job

    @property
    def ckpt_path(self) -> str | None:
        """The checkpoint ``trainer.fit`` resumes from; None: a fresh start."""
        return self.start.ckpt_path

    def finished(self, result: float | None) -> "TrainingJob":
        self.done = True
        self.result = result
        return self

    def build(self) -> tuple[L.LightningModule, L.LightningDataModule]:
        """The seeded data (every split loaded) and model, its layers made exact at any world
        size (``strategy.exact``), checked against the checkpoint it resumes from: bad data or a
        checkpoint of another job fails here, before any run or rank process exists."""
        cfg = self.cfg
        self.seed = L.seed_everything(cfg.seed, workers=True, verbose=False)
        data_class = self.task.datamodule_class(cfg.data.name)
        datamodule = data_class(**OmegaConf.to_container(cfg.data, resolve=True))
        datamodule.prepare_data()
        datamodule.copies_to_read = self.settings.copies_to_read  # said before reading
        datamodule.load()  # train, validation and test splits
        if check_world_size := getattr(datamodule, "check_world_size", None):
            check_world_size(self.settings.world_size)  # the data contract's; other modules: none
        with as_config_error("model"), model_init_context(cfg.trainer.get("precision")):
            model = self.task.build_model(self.model_cfg, datamodule)
        check_shardable(cfg.strategy.name, model, self.task.sharded_blocks)  # the task's types
        if cfg.strategy.exact:  # devices=N trains what devices=1 trains (and ExactTraining)
            make_exact(model)
        if self.weights:
            checkpoint.load_weights(model, self.weights, Path(cfg.weights_from).name)
        if self.start.saved:
            checkpoint.check_fits(self.start.saved, model, datamodule, self.start.ckpt_path)
        return model, datamodule

    def tracked_run(self) -> TrackedRun:
        """The job's run: a new one, the one its checkpoint recorded into, or, for a finished job
        trained on, a new one after it (see :meth:`TrackedRun.for_training`)."""
        return TrackedRun.for_training(self.cfg, self.settings, self.start)

    def begin(self) -> None:
        """The job starts: ``job.json`` in its folder says so (run again there, it resumes) and
        its config is shown and written (``config.yaml``)."""
        sweeps.record_job(self.output_dir)
        reporting.show_config(self.cfg)

    def fit_trainer(self, model: L.LightningModule, run: TrackedRun) -> L.Trainer:
        """The Trainer that fits ``model``: the template's callbacks (checkpoints, stop signals,
        per-batch seeding, the job's record in each checkpoint) and the run's."""
        cfg = self.cfg
        out = self.output_dir
        if self.ckpt_path and Path(self.ckpt_path).parent == out / "checkpoints":  # moot
            warnings.filterwarnings(
                "ignore", f"Checkpoint directory {re.escape(str(out))}.* is not"
            )
        recorded = checkpoint.settings_to_record(cfg, self.seed, self.start.saved)
        callbacks: list[Callback] = [
            *build_callbacks(cfg.callbacks, out, monitor=(self.task.monitor, self.task.mode)),
            SeedEachBatch(self.seed, per_rank=not cfg.strategy.exact),
            *([ExactTraining()] if cfg.strategy.exact else []),  # checked on the first batch
            LoggedSoFar(self.start.logged),
            *run.training_callbacks(),
            checkpoint.JobRecord(recorded, checkpoint.job_overrides()),
        ]
        return build_trainer(
            cfg,
            self.settings,
            run.loggers,
            callbacks,
            fitting=True,
            resumes=self.ckpt_path is not None,
            steps_its_own=not model.automatic_optimization,
        )

    def fitted_metrics(self, trainer: L.Trainer) -> dict[str, float]:
        """The last value of each metric the job logged while fitting, also before a stop (not
        the step axis's keys), and the best checkpoint's score (``<monitor>_best``): what the
        uninterrupted job reports. Kept in ``job.json`` until the job has its result: one
        stopped in its test resumes with them (start.py)."""
        logged = next(c for c in trainer.callbacks if isinstance(c, LoggedSoFar)).record(trainer)
        if isinstance(best := trainer.checkpoint_callback, checkpoint.BestCheckpoint):
            logged.update(best.best_so_far())  # the best checkpoint's score: <monitor>_best
        sweeps.record_job(self.output_dir, fitted=sweeps.fit_record(trainer.global_step, logged))
        return logged

    @staticmethod
    def test(
        trainer: L.Trainer, model: L.LightningModule, datamodule: L.LightningDataModule, best: str
    ) -> dict[str, float]:
        """The test metrics of the ``best`` checkpoint (logged at the job's last step)."""
        tested = trainer.test(model, datamodule=datamodule, ckpt_path=best, verbose=False)[0]
        return steps.without_position(tested)

    def best_checkpoint(self, trainer: L.Trainer) -> str:
        """The best checkpoint by the monitored metric; without validation, or for a task
        without a metric (``Task.monitor=None``), the last one."""
        last = self.output_dir / "checkpoints/last.ckpt"
        best = trainer.checkpoint_callback
        found = best.best_model_path if isinstance(best, checkpoint.BestCheckpoint) else ""
        return found or str(last)

    def report_outcome(
        self,
        metrics: dict[str, float],
        model: L.LightningModule,
        datamodule: L.LightningDataModule,
        best: str,
    ) -> tuple[L.LightningModule, list[Path]]:
        """After fit and test: ``metrics.json``, then the model whole on rank 0 (FSDP's weights
        gathered from ``best``) and the task's figures of it."""
        reporting.report_metrics(metrics, self.output_dir, best_checkpoint=best)
        model = checkpoint.whole_model(model, best, self.task)
        figures = reporting.figures(self.task, model, datamodule, self.output_dir / "figures")
        return model, figures

    def record_result(self, metrics: dict[str, float]) -> float | None:
        """The job's result (``optimized_metric``) in its folder and, for a sweep job, in the
        sweep's parent run; returned for Hydra's sweepers."""
        result = metrics.get(self.cfg.optimized_metric)
        sweeps.record_job(self.output_dir, result=result)
        sweep_run.summarize(self.cfg, self.task.mode)
        return result


class CheckpointJob:
    """``src.eval``'s and ``src.predict``'s job: a checkpoint's model, its data and its MLflow
    run (``source``, if it was tracked)."""

    def __init__(
        self,
        cfg: DictConfig,
        settings: JobSettings,
        model: L.LightningModule,
        datamodule: L.LightningDataModule,
        source: dict[str, str] | None,
    ) -> None:
        self.cfg = cfg
        self.settings = settings
        self.model = model
        self.datamodule = datamodule
        self.source = source
        self.split = cfg.split
        self.output_dir = settings.output_dir

    @classmethod
    def from_checkpoint(
        cls, cfg: DictConfig, task: Task, splits: tuple[str, ...]
    ) -> "CheckpointJob":
        """The checked settings (``split`` one of ``splits``), then the seeded checkpoint's model
        and data module; ``cfg.data`` becomes the data settings used (the checkpoint's, but for
        keys typed)."""
        check_choice("split", cfg.split, splits)
        settings = check_settings(cfg, fitting=False)
        check_keys("data", cfg.data, task.datamodule_class(cfg.data.name))
        L.seed_everything(cfg.seed, workers=True, verbose=False)
        data = OmegaConf.to_container(cfg.data, resolve=True)
        loaded = checkpoint.load_for_inference(cfg.ckpt_path, data, typed_keys("data"), task)
        model, datamodule, source = loaded
        check_shardable(cfg.strategy.name, model, task.sharded_blocks)
        with open_dict(cfg):
            cfg.data = OmegaConf.create(dict(datamodule.hparams))
        return cls(cfg, settings, model, datamodule, source)

    def load_data(self, stage: str) -> None:
        """The data of ``stage`` (Lightning's: test, validate, predict) read now: bad data fails
        before any run exists."""
        if stage == "predict":
            self.datamodule.predict_split = self.split
        self.datamodule.prepare_data()
        self.datamodule.copies_to_read = self.settings.copies_to_read  # said before reading
        self.datamodule.load(stage)

    def evaluation_run(self) -> TrackedRun:
        """An evaluation's own run, linked to (and in the same store nested under) the training
        run the checkpoint came from."""
        return TrackedRun.for_checkpoint(self.cfg, self.settings, self.source)

    def begin(self) -> None:
        """The config used is shown and written (``config.yaml``)."""
        reporting.show_config(self.cfg)

    def eval_trainer(self, loggers: list[Logger], callbacks: Sequence[Callback] = ()) -> L.Trainer:
        """The Trainer with the template's callbacks and ``callbacks``."""
        template = build_callbacks(self.cfg.callbacks, self.output_dir, monitor=None)
        callbacks = [*template, *callbacks]
        return build_trainer(self.cfg, self.settings, loggers, callbacks, fitting=False)

    def attach_to_source_run(self, path: Path, folder: str) -> None:
        """A file it wrote (predictions) also goes to the checkpoint's training run, if tracked."""
        TrackedRun.attach_to(self.source, path, folder)

    def report_results(self, metrics: dict[str, Any]) -> None:
        reporting.report_metrics(metrics, self.output_dir)
