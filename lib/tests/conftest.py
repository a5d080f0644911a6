"""The library's tests run on their own task (``project/``: a regression on synthetic vectors,
laid out as a project, its entry points the template's), never on the image classifier: what
they check holds for any task."""

import sys
from pathlib import Path

import pytest
from lightning_exact.job.entry import LIBRARY_CONF
from lightning_exact.testing import instruments, processes
from lightning_exact.testing.harness import Harness, load_tiny_job
from lightning_exact.testing.plugin import FAKE_SECRET, LONG_VALUE, TRAINED_STEPS, Job
from lightning_exact.testing.processes import (
    busy_stacks,
    describe,
    kill_process_trees,
    one_error_line,
    process_group,
    processes_with_env,
    run_job,
    wait_for_file,
)
from lightning_exact.testing.records import (
    assert_rank_logs,
    assert_same_metrics,
    assert_same_tensors,
    best_checkpoint,
    files_holding,
    load_checkpoint,
    read_metrics,
)
from lightning_exact.testing.records import only_run as only_run_in
from lightning_exact.testing.servers import (
    free_port,
    invoke,
    local_server_argv,
    mlflow_server,
    served,
)
from omegaconf import OmegaConf

pytest_plugins = ["lightning_exact.testing.plugin"]

TESTS = Path(__file__).resolve().parent  # the library's tests and their instruments
PROJECT = TESTS / "project"
# ``src`` is the test project's in these tests' process too, as a project's is in its own: its
# task (src.task), its entry points; never another installed project's.
assert "src" not in sys.modules, "src was imported before the test project was put first"
sys.path.insert(0, str(PROJECT))
HARNESS = Harness(PROJECT, load_tiny_job(PROJECT / "tests" / "task" / "tiny_job.py"))

# The tiny job's sizes (project/tests/task/tiny_job.py)
N_TRAIN, N_TEST, VAL_SIZE = HARNESS.n_train, HARNESS.n_test, HARNESS.val_size
BATCH_SIZE, DATA_NAME = HARNESS.batch_size, HARNESS.data_name
STEPS_PER_EPOCH = HARNESS.steps_per_epoch
OPTIMIZER_STEPS_PER_BATCH = HARNESS.optimizer_steps_per_batch
run_entry = HARNESS.run_entry
tiny_overrides = HARNESS.tiny_overrides
signal_at_step = HARNESS.signal_at_step
epoch_ends = HARNESS.epoch_ends
SIGNAL_AT_STEP = instruments.SIGNAL_AT_STEP


# Training metrics are also logged every trainer.log_every_n_steps (the library's default; the
# tiny job's epochs are shorter): where, beside each epoch's end (training_points)
LOG_EVERY_N_STEPS = OmegaConf.load(LIBRARY_CONF / "trainer" / "default.yaml").log_every_n_steps


def training_points(epochs: int) -> list[int]:
    """The global steps at which the tiny job's first ``epochs`` epochs log their training
    metrics: each epoch's end and every ``trainer.log_every_n_steps``."""
    ends = epoch_ends(epochs)
    return sorted({*ends, *range(LOG_EVERY_N_STEPS, ends[-1] + 1, LOG_EVERY_N_STEPS)})


# The tiny job's MLflow run: its task's run_label (project/conf/task.yaml); the experiment is
# the data's
TRAIN_RUN_NAME = "mlp"


def only_run(store: Path, experiment: str = DATA_NAME, task: str = "train"):
    """The single MLflow run of ``task`` in a SQLite store; the tiny job's experiment unless
    ``experiment``."""
    return only_run_in(store, experiment, task)


__all__ = [
    "BATCH_SIZE",
    "DATA_NAME",
    "FAKE_SECRET",
    "Job",
    "LONG_VALUE",
    "N_TEST",
    "N_TRAIN",
    "OPTIMIZER_STEPS_PER_BATCH",
    "PROJECT",
    "SIGNAL_AT_STEP",
    "TESTS",
    "TRAIN_RUN_NAME",
    "STEPS_PER_EPOCH",
    "TRAINED_STEPS",
    "VAL_SIZE",
    "assert_rank_logs",
    "assert_same_metrics",
    "assert_same_tensors",
    "best_checkpoint",
    "files_holding",
    "free_port",
    "only_run",
    "processes_with_env",
    "wait_for_file",
    "busy_stacks",
    "describe",
    "epoch_ends",
    "invoke",
    "kill_process_trees",
    "load_checkpoint",
    "local_server_argv",
    "mlflow_server",
    "one_error_line",
    "process_group",
    "processes",
    "read_metrics",
    "run_entry",
    "run_job",
    "served",
    "signal_at_step",
    "tiny_overrides",
    "training_points",
]


@pytest.fixture(scope="session")
def harness() -> Harness:
    return HARNESS
