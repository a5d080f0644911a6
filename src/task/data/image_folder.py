"""``data=image_folder``: images in class folders, ``<root>/train/<class>/*.png`` and
``<root>/test/<class>/*.jpg``, decoded once into the same in-memory ``uint8`` tensor the IDX
datasets use, so batches are sliced as fast."""

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch import Tensor

from src.task.data.augment import check_augment
from src.task.data.images import ImageDataModule
from src.template.data import DataError

EXTENSIONS = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp"}
MODES = {1: "L", 3: "RGB"}


def class_folders(split_dir: Path) -> list[Path]:
    """The class folders of one split, sorted by name (label = position)."""
    if not split_dir.is_dir():
        raise DataError(
            f"{split_dir} is not a folder: data.root must hold train/ and test/, each with one "
            "sub-folder of images per class"
        )
    folders = sorted(p for p in split_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not folders:
        raise DataError(f"{split_dir} has no class folders (one sub-folder of images per class)")
    return folders


def image_files(folder: Path) -> list[Path]:
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in EXTENSIONS)
    if not files:
        raise DataError(f"{folder} holds no images ({', '.join(sorted(EXTENSIONS))})")
    return files


def decode(path: Path, mode: str, size: tuple[int, int]) -> np.ndarray:
    """One image as ``uint8 [H, W, C]`` in ``mode``, resized to ``size`` (H, W) if needed."""
    try:
        with Image.open(path) as image:
            if image.mode.startswith("I"):  # 16- or 32-bit integers: scale, do not clip
                image = Image.fromarray(
                    (np.asarray(image, np.float64) / 257).clip(0, 255).astype(np.uint8)
                )
            image = image.convert(mode)
            if image.size != (size[1], size[0]):
                image = image.resize((size[1], size[0]), Image.Resampling.BILINEAR)
            return np.asarray(image, dtype=np.uint8).reshape(size[0], size[1], -1)
    except (OSError, UnidentifiedImageError, ValueError) as error:
        raise DataError(f"{path}: not a readable image ({error}); remove or replace it") from error


def read_folder(
    split_dir: Path, classes: Sequence[str], channels: int, size: tuple[int, int]
) -> tuple[Tensor, Tensor]:
    """Every image of one split as ``uint8 [N, C, H, W]`` and its ``int64`` labels, in (class,
    file name) order: a sample's index is stable as long as the folder does not change. Each
    image is decoded straight into its place: memory is the split's pixels, once."""
    files, labels = [], []
    for label, name in enumerate(classes):
        found = image_files(split_dir / name)
        files += found
        labels += [label] * len(found)
    images = torch.empty((len(files), channels, *size), dtype=torch.uint8)

    def decode_range(start: int) -> None:  # a range per task: no future per image
        for i in range(start, min(start + 256, len(files))):
            image = decode(files[i], MODES[channels], size)
            images[i] = torch.from_numpy(image.copy()).permute(2, 0, 1)

    with ThreadPoolExecutor(max_workers=os.cpu_count()) as pool:  # Pillow decodes without the GIL
        list(pool.map(decode_range, range(0, len(files), 256)))
    return images, torch.tensor(labels, dtype=torch.long)


def channel_statistics(images: Tensor, chunk_bytes: int = 1 << 23) -> tuple[list, list]:
    """Per-channel mean and standard deviation of ``[0, 1]`` pixels, from exact counts of each
    pixel value, a chunk of images at a time: no float copy of the split."""
    channels, pixels = images.shape[1], images[0, 0].numel()
    counts = torch.zeros(channels, 256, dtype=torch.long)
    step = max(1, chunk_bytes // images[0].numel())
    for start in range(0, len(images), step):
        for channel in range(channels):
            values = images[start : start + step, channel].reshape(-1)
            counts[channel] += torch.bincount(values, minlength=256)
    n, levels = len(images) * pixels, torch.arange(256, dtype=torch.long)
    total, squares = (counts * levels).sum(dim=1).tolist(), (counts * levels**2).sum(dim=1).tolist()
    mean = [s / n / 255 for s in total]
    variance = [
        (n * q - s * s) / (n * max(n - 1, 1)) / 255**2 for s, q in zip(total, squares, strict=True)
    ]
    return mean, [v**0.5 for v in variance]


class ImageFolderDataModule(ImageDataModule):
    """Classes are the sub-folders of ``train/`` (``test/`` must have the same ones); images
    are decoded as ``channels`` (1: grayscale, 3: RGB) at ``image_size`` (H, W)."""

    CONTENT_KEYS = (*ImageDataModule.CONTENT_KEYS, "image_size", "channels", "mean", "std")

    def __init__(
        self,
        name: str,
        root: str,
        image_size: Sequence[int],
        channels: int,
        batch_size: int,
        val_size: int,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        num_workers: int = 0,
        split_seed: int = 12345,
        shuffle_seed: int = 0,
        pin_memory: bool = False,
        device_resident: bool = False,
        augment: dict | None = None,
        folds: int | None = None,
        fold: int = 0,
    ) -> None:
        if channels not in MODES:
            raise DataError(f"data.channels={channels} must be 1 (grayscale) or 3 (RGB)")
        size = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
        if len(size) != 2 or min(size) < 1:
            raise DataError(f"data.image_size={image_size} must be [height, width] or one side")
        super().__init__()
        check_augment(augment)
        self.save_hyperparameters(logger=False)  # stored in checkpoints; tracking logs the config
        self.root = Path(root).expanduser()
        self.image_shape = (channels, *size)
        self.source = str(self.root.resolve())
        self.classes = tuple(folder.name for folder in class_folders(self.root / "train"))
        self.mean = tuple(mean) if mean is not None else None
        self.std = tuple(std) if std is not None else None

    def prepare_data(self) -> None:
        test_classes = tuple(folder.name for folder in class_folders(self.root / "test"))
        if test_classes != self.classes:
            raise DataError(
                f"{self.root}/test has classes {list(test_classes)} but {self.root}/train has "
                f"{list(self.classes)}; both need the same class folders"
            )

    def read(self, split: str) -> tuple[Tensor, Tensor]:
        channels, *size = self.image_shape
        images, labels = read_folder(self.root / split, self.classes, channels, tuple(size))
        if split == "train" and self.mean is None:
            # Per-channel statistics of the training pixels (set data.mean/std to fix them).
            mean, std = channel_statistics(images)
            self.mean, self.std = tuple(mean), tuple(max(value, 1e-6) for value in std)
        return images, labels
