"""The regression's tiny job for the machinery's end-to-end tests (``tests/conftest.py``): its
data is drawn from ``data_seed``, so nothing is written; the sizes are
conf/data/synthetic.yaml's."""

from pathlib import Path

N_TRAIN = 301
N_TEST = 73
VAL_SIZE = 43
BATCH_SIZE = 16  # 16 steps an epoch
DATA_NAME = "synthetic"


def write_data(root: Path) -> None:
    """Nothing to write: every process draws the same vectors."""


def overrides(root: Path) -> list[str]:
    return ["trainer.max_epochs=2", "callbacks.progress_bar=none"]
