"""The text task's tiny job for the machinery's end-to-end tests (``tests/conftest.py``): its
text is drawn from ``data_seed``, so nothing is written; the sizes are conf/data/chars.yaml's."""

from pathlib import Path

N_TRAIN = 232
N_TEST = 60
VAL_SIZE = 40
BATCH_SIZE = 16  # 12 steps an epoch
DATA_NAME = "chars"


def write_data(root: Path) -> None:
    """Nothing to write: every process draws the same text."""


def overrides(root: Path) -> list[str]:
    return ["trainer.max_epochs=2", "callbacks.progress_bar=none"]
