"""The GAN's tiny job for the machinery's end-to-end tests (``tests/conftest.py``): images shaped
as Fashion-MNIST's (28x28, 1 channel, 10 classes), written by the tests themselves."""

from pathlib import Path

from tests.idx_data import make_dataset

N_TRAIN = 403
N_TEST = 131
VAL_SIZE = 67
BATCH_SIZE = 32  # 10 batches an epoch
DATA_NAME = "fashion_mnist"
OPTIMIZER_STEPS_PER_BATCH = 2  # the generator's and the discriminator's


def write_data(root: Path) -> None:
    make_dataset(root, "FashionMNIST", n_train=N_TRAIN, n_test=N_TEST, seed=7, learnable=True)


def overrides(root: Path) -> list[str]:
    return [
        f"data.root={root}",
        "data.download=false",
        f"data.val_size={VAL_SIZE}",
        f"data.batch_size={BATCH_SIZE}",
        "trainer.max_epochs=2",
        "callbacks.progress_bar=none",
    ]
