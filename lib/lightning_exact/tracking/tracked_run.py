"""A job's run record as one object: its loggers (the MLflow run, TensorBoard, CSV, extra), the
callbacks that keep the run's books, and ``with run.recording(trainer):`` around the Trainer's
work, which records the config, sends the records and ends the run FINISHED, FAILED or KILLED."""

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning.pytorch as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger
from omegaconf import DictConfig

from lightning_exact.checkpoints.shutdown import run_lifecycle
from lightning_exact.job.settings import JobSettings
from lightning_exact.job.start import Start, say
from lightning_exact.task import Task
from lightning_exact.tracking import outcome, run
from lightning_exact.training.steps import saved_step


class TrackedRun:
    """The loggers of one job and what it records into them; ``history``: the (finished run,
    last step copied) whose points a lengthened job's new run starts with."""

    def __init__(
        self,
        cfg: DictConfig,
        settings: JobSettings,
        loggers: list[Logger],
        history: tuple[str, int] | None = None,
    ) -> None:
        self.cfg = cfg
        self.settings = settings
        self.loggers = loggers
        self.history = history

    @classmethod
    def for_training(cls, cfg: DictConfig, settings: JobSettings, start: Start) -> "TrackedRun":
        """A new run, or the one the resumed checkpoint recorded into; a finished job trained on
        (lengthened) records into a new run that starts with the finished run's points."""
        if start.finished_run is None:
            continue_run = run.run_to_continue(start.saved, cfg.logger, settings, auto=start.auto)
            resumed = {run.RESUMED_TAG: str(saved_step(start.saved))} if start.saved else {}
            loggers = run.build_loggers(cfg, settings, resumed, continue_run=continue_run)
            return cls(cfg, settings, loggers)
        say(
            f"{Path(start.ckpt_path).parent.parent}: this job finished; it trains on into a new "
            f"MLflow run (tag continues_run={start.finished_run}), its finished run left as it was"
        )
        tags = {"continues_run": start.finished_run} if start.finished_run else {}
        loggers = run.build_loggers(cfg, settings, extra_tags=tags)
        history = None
        if start.finished_run and cfg.logger.get("continue_run", True):  # false: its own steps
            history = (start.finished_run, saved_step(start.saved))
        return cls(cfg, settings, loggers, history)

    @classmethod
    def for_checkpoint(
        cls, cfg: DictConfig, settings: JobSettings, source: Mapping[str, str] | None
    ) -> "TrackedRun":
        """An evaluation's own run, tagged with (in the same store: nested under) ``source``,
        the training run its checkpoint came from."""
        tags = outcome.source_tags(source, cfg.ckpt_path, cfg.logger.get("tracking_uri", ""))
        return cls(cfg, settings, run.build_loggers(cfg, settings, extra_tags=tags))

    def training_callbacks(self) -> list[Callback]:
        """The run's bookkeeping in checkpoints, and system metrics (one sampler per node)."""
        return run.callbacks(self.loggers, self.cfg.logger, self.settings.output_dir)

    @contextmanager
    def recording(self, trainer: L.Trainer) -> Iterator[None]:
        """Around the Trainer's work: stop signals handled, the config logged as params (and a
        lengthened job's history copied), the records sent; the run never left RUNNING."""
        send_timeout_s = self.cfg.logger.get("send_timeout_s", 0)
        with run.sending(self.loggers, send_timeout_s), run_lifecycle(trainer):
            run.log_config(self.loggers, self.cfg, trainer)
            if self.history:
                uri = self.cfg.logger.get("tracking_uri", "")  # none for logger=csv
                run.copy_history(self.loggers, uri, *self.history)
            yield

    def record_outcome(
        self,
        task: Task,
        model: L.LightningModule,
        datamodule: Any,
        best_checkpoint: str,
        figures: list[Path],
        step: int,
        metrics: Sequence[str],
    ) -> None:
        """After training: the data read, the files (config, metrics, best checkpoint, figures)
        and the task's exported model, logged at ``step`` with its final ``metrics``."""
        out = self.settings.output_dir
        outcome.log_outcome(self.loggers, datamodule, out, best_checkpoint, figures)
        outcome.log_model(
            self.loggers, self.cfg.logger, task, model, datamodule, out, step, metrics
        )

    @staticmethod
    def attach_to(source: Mapping[str, str] | None, path: Path, folder: str) -> None:
        """A file (predictions) added to the training run ``source``, if the checkpoint had one."""
        outcome.attach_to_source_run(source, path, folder)
