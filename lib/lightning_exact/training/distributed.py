"""Rank-aware process handling: the watched DDP and FSDP strategies, process counts and who
started them, device checks, per-rank logs, and leaving nothing distributed behind."""

import hashlib
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from lightning.fabric.plugins.environments import LightningEnvironment, TorchElasticEnvironment
from lightning.fabric.utilities.exceptions import MisconfigurationException as ConfigError
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.environments import SLURMEnvironment
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch import nn

from lightning_exact.checkpoints.shutdown import LAUNCHER_PID_ENV, watch_launcher, watch_ranks
from lightning_exact.job.config import is_count
from lightning_exact.private import SubprocessScriptLauncher, set_num_threads_if_needed
from lightning_exact.training.sharded import save_swapped

log = logging.getLogger(__name__)
# CPU ranks per core: beyond 1 they share cores (the tests do, on purpose); beyond 2, a mistake.
CPU_RANKS_PER_CORE = 2


def requested_processes(accelerator: str, devices: Any, num_nodes: int) -> int:
    """How many processes ``devices`` x ``num_nodes`` asks for, before Lightning resolves it."""
    if isinstance(devices, int) and devices > 0:
        per_node = devices
    elif isinstance(devices, Sequence) and not isinstance(devices, str):
        per_node = len(devices)  # GPU indices
    else:  # "auto" or -1: every GPU there is, else one process
        per_node = torch.cuda.device_count() if uses_gpu(accelerator) else 1
    return per_node * num_nodes


def external_rank() -> int | None:
    """This process's rank where torchrun or srun started every rank, else ``None``."""
    if TorchElasticEnvironment.detect():
        return int(os.environ["RANK"])
    srun_task = SLURMEnvironment.detect() and int(os.environ["SLURM_NTASKS"]) > 1
    if srun_task and "LOCAL_RANK" not in os.environ:  # Lightning's own ranks have LOCAL_RANK
        return int(os.environ["SLURM_PROCID"])
    return None


def launch_rank(processes_per_node: int) -> int:
    """This process's global rank before any Trainer exists (Lightning's ``rank_zero_only.rank``
    takes ``LOCAL_RANK`` for it: the launching process of node 1 would think it is rank 0)."""
    rank = external_rank()
    if rank is None:
        env = LightningEnvironment()  # Lightning's launcher: NODE_RANK and LOCAL_RANK
        rank = env.node_rank() * processes_per_node + env.local_rank()
    return rank


def srun_starts_ranks(processes: int) -> bool:
    """Whether srun started this job's ``processes`` ranks as its tasks (Lightning starts none)."""
    return SLURMEnvironment.detect() and os.environ.get("SLURM_NTASKS") == str(processes)


def uses_gpu(accelerator: str) -> bool:
    """Whether ``accelerator`` means GPUs here: named, or ``auto`` on a machine that has one."""
    return accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())


class WatchedRanks:
    """Mixed into a Lightning strategy that starts one process per rank: its rank processes watched
    (:func:`~lightning_exact.checkpoints.shutdown.watch_ranks`) by :class:`WatchedLauncher`."""

    def __init__(self, watch_s: float, exit_grace_s: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.watch_s = watch_s
        self.exit_grace_s = exit_grace_s
        self.watching_launcher = False  # in a rank process: the launcher-watch thread runs

    def _configure_launcher(self) -> None:  # Lightning's: the launcher for start_method="popen"
        self._launcher = WatchedLauncher(self)


class WatchedDDPStrategy(WatchedRanks, DDPStrategy):
    """Lightning's DDP, its rank processes watched."""


class WatchedFSDPStrategy(WatchedRanks, ModelParallelStrategy):
    """Fully sharded data parallel: Lightning's ``ModelParallelStrategy`` with all ``ranks`` in one
    data-parallel group (no tensor parallelism), so the task's ``configure_model`` shards with
    torch's ``fully_shard`` (FSDP2) over all ranks (:func:`shard`); watched like DDP. Checkpoints
    are folders where each rank writes its shard, swapped in whole
    (:mod:`~lightning_exact.training.sharded`), or, with ``sharded_checkpoints`` off, gathered by
    rank 0 into the one file DDP writes."""

    def __init__(
        self,
        watch_s: float,
        exit_grace_s: float,
        ranks: int,
        sharded_checkpoints: bool,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            watch_s,
            exit_grace_s,
            data_parallel_size=ranks,
            tensor_parallel_size=1,
            save_distributed_checkpoint=sharded_checkpoints,
            **kwargs,
        )
        self.sharded_checkpoints = sharded_checkpoints

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any = None
    ) -> None:
        """Lightning's save; a sharded folder is written beside its place and swapped in whole
        once every rank wrote its shard (Lightning writes it in place)."""
        if not self.sharded_checkpoints:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        path = Path(self.broadcast(str(filepath)))
        save = super().save_checkpoint
        save_swapped(path, lambda staging: save(checkpoint, staging, storage_options), self.barrier)
        return None

    def on_validation_start(self) -> None:
        """Every rank validates with rank 0's buffers (BatchNorm's running statistics), as under
        DDP, which copies them from rank 0 before each forward; FSDP leaves them per rank."""
        super().on_validation_start()
        self.copy_rank_zeros_buffers()

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The weights a checkpoint keeps, with rank 0's buffers as under DDP: a sharded one
        stores one copy of each unsharded tensor, written by whichever rank torch picks.
        (Training reads no running statistic, and validation takes rank 0's: no result moves.)"""
        self.copy_rank_zeros_buffers()
        return super().lightning_module_state_dict()

    def copy_rank_zeros_buffers(self) -> None:
        """Rank 0's buffers to every rank, in place."""
        if self.world_size > 1:
            for buffer in self.lightning_module.buffers():
                torch.distributed.broadcast(buffer, src=0)


# One entry of Task.sharded_blocks: a module type (each submodule of it is one FSDP unit), or
# the dotted names of submodules sharded together as one unit (modules that tie weights).
ShardedBlock = type[nn.Module] | tuple[str, ...]


def check_shardable(strategy: str, module: nn.Module, blocks: Sequence[ShardedBlock]) -> None:
    """Under strategy=fsdp, refuse before a run or a rank exists a ``module`` that :func:`shard`
    would refuse in every rank, or FSDP fail on in every rank (``Task.sharded_blocks``)."""
    if strategy == "fsdp":
        sharded_units(module, blocks)


def sharded_units(module: nn.Module, blocks: Sequence[ShardedBlock]) -> list[list[nn.Module]]:
    """The FSDP units of ``module``, innermost first, each a list of the submodules sharded
    together: every named group of ``blocks``, and each other submodule of a type in them. Every
    module holding parameters of its own must be in one or inside one (Lightning loads a gathered
    checkpoint unit by unit, and fails on parameters outside them, the network's root too), and
    no parameter may belong to two units side by side (tied weights: FSDP refuses them)."""
    groups = [group_modules(module, names) for names in blocks if isinstance(names, tuple)]
    grouped = {id(part) for group in groups for member in group for part in member.modules()}
    types = tuple(block for block in blocks if isinstance(block, type))
    units = [
        [sub]
        for sub in module.modules()
        if sub is not module and isinstance(sub, types) and id(sub) not in grouped
    ]
    depth = {id(sub): name.count(".") for name, sub in module.named_modules()}
    # Innermost first, as FSDP2 asks: a unit inside another is deeper than it.
    units = sorted([*units, *groups], key=lambda unit: -max(depth[id(m)] for m in unit))
    check_all_inside(module, units, blocks)
    check_nothing_shared(module, units)
    return units


def group_modules(module: nn.Module, names: tuple[str, ...]) -> list[nn.Module]:
    """The submodules ``names`` name, found under ``module`` itself or the first submodule
    holding all of them (the check sees the LightningModule, ``shard`` the network in it)."""
    for root in module.modules():
        try:
            return [root.get_submodule(name) for name in names]
        except AttributeError:
            continue
    where = f"{type(module).__name__}'s submodules"
    raise ConfigError(
        f"strategy=fsdp: Task.sharded_blocks names {names}, not all of them among {where}; "
        "name submodules of the network the task's configure_model shards (e.g. 'lm_head')"
    )


def check_all_inside(
    module: nn.Module, units: list[list[nn.Module]], blocks: Sequence[ShardedBlock]
) -> None:
    """Refuse parameters held by a module outside every unit."""
    inside = {id(part) for unit in units for member in unit for part in member.modules()}
    if loose := [
        name
        for name, sub in module.named_modules()
        if id(sub) not in inside and next(sub.parameters(recurse=False), None) is not None
    ]:
        kinds = sorted({type(module.get_submodule(name)).__name__ for name in loose})
        named = [block.__name__ if isinstance(block, type) else block for block in blocks]
        raise ConfigError(
            f"strategy=fsdp: {', '.join(loose)} ({', '.join(kinds)}) hold parameters outside "
            f"the sharded blocks {named}; add its type to them "
            "(Task.sharded_blocks and the task's configure_model)"
        )


def check_nothing_shared(module: nn.Module, units: list[list[nn.Module]]) -> None:
    """Refuse a parameter in two units side by side (weights tied between them): FSDP gives each
    parameter to one unit, the innermost that holds it."""
    names = {id(sub): name for name, sub in module.named_modules()}
    owner: dict[int, list[nn.Module]] = {}
    for unit in units:  # innermost first
        for member in unit:
            for param_name, param in member.named_parameters():
                first = owner.setdefault(id(param), unit)
                if first is unit or holds(unit, first):
                    continue
                pair = sorted({names[id(first[0])], names[id(member)]})
                raise ConfigError(
                    f"strategy=fsdp: {pair[0]} and {pair[1]} share a parameter "
                    f"({names[id(member)]}.{param_name}: tied weights) but are sharded apart; "
                    f"shard them together: add {below_common_parent(pair)} to "
                    "Task.sharded_blocks"
                )


def below_common_parent(names: list[str]) -> tuple[str, ...]:
    """Dotted names relative to their deepest common parent (the network a task shards):
    ``net.lm_head``, ``net.wte`` -> ``lm_head``, ``wte``."""
    parts = [name.split(".") for name in names]
    common = 0
    while all(len(p) > common + 1 and p[common] == parts[0][common] for p in parts):
        common += 1
    return tuple(".".join(p[common:]) for p in parts)


def holds(outer: list[nn.Module], inner: list[nn.Module]) -> bool:
    """Whether every module of the unit ``inner`` is inside a module of the unit ``outer``."""
    parts = {id(part) for member in outer for part in member.modules()}
    return all(id(member) in parts for member in inner)


def shard(module: nn.Module, mesh: Any, blocks: Sequence[ShardedBlock]) -> None:
    """Shard ``module``'s parameters, gradients and optimizer state over the data-parallel
    ranks of ``mesh``, the LightningModule's ``device_mesh`` (FSDP2): each unit of
    :func:`sharded_units` (a submodule of a type in ``blocks``, or a named group of submodules
    that tie weights) gathered just before it runs and freed after. Call it from
    ``configure_model``: Lightning calls that for each stage (fit, then test), and a sharded
    module is left as it is."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if isinstance(module, FSDPModule):
        return
    units = sharded_units(module, blocks)
    if mesh is not None and "data_parallel" in (mesh.mesh_dim_names or ()):
        # The strategy's mesh is 2-D (data x tensor parallel); given whole, fully_shard would
        # replicate over the ranks and shard over the tensor-parallel dimension, of size 1.
        mesh = mesh["data_parallel"]
    for unit in units:
        fully_shard(unit if len(unit) > 1 else unit[0], mesh=mesh)
    fully_shard(module, mesh=mesh)


class WatchedLauncher(SubprocessScriptLauncher):
    """Lightning's ``launch`` with our watchdog for its observer, which SIGKILLs the launching
    process and so leaves the run RUNNING, the dead rank unnamed."""

    def __init__(self, strategy: WatchedRanks) -> None:
        super().__init__(strategy.cluster_environment, strategy.num_processes, strategy.num_nodes)
        self.strategy = strategy

    def launch(self, function: Any, *args: Any, trainer: L.Trainer | None = None, **kw: Any) -> Any:
        env = self.cluster_environment
        strategy = self.strategy
        me = str(os.getpid())
        env.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not env.creates_processes_externally:
            os.environ[LAUNCHER_PID_ENV] = me  # inherited by the rank processes
            self._call_children_scripts()
            first = env.node_rank() * self.num_processes + 1
            watch_ranks(self.procs, first, trainer, strategy.watch_s, strategy.exit_grace_s)
        elif os.environ.get(LAUNCHER_PID_ENV, me) != me and not strategy.watching_launcher:
            watch_launcher(strategy.watch_s)  # a rank process: leave if the launcher is gone
            strategy.watching_launcher = True
        set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kw)


def check_devices(accelerator: str, devices: Any, num_nodes: Any) -> None:
    """Refuse in this project's words (Lightning's errors name its internals) device and node
    counts Lightning cannot take, more GPUs than there are, more CPU ranks than cores can run."""
    if not is_count(num_nodes, 1):
        raise ConfigError(
            f"num_nodes={num_nodes} is not valid: it is the number of machines taking part; use "
            "num_nodes=1 (this machine) or more"
        )
    indices = isinstance(devices, Sequence) and not isinstance(devices, str)
    if indices:
        valid = len(devices) > 0 and all(is_count(i, 0) for i in devices)
    else:
        valid = devices in ("auto", -1) or is_count(devices, 1)
    if not valid:
        raise ConfigError(
            f"devices={devices} is not valid: use devices=N for N processes per machine "
            "(N >= 1, on CPU or one per GPU), devices=auto (every GPU, else 1 process) or GPU "
            "indices such as devices=[0,1]"
        )
    if uses_gpu(accelerator):
        check_gpu_devices(accelerator, devices)
    else:
        check_cpu_devices(devices, indices)


def check_gpu_devices(accelerator: str, devices: Any) -> None:
    """GPUs asked for: there are some, and at least ``devices`` of them."""
    gpus = torch.cuda.device_count()
    if accelerator in ("gpu", "cuda") and gpus == 0:
        raise ConfigError(
            f"accelerator={accelerator} but no GPU is visible here (torch.cuda.device_count() "
            "is 0); use accelerator=cpu or accelerator=auto"
        )
    if is_count(devices, 1) and devices > gpus:
        raise ConfigError(
            f"devices={devices} but this machine has {gpus} GPU(s); use "
            f"devices={gpus} (and num_nodes=... for more machines) or accelerator=cpu"
        )


def check_cpu_devices(devices: Any, indices: bool) -> None:
    """Processes on the CPU: a count (not GPU indices, not -1), and not more than the cores
    can run (:data:`CPU_RANKS_PER_CORE`)."""
    if devices == -1:
        raise ConfigError(
            "devices=-1 means every GPU, and no GPU is used here; use "
            "devices=N for N processes on the CPU"
        )
    if indices:
        raise ConfigError(
            f"devices={devices} lists GPU indices but no GPU is used here; use "
            f"devices={len(devices)} for {len(devices)} processes on the CPU"
        )
    # This process's CPU affinity, or the node's cores where torchrun or srun bound each rank.
    affinity = external_rank() is None and hasattr(os, "sched_getaffinity")
    cores = len(os.sched_getaffinity(0)) if affinity else os.cpu_count() or 1
    if is_count(devices, 1) and devices > CPU_RANKS_PER_CORE * cores:
        raise ConfigError(
            f"devices={devices} would start {devices} processes on this machine's {cores} CPU "
            f"core(s); use devices={cores} (one process per core; num_nodes=... for more "
            "machines)"
        )


def hparams_digest(hparams: Mapping[str, Any]) -> str:
    """A short digest of a model's hyperparameters: equal on ranks that train the same model."""
    return hashlib.md5(repr(sorted(dict(hparams).items())).encode()).hexdigest()[:8]


def hparams_line(hparams: Mapping[str, Any]) -> str:
    """The digest of all of a model's hyperparameters, then its plain ones by name (what a sweep
    varies, read from the model): ``f1e8f120: lr=0.003 weight_decay=0.0001``. Nested ones
    (``net``) are in the digest only."""
    plain = [f"{k}={v}" for k, v in hparams.items() if isinstance(v, bool | int | float | str)]
    return ": ".join([hparams_digest(hparams), *filter(None, [" ".join(plain)])])


class LogRankSetup(Callback):
    """Each rank logs what it really runs with to its own file: the proof, after the fact, that
    ranks agree on hyperparameters and do not oversubscribe the cores."""

    def __init__(self, monitor: str) -> None:
        self.monitor = monitor

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        log.info(
            "rank %d/%d (node %d, local %d) %s: backend %s%s, %d CPU threads, per-device batch "
            "%s, hyperparameters md5 %s",
            trainer.global_rank,
            trainer.world_size,
            trainer.node_rank,
            trainer.local_rank,
            getattr(stage, "value", stage),
            getattr(trainer.strategy, "process_group_backend", None) or "none",
            " (FSDP: sharded)" if isinstance(trainer.strategy, WatchedFSDPStrategy) else "",
            torch.get_num_threads(),
            getattr(trainer.datamodule, "per_device_batch_size", None),
            hparams_line(pl_module.hparams),
        )

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if (value := trainer.callback_metrics.get(self.monitor)) is not None:
            log.info(
                "rank %d/%d: %s %.6f", trainer.global_rank, trainer.world_size, self.monitor, value
            )


@contextmanager
def job_scope() -> Iterator[None]:
    """Leave no process group, environment (MASTER_ADDR, ...) or thread count to a sweep's next
    job. Ranks N>0 that torchrun or srun started write ``<task>_rank<N>.log``, not Hydra's log."""
    threads = torch.get_num_threads()
    environment = dict(os.environ)
    root = logging.getLogger()
    rank = external_rank()
    for handler in [h for h in root.handlers if rank and isinstance(h, logging.FileHandler)]:
        path = Path(handler.baseFilename)
        own = logging.FileHandler(path.with_name(f"{path.stem}_rank{rank}{path.suffix}"))
        own.setFormatter(handler.formatter)
        own.setLevel(handler.level)
        root.removeHandler(handler)
        handler.close()
        root.addHandler(own)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(environment)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        torch.set_num_threads(threads)
