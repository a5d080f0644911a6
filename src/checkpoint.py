"""Loading a training checkpoint for eval/predict: the model, and the data it was trained on."""

from pathlib import Path

import torch
from omegaconf import DictConfig

from src.data import MNISTDataModule
from src.model import ImageClassifier


class CheckpointError(ValueError):
    """A checkpoint that is missing or does not fit the requested job."""


def load_for_inference(
    ckpt_path: str | None, data: DictConfig
) -> tuple[ImageClassifier, MNISTDataModule, dict[str, str] | None]:
    """The checkpoint's model, a data module for ``data`` (refusing a dataset mismatch) and the
    MLflow run the checkpoint came from, if it was tracked.

    Checkpoints hold plain values only, so they load with ``weights_only=True``.
    """
    if not ckpt_path:
        raise CheckpointError(
            "ckpt_path is required, e.g. ckpt_path=outputs/train/runs/<time>/checkpoints/last.ckpt"
        )
    path = Path(ckpt_path)
    if not path.is_file():
        raise CheckpointError(f"ckpt_path={ckpt_path}: no such file")
    saved = torch.load(path, map_location="cpu", weights_only=True)
    trained_on = saved.get("datamodule_hyper_parameters", {}).get("name")
    if trained_on and trained_on != data.name:
        raise CheckpointError(
            f"{path.name} was trained on {trained_on} but data={data.name}; add data={trained_on}"
        )
    model = ImageClassifier.load_from_checkpoint(path, map_location="cpu", weights_only=True)
    return model, MNISTDataModule(**data), saved.get("mlflow")
