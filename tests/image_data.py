"""Tiny image-folder datasets written by the tests themselves: PNG files in class folders."""

from pathlib import Path

import numpy as np
from PIL import Image

CLASSES = ("circle", "cross", "dot", "square", "stripe")


def learnable_image(label: int, size: tuple[int, int], channels: int, rng) -> np.ndarray:
    """Noise plus a bright block whose position and colour encode the label."""
    height, width = size
    image = rng.integers(0, 80, (height, width, channels), dtype=np.uint8)
    rows, cols = height // 3, width // 3
    row, col = divmod(label, 3)
    image[row * rows : (row + 1) * rows, col * cols : (col + 1) * cols, label % channels] = 255
    return image


def make_image_folder(
    root: Path,
    n_train: int = 12,
    n_test: int = 5,
    size: tuple[int, int] = (32, 32),
    channels: int = 3,
    seed: int = 0,
    classes: tuple[str, ...] = CLASSES,
    suffix: str = ".png",
) -> Path:
    """``root/{train,test}/<class>/<n>.png`` (or ``suffix``: ``.jpg``): ``n_train``/``n_test``
    images per class."""
    rng = np.random.default_rng(seed)
    mode = {1: "L", 3: "RGB"}[channels]
    for split, count in (("train", n_train), ("test", n_test)):
        for label, name in enumerate(classes):
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                pixels = learnable_image(label, size, channels, rng)
                Image.fromarray(pixels.squeeze(-1) if channels == 1 else pixels, mode).save(
                    folder / f"{i:04d}{suffix}"
                )
    return root


def spoil(root: Path) -> list[Path]:
    """What a real folder holds besides its images (issue 60): three truncated files (two in
    train/, one in test/: each cut in half), a ``.txt`` in a class folder and a grayscale PNG
    among RGB images. The truncated files, in listing order."""
    files = (
        sorted((root / "train").rglob("0001.*"))[:2] + sorted((root / "test").rglob("0000.*"))[:1]
    )
    for path in files:
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    first = sorted((root / "train").iterdir())[0]
    (first / "notes.txt").write_text("not an image")
    with Image.open(sorted(first.glob("0002.*"))[0]) as image:
        image.convert("L").save(first / "gray.png")
    return files
