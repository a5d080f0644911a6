"""The data contract: what the template's machinery needs from a dataset, and nothing more.

A dataset is an :class:`ImageDataModule` subclass that implements :meth:`~ImageDataModule.read`
(the official train and test splits as one ``uint8 [N, C, H, W]`` tensor and ``int64`` labels),
saves its config as hyperparameters (``self.save_hyperparameters(logger=False)``: at least
``name``, ``batch_size``, ``val_size``, ``num_workers``, ``split_seed``, ``shuffle_seed``,
``pin_memory`` and ``device_resident``, the keys every ``conf/data/*.yaml`` has) and sets, in
its ``__init__``:

* ``image_shape`` -- ``(C, H, W)`` of every image; networks are built from it;
* ``classes`` -- class names, index = label;
* ``mean``, ``std`` -- per-channel normalisation of ``[0, 1]`` pixels (figures undo it);
* ``source`` -- where the files are, for the MLflow dataset record.

The base class does the rest the same way for every dataset: validation carved from train with
its own generator (``val_size``, ``split_seed``), stable per-sample indices (position in the
official split), a digest per split, batched fetches (one vectorised index per batch, no
per-sample Python) and the samplers that make results independent of the world size.
"""

import copy
import hashlib
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from lightning.pytorch import LightningDataModule
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Sampler

from src.template.checkpoint import resume_position
from src.template.distributed import GlobalBatchSampler, UnpaddedSampler

SPLITS = ("train", "val", "test")


class DataError(RuntimeError):
    """Bad or missing data: the message says what is wrong and how to fix it."""


class Batch(NamedTuple):
    images: Tensor  # float32 [B, C, H, W], normalised
    labels: Tensor  # int64 [B]
    indices: Tensor  # int64 [B], position in the official split


def keep_batch(batch: Batch) -> Batch:
    """collate_fn: __getitems__ already returns a collated Batch (module-level so it pickles)."""
    return batch


class ImageBatches(Dataset):
    """One split in memory (``uint8 [N, C, H, W]``), fetched a whole batch at a time."""

    def __init__(
        self,
        images: Tensor,
        labels: Tensor,
        mean: Sequence[float],
        std: Sequence[float],
        source_indices: Tensor | None = None,
    ) -> None:
        if images.ndim != 4 or images.dtype != torch.uint8:
            raise ValueError(
                f"images must be uint8 [N, C, H, W], got {images.dtype} {images.shape}"
            )
        self.images, self.labels = images, labels
        self.mean = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
        self.source_indices = (
            torch.arange(len(images)) if source_indices is None else source_indices
        )

    def __len__(self) -> int:
        return len(self.labels)

    def digest(self) -> str:
        """MD5 of the split's pixels and labels: tells whether two runs saw the same data."""
        md5 = hashlib.md5(self.images.numpy().tobytes())
        md5.update(self.labels.numpy().tobytes())
        return md5.hexdigest()

    def to(self, device: torch.device) -> "ImageBatches":
        """This split on ``device`` (a copy; the original stays for digests and figures)."""
        moved = copy.copy(self)
        for name in ("images", "labels", "mean", "std", "source_indices"):
            setattr(moved, name, getattr(self, name).to(device))
        return moved

    def __getitems__(self, indices: list[int]) -> Batch:
        idx = torch.as_tensor(indices, dtype=torch.long, device=self.images.device)
        images = self.images[idx].float().div_(255).sub_(self.mean).div_(self.std)
        return Batch(images, self.labels[idx], self.source_indices[idx])

    def __getitem__(self, i: int) -> Batch:
        batch = self.__getitems__([i])
        return Batch(batch.images[0], batch.labels[0], batch.indices[0])


def per_device_batch_size(global_batch: int, world_size: int, training: bool = True) -> int:
    """The configured batch size is global so results don't change with the device count.

    Training needs equal shares of every global batch; evaluation splits the data by samples,
    so there each device takes up to ``ceil(batch_size / world_size)`` samples at a time.
    """
    if global_batch <= 0:
        raise DataError(f"data.batch_size={global_batch} must be 1 or more")
    if not training:
        return -(-global_batch // world_size)
    if global_batch % world_size:
        nearest = max(world_size, round(global_batch / world_size) * world_size)
        raise DataError(
            f"data.batch_size={global_batch} is the global batch size and must be divisible by "
            f"the world size {world_size} (devices x num_nodes); use e.g. data.batch_size={nearest}"
        )
    return global_batch // world_size


class ImageDataModule(LightningDataModule):
    """Train and validation carved from the official train split, test is the test split; the
    loaders give exact results for any number of devices. Subclasses implement :meth:`read`."""

    # Config keys that say what the data is (not where it is or how it is loaded): eval and
    # predict take them from the checkpoint, and resuming with other values is refused.
    CONTENT_KEYS: tuple[str, ...] = ("name", "val_size", "split_seed")

    image_shape: tuple[int, int, int]
    classes: tuple[str, ...]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    source: str

    def __init__(self) -> None:
        super().__init__()
        self.per_device_batch_size = 0  # set by setup() once the world size is known
        self.predict_split = "test"  # set by the predict entry point
        self.train_set: ImageBatches | None = None
        self.val_set: ImageBatches | None = None
        self.test_set: ImageBatches | None = None
        self._on_device: dict[int, ImageBatches] = {}  # data.device_resident: id(split) -> copy

    # --- what a dataset implements

    def read(self, split: str) -> tuple[Tensor, Tensor]:
        """The official ``"train"`` or ``"test"`` split: ``uint8 [N, C, H, W]``, ``int64 [N]``.

        Raise :class:`DataError` naming the file or folder for anything missing or malformed.
        """
        raise NotImplementedError

    # --- what the machinery uses

    @property
    def name(self) -> str:
        return self.hparams.name

    @property
    def num_classes(self) -> int:
        return len(self.classes)

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

    def describe_splits(self) -> dict[str, tuple[int, str]]:
        """Size and content digest of each loaded split, for experiment tracking."""
        sets = {"train": self.train_set, "validation": self.val_set, "test": self.test_set}
        return {name: (len(data), data.digest()) for name, data in sets.items() if data is not None}

    def setup(self, stage: str | None = None) -> None:
        world = self.trainer.world_size if self.trainer is not None else 1
        self.per_device_batch_size = per_device_batch_size(
            self.hparams.batch_size, world, training=stage in (None, "fit")
        )
        self.load(stage)

    def load(self, stage: str | None = None) -> None:
        """Read and validate (once) the splits ``stage`` needs. The entry points call it before
        any run or process starts, so missing, corrupt or too-small data fails first."""
        if self.hparams.num_workers < 0:
            raise DataError(f"data.num_workers={self.hparams.num_workers} must be 0 or more")
        if self.hparams.get("device_resident") and self.hparams.num_workers:
            raise DataError(
                "data.device_resident=true slices batches on the device, in the main process; "
                "set data.num_workers=0"
            )
        if stage in (None, "fit", "validate") or (
            stage == "predict" and self.predict_split != "test"
        ):
            self._load_train()
        if stage in (None, "test") or (stage == "predict" and self.predict_split == "test"):
            self._load_test()

    def _checked(self, split: str) -> tuple[Tensor, Tensor]:
        images, labels = self.read(split)
        if tuple(images.shape[1:]) != tuple(self.image_shape):
            raise DataError(
                f"{self.source}: {split} images are {tuple(images.shape[1:])}, "
                f"expected (C, H, W) = {tuple(self.image_shape)}"
            )
        if len(labels) and int(labels.max()) >= self.num_classes:
            raise DataError(
                f"{self.source}: {split} label {int(labels.max())} outside "
                f"[0, {self.num_classes}); wrong dataset in this folder?"
            )
        return images, labels

    def _load_train(self) -> None:
        if self.train_set is not None:  # setup may run more than once
            return
        images, labels = self._checked("train")
        n, val_size = len(labels), self.hparams.val_size
        if not 0 < val_size < n:
            raise DataError(
                f"data.val_size={val_size} must be in (0, {n}) for {n} training samples"
            )
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.hparams.split_seed))
        val_idx, train_idx = perm[:val_size], perm[val_size:]
        m, s = self.mean, self.std
        self.val_set = ImageBatches(images[val_idx], labels[val_idx], m, s, val_idx)
        self.train_set = ImageBatches(images[train_idx], labels[train_idx], m, s, train_idx)

    def _load_test(self) -> None:
        if self.test_set is None:
            images, labels = self._checked("test")
            self.test_set = ImageBatches(images, labels, self.mean, self.std)

    def _world(self) -> tuple[int, int]:
        """(world size, global rank): what the samplers split the data over."""
        if self.trainer is None:
            return 1, 0
        return self.trainer.world_size, self.trainer.global_rank

    def _on_gpu(self) -> bool:
        return self.trainer is not None and self.trainer.strategy.root_device.type == "cuda"

    def _resident(self, dataset: ImageBatches) -> ImageBatches:
        """``data.device_resident``: the split's uint8 pixels moved to the training device once
        (MNIST's 60,000 images are 47 MB), so no batch is ever copied host-to-device."""
        if id(dataset) not in self._on_device:
            device = self.trainer.strategy.root_device if self.trainer else torch.device("cpu")
            self._on_device[id(dataset)] = dataset.to(device)
        return self._on_device[id(dataset)]

    def _loader(self, dataset: ImageBatches | None, sampler: Sampler) -> DataLoader:
        if dataset is None:
            raise DataError("dataloader requested before setup() loaded its split")
        resident = bool(self.hparams.get("device_resident"))
        workers = self.hparams.num_workers
        return DataLoader(
            self._resident(dataset) if resident else dataset,
            batch_size=self.per_device_batch_size,
            sampler=sampler,
            num_workers=workers,
            persistent_workers=workers > 0,
            # Only a GPU benefits; Lightning then copies pinned batches with non_blocking=True.
            pin_memory=self.hparams.pin_memory and self._on_gpu() and not resident,
            collate_fn=keep_batch,
        )

    def _eval_loader(self, dataset: ImageBatches | None) -> DataLoader:
        """Every sample exactly once across ranks: exact val/test/predict metrics for any N."""
        return self._loader(dataset, UnpaddedSampler(dataset, *self._world()))

    def train_dataloader(self) -> DataLoader:
        """The same global batches, in the same order, for any number of devices."""
        sampler = GlobalBatchSampler(
            self.train_set, *self._world(), self.hparams.batch_size, self.hparams.shuffle_seed
        )
        sampler.resume_at(*resume_position(self.trainer))  # before any worker fetches
        return self._loader(self.train_set, sampler)

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader(self.val_set)

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader(self.test_set)

    def predict_dataloader(self) -> DataLoader:
        if self.predict_split not in SPLITS:
            raise DataError(f"predict split {self.predict_split!r} must be one of {SPLITS}")
        (self._load_test if self.predict_split == "test" else self._load_train)()
        return self._eval_loader(getattr(self, f"{self.predict_split}_set"))

    def split(self, name: str) -> ImageBatches | None:
        """A loaded split by name: ``train``, ``val`` or ``test``."""
        return getattr(self, f"{name}_set")
