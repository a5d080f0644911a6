"""Image classification data: what every dataset of this task adds to the machinery's data
contract (:mod:`src.template.data`): the image shape networks are built for, class names, and
the per-channel normalisation that turns stored ``uint8`` pixels into model inputs."""

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from src.task.data.augment import AugmentedSplit, EpochTaggedSampler, check_augment
from src.template.data import DataError, TensorDataModule
from src.template.resume import resume_position


class Normalize(nn.Module):
    """uint8 pixels ``[B, C, H, W]`` -> normalised float32, per channel."""

    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        super().__init__()
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1))

    def forward(self, images: Tensor) -> Tensor:
        return images.float().div(255).sub_(self.mean).div_(self.std)


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
        sampler = EpochTaggedSampler(self.train_set, *self._world(), self.hparams.batch_size, seed)
        sampler.resume_at(*resume_position(self.trainer))  # before any worker fetches
        augmented = AugmentedSplit(self.train_set, settings, seed, self.mean, self.std)
        return self._loader(augmented, sampler)

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
        self.mean, self.std = state_dict.get("mean", self.mean), state_dict.get("std", self.std)
