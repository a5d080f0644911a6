"""The job's settings that several layers read, computed once from its checked config: how many
processes, who starts them, this process's rank before any Trainer exists, its output folder.
Lower layers take these values rather than computing them again from ``cfg``."""

from dataclasses import dataclass
from pathlib import Path

from lightning.fabric.plugins.environments import TorchElasticEnvironment
from omegaconf import DictConfig

from lightning_exact.training.distributed import launch_rank, requested_processes, srun_starts_ranks


@dataclass(frozen=True)
class JobSettings:
    output_dir: Path
    processes_per_node: int  # ``devices`` resolved: "auto" is every GPU there is, else 1
    num_nodes: int
    launcher: str  # who starts the ranks: "srun", "torchrun", else "lightning" (or one process)
    rank_at_launch: int  # this process's global rank, known before any Trainer exists

    @property
    def world_size(self) -> int:
        return self.processes_per_node * self.num_nodes

    @property
    def copies_to_read(self) -> int:
        """Copies of in-memory data this machine's ranks have yet to read when this one reads
        (each rank reads its own): every rank's, where the ranks start together (torchrun,
        srun) and on the first rank; on the others Lightning starts after its first has read
        (that copy is in memory already), every rank's but that one."""
        first = self.rank_at_launch % self.processes_per_node == 0
        if self.launcher == "lightning" and not first:
            return self.processes_per_node - 1
        return self.processes_per_node

    @property
    def opens_store(self) -> bool:
        """Only rank 0 opens the MLflow store: ranks started together would race to create its
        schema."""
        return self.rank_at_launch == 0

    @classmethod
    def from_config(cls, cfg: DictConfig) -> "JobSettings":
        """The settings of ``cfg``, whose hardware keys are checked (``check_devices``)."""
        per_node = requested_processes(cfg.accelerator, cfg.devices, 1)
        world_size = per_node * cfg.num_nodes
        if srun_starts_ranks(world_size):
            launcher = "srun"
        elif TorchElasticEnvironment.detect():
            launcher = "torchrun"
        else:
            launcher = "lightning"
        return cls(
            output_dir=Path(cfg.paths.output_dir),
            processes_per_node=per_node,
            num_nodes=cfg.num_nodes,
            launcher=launcher,
            rank_at_launch=launch_rank(per_node),
        )
