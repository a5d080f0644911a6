"""Image classification data: what every dataset of this task adds to the machinery's data
contract (:mod:`src.template.data`): the image shape networks are built for, class names, and
the per-channel normalisation that turns stored ``uint8`` pixels into model inputs."""

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor, nn
from torch.utils.data import DataLoader

from src.task.data.augment import AugmentedSplit, EpochTaggedSampler, check_augment
from src.template.data import DataError, TensorDataModule
from src.template.resume import resume_position

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


def read_images(image_at: Callable[[int], np.ndarray], indices: Sequence[int]) -> Tensor:
    """Images ``indices`` (each ``uint8 [H, W, C]``) as ``uint8 [N, C, H, W]``, each decoded
    straight into its place, a range of them per thread (Pillow decodes without the GIL)."""
    first = image_at(indices[0]).transpose(2, 0, 1)
    images = torch.empty((len(indices), *first.shape), dtype=torch.uint8)
    into = images.numpy()  # a view: each image is copied once, from the decoder into place
    into[0] = first

    def decode_range(start: int) -> None:  # not a future per image: millions would not fit
        for i in range(max(start, 1), min(start + 256, len(indices))):
            into[i] = image_at(indices[i]).transpose(2, 0, 1)

    with ThreadPoolExecutor(max_workers=os.cpu_count()) as pool:
        list(pool.map(decode_range, range(0, len(indices), 256)))
    return images


def pixel_counts(images: Tensor, chunk_bytes: int = 1 << 23) -> Tensor:
    """How often each value 0-255 occurs in each channel of ``uint8 [N, C, H, W]`` images, a
    chunk at a time: exact, and no float copy of the split."""
    counts = torch.zeros(images.shape[1], 256, dtype=torch.long)
    step = max(1, chunk_bytes // max(1, images[0].numel()))
    for start in range(0, len(images), step):
        for channel in range(images.shape[1]):
            values = images[start : start + step, channel].reshape(-1)
            counts[channel] += torch.bincount(values, minlength=256)
    return counts


def channel_statistics(counts: Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and (sample) standard deviation of ``[0, 1]`` pixels from
    :func:`pixel_counts`, exact up to the final division; std at least 1e-6."""
    levels = torch.arange(256, dtype=torch.long)
    n = int(counts[0].sum())
    total = (counts * levels).sum(dim=1).tolist()
    squares = (counts * levels**2).sum(dim=1).tolist()
    mean = tuple(s / n / 255 for s in total)
    variance = [(n * q - s * s) / (n * max(n - 1, 1)) for s, q in zip(total, squares, strict=True)]
    return mean, tuple(max(v**0.5 / 255, 1e-6) for v in variance)


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
