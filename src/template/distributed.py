"""Everything rank-aware about processes: the DDP strategy and its watched launcher, how many
processes a job asks for and who started them, device checks, per-rank logs, and leaving
nothing distributed behind. (The samplers that make results independent of the number of
processes live with the data: :mod:`src.template.data`, :mod:`src.template.resume`.)
"""

import hashlib
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException as ConfigError
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, Strategy
from lightning.pytorch.utilities import rank_zero_warn
from omegaconf import DictConfig
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from src.template.private import SubprocessScriptLauncher, set_num_threads_if_needed
from src.template.shutdown import LAUNCHER_PID_ENV, RankWatchdog, watch_launcher

log = logging.getLogger(__name__)


def build_strategy(cfg: DictConfig, processes: int) -> str | Strategy:
    """``strategy=ddp``, or ``auto`` asked for several processes → one process per device,
    watched (:class:`WatchedDDPStrategy`); ``auto`` for one process → Lightning's choice.

    The process group backend defaults to the accelerator's (nccl on GPU, gloo on CPU).
    """
    if cfg.name not in ("ddp", "auto") or (cfg.name == "auto" and processes <= 1):
        return cfg.name
    return WatchedDDPStrategy(
        watch_s=cfg.watch_s,
        exit_grace_s=cfg.exit_grace_s,
        process_group_backend=cfg.process_group_backend,
        find_unused_parameters=cfg.find_unused_parameters,
        timeout=timedelta(seconds=cfg.timeout_s),
    )


def requested_processes(accelerator: str, devices: Any, num_nodes: int) -> int:
    """How many processes ``devices`` x ``num_nodes`` asks for, before Lightning resolves it."""
    if isinstance(devices, int) and devices > 0:
        per_node = devices
    elif isinstance(devices, Sequence) and not isinstance(devices, str):
        per_node = len(devices)  # a list of device indices
    else:  # "auto" or -1: every GPU there is, else one process
        per_node = torch.cuda.device_count() if uses_gpu(accelerator) else 1
    return per_node * num_nodes


def launch_rank(processes_per_node: int) -> int:
    """This process's global rank as its launcher set it, before any Trainer exists.

    torchrun sets ``RANK``; Lightning's launcher gives the processes it starts ``LOCAL_RANK``
    (and ``NODE_RANK`` on other machines); srun sets ``SLURM_PROCID`` for each task (a process
    started by Lightning's launcher inside an allocation inherits its launcher's). Lightning's
    own guess at import (``rank_zero_only.rank``) takes ``LOCAL_RANK`` for the global rank, so
    the launching process of node 1 would think it is rank 0.
    """
    env = os.environ
    if "RANK" in env:
        return int(env["RANK"])
    node = int(env.get("NODE_RANK", env.get("GROUP_RANK", 0)))
    if "LOCAL_RANK" in env:
        return node * processes_per_node + int(env["LOCAL_RANK"])
    if "SLURM_PROCID" in env:
        return int(env["SLURM_PROCID"])
    return node * processes_per_node


def srun_starts_ranks(processes: int) -> bool:
    """Whether this process is one of ``processes`` ranks that srun started as SLURM tasks (in
    an sbatch script or a submitit sweep job), so Lightning must start none itself."""
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    return SLURMEnvironment.detect() and os.environ.get("SLURM_NTASKS") == str(processes)


def uses_gpu(accelerator: str) -> bool:
    """Whether ``accelerator`` means GPUs here: named, or ``auto`` on a machine that has one."""
    return accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())


class WatchedDDPStrategy(DDPStrategy):
    """Lightning's DDP whose launcher is watched by :class:`~src.shutdown.RankWatchdog`."""

    def __init__(self, watch_s: float, exit_grace_s: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.watch_s, self.exit_grace_s = watch_s, exit_grace_s

    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if type(self._launcher) is SubprocessScriptLauncher:
            self._launcher = WatchedLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes,
                watch_s=self.watch_s, exit_grace_s=self.exit_grace_s,
            )  # fmt: skip


class WatchedLauncher(SubprocessScriptLauncher):
    """Starts ranks 1..N-1 like Lightning (re-running the command), then watches them.

    Lightning has no public hook for this: it subclasses its private launcher, whose ``launch``
    it mirrors minus the observer. Lightning is pinned; re-check on upgrades (the fault tests
    in ``tests/test_shutdown.py`` fail if it breaks)."""

    def __init__(self, *args: Any, watch_s: float, exit_grace_s: float) -> None:
        super().__init__(*args)
        self.watch_s, self.exit_grace_s = watch_s, exit_grace_s
        self.watching_launcher = False  # in a rank process: the launcher-watch thread runs

    def launch(self, function: Any, *args: Any, trainer: L.Trainer | None = None, **kw: Any) -> Any:
        self.cluster_environment.validate_settings(
            num_devices=self.num_processes, num_nodes=self.num_nodes
        )
        me = str(os.getpid())
        if not self.cluster_environment.creates_processes_externally:
            os.environ[LAUNCHER_PID_ENV] = me  # inherited by the rank processes
            self._call_children_scripts()
            first = self.cluster_environment.node_rank() * self.num_processes + 1
            watchdog = RankWatchdog(self.procs, first, trainer, self.watch_s, self.exit_grace_s)
            watchdog.start()
        elif os.environ.get(LAUNCHER_PID_ENV, me) != me and not self.watching_launcher:
            watch_launcher(self.watch_s)  # a rank process: leave if the launcher is gone
            self.watching_launcher = True
        set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kw)


def check_devices(accelerator: str, devices: Any, num_nodes: Any) -> None:
    """Device and node counts Lightning cannot take, more GPUs than this machine has, or more
    CPU processes than its cores can run, fail now in this project's words (Lightning's own
    errors name its internals)."""
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
        raise ConfigError(
            f"num_nodes={num_nodes} is not valid: it is the number of machines taking part; "
            "use num_nodes=1 (this machine) or more"
        )
    gpu_indices = isinstance(devices, Sequence) and not isinstance(devices, str)
    if gpu_indices:
        valid = len(devices) > 0 and all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in devices
        )
    else:
        valid = devices in ("auto", -1) or (
            isinstance(devices, int) and not isinstance(devices, bool) and devices >= 1
        )
    if not valid:
        raise ConfigError(
            f"devices={devices} is not valid: use devices=N for N processes per machine "
            "(N >= 1, on CPU or one per GPU), devices=auto (every GPU, else 1 process) or GPU "
            "indices such as devices=[0,1]"
        )
    available = torch.cuda.device_count()
    if accelerator in ("gpu", "cuda") and available == 0:
        raise ConfigError(
            f"accelerator={accelerator} but no GPU is visible here (torch.cuda.device_count() "
            "is 0); use accelerator=cpu or accelerator=auto"
        )
    if devices == -1 and not uses_gpu(accelerator):
        raise ConfigError(
            "devices=-1 means every GPU, and no GPU is used here; use devices=N for N "
            "processes on the CPU"
        )
    if gpu_indices and not uses_gpu(accelerator):
        raise ConfigError(
            f"devices={list(devices)} lists GPU indices but no GPU is used here; "
            f"use devices={len(devices)} for {len(devices)} processes on the CPU"
        )
    if uses_gpu(accelerator) and isinstance(devices, int) and devices > available:
        raise ConfigError(
            f"devices={devices} but this machine has {available} GPU(s); use devices={available} "
            "(and num_nodes=... for more machines) or accelerator=cpu"
        )
    cores = cpu_cores()
    if (
        not uses_gpu(accelerator)
        and isinstance(devices, int)
        and devices > CPU_RANKS_PER_CORE * cores
    ):
        raise ConfigError(
            f"devices={devices} would start {devices} processes on this machine's {cores} CPU "
            f"core(s); use devices={cores} (one process per core; num_nodes=... for more machines)"
        )


# CPU ranks per core a job may start: beyond one they only share cores (the tests do it on
# purpose, to check results do not depend on the world size), beyond this it is a mistake.
CPU_RANKS_PER_CORE = 2


def cpu_cores() -> int:
    """The CPU cores this node's ranks can use: this process's CPU affinity (what a container,
    ``taskset`` or a SLURM allocation grants), or the machine's cores where each rank was started
    by torchrun or srun (an srun task may be bound to its own few cores)."""
    if external_rank() is not None or not hasattr(os, "sched_getaffinity"):
        return os.cpu_count() or 1
    return len(os.sched_getaffinity(0))


def use_sync_batchnorm(wanted: bool, model: nn.Module, accelerator: str) -> bool:
    """``strategy.sync_batchnorm`` where it can apply; where it cannot, a warning, never a crash."""
    if not wanted:
        return False
    if not any(isinstance(module, _BatchNorm) for module in model.modules()):
        reason = "the model has no BatchNorm layers"
    elif not uses_gpu(accelerator):
        reason = (
            "torch's SyncBatchNorm runs on GPUs only; on CPU each rank keeps its own statistics"
        )
    else:
        return True
    rank_zero_warn(f"strategy.sync_batchnorm=true is ignored: {reason}")
    return False


def hparams_digest(hparams: Mapping[str, Any]) -> str:
    """A short digest of a model's hyperparameters (as saved in its checkpoints): equal on
    every rank that trains the same model."""
    return hashlib.md5(repr(sorted(dict(hparams).items())).encode()).hexdigest()[:8]


class LogRankSetup(Callback):
    """Each rank writes what it really runs with to its own log (Hydra gives every rank a file):
    the proof, after the fact, that ranks agree on hyperparameters and do not oversubscribe."""

    def __init__(self, monitor: str) -> None:
        self.monitor = monitor

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        backend = getattr(trainer.strategy, "process_group_backend", None) or "none"
        hparams = hparams_digest(pl_module.hparams)
        log.info(
            "rank %d/%d (node %d, local %d) %s: backend %s, %d CPU threads, per-device batch %s, "
            "hyperparameters md5 %s",
            trainer.global_rank, trainer.world_size, trainer.node_rank, trainer.local_rank,
            getattr(stage, "value", stage), backend, torch.get_num_threads(),
            getattr(trainer.datamodule, "per_device_batch_size", None), hparams,
        )  # fmt: skip

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        value = trainer.callback_metrics.get(self.monitor)
        if value is not None:
            log.info("rank %d/%d: %s %.6f", trainer.global_rank, trainer.world_size, self.monitor,
                     value)  # fmt: skip


@contextmanager
def job_scope() -> Iterator[None]:
    """Leave nothing distributed behind: a sweep runs its next job in the same process.

    Resets the process group, the environment (Lightning's launcher sets MASTER_ADDR,
    WORLD_SIZE, LOCAL_RANK, OMP_NUM_THREADS, ...) and the thread count.
    """
    threads = torch.get_num_threads()
    separate_rank_log()
    environment = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(environment)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        torch.set_num_threads(threads)


def external_rank() -> int | None:
    """This process's rank when torchrun or srun started every rank (``None`` otherwise)."""
    env = os.environ
    if "RANK" in env:  # torchrun
        return int(env["RANK"])
    if "LOCAL_RANK" not in env and int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in env:
        return int(env["SLURM_PROCID"])  # an srun task (Lightning's own ranks have LOCAL_RANK)
    return None


def separate_rank_log() -> None:
    """Ranks started by torchrun or srun share one output folder, so they would all append to
    Hydra's ``<task>.log``: ranks other than 0 write ``<task>_rank<N>.log`` instead (as those
    Lightning starts write ``<task>_ddp_process_<N>.log``)."""
    rank = external_rank()
    if not rank:
        return
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, logging.FileHandler)]:
        path = Path(handler.baseFilename)
        own = logging.FileHandler(path.with_name(f"{path.stem}_rank{rank}{path.suffix}"))
        own.setFormatter(handler.formatter)
        own.setLevel(handler.level)
        root.removeHandler(handler)
        handler.close()
        root.addHandler(own)
