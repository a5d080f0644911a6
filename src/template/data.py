"""The data contract: what the machinery needs from a dataset, and nothing more.

A dataset is a :class:`TensorDataModule` subclass that implements :meth:`~TensorDataModule.read`
(the official ``"train"`` and ``"test"`` splits as an inputs tensor and a targets tensor, one
row per sample), saves its config as hyperparameters (``self.save_hyperparameters(logger=False)``:
at least ``name``, ``batch_size``, ``val_size``, ``num_workers``, ``split_seed``,
``shuffle_seed``, ``pin_memory`` and ``device_resident``) and sets ``source`` (where the files
are, for the MLflow dataset record). It may override :meth:`~TensorDataModule.check` (refuse
malformed splits) and :meth:`~TensorDataModule.transform` (what turns a batch of stored inputs
into model inputs, e.g. uint8 pixels into normalised floats).

The base class does the rest the same way for every dataset: validation carved from train with
its own generator, stable per-sample indices (position in the official split), a digest per
split, whole-batch fetches, and the samplers that make results independent of the world size.
"""

import copy
import hashlib
from typing import Any, NamedTuple

import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, Sampler

from src.template.resume import GlobalBatchSampler, resume_position


class DataError(RuntimeError):
    """Bad or missing data: the message says what is wrong and how to fix it."""


class Batch(NamedTuple):
    inputs: Tensor  # what the model takes, [B, ...]
    targets: Tensor  # [B, ...]
    indices: Tensor  # int64 [B], position in the official split


def keep_batch(batch: Batch) -> Batch:
    """collate_fn: __getitems__ already returns a collated Batch (module-level so it pickles)."""
    return batch


class TensorSplit(Dataset):
    """One split in memory, fetched a whole batch at a time (one vectorised index per batch)."""

    def __init__(
        self,
        inputs: Tensor,
        targets: Tensor,
        indices: Tensor | None = None,
        transform: nn.Module | None = None,
    ) -> None:
        self.inputs, self.targets, self.transform = inputs, targets, transform
        self.indices = torch.arange(len(inputs)) if indices is None else indices

    def __len__(self) -> int:
        return len(self.targets)

    def digest(self) -> str:
        """MD5 of the split's inputs and targets: tells whether two runs saw the same data."""
        md5 = hashlib.md5(self.inputs.cpu().numpy().tobytes())
        md5.update(self.targets.cpu().numpy().tobytes())
        return md5.hexdigest()

    def to(self, device: torch.device) -> "TensorSplit":
        """This split on ``device`` (a copy; the original stays for digests and figures)."""
        moved = copy.copy(self)
        moved.inputs, moved.targets = self.inputs.to(device), self.targets.to(device)
        moved.indices = self.indices.to(device)
        moved.transform = copy.deepcopy(self.transform).to(device) if self.transform else None
        return moved

    def __getitems__(self, indices: list[int]) -> Batch:
        idx = torch.as_tensor(indices, dtype=torch.long, device=self.inputs.device)
        inputs = self.inputs[idx]
        if self.transform is not None:
            inputs = self.transform(inputs)
        return Batch(inputs, self.targets[idx], self.indices[idx])

    def __getitem__(self, i: int) -> Batch:
        return Batch(*(part[0] for part in self.__getitems__([i])))


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


def fitting_batch(samples: int) -> int:
    """A batch size to suggest for ``samples`` training samples: the largest power of two that
    fits (it divides over any power-of-two number of devices)."""
    return 1 << (max(samples, 1).bit_length() - 1)


def carve_validation(n: int, hparams: Any) -> tuple[Tensor, Tensor]:
    """(validation, training) indices of an official training split of ``n`` samples: a
    permutation fixed by ``split_seed``, of which validation is the first ``val_size``, or with
    ``folds=K``, fold ``fold`` of K equal parts (k-fold cross-validation: a sweep over
    ``data.fold=0,...,K-1``)."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(hparams.split_seed))
    folds, fold = hparams.get("folds"), hparams.get("fold") or 0
    if not folds:
        return perm[: hparams.val_size], perm[hparams.val_size :]
    if not 2 <= folds <= n or not 0 <= fold < folds:
        raise DataError(
            f"data.folds={folds} data.fold={fold}: use 2 <= folds <= {n} and 0 <= fold < folds, "
            "e.g. data.folds=5 data.fold=0,1,2,3,4 (a sweep)"
        )
    start, end = n * fold // folds, n * (fold + 1) // folds
    return perm[start:end], torch.cat([perm[:start], perm[end:]])


class TensorDataModule(LightningDataModule):
    """Train and validation carved from the official train split, test is the test split; the
    loaders give exact results for any number of devices. Subclasses implement :meth:`read`."""

    # Config keys that say what the data is (not where it is or how it is loaded): eval and
    # predict take them from the checkpoint, and resuming with other values is refused.
    CONTENT_KEYS: tuple[str, ...] = ("name", "val_size", "split_seed", "folds", "fold")

    source: str

    def __init__(self) -> None:
        super().__init__()
        self.per_device_batch_size = 0  # set by setup() once the world size is known
        self.predict_split = "test"  # set by the predict entry point
        self.train_set: TensorSplit | None = None
        self.val_set: TensorSplit | None = None
        self.test_set: TensorSplit | None = None
        self._on_device: dict[int, TensorSplit] = {}  # data.device_resident: id(split) -> copy

    # --- what a dataset implements

    def read(self, split: str) -> tuple[Tensor, Tensor]:
        """The official ``"train"`` or ``"test"`` split: inputs ``[N, ...]``, targets ``[N, ...]``.

        Raise :class:`DataError` naming the file or folder for anything missing or malformed.
        """
        raise NotImplementedError

    def check(self, split: str, inputs: Tensor, targets: Tensor) -> None:
        """Refuse (:class:`DataError`) a split that does not fit this dataset's settings."""

    def transform(self) -> nn.Module | None:
        """Stored inputs of a batch -> model inputs (called after the train split is read)."""
        return None

    # --- what the machinery uses

    @property
    def name(self) -> str:
        return self.hparams.name

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
        if stage in (None, "fit"):
            self._check_batch_fits()
        if stage in (None, "test") or (stage == "predict" and self.predict_split == "test"):
            self._load_test()

    def _checked(self, split: str) -> tuple[Tensor, Tensor]:
        inputs, targets = self.read(split)
        self.check(split, inputs, targets)
        return inputs, targets

    def _load_train(self) -> None:
        if self.train_set is not None:  # setup may run more than once
            return
        inputs, targets = self._checked("train")
        n, val_size = len(targets), self.hparams.val_size
        if not self.hparams.get("folds") and not 0 < val_size < n:
            val = max(1, n // 10)  # suggested, with a batch size that fits what it leaves
            fix = f"; use e.g. data.val_size={val}" if n > 1 else ""
            if n > 1 and self.hparams.batch_size > n - val:
                fix += f" data.batch_size={fitting_batch(n - val)}"
            raise DataError(
                f"data.val_size={val_size} must be in (0, {n}) for {n} training samples{fix}"
            )
        val_idx, train_idx = carve_validation(n, self.hparams)
        transform = self.transform()
        self.val_set = TensorSplit(inputs[val_idx], targets[val_idx], val_idx, transform)
        self.train_set = TensorSplit(inputs[train_idx], targets[train_idx], train_idx, transform)

    def _check_batch_fits(self) -> None:
        """Training drops an incomplete last global batch: a training split smaller than one
        batch would train on nothing (refused here, before any rank or run starts)."""
        left, batch = len(self.train_set), self.hparams.batch_size
        if batch > left:
            raise DataError(
                f"data.batch_size={batch} is larger than the {left} training samples left "
                f"after data.val_size={self.hparams.val_size}; use e.g. "
                f"data.batch_size={fitting_batch(left)}"
            )

    def _load_test(self) -> None:
        if self.test_set is None:
            inputs, targets = self._checked("test")
            self.test_set = TensorSplit(inputs, targets, transform=self.transform())

    def _world(self) -> tuple[int, int]:
        """(world size, global rank): what the samplers split the data over."""
        if self.trainer is None:
            return 1, 0
        return self.trainer.world_size, self.trainer.global_rank

    def _resident(self, dataset: TensorSplit) -> TensorSplit:
        """``data.device_resident``: the split moved to the training device once, so no batch is
        ever copied host-to-device."""
        if id(dataset) not in self._on_device:
            device = self.trainer.strategy.root_device if self.trainer else torch.device("cpu")
            self._on_device[id(dataset)] = dataset.to(device)
        return self._on_device[id(dataset)]

    def _loader(self, dataset: TensorSplit | None, sampler: Sampler) -> DataLoader:
        if dataset is None:
            raise DataError("dataloader requested before setup() loaded its split")
        resident = bool(self.hparams.get("device_resident"))
        workers = self.hparams.num_workers
        on_gpu = self.trainer is not None and self.trainer.strategy.root_device.type == "cuda"
        return DataLoader(
            self._resident(dataset) if resident else dataset,
            batch_size=self.per_device_batch_size,
            sampler=sampler,
            num_workers=workers,
            persistent_workers=workers > 0,
            # Only a GPU benefits; Lightning then copies pinned batches with non_blocking=True.
            pin_memory=self.hparams.pin_memory and on_gpu and not resident,
            collate_fn=keep_batch,
        )

    def _eval_loader(self, dataset: TensorSplit | None) -> DataLoader:
        """Every sample exactly once across ranks (none padded or dropped): exact val/test/predict
        metrics for any N. Lightning's own sampler for this; it leaves it in place."""
        world, rank = self._world()
        sampler = UnrepeatedDistributedSampler(dataset, world, rank, shuffle=False)
        return self._loader(dataset, sampler)

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
        splits = ("train", "val", "test")
        if self.predict_split not in splits:
            raise DataError(f"predict split {self.predict_split!r} must be one of {splits}")
        (self._load_test if self.predict_split == "test" else self._load_train)()
        return self._eval_loader(self.split(self.predict_split))

    def split(self, name: str) -> TensorSplit | None:
        """A loaded split by name: ``train``, ``val`` or ``test``."""
        return getattr(self, f"{name}_set")

    def state_dict(self) -> dict[str, Any]:
        return {}
