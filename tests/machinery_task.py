"""The machinery's own task for its tests: the regression of ``tests/regression_task/`` (synthetic
vectors, an MLP), imported in place. Tests of ``src/template/`` build their data and models from
it, never from ``src/task/``, so a forker who replaces the shipped task keeps every one of them
(``tests/test_task_contract.py`` makes that replacement and runs them)."""

from tests.regression_task.src.task import TASK
from tests.regression_task.src.task.data import SyntheticDataModule
from tests.regression_task.src.task.model import Regressor

__all__ = ["SIZES", "TASK", "Regressor", "SyntheticDataModule", "synthetic_data"]

# 50 training vectors (10 carved out for validation) and 17 test vectors, 8 features each
SIZES = {"features": 8, "n_train": 50, "n_test": 17, "val_size": 10, "batch_size": 8}


def synthetic_data(**overrides: object) -> SyntheticDataModule:
    """A small data module of the machinery's test task; ``overrides`` replace its settings."""
    return SyntheticDataModule(**({"name": "synthetic", **SIZES} | overrides))
