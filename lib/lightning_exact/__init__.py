"""lightning-exact: the machinery of the Lightning + Hydra DDP template. Distributed training
that equals one process, a stopped job that resumes exactly, one MLflow run per job, sweeps.

It never imports a dataset, network or LightningModule by name: a project hands it one
:class:`Task` (its ``src/task/``). What a task may import is named here, and only here; it is
documented in lib/README.md and docs/make-it-yours.md, and it keeps working across minor
versions (a renamed name keeps its old one for one release, with a one-line warning). Every
other module of the package is the machinery's own and may change in any release."""

from importlib.metadata import version

from lightning_exact.checkpoints.checkpoint import (
    CheckpointError,
    model_from_checkpoint,
    read_checkpoint,
)
from lightning_exact.checkpoints.resume import GlobalBatchSampler, resume_position
from lightning_exact.data import (
    Batch,
    DataError,
    TensorDataModule,
    carve_validation,
    drop_rows,
    keep_batch,
)
from lightning_exact.files import folder_kept_if_used
from lightning_exact.job.config import ConfigError, check_choice, check_keys
from lightning_exact.task import ModelExport, Task
from lightning_exact.training.distributed import shard
from lightning_exact.training.exact import global_batch_randn, sample_randn
from lightning_exact.training.precision import trainer_precision
from lightning_exact.training.steps import logged_step

__version__ = version("lightning-exact")  # lib/pyproject.toml's; CHANGELOG.md says what changed

__all__ = [
    "Batch",
    "CheckpointError",
    "ConfigError",
    "DataError",
    "GlobalBatchSampler",
    "ModelExport",
    "Task",
    "TensorDataModule",
    "__version__",
    "carve_validation",
    "check_choice",
    "check_keys",
    "drop_rows",
    "folder_kept_if_used",
    "global_batch_randn",
    "keep_batch",
    "logged_step",
    "model_from_checkpoint",
    "read_checkpoint",
    "resume_position",
    "sample_randn",
    "shard",
    "trainer_precision",
]
