"""``data=shards``: the shards ``python -m src.prepare`` wrote, streamed from disk (or S3).

Samples are read by index through LitData's random access (``StreamingDataset[i]``) with the
project's own samplers, so the global batches are those of the in-memory datasets: a function
of (seed, epoch) only, the same for any number of devices and loader workers, and resumable
mid-epoch. PNG/JPEG decoding (and ``data.augment``) runs in the loader workers; memory is the
open shards, not the dataset. Validation is carved from train as for every dataset.
"""

import hashlib
import io
import json
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning_exact import Batch, DataError, carve_validation, resume_position
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from src.task.data.augment import AugmentedSplit, check_augment
from src.task.data.images import ImageDataModule, decode_image
from src.task.data.partitions import (
    PartitionedBatchSampler,
    check_partitions,
    chunk_groups,
    partition_rows,
)
from src.task.data.survey import say, size_note

# LitData's advice to use a 25 GB cache: check_cache says what this job needs instead.
CACHE_ADVICE = "The provided `max_cache_size` is less than 25GB"


def drop_cache_advice(record: logging.LogRecord) -> bool:
    """A logging filter (one function, so adding it twice adds it once)."""
    return not str(record.msg).startswith(CACHE_ADVICE)


def quiet_libraries() -> None:
    """LitData's and botocore's INFO lines (cache sizes, prefetch widths, where credentials were
    found) tell this project's user nothing; their warnings still show."""
    for name in ("litdata", "botocore"):
        logging.getLogger(name).setLevel(logging.WARNING)
    logging.getLogger("litdata.streaming.dataset").addFilter(drop_cache_advice)


def litdata() -> Any:
    """The ``litdata`` module, or a one-line way to install it."""
    try:
        import litdata
    except ImportError as error:
        raise DataError(
            "data=shards and src.prepare need LitData: "
            "pip install --no-deps -c constraints.txt litdata"
        ) from error
    quiet_libraries()
    return litdata


def allow_plain_http() -> None:
    """An ``http://`` ``AWS_ENDPOINT_URL`` (MinIO, a local moto server) is what the user asked
    for: let LitData's obstore client use it (it refuses plain HTTP by default)."""
    if os.environ.get("AWS_ENDPOINT_URL", "").startswith("http://"):
        from litdata.streaming import downloader

        downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = True  # type: ignore[index]


def eval_rows(positions: Tensor, world_size: int, rank: int) -> list[int]:
    """The rows of a split that ``rank`` evaluates: a contiguous run of the split's positions
    in the shards, so every sample is evaluated once (no padding: exact for any world size)
    and each rank reads about ``1 / world_size`` of the shards."""
    order = positions.argsort()
    return order[rank * len(order) // world_size : (rank + 1) * len(order) // world_size].tolist()


def training_bytes(chunks: list[dict], partitions: int | None, mine: Sequence[int] = ()) -> int:
    """Bytes of the training shards (``index.json``'s ``chunks``) a rank reads in an epoch:
    every shard, or with ``data.partitions`` the shards of its partitions ``mine``."""
    sizes = [chunk["chunk_bytes"] for chunk in chunks]
    if not partitions:
        return sum(sizes)
    groups = chunk_groups([chunk["chunk_size"] for chunk in chunks], partitions).tolist()
    return sum(size for size, group in zip(sizes, groups, strict=True) if group in mine)


class ShardRunSampler(DistributedSampler):
    """:func:`eval_rows` of this rank (a ``DistributedSampler``, so Lightning keeps it)."""

    def __init__(self, dataset: "ShardSplit", num_replicas: int, rank: int) -> None:
        super().__init__(dataset, num_replicas, rank, shuffle=False)
        self.rows = eval_rows(dataset.indices, num_replicas, rank)
        self.num_samples = len(self.rows)

    def __iter__(self) -> Iterator[int]:
        return iter(self.rows)


class ShardSplit(Dataset):
    """Some samples of one split's shards (``positions``: their indices in the official split),
    fetched and decoded a batch at a time; ``inputs[i]`` decodes one image (figures, export)."""

    def __init__(
        self,
        folder: str,
        positions: Tensor,
        labels: Tensor,
        image_shape: tuple[int, int, int],
        transform: nn.Module | None,
        digest: str,
        max_cache_size: str,
        cache_dir: str | None = None,
    ) -> None:
        self.folder = folder
        self.image_shape = image_shape
        self.transform = transform
        self.cache_dir = cache_dir
        self.indices = positions
        self.targets = labels[positions]
        self.max_cache_size = max_cache_size
        self._digest = hashlib.md5(f"{digest}:".encode() + positions.numpy().tobytes()).hexdigest()
        self._data: Any = None  # opened in the process that reads (each loader worker)

    def __len__(self) -> int:
        return len(self.indices)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_data": None}

    def digest(self) -> str:
        return self._digest

    def data(self) -> Any:
        if self._data is None:
            self._data = litdata().StreamingDataset(
                self.folder, max_cache_size=self.max_cache_size, cache_dir=self.cache_dir
            )
            if "://" in self.folder:
                # Remote: whole shards are downloaded into the bounded cache and read from
                # there, rather than one ranged GET per sample (LitData's default for reads
                # by index). Pinned litdata: its cache is built as __getitem__ builds it.
                from litdata.utilities.env import _WorkerEnv

                allow_plain_http()
                self._data.cache = self._data._create_cache(worker_env=_WorkerEnv.detect())
                self._data.on_demand_bytes = False
        return self._data

    def decoded(self, rows: list[int], size: Sequence[int] | None = None) -> Iterator[np.ndarray]:
        """``uint8 [C, H, W]`` (read-only) of the samples at ``rows``, each at its stored size
        (an image file's own) or resized to ``size`` (H, W) as every data path resizes."""
        data = self.data()
        channels = self.image_shape[0]
        for row in rows:
            file = io.BytesIO(data[int(self.indices[row])]["image"])
            yield decode_image(file, channels, size).transpose(2, 0, 1)

    def originals(self, rows: list[int]) -> list[Tensor]:
        """The samples at ``rows`` as stored (for augmentation's crops), one tensor each."""
        return [torch.from_numpy(pixels.copy()) for pixels in self.decoded(rows)]

    def raw(self, rows: list[int]) -> Tensor:
        """``uint8 [B, C, H, W]`` of the samples at ``rows``, at the trained image size (each
        image copied once, into the batch)."""
        return torch.from_numpy(np.stack(list(self.decoded(rows, self.image_shape[1:]))))

    @property
    def inputs(self) -> "LazyImages":
        return LazyImages(self)

    def __getitems__(self, rows: list[int]) -> Batch:
        inputs = self.raw(rows)
        if self.transform is not None:
            inputs = self.transform(inputs)
        idx = torch.as_tensor(rows, dtype=torch.long)
        return Batch(inputs, self.targets[idx], self.indices[idx])

    def __getitem__(self, i: int) -> Batch:
        return Batch(*(part[0] for part in self.__getitems__([i])))


class LazyImages:
    """``split.inputs[i]`` or ``[a:b]`` as the in-memory splits give them, decoded on demand."""

    def __init__(self, split: ShardSplit) -> None:
        self.split = split

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, key: int | slice) -> Tensor:
        if isinstance(key, slice):
            return self.split.raw(list(range(len(self.split)))[key])
        return self.split.raw([int(key)])[0]


class ShardDataModule(ImageDataModule):
    """Classes, image shape and normalisation come from the shards' ``manifest.json``."""

    def __init__(
        self,
        name: str,
        root: str,
        batch_size: int,
        val_size: int | None = None,
        num_workers: int = 0,
        split_seed: int = 12345,
        shuffle_seed: int = 0,
        pin_memory: bool = False,
        device_resident: bool = False,
        augment: dict | None = None,
        max_cache_size: str = "10GB",
        cache_dir: str | None = None,
        partitions: int | None = None,
        folds: int | None = None,
        fold: int = 0,
    ) -> None:
        if device_resident:
            raise DataError("data=shards streams from disk; set data.device_resident=false")
        check_augment(augment)
        super().__init__()
        self.save_hyperparameters(logger=False)
        self.root = str(root)
        local = "://" not in self.root
        if local:
            self.root = str(Path(root).expanduser().resolve())
        self.source = self.root
        manifest = self._read_manifest(local)
        self.manifest = manifest
        self.classes = tuple(manifest["classes"])
        self.image_shape = tuple(manifest["image_shape"])
        self.mean = tuple(manifest["mean"])
        self.std = tuple(manifest["std"])
        if val_size is None:  # the source dataset's: the same validation samples
            self.hparams.val_size = manifest.get("val_size", 0)

    def _read_manifest(self, local: bool) -> dict[str, Any]:
        if local:
            path = Path(self.root) / "manifest.json"
            if not path.is_file():
                raise DataError(
                    f"{path} not found: data.root must be a folder written by "
                    "`python -m src.prepare out=DIR`"
                )
            manifest = json.loads(path.read_text())
        else:
            manifest = json.loads(self._remote_bytes("manifest.json"))
        missing = sorted({"train", "test"} - set(manifest.get("complete", [])))
        if missing:
            raise DataError(
                f"{self.root}: the conversion of {', '.join(missing)} did not finish; rerun "
                "the same `python -m src.prepare` command to complete it"
            )
        return manifest

    def _remote_bytes(self, name: str) -> bytes:
        """A small file beside the shards on S3 (``s3://bucket/prefix``)."""
        import boto3
        from botocore.exceptions import BotoCoreError, ClientError

        quiet_libraries()
        bucket, _, prefix = self.root.removeprefix("s3://").partition("/")
        key = f"{prefix.rstrip('/')}/{name}" if prefix else name
        try:
            return boto3.client("s3").get_object(Bucket=bucket, Key=key)["Body"].read()
        except (BotoCoreError, ClientError) as error:
            raise DataError(
                f"s3://{bucket}/{key}: {error}. data.root must be a folder written by `python -m "
                "src.prepare out=DIR`, reached with boto3's credentials and AWS_ENDPOINT_URL"
            ) from error

    def _labels(self, split: str) -> Tensor:
        name = f"{split}_labels.npy"
        if "://" in self.root:
            data = np.load(io.BytesIO(self._remote_bytes(name)))
        else:
            data = np.load(Path(self.root) / name)
        return torch.from_numpy(data).long()

    def _split(self, split: str, positions: Tensor, labels: Tensor) -> ShardSplit:
        return ShardSplit(
            f"{self.root}/{split}",
            positions,
            labels,
            self.image_shape,
            self.transform(),
            self.manifest["identity"]["digests"][split],
            self.hparams.max_cache_size,
            self.hparams.cache_dir,
        )

    def read(self, split: str) -> tuple[Tensor, Tensor]:
        """Every image decoded (e.g. to convert shards again); training does not call it."""
        labels = self._labels(split)
        whole = self._split(split, torch.arange(len(labels)), labels)
        return whole.raw(list(range(len(labels)))), labels

    def load_train(self) -> None:
        if self.train_set is not None:
            return
        # The files' own sizes (src.prepare recorded them): where they are not the trained size.
        if note := size_note(
            self.manifest.get("source_sizes"),
            self.image_shape[1:],
            set_by=" of src.prepare",
            again="src.prepare out=NEW_FOLDER ",
        ):
            say(note)
        labels = self._labels("train")
        # The carve-out of every dataset (lib/lightning_exact/data.py): the same validation samples.
        val_idx, train_idx = carve_validation(len(labels), self.hparams)
        self.val_set = self._split("train", val_idx, labels)
        self.train_set = self._split("train", train_idx, labels)

    def check_world_size(self, world_size: int) -> None:
        """``data.partitions``: whole partitions for each of ``world_size`` ranks and the same
        share of each in every global batch, checked at start."""
        if count := self.hparams.get("partitions"):
            check_partitions(count, world_size, self.hparams.batch_size)

    def check_cache(self, count: int | None, mine: Sequence[int] = ()) -> None:
        """Remote shards are read in a random order, so LitData's cache must hold all the shards
        a rank reads in an epoch: a smaller one re-downloads a shard at nearly every sample
        (measured: 100x slower, and reads of evicted files failed)."""
        limit = self.hparams.max_cache_size
        if "://" not in self.root or limit is None:
            return
        from litdata.utilities.format import _convert_bytes_to_int  # what LitData accepts

        chunks = json.loads(self._remote_bytes("train/index.json"))["chunks"]
        need = training_bytes(chunks, count, mine)
        if need > _convert_bytes_to_int(str(limit)):
            several = not count and self.world_and_rank()[0] > 1
            fix = ", or data.partitions=C (each of N ranks reads C/N of them)" if several else ""
            raise DataError(
                f"data.max_cache_size={limit} cannot hold the {need / 1e6:,.1f} MB of training "
                f"shards this rank reads each epoch in random order; set data.max_cache_size="
                f"{-(-need // 1_000_000)}MB or more{fix}"
            )

    def train_dataloader(self) -> DataLoader:
        """``data.partitions=C``: each rank reads only its partitions' shards
        (:mod:`src.task.data.partitions`); otherwise the project's global order."""
        count = self.hparams.get("partitions")
        if not count:
            self.check_cache(None)
            return super().train_dataloader()
        if "chunks" not in self.manifest:
            raise DataError(f"{self.root}: convert again with src.prepare for data.partitions")
        parts = partition_rows(self.manifest["chunks"]["train"], count, self.train_set.indices)
        settings = check_augment(self.hparams.get("augment"))
        seed = self.hparams.shuffle_seed
        sampler = PartitionedBatchSampler(
            self.train_set,
            *self.world_and_rank(),
            self.hparams.batch_size,
            seed,
            parts,
            tag_epoch=settings is not None,
        )
        self.check_cache(count, sampler.mine)  # the partitions the sampler gives this rank
        sampler.resume_at(*resume_position(self.trainer))  # before any worker fetches
        data = self.train_set
        if settings is not None:
            data = AugmentedSplit(data, settings, seed, self.mean, self.std, self.image_shape)
        return self.loader(data, sampler)

    def eval_loader(self, dataset: ShardSplit) -> DataLoader:
        return self.loader(dataset, ShardRunSampler(dataset, *self.world_and_rank()))

    def load_test(self) -> None:
        if self.test_set is None:
            labels = self._labels("test")
            self.test_set = self._split("test", torch.arange(len(labels)), labels)
