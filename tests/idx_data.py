"""Tiny IDX datasets written by the tests themselves, in torchvision's raw layout."""

import gzip
from pathlib import Path

import numpy as np


def idx_bytes(array: np.ndarray) -> bytes:
    """Serialise a uint8 array in the big-endian IDX format."""
    header = (0x0800 | array.ndim).to_bytes(4, "big")
    header += b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    return header + array.astype(np.uint8).tobytes()


def write_idx(path: Path, array: np.ndarray) -> Path:
    """Write an IDX file, gzip-compressed when the name ends in .gz."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = idx_bytes(array)
    path.write_bytes(gzip.compress(data, mtime=0) if path.suffix == ".gz" else data)
    return path


def learnable_images(labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Noise plus a bright 7x7 square whose position encodes the label: a ConvNet learns it
    in one epoch, so tests can assert real accuracies."""
    images = rng.integers(0, 96, (len(labels), 28, 28), dtype=np.uint8)
    for i, label in enumerate(labels):
        row, col = divmod(int(label), 4)
        images[i, 7 * row : 7 * row + 7, 7 * col : 7 * col + 7] = 255
    return images


def make_dataset(
    root: Path,
    folder: str = "MNIST",
    n_train: int = 50,
    n_test: int = 17,
    seed: int = 0,
    gz: bool = True,
    learnable: bool = False,
) -> dict[str, np.ndarray]:
    """Write a tiny dataset in <root>/<folder>/raw and return its arrays by file name.

    Random pixels by default; ``learnable=True`` makes the label visible in the image.
    """
    rng = np.random.default_rng(seed)
    train_labels = rng.integers(0, 10, n_train, dtype=np.uint8)
    test_labels = rng.integers(0, 10, n_test, dtype=np.uint8)

    def images(labels: np.ndarray) -> np.ndarray:
        if learnable:
            return learnable_images(labels, rng)
        return rng.integers(0, 256, (len(labels), 28, 28), dtype=np.uint8)

    arrays = {
        "train-images-idx3-ubyte": images(train_labels),
        "train-labels-idx1-ubyte": train_labels,
        "t10k-images-idx3-ubyte": images(test_labels),
        "t10k-labels-idx1-ubyte": test_labels,
    }
    for name, array in arrays.items():
        write_idx(root / folder / "raw" / (f"{name}.gz" if gz else name), array)
    return arrays
