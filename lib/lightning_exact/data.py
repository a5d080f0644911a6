"""The data contract: a :class:`TensorDataModule` subclass implements ``read`` (``check`` and
``transform`` optional), saves its config as hyperparameters (docs/make-it-yours.md) and sets
``source``; the base class carves validation and builds loaders exact for any device count."""

import copy
import hashlib
import multiprocessing
import os
import threading
from functools import partial
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from typing import Any, NamedTuple

import numpy as np
import torch
from lightning.fabric.utilities.seed import pl_worker_init_function
from lightning.pytorch import LightningDataModule
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, Sampler

from lightning_exact.checkpoints.resume import GlobalBatchSampler, resume_position


def worker_context(dataset: Dataset) -> BaseContext:
    """Loader workers forked from a single-threaded server that has imported the dataset's
    module already (Python 3.14's default on Linux), not from the rank: it runs threads (gloo's,
    ours), and a child forked while one holds a lock can hang (seen: 1 job in ~100 on 2 ranks)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([type(dataset).__module__])  # before its first start only
    return context


def watch_rank_and_seed(worker_id: int, rank: int) -> None:
    """worker_init_fn: end the loader worker when its rank process dies, and seed it as Lightning
    does after ``seed_everything(workers=True)`` (it adds none to a loader that has one). Torch
    ends a worker whose parent died, but a forkserver worker's parent is the forkserver, which
    its workers keep alive: after a SIGKILLed rank both would live on, holding memory."""
    rank_process = multiprocessing.parent_process()
    if rank_process is not None:
        threading.Thread(target=exit_after, args=(rank_process,), daemon=True).start()
    if int(os.environ.get("PL_SEED_WORKERS", 0)):
        pl_worker_init_function(worker_id, rank)


def exit_after(process: BaseProcess) -> None:
    process.join()
    os._exit(1)


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
        self.inputs = inputs
        self.targets = targets
        self.transform = transform
        self.indices = torch.arange(len(inputs)) if indices is None else indices

    def __len__(self) -> int:
        return len(self.targets)

    def digest(self) -> str:
        """MD5 of inputs and targets: tells whether two runs saw the same data."""
        md5 = hashlib.md5(np.ascontiguousarray(self.inputs.cpu().numpy()))  # hashed in place
        md5.update(np.ascontiguousarray(self.targets.cpu().numpy()))
        return md5.hexdigest()

    def to(self, device: torch.device) -> "TensorSplit":
        """A copy on ``device``; the original stays for digests and figures."""
        moved = copy.copy(self)
        moved.inputs = self.inputs.to(device)
        moved.targets = self.targets.to(device)
        moved.indices = self.indices.to(device)
        moved.transform = copy.deepcopy(self.transform).to(device) if self.transform else None
        return moved

    def __getitems__(self, indices: list[int]) -> Batch:
        idx = torch.as_tensor(indices, dtype=torch.long, device=self.inputs.device)
        inputs = self.inputs[idx]
        inputs = self.transform(inputs) if self.transform is not None else inputs
        return Batch(inputs, self.targets[idx], self.indices[idx])

    def __getitem__(self, i: int) -> Batch:
        return Batch(*(part[0] for part in self.__getitems__([i])))


def per_device_batch_size(global_batch: int, world_size: int, training: bool = True) -> int:
    """``batch_size`` is global, so results don't change with the device count: training needs
    equal shares of it; evaluation splits by samples (up to ``ceil(batch / world)`` each)."""
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
    """The largest power of two <= ``samples``: it divides over any power-of-two device count."""
    return 1 << (max(samples, 1).bit_length() - 1)


def carve_validation(n: int, hparams: Any) -> tuple[Tensor, Tensor]:
    """(validation, training) indices: the first ``val_size`` of a ``split_seed`` permutation,
    or with ``folds=K``, fold ``fold`` of K equal parts (a sweep over ``data.fold``). Both are
    in index order, the order a sharded copy stores them in (so both sum batches alike), and
    training keeps the read rows in place (:func:`drop_rows`). Sizes that do not fit are
    refused with ones that do."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(hparams.split_seed))
    folds = hparams.get("folds")
    fold = hparams.get("fold") or 0
    val_size = hparams.val_size
    if not folds and not 0 < val_size < n:
        val = max(1, n // 10)  # suggested, with a batch size that fits what it leaves
        fix = f"; use e.g. data.val_size={val}" if n > 1 else ""
        if n > 1 and hparams.batch_size > n - val:
            fix += f" data.batch_size={fitting_batch(n - val)}"
        raise DataError(
            f"data.val_size={val_size} must be in (0, {n}) for {n} training samples{fix}"
        )
    if not folds:
        return perm[:val_size].sort().values, perm[val_size:].sort().values
    if not 2 <= folds <= n or not 0 <= fold < folds:
        raise DataError(
            f"data.folds={folds} data.fold={fold}: use 2 <= folds <= {n} and 0 <= fold < folds, "
            "e.g. data.folds=5 data.fold=0,1,2,3,4 (a sweep)"
        )
    start = n * fold // folds
    end = n * (fold + 1) // folds
    return perm[start:end].sort().values, torch.cat([perm[:start], perm[end:]]).sort().values


def drop_rows(rows: Tensor, kept: Tensor, chunk_bytes: int = 1 << 25) -> Tensor:
    """``rows[kept]`` (``kept`` ascending) written over ``rows`` itself, at most ``chunk_bytes``
    at a time: the training split takes no second copy of what was read (peak memory its rows
    and one chunk, not 2x)."""
    row_bytes = rows[0].numel() * rows.element_size() if len(rows) else 1
    chunk = max(1, chunk_bytes // max(1, row_bytes))
    for start in range(0, len(kept), chunk):
        part = kept[start : start + chunk]
        rows[start : start + len(part)] = rows[part]  # never past a row still to be read
    return rows[: len(kept)]


class TensorDataModule(LightningDataModule):
    """Train and validation carved from the official train split; test is the test split."""

    # What the data is (not where or how it loads): eval and predict take these from the
    # checkpoint, and resuming with other values is refused.
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
        # Copies of the splits this machine's ranks have yet to read when this process reads
        # (each rank holds its own): set by the job before load(), so that a module can say
        # before reading that they will not fit in memory. 1 outside a job.
        self.copies_to_read = 1

    def read(self, split: str) -> tuple[Tensor, Tensor]:
        """The official ``"train"`` or ``"test"`` split as (inputs, targets), one row a sample,
        tensors of its own (the carve-out reuses their memory); a :class:`DataError` naming the
        file for anything missing or malformed."""
        raise NotImplementedError

    def check(self, split: str, inputs: Tensor, targets: Tensor) -> None:
        """Refuse (:class:`DataError`) a split that does not fit this dataset's settings."""

    def check_world_size(self, world_size: int) -> None:
        """Refuse (:class:`DataError`) a training job's world size that this data cannot be
        split over (sharded data read by partitions): called at start, before any run or rank
        exists, also for a job resumed on another number of ranks. The global batch's own
        divisibility is the template's check."""

    def transform(self) -> nn.Module | None:
        """Stored inputs of a batch -> model inputs (called after the train split is read)."""
        return None

    @property
    def name(self) -> str:
        return self.hparams.name

    def describe_splits(self) -> dict[str, tuple[int, str]]:
        """Size and content digest of each loaded split, for experiment tracking."""
        sets = {"train": self.train_set, "validation": self.val_set, "test": self.test_set}
        return {name: (len(data), data.digest()) for name, data in sets.items() if data is not None}

    def setup(self, stage: str | None = None) -> None:
        world = self.trainer.world_size if self.trainer is not None else 1
        training = stage in (None, "fit")
        self.per_device_batch_size = per_device_batch_size(self.hparams.batch_size, world, training)
        self.load(stage)

    def load(self, stage: str | None = None) -> None:
        """Read and check (once) the splits ``stage`` needs: the entry points call it first."""
        workers = self.hparams.num_workers
        if workers < 0:
            raise DataError(f"data.num_workers={workers} must be 0 or more")
        if self.hparams.get("device_resident") and workers:
            raise DataError(
                "data.device_resident=true slices batches on the device, in the main process; "
                "set data.num_workers=0"
            )
        splits = self.splits_for(stage)
        if "train" in splits:
            self.load_train()
        batch = self.hparams.batch_size  # training drops an incomplete last global batch
        if stage in (None, "fit") and batch > (left := len(self.train_set)):
            raise DataError(
                f"data.batch_size={batch} is larger than the {left} training samples left "
                f"after data.val_size={self.hparams.val_size}; use e.g. "
                f"data.batch_size={fitting_batch(left)}"
            )
        if "test" in splits:
            self.load_test()

    def splits_for(self, stage: str | None) -> tuple[str, ...]:
        """The official splits ``load(stage)`` reads: ``"train"`` (training and validation)
        and ``"test"``, or one of them."""
        predict_test = self.predict_split == "test"
        train = stage in (None, "fit", "validate") or (stage == "predict" and not predict_test)
        test = stage in (None, "test") or (stage == "predict" and predict_test)
        return ("train",) * train + ("test",) * test

    def read_checked(self, split: str) -> tuple[Tensor, Tensor]:
        """``read(split)``, then ``check`` on what it returned: what loading a split means."""
        inputs, targets = self.read(split)
        self.check(split, inputs, targets)
        return inputs, targets

    def load_train(self) -> None:
        """Set ``train_set`` and ``val_set`` (once): the validation samples carved from the
        official train split. Override for data that does not fit in memory (see shards.py)."""
        if self.train_set is not None:  # setup may run more than once
            return
        inputs, targets = self.read_checked("train")
        val_idx, train_idx = carve_validation(len(targets), self.hparams)
        transform = self.transform()
        # What read() returned holds both splits, each once: the training rows moved to its
        # front in place, the validation rows after them (copied out meanwhile).
        val_inputs = inputs[val_idx]
        train_inputs = drop_rows(inputs, train_idx)
        inputs[len(train_idx) : len(train_idx) + len(val_idx)] = val_inputs
        val_inputs = inputs[len(train_idx) : len(train_idx) + len(val_idx)]
        self.val_set = TensorSplit(val_inputs, targets[val_idx], val_idx, transform)
        self.train_set = TensorSplit(train_inputs, targets[train_idx], train_idx, transform)

    def load_test(self) -> None:
        """Set ``test_set`` (once) from the official test split."""
        if self.test_set is None:
            self.test_set = TensorSplit(*self.read_checked("test"), transform=self.transform())

    def world_and_rank(self) -> tuple[int, int]:
        """(world size, global rank): what a sampler splits the data over; (1, 0) before a
        Trainer is attached."""
        trainer = self.trainer
        return (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)

    def _resident(self, dataset: TensorSplit) -> TensorSplit:
        """The split copied to the training device once (``data.device_resident``)."""
        if id(dataset) not in self._on_device:
            device = self.trainer.strategy.root_device if self.trainer else torch.device("cpu")
            self._on_device[id(dataset)] = dataset.to(device)
        return self._on_device[id(dataset)]

    def loader(self, dataset: Dataset, sampler: Sampler) -> DataLoader:
        """The DataLoader of every split: this rank's batches as ``sampler`` gives them, with the
        data settings applied (workers from a forkserver, pinned or device-resident batches)."""
        resident = bool(self.hparams.get("device_resident"))
        workers = self.hparams.num_workers
        on_gpu = self.trainer is not None and self.trainer.strategy.root_device.type == "cuda"
        return DataLoader(
            self._resident(dataset) if resident else dataset,
            batch_size=self.per_device_batch_size,
            sampler=sampler,
            num_workers=workers,
            persistent_workers=workers > 0,
            multiprocessing_context=worker_context(dataset) if workers else None,
            worker_init_fn=partial(watch_rank_and_seed, rank=self.world_and_rank()[1]),
            # Only a GPU benefits; Lightning then copies pinned batches with non_blocking=True.
            pin_memory=self.hparams.pin_memory and on_gpu and not resident,
            collate_fn=keep_batch,
        )

    def eval_loader(self, dataset: TensorSplit) -> DataLoader:
        """Every sample once across ranks, none padded or dropped: exact metrics for any N."""
        sampler = UnrepeatedDistributedSampler(dataset, *self.world_and_rank(), shuffle=False)
        return self.loader(dataset, sampler)

    def train_dataloader(self) -> DataLoader:
        """The same global batches, in the same order, for any number of devices."""
        sampler = GlobalBatchSampler(
            self.train_set,
            *self.world_and_rank(),
            self.hparams.batch_size,
            self.hparams.shuffle_seed,
        )
        sampler.resume_at(*resume_position(self.trainer))  # before any worker fetches
        return self.loader(self.train_set, sampler)

    def val_dataloader(self) -> DataLoader:
        return self.eval_loader(self.val_set)

    def test_dataloader(self) -> DataLoader:
        return self.eval_loader(self.test_set)

    def predict_dataloader(self) -> DataLoader:
        return self.eval_loader(getattr(self, f"{self.predict_split}_set"))
