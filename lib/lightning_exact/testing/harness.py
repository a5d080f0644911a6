"""A project's test harness: its folder and its task's tiny job (``tests/task/tiny_job.py``), the
one place the end-to-end tests, the library's and a project's own, learn what to train.

A project's ``tests/conftest.py`` makes one ``Harness`` and hands it to the fixtures of
:mod:`lightning_exact.testing.plugin` through a ``harness`` fixture."""

import importlib.util
import subprocess
from pathlib import Path
from types import ModuleType

from lightning_exact.testing import instruments, processes


def load_tiny_job(path: Path) -> ModuleType | None:
    """The tiny job module at ``path`` (None where the project has none yet)."""
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location("tiny_job", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Harness:
    """What a test needs to run a project's jobs: ``python -m src.<entry>`` there, the tiny
    job's data and overrides, its sizes, the instruments."""

    def __init__(self, project: Path, tiny_job: ModuleType | None) -> None:
        self.project = project
        self.tiny_job = tiny_job
        job = tiny_job
        self.n_train = getattr(job, "N_TRAIN", 0)
        self.n_test = getattr(job, "N_TEST", 0)
        self.val_size = getattr(job, "VAL_SIZE", 0)
        self.batch_size = getattr(job, "BATCH_SIZE", 1)
        self.data_name = getattr(job, "DATA_NAME", "")  # its MLflow experiment
        # the last incomplete global batch dropped
        self.steps_per_epoch = (self.n_train - self.val_size) // self.batch_size
        # Optimizer steps (Lightning's global_step) a batch: a model stepping several optimizers
        # itself says how many; its steps (the x-axis, the step keys) are batches.
        self.optimizer_steps_per_batch = getattr(job, "OPTIMIZER_STEPS_PER_BATCH", 1)

    def run_entry(
        self,
        module: str,
        *overrides: str,
        cwd: Path,
        check: bool = True,
        env: dict[str, str] | None = None,
        timeout: float = 300,
    ) -> subprocess.CompletedProcess:
        """``python -m src.<module>`` of the project, as a user runs it (see
        :func:`~lightning_exact.testing.processes.run_entry`)."""
        return processes.run_entry(
            module,
            *overrides,
            project=self.project,
            cwd=cwd,
            check=check,
            env=env,
            timeout=timeout,
        )

    def tiny_overrides(
        self, data_root: Path, *, logger: str = "mlflow", model: bool = False
    ) -> list[str]:
        """Overrides for the task's seconds-long tiny job on the data of ``data_root``, logging
        to ``logger``. An MLflow job logs no MLflow model unless ``model``: the export takes
        seconds of a short job, so only the tests that check the model pay for it."""
        tiny = self.tiny_job.overrides(data_root)
        if logger != "mlflow":
            return [*tiny, f"logger={logger}"]
        return tiny if model else [*tiny, "logger.log_model=false"]

    def signal_at_step(self, at: str) -> dict[str, str]:
        """The environment of a job whose rank 0 gets a real signal at step ``at``
        (``"14:SIGTERM"``, ``"test:SIGTERM"``): :func:`~.instruments.signal_at_step`."""
        return instruments.signal_at_step(at, self.project)

    def epoch_ends(self, epochs: int) -> list[int]:
        """The global steps at which the tiny job's first ``epochs`` epochs end: where its
        metrics are logged when ``trainer.log_every_n_steps`` (50) is more than an epoch."""
        return [self.steps_per_epoch * (epoch + 1) for epoch in range(epochs)]
