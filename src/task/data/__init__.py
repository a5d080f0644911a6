"""Datasets, chosen by ``data.name``: each name maps to a DataModule class of this package that
implements the data contract (:mod:`lightning_exact.data`, with :mod:`src.task.data.images`). A new
dataset is a module here, a line in ``DATAMODULES`` and a file in ``conf/data/``; a new IDX
dataset only an entry in ``DATASETS`` (``mnist.py``) and a file in ``conf/data/``."""

from src.task.data.image_folder import ImageFolderDataModule
from src.task.data.images import ImageDataModule
from src.task.data.mnist import DATASETS, MNISTDataModule
from src.task.data.shards import ShardDataModule

DATAMODULES: dict[str, type[ImageDataModule]] = {
    **dict.fromkeys(DATASETS, MNISTDataModule),  # every IDX dataset: mnist, fashion_mnist, ...
    "image_folder": ImageFolderDataModule,
    "shards": ShardDataModule,
}
