"""Train-time augmentation (``data.augment``): random resized crop, horizontal flip, colour
jitter, with torch ops only.

Each sample's randomness is a function of (seed, epoch, sample index) alone: the sampler hands
the loader ``(epoch, position)`` pairs, so the augmented batch is the same for any number of
devices or loader workers, and a resumed job draws what the uninterrupted one drew.
"""

import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from lightning_exact import Batch, DataError, GlobalBatchSampler
from torch import Tensor
from torch.utils.data import Dataset

KEYS = {"crop_scale", "crop_ratio", "flip", "jitter"}


def check_augment(augment: dict[str, Any] | None) -> dict[str, Any] | None:
    """``data.augment``: null (off) or a mapping of :data:`KEYS`; refuse anything else."""
    if not augment:
        return None
    unknown = set(augment) - KEYS
    if unknown:
        raise DataError(
            f"data.augment has unknown keys {sorted(unknown)}; valid: {', '.join(sorted(KEYS))}"
        )
    scale = augment.get("crop_scale")
    if scale is not None and not (len(scale) == 2 and 0 < scale[0] <= scale[1] <= 1):
        raise DataError(f"data.augment.crop_scale={scale} must be [low, high] in (0, 1]")
    jitter = float(augment.get("jitter") or 0)
    if not 0 <= jitter < 1:
        raise DataError(f"data.augment.jitter={jitter} must be in [0, 1)")
    return dict(augment)


class EpochTaggedSampler(GlobalBatchSampler):
    """The project's global batch order, each position handed out as ``(epoch, position)``."""

    def __iter__(self) -> Iterator[tuple[int, int]]:  # type: ignore[override]
        epoch = self.epoch
        return ((epoch, i) for i in super().__iter__())


def sample_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    state = np.random.SeedSequence([seed, epoch, index]).generate_state(1)[0]
    return torch.Generator().manual_seed(int(state))


def augment_one(
    image: Tensor, settings: dict[str, Any], generator: torch.Generator, size: Sequence[int]
) -> Tensor:
    """One float image ``[C, h, w]`` of ``[0, 1]`` pixels (any size: an image file's own),
    augmented with ``generator``, as ``[C, H, W]`` of ``size``: the crop is taken from the image
    as stored, then resized. The random draws come in one order: crop, flip, jitter."""
    _, height, width = image.shape
    box = (0, 0, height, width)  # top, left, height, width: the whole image
    if settings.get("crop_scale") is not None:
        box = random_crop(height, width, settings, generator)
    top, left, h, w = box
    if settings.get("crop_scale") is not None or (height, width) != tuple(size):
        crop = image[None, :, top : top + h, left : left + w]
        image = F.interpolate(
            crop, size=tuple(size), mode="bilinear", align_corners=False, antialias=True
        )[0]
    if settings.get("flip") and float(torch.rand((), generator=generator)) < 0.5:
        image = image.flip(-1)
    if jitter := float(settings.get("jitter") or 0):
        image = color_jitter(image, jitter, generator)
    return image


def uniform(generator: torch.Generator, low: float, high: float) -> float:
    return low + (high - low) * float(torch.rand((), generator=generator))


def random_crop(
    height: int, width: int, settings: dict[str, Any], generator: torch.Generator
) -> tuple[int, int, int, int]:
    """(top, left, height, width) of a crop of ``crop_scale`` of the area and an aspect ratio
    in ``crop_ratio``, as torchvision's RandomResizedCrop draws them."""
    ratio = settings.get("crop_ratio") or (3 / 4, 4 / 3)
    area = uniform(generator, *settings["crop_scale"]) * height * width
    aspect = math.exp(uniform(generator, math.log(ratio[0]), math.log(ratio[1])))
    h = min(height, max(1, round(math.sqrt(area / aspect))))
    w = min(width, max(1, round(math.sqrt(area * aspect))))
    top = int(torch.randint(0, height - h + 1, (), generator=generator))
    left = int(torch.randint(0, width - w + 1, (), generator=generator))
    return top, left, h, w


def color_jitter(image: Tensor, jitter: float, generator: torch.Generator) -> Tensor:
    """Brightness, contrast and (RGB) saturation, each scaled by a factor in 1 ± ``jitter``."""
    image = image * uniform(generator, 1 - jitter, 1 + jitter)  # brightness
    mean = image.mean()
    image = (image - mean) * uniform(generator, 1 - jitter, 1 + jitter) + mean  # contrast
    if image.shape[0] == 3:  # saturation
        weights = torch.tensor([0.299, 0.587, 0.114]).view(3, 1, 1)
        gray = (image * weights).sum(0, keepdim=True)
        image = (image - gray) * uniform(generator, 1 - jitter, 1 + jitter) + gray
    return image.clamp(0, 1)


class AugmentedSplit(Dataset):
    """A training split whose batches are augmented per sample; takes ``(epoch, position)``
    pairs from :class:`EpochTaggedSampler`. Reads the split's stored ``uint8`` pixels (shards:
    each image at its own size), augments each on ``[0, 1]`` pixels to ``image_shape`` and
    normalises it once."""

    def __init__(
        self,
        split: Dataset,
        settings: dict[str, Any],
        seed: int,
        mean: Sequence[float],
        std: Sequence[float],
        image_shape: Sequence[int],
    ) -> None:
        self.split = split
        self.settings = settings
        self.seed = seed
        self.shape = tuple(image_shape)
        self.mean = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)

    def __len__(self) -> int:
        return len(self.split)

    def stored(self, rows: list[int]) -> Sequence[Tensor]:
        """The rows' pixels before any transform: shards decode each at its own size."""
        if hasattr(self.split, "originals"):
            return self.split.originals(rows)
        return self.split.inputs[torch.as_tensor(rows, dtype=torch.long)]

    def __getitems__(self, items: list[tuple[int, int]]) -> Batch:
        rows = [position for _, position in items]
        idx = torch.as_tensor(rows, dtype=torch.long)
        indices = self.split.indices[idx]
        augmented = torch.empty((len(rows), *self.shape), dtype=torch.float32)
        images = self.stored(rows)
        for row, ((epoch, _), index) in enumerate(zip(items, indices.tolist(), strict=True)):
            generator = sample_generator(self.seed, epoch, index)
            pixels = images[row].float().div_(255)
            image = augment_one(pixels, self.settings, generator, self.shape[1:])
            torch.sub(image, self.mean, out=augmented[row]).div_(self.std)
        return Batch(augmented, self.split.targets[idx], indices)
