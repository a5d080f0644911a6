"""The one wrapper of the train, eval and predict entry points: compose the config with Hydra,
run the job with the task, and end expected errors (bad input, a failed rank) in one line."""

from collections.abc import Callable
from pathlib import Path
from typing import Any

import hydra
from lightning.fabric.utilities.exceptions import MisconfigurationException as ConfigError
from omegaconf import DictConfig

from src.template.checkpoint import CheckpointError
from src.template.config import run_entry_point
from src.template.data import DataError
from src.template.distributed import job_scope
from src.template.reporting import quiet_library_notices, short_errors
from src.template.shutdown import RankFailed
from src.template.store import TrackingError
from src.template.sweeps import SweepFolderTaken, SweepJobFailed
from src.template.task import Task

CONF = Path(__file__).resolve().parents[2] / "conf"
# Errors that mean bad input or a failed rank: shown as one line, no traceback.
EXPECTED = (
    DataError, CheckpointError, TrackingError, ConfigError, RankFailed, SweepJobFailed,
    SweepFolderTaken,
)  # fmt: skip


def main(config_name: str, job: Callable[[DictConfig, Task], Any], task: Task) -> None:
    """``python -m src.<entry> [overrides]``: ``job(cfg, task)`` with ``conf/<config_name>.yaml``.
    Its return value goes to Hydra (a sweeper optimises it)."""
    expected = (*EXPECTED, *task.errors)

    @hydra.main(version_base="1.3", config_path=str(CONF), config_name=config_name)
    def run(cfg: DictConfig) -> Any:
        quiet_library_notices()  # here: a SLURM sweep job runs this function, not main()
        with short_errors(*expected), job_scope():
            return job(cfg, task)

    run_entry_point(run, expected)
