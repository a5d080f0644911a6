"""Assembles the Lightning ``Trainer`` (hardware, strategy, callbacks) from config."""

import time
import warnings
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as L
from hydra.utils import instantiate
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.callbacks import Callback, RichProgressBar, TQDMProgressBar
from lightning.pytorch.loggers import Logger
from lightning.pytorch.plugins import DoublePrecision, Precision
from lightning.pytorch.plugins.environments import SLURMEnvironment
from lightning.pytorch.profilers import PassThroughProfiler
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.model_summary import ModelSummary
from omegaconf import DictConfig, OmegaConf

from lightning_exact.checkpoints.checkpoint import (
    AtomicCheckpointIO,
    BestCheckpoint,
    LastCheckpoint,
)
from lightning_exact.checkpoints.resume import MidEpochState, silence_resume_warning
from lightning_exact.checkpoints.shutdown import StopOnSignal
from lightning_exact.data import DataError, per_device_batch_size
from lightning_exact.environment import quiet
from lightning_exact.job.config import ConfigError, as_config_error, check_count, check_keys
from lightning_exact.job.settings import JobSettings
from lightning_exact.private import forget_train_loader
from lightning_exact.training.distributed import (
    LogRankSetup,
    WatchedDDPStrategy,
    WatchedFSDPStrategy,
    check_devices,
)
from lightning_exact.training.precision import check_precision, trainer_precision
from lightning_exact.training.steps import GlobalStepAxis
from lightning_exact.training.train_points import TrainingPoints

# Trainer arguments that build_trainer sets from other config: key -> where to set it instead.
SET_BY_TEMPLATE = {
    **{key: f"the top-level key {key}" for key in ("accelerator", "devices", "num_nodes")},
    "strategy": "the strategy group (strategy=ddp)",
    "sync_batchnorm": "strategy.exact (BatchNorm over the global batch, on by default)",
    "logger": "the logger group (logger=mlflow|csv|none)",
    "callbacks": "the callbacks group (callbacks.extra for your own)",
    "enable_progress_bar": "callbacks.progress_bar",
    "enable_model_summary": "callbacks.model_summary_depth (model_summary.txt)",
    "default_root_dir": "paths.output_dir",
    "plugins": "the template (atomic checkpoint writes, SLURM)",
}


def check_global_batch(batch_size: int, world_size: int, resuming: bool) -> None:
    """Training splits the global batch equally over the ranks. A resume keeps its job's batch
    size (another would be another job): its refusal also names the world sizes that divide it,
    the ones to resume on (spot capacity)."""
    try:
        per_device_batch_size(batch_size, world_size)
    except DataError as error:
        if not resuming:
            raise
        below = max(n for n in range(1, world_size) if batch_size % n == 0)
        above = [n for n in range(world_size + 1, batch_size + 1) if batch_size % n == 0][:1]
        fits = " or ".join(map(str, [below, *above]))
        plural = "s" if [below, *above] != [1] else ""
        advice = f"a resume keeps its job's: resume it on {fits} rank{plural}"
        raise DataError(f"{error} ({advice})") from None


def check_settings(cfg: DictConfig, fitting: bool) -> JobSettings:
    """Refuse, before anything is written, settings that cannot work; for training also a global
    batch the world size does not divide (evaluation splits by samples). Returns the job's
    settings, computed once."""
    check_devices(cfg.accelerator, cfg.devices, cfg.num_nodes)
    settings = JobSettings.from_config(cfg)
    check_keys("trainer", cfg.trainer, L.Trainer, set_by=SET_BY_TEMPLATE)
    check_precision(cfg.trainer.get("precision"), on_cpu=cfg.accelerator == "cpu")
    if cfg.seed is not None:
        check_count("seed", cfg.seed, 0)
    check_count("data.batch_size", cfg.data.batch_size, 1)
    if fitting:
        if cfg.trainer.get("fast_dev_run"):  # Lightning then writes no checkpoint to test
            raise ConfigError(
                f"trainer.fast_dev_run={cfg.trainer.fast_dev_run} writes no checkpoint, and a job "
                "tests its best one: use debug=fast (a few batches of every stage, checkpoints "
                "written), with logger=none for no run"
            )
        check_length(cfg.trainer.max_epochs, cfg.trainer.max_steps, cfg.trainer.max_time)
        if (every := cfg.callbacks.checkpoint.get("every_n_train_steps")) is not None:
            check_count("callbacks.checkpoint.every_n_train_steps", every, 1)
        check_count("callbacks.stop_check_every_n_steps", cfg.callbacks.stop_check_every_n_steps, 1)
        check_global_batch(cfg.data.batch_size, settings.world_size, resuming=bool(cfg.ckpt_path))
    # A trial build: Lightning's own checks of the trainer values, before anything is written.
    # Quiet: the real build says the same (its info lines, its warnings) once.
    with (
        as_config_error("trainer"),
        quiet("lightning.pytorch.utilities.rank_zero"),
        warnings.catch_warnings(action="ignore"),
    ):
        trial = build_trainer(cfg, settings, [], [], fitting)
    on_cpu = isinstance(trial.accelerator, CPUAccelerator)  # accelerator=auto resolved
    check_precision(cfg.trainer.get("precision"), on_cpu=on_cpu)
    return settings


def check_length(max_epochs: Any, max_steps: Any, max_time: Any) -> None:
    """A job counted in epochs (``trainer.max_epochs``), in steps (``trainer.max_steps``, with
    ``max_epochs=-1``) or both (whichever ends it first), or by time: never without an end (a
    schedule is sized by it)."""
    if max_epochs not in (-1, None):
        check_count("trainer.max_epochs", max_epochs, 1)
    if max_steps != -1:
        check_count("trainer.max_steps", max_steps, 1)
    if max_epochs == -1 and max_steps == -1 and max_time is None:
        raise ConfigError(
            "trainer.max_epochs=-1 with trainer.max_steps=-1 trains without end: set "
            "trainer.max_steps=N to count the job in steps, or trainer.max_epochs=N"
        )


def build_callbacks(
    callbacks_cfg: DictConfig, output_dir: Path, monitor: tuple[str | None, str] | None
) -> list[Callback]:
    """From the ``callbacks`` section: rank setup log, stop on signal, progress bar and
    ``callbacks.extra`` (any callback by ``_target_``); when training (``monitor``: metric and
    mode; a metric of None: the task has none, only last.ckpt is kept) checkpoints and model
    summary in ``output_dir``."""
    # Training: a step's points are logged (their window closed) before a stop can end the job
    # at that step or a checkpoint saves the window's metric states.
    points = [TrainingPoints(), GlobalStepAxis()] if monitor else []
    stop = StopOnSignal(callbacks_cfg.stop_check_every_n_steps)
    callbacks: list[Callback] = [LogRankSetup((monitor[0] or "") if monitor else ""), *points, stop]
    bar = {"rich": RichBar, "tqdm": TqdmBar}.get(callbacks_cfg.progress_bar)
    callbacks += [bar()] if bar else []
    with as_config_error("callbacks.extra"):
        callbacks += [instantiate(spec) for spec in callbacks_cfg.get("extra", {}).values()]
    if monitor is None:
        return callbacks
    return [*callbacks, *checkpoints(callbacks_cfg, output_dir, *monitor)]


def checkpoints(
    callbacks_cfg: DictConfig, output_dir: Path, metric: str | None, mode: str
) -> list[Callback]:
    """The best checkpoint by ``metric`` (none: the task has no metric, the last checkpoint is
    its best), last.ckpt, the epoch's metric states in mid-epoch ones, and the model summary."""
    ckpt_dir = output_dir / "checkpoints"
    silence_resume_warning()
    every = callbacks_cfg.checkpoint.every_n_train_steps
    last = LastCheckpoint(dirpath=ckpt_dir, every_n_train_steps=every)
    summary = ModelSummaryFile(
        ckpt_dir.parent / "model_summary.txt", callbacks_cfg.model_summary_depth
    )
    if metric is None:
        return [last, MidEpochState(), summary]
    # The best is chosen at every validation, mid-epoch ones included; last.ckpt is written at
    # every epoch end, validation and stop (see checkpoint.py). The metric is named by hand: its
    # "/" would make folders (val/acc -> acc0.9176).
    best = BestCheckpoint(
        dirpath=ckpt_dir,
        filename=f"epoch{{epoch:03d}}-step{{step:06d}}-{metric.rsplit('/', 1)[-1]}{{{metric}:.4f}}",
        auto_insert_metric_name=False,
        monitor=metric,
        mode=mode,
        save_top_k=callbacks_cfg.checkpoint.save_top_k,
        save_on_train_epoch_end=False,
    )
    return [best, last, MidEpochState(), summary]


class ShowsLastEpoch(Callback):
    """A progress bar that ends showing the last epoch's metrics: those a LightningModule logs in
    ``on_train_epoch_end`` reach the bar only after every epoch-end hook (Lightning#19322), so
    it would show the epoch before's."""

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.on_train_epoch_end(trainer, pl_module)  # the bar's own refresh of its metrics
        super().on_train_end(trainer, pl_module)


class TqdmBar(ShowsLastEpoch, TQDMProgressBar):
    pass


class RichBar(ShowsLastEpoch, RichProgressBar):
    """Rich's bar, its training row updated at most every 0.1 s and at an epoch's last step:
    Lightning updates it, reading every metric, at every step (30 µs), and Rich redraws the
    screen once a second either way. A job counted in steps (``trainer.max_epochs=-1``) shows
    its epoch alone, not Lightning's "Epoch 0/-2"."""

    next_update_s = 0.0

    def _get_train_description(self, current_epoch: int) -> str:
        description = super()._get_train_description(current_epoch)
        if self.trainer.max_epochs == -1:
            description = description.replace(f"Epoch {current_epoch}/-2", f"Epoch {current_epoch}")
        return description

    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        now = time.monotonic()
        if now >= self.next_update_s or batch_idx + 1 >= self.total_train_batches:
            self.next_update_s = now + 0.1
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)


class ModelSummaryFile(Callback):
    """The model summary (layers, shapes, parameters, FLOPs) in the output folder, not on the
    console, written by rank 0 at the start of fitting. Every rank makes it: its example forward
    gathers a sharded (FSDP) model's weights, a collective that rank 0 alone would wait on. The
    example is converted as the Trainer converts a batch (Lightning's summary runs it as typed:
    float32 into a ``trainer.precision=64-true`` model fails)."""

    def __init__(self, path: Path, max_depth: int) -> None:
        self.path = path
        self.max_depth = max_depth

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        example = pl_module.example_input_array
        with trainer_precision(pl_module) as convert:
            pl_module.example_input_array = convert(example)
        try:
            summary = f"{ModelSummary(pl_module, max_depth=self.max_depth)}\n"
        finally:
            pl_module.example_input_array = example
        if trainer.is_global_zero:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(summary)


class Trainer(L.Trainer):
    """Lightning's Trainer; a job that ``resumes`` keeps its position when its model sizes a
    schedule with ``estimated_stepping_batches`` in ``configure_optimizers`` (Lightning's
    documented way): asked then, Lightning builds the training loader, and starts iterating it,
    before the checkpoint's loop state is restored (Lightning#20550), so a job resumed mid-epoch
    would train its epoch again from the first batch. That early loader is dropped here: the fit
    loop builds it again after the restore, at the restored position."""

    def __init__(self, *args: Any, resumes: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.resumes = resumes

    @property
    def estimated_stepping_batches(self) -> int | float:
        built_here = self.train_dataloader is None
        steps = super().estimated_stepping_batches
        if self.resumes and built_here and self.train_dataloader is not None:
            forget_train_loader(self)
        return steps


class NoProfiler(PassThroughProfiler):
    """Lightning's default, which profiles nothing, without a new context manager at each of the
    ~80 hook calls of a training step (a microsecond each); ``trainer.profiler`` (null here)
    replaces it."""

    def profile(self, action_name: str) -> AbstractContextManager:
        return nullcontext()


def watched_strategy(
    strategy: DictConfig, processes: int, steps_its_own: bool = False
) -> str | Strategy:
    """``strategy.name``: ddp (or auto for several processes) and fsdp as the template's watched
    strategies (a dead rank is named and its job ended); else Lightning's own by name."""
    launch = {
        "watch_s": strategy.watch_s,
        "exit_grace_s": strategy.exit_grace_s,
        "process_group_backend": strategy.process_group_backend,  # null: nccl on GPU, else gloo
        "timeout": timedelta(seconds=strategy.timeout_s),
    }
    if strategy.name == "ddp" or (strategy.name == "auto" and processes > 1):
        unused = find_unused_parameters(strategy.find_unused_parameters, steps_its_own)
        return WatchedDDPStrategy(**launch, find_unused_parameters=unused)
    if strategy.name == "fsdp":
        sharded = strategy.sharded_checkpoints
        return WatchedFSDPStrategy(**launch, ranks=processes, sharded_checkpoints=sharded)
    return strategy.name


def find_unused_parameters(setting: bool | None, steps_its_own: bool) -> bool:
    """DDP's ``find_unused_parameters``: as set, or (null) from the model. A model that steps its
    own optimizers (``automatic_optimization = False``: a GAN's generator and discriminator)
    toggles them (``toggle_optimizer``), so each backward leaves the other's parameters without
    gradients: DDP must find them at every backward (a walk of the autograd graph from the loss,
    and a small all-reduce of which parameters no rank used) or fail on every rank. DDP's static
    graph does not fit: it takes the parameters used in one backward for those of every one. A
    model Lightning optimizes uses every parameter in every step: none to find, no cost."""
    if setting is None:
        return steps_its_own
    if steps_its_own and not setting and rank_zero_only.rank == 0:
        print(
            "Note: strategy.find_unused_parameters=false with a model that steps its own "
            "optimizers: DDP fails on every rank if a backward leaves a parameter without a "
            "gradient (an optimizer toggled); null (the default) finds them"
        )
    return bool(setting)


def fsdp_double_precision(loop: dict[str, Any]) -> list[Precision]:
    """``trainer.precision=64-true`` under ``strategy=fsdp`` as Lightning's float64 plugin:
    Lightning's ``ModelParallelStrategy`` refuses the flag by name (its list of precisions leaves
    64-true out), though FSDP2 shards float64 weights as any others and the strategy converts the
    model with the plugin it is given (``tests/test_exact.py``: FSDP on 2 ranks equals one process
    to 1e-8 in float64). The flag is taken out of ``loop``."""
    if str(loop.get("precision")) not in ("64-true", "64"):
        return []
    del loop["precision"]
    return [DoublePrecision()]


def build_trainer(
    cfg: DictConfig,
    settings: JobSettings,
    loggers: list[Logger],
    callbacks: Sequence[Callback],
    fitting: bool,
    resumes: bool = False,
    steps_its_own: bool = False,
) -> L.Trainer:
    """A Trainer for ``cfg`` (checked by :func:`check_settings`): hardware from the top-level
    keys, loop settings from ``trainer``, DDP's search for unused parameters from the model
    (``steps_its_own``: it steps its own optimizers). Checkpoints are written atomically; where
    srun starts the ranks, Lightning does not requeue on SIGUSR1 (it would save mid-step and end
    the run): :class:`StopOnSignal` checkpoints and ``slurm/train.sbatch`` requeues."""
    strategy = watched_strategy(cfg.strategy, settings.world_size, steps_its_own)
    srun = [SLURMEnvironment(auto_requeue=False)] if settings.launcher == "srun" else []
    loop = OmegaConf.to_container(cfg.trainer, resolve=True)
    loop["profiler"] = loop.get("profiler") or NoProfiler()  # null: no cost per hook
    precision = []
    if isinstance(strategy, WatchedFSDPStrategy):  # FSDP2 fails to gather weights under
        loop["inference_mode"] = False  # inference_mode before torch 2.13 (pytorch#197327)
        precision = fsdp_double_precision(loop)
    return Trainer(
        resumes=resumes,
        accelerator=cfg.accelerator,
        devices=cfg.devices,
        num_nodes=cfg.num_nodes,
        strategy=strategy,
        logger=loggers or False,
        callbacks=list(callbacks),
        enable_progress_bar=cfg.callbacks.progress_bar != "none",
        enable_model_summary=False,  # ModelSummaryFile
        default_root_dir=settings.output_dir,
        plugins=[AtomicCheckpointIO(), *srun, *precision],
        **loop,
    )
