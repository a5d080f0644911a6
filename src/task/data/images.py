"""Image classification data: what every dataset of this task adds to the machinery's data
contract (:mod:`lightning_exact.data`): the image shape networks are built for, class names, and
the per-channel normalisation that turns stored ``uint8`` pixels into model inputs."""

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch
from lightning_exact import DataError, TensorDataModule, resume_position
from PIL import Image
from torch import Tensor, nn
from torch.utils.data import DataLoader

from src.task.data.augment import AugmentedSplit, EpochTaggedSampler, check_augment

MODES = {1: "L", 3: "RGB"}


def decode_image(
    file: str | Path | IO[bytes], channels: int, size: Sequence[int] | None = None
) -> np.ndarray:
    """An image file as ``uint8 [H, W, C]``, at its own size or resized to ``size`` (H, W):
    the one decoding of every path (in memory, shards, predict), so all see the same pixels."""
    return decode_source(file, channels, size)[0]


def decode_source(
    file: str | Path | IO[bytes], channels: int, size: Sequence[int] | None = None
) -> tuple[np.ndarray, int, int, str]:
    """:func:`decode_image`, and the file's own height, width and mode (what it was before it
    was converted and resized: src.task.data.survey says where they differ)."""
    with Image.open(file) as image:
        width, height = image.size
        mode = image.mode
        if image.mode.startswith("I"):  # 16- or 32-bit integers: scale, do not clip
            image = Image.fromarray(
                (np.asarray(image, np.float64) / 257).clip(0, 255).astype(np.uint8)
            )
        image = image.convert(MODES[channels])
        if size is not None and image.size != (size[1], size[0]):
            image = image.resize((size[1], size[0]), Image.Resampling.BILINEAR)
        pixels = np.asarray(image, dtype=np.uint8)  # read-only: callers copy it where it goes
    return pixels.reshape(pixels.shape[0], pixels.shape[1], -1), height, width, mode


class Normalize(nn.Module):
    """uint8 pixels ``[B, C, H, W]`` -> normalised float32, per channel."""

    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        super().__init__()
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1))

    def forward(self, images: Tensor) -> Tensor:
        return images.float().div(255).sub_(self.mean).div_(self.std)


ROWS_PER_TASK = 256  # images one decoding thread takes at a time: not a future per image


class PixelSums:
    """Per-channel count, sum and sum of squares of ``uint8`` pixels, added an image at a time
    as it is decoded: a split's mean and std from the decoding pass itself, without a second
    pass or a float copy of the split. Exact: an image's sums are taken in float64 (integers
    below 2**53) and kept as int64, so the statistics are those of every pixel at once."""

    def __init__(self, channels: int) -> None:
        self.pixels = 0  # per channel
        self.total = np.zeros(channels, np.int64)
        self.squares = np.zeros(channels, np.int64)

    def add(self, image: np.ndarray) -> None:
        """One ``uint8 [C, H, W]`` image."""
        values = image.reshape(len(self.total), -1).astype(np.float64)
        self.pixels += values.shape[1]
        self.total += values.sum(axis=1).astype(np.int64)
        self.squares += np.einsum("ij,ij->i", values, values).astype(np.int64)

    def merge(self, other: "PixelSums") -> None:
        self.pixels += other.pixels
        self.total += other.total
        self.squares += other.squares

    def statistics(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """Per-channel mean and (sample) standard deviation of ``[0, 1]`` pixels, exact up to
        the final division; std at least 1e-6."""
        n = self.pixels
        mean = tuple(s / n / 255 for s in self.total.tolist())
        pairs = zip(self.total.tolist(), self.squares.tolist(), strict=True)
        variance = [(n * q - s * s) / (n * max(n - 1, 1)) for s, q in pairs]
        return mean, tuple(max(v**0.5 / 255, 1e-6) for v in variance)


def read_images(
    image_at: Callable[[int], np.ndarray | None],
    indices: Sequence[int],
    shape: Sequence[int],
    sums: PixelSums | None = None,
) -> Tensor:
    """Images ``indices`` (each ``uint8 [H, W, C]``; None for a file that did not decode: its
    row zeros) as one ``uint8 [N, C, H, W]`` tensor of ``shape`` (C, H, W), allocated once and
    filled in place, a range of rows per thread (Pillow decodes without the GIL). Each image is
    copied once, from the decoder into its row, and, with ``sums``, added to them there (the
    split's statistics in the same pass)."""
    images = torch.empty((len(indices), *shape), dtype=torch.uint8)
    into = images.numpy()  # a view: its pages are touched as rows are written

    def decode_range(start: int) -> PixelSums | None:
        part = PixelSums(shape[0]) if sums is not None else None  # one per thread: no lock
        for row in range(start, min(start + ROWS_PER_TASK, len(indices))):
            pixels = image_at(indices[row])
            if pixels is None:
                into[row] = 0
                continue
            into[row] = pixels.transpose(2, 0, 1)
            if part is not None:
                part.add(into[row])
        return part

    with ThreadPoolExecutor(max_workers=os.cpu_count()) as pool:
        for part in pool.map(decode_range, range(0, len(indices), ROWS_PER_TASK)):
            if sums is not None and part is not None:
                sums.merge(part)
    return images


class ImageDataModule(TensorDataModule):
    """Splits of ``uint8 [N, C, H, W]`` images and ``int64`` labels. A subclass sets, in its
    ``__init__``: ``image_shape`` (C, H, W), ``classes`` (names, index = label), ``mean`` and
    ``std`` (per channel, of ``[0, 1]`` pixels; may be set by ``read("train")``) and ``source``."""

    image_shape: tuple[int, int, int]
    classes: tuple[str, ...]
    mean: tuple[float, ...]
    std: tuple[float, ...]

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def check(self, split: str, inputs: Tensor, targets: Tensor) -> None:
        if inputs.ndim != 4 or inputs.dtype != torch.uint8:
            raise DataError(f"{self.source}: {split} images must be uint8 [N, C, H, W]")
        if tuple(inputs.shape[1:]) != tuple(self.image_shape):
            raise DataError(
                f"{self.source}: {split} images are {tuple(inputs.shape[1:])}, "
                f"expected (C, H, W) = {tuple(self.image_shape)}"
            )
        if len(targets) and int(targets.max()) >= self.num_classes:
            raise DataError(
                f"{self.source}: {split} label {int(targets.max())} outside "
                f"[0, {self.num_classes}); wrong dataset in this folder?"
            )

    def sample_source(self, split: str) -> tuple[Tensor, Callable[[int], np.ndarray]]:
        """The split's labels and image ``i`` as ``uint8 [H, W, C]``, for src.prepare. Here the
        split is read whole; a dataset of files reads one at a time (image_folder)."""
        inputs, targets = self.read_checked(split)
        images = inputs.permute(0, 2, 3, 1).numpy()  # a view
        return targets, images.__getitem__

    def transform(self) -> nn.Module:
        return Normalize(self.mean, self.std)

    def train_dataloader(self) -> DataLoader:
        """With ``data.augment``: the same global batches, each sample augmented as a function
        of (shuffle seed, epoch, sample index) (:mod:`src.task.data.augment`)."""
        settings = check_augment(self.hparams.get("augment"))
        if settings is None:
            return super().train_dataloader()
        if self.hparams.get("device_resident"):
            raise DataError("data.augment runs in the loader; set data.device_resident=false")
        seed = self.hparams.shuffle_seed
        sampler = EpochTaggedSampler(
            self.train_set, *self.world_and_rank(), self.hparams.batch_size, seed
        )
        sampler.resume_at(*resume_position(self.trainer))  # before any worker fetches
        augmented = AugmentedSplit(
            self.train_set, settings, seed, self.mean, self.std, self.image_shape
        )
        return self.loader(augmented, sampler)

    def state_dict(self) -> dict[str, Any]:
        """Saved in checkpoints: eval and predict normalise as training did (also where the
        statistics were computed from the training split) and know the class names."""
        return {"mean": self.mean, "std": self.std, "classes": list(self.classes)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        trained = tuple(state_dict.get("classes", self.classes))
        if trained != tuple(self.classes):
            raise DataError(
                f"{self.source} has classes {list(self.classes)} but the model was trained on "
                f"{list(trained)}; use data that has the same classes"
            )
        self.mean = state_dict.get("mean", self.mean)
        self.std = state_dict.get("std", self.std)
