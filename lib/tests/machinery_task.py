"""The machinery's own task for its tests: the regression of ``tests/project/`` (synthetic
vectors, an MLP), whose ``src`` the conftest puts first on ``sys.path``: unit tests build their
data and models from it, never from the image classifier."""

from src.task import TASK
from src.task.data import SyntheticDataModule
from src.task.model import Regressor

__all__ = ["SIZES", "TASK", "Regressor", "SyntheticDataModule", "synthetic_data"]

# 50 training vectors (10 carved out for validation) and 17 test vectors, 8 features each
SIZES = {"features": 8, "n_train": 50, "n_test": 17, "val_size": 10, "batch_size": 8}


def synthetic_data(**overrides: object) -> SyntheticDataModule:
    """A small data module of the machinery's test task; ``overrides`` replace its settings."""
    return SyntheticDataModule(**({"name": "synthetic", **SIZES} | overrides))
