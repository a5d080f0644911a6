"""The task's tiny job: what the end-to-end tests in ``tests/`` train, through the harness of
``tests/conftest.py`` (its ``tiny_root`` and ``tiny_overrides``). Here the shipped image task's: a
learnable MNIST-format dataset written by the tests themselves and a small ConvNet, seconds long.

A forker who replaces the task writes theirs in this file, with the same names (the regression's
is ``lib/tests/project/tests/task/tiny_job.py``): the project's end-to-end tests and the
conformance checks then train it.
"""

from pathlib import Path

from tests.idx_data import make_dataset

# Sizes chosen so no split divides evenly by 2, 3 or 4 devices.
N_TRAIN = 403  # the official train split, validation carved from it
N_TEST = 131
VAL_SIZE = 67
BATCH_SIZE = 32  # global: (N_TRAIN - VAL_SIZE) // BATCH_SIZE = 10 steps an epoch
DATA_NAME = "mnist"  # data.name: the MLflow experiment the tiny job's runs go to


def write_data(root: Path) -> None:
    """The tiny dataset, under ``root`` (the noise plus a square whose place is the label)."""
    make_dataset(root, n_train=N_TRAIN, n_test=N_TEST, seed=7, learnable=True)


def overrides(root: Path) -> list[str]:
    """A 2-epoch job on the data of ``root``, with a small network."""
    return [
        f"data.root={root}",
        "data.download=false",
        f"data.val_size={VAL_SIZE}",
        f"data.batch_size={BATCH_SIZE}",
        "model.net.channels=[8,16]",
        "model.net.hidden=32",
        "model.lr=0.01",
        "trainer.max_epochs=2",
        "callbacks.progress_bar=none",
    ]
