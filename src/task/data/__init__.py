"""Datasets, chosen by ``data.name``: each name maps to a DataModule class of this package that
implements the data contract (:mod:`src.template.data`). A new dataset is a module here, a line
in ``DATAMODULES`` and a file in ``conf/data/``."""

from omegaconf import DictConfig, OmegaConf

from src.task.data.image_folder import ImageFolderDataModule
from src.task.data.mnist import MNISTDataModule
from src.template.data import DataError, ImageDataModule

DATAMODULES: dict[str, type[ImageDataModule]] = {
    "mnist": MNISTDataModule,
    "fashion_mnist": MNISTDataModule,
    "image_folder": ImageFolderDataModule,
}


def datamodule_class(name: str) -> type[ImageDataModule]:
    if name not in DATAMODULES:
        raise DataError(f"data.name={name} is unknown; known: {', '.join(DATAMODULES)}")
    return DATAMODULES[name]


def build_datamodule(data: DictConfig) -> ImageDataModule:
    """The DataModule for the ``data`` config section (plain values: checkpoints store them and
    must load with ``weights_only=True``)."""
    return datamodule_class(data.name)(**OmegaConf.to_container(data, resolve=True))
