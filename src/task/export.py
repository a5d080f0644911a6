"""What a trained image classifier is as a served MLflow model: raw uint8 images in, the predicted
class, its name and every class's probability out (see :mod:`src.task.served_model`). The machinery
exports, saves, logs and registers it (:mod:`lightning_exact.tracking.mlflow_model`)."""

import copy
from pathlib import Path
from typing import Any

import torch
from lightning_exact import ModelExport
from torch import nn

from src.task.data.images import ImageDataModule, Normalize

EXAMPLES = 2  # images in the input example


class RawImageClassifier(nn.Module):
    """uint8 images ``[N, C, H, W]`` -> (class probabilities ``[N, K]``, predicted class ``[N]``),
    normalised exactly as the data module does for training."""

    def __init__(self, net: nn.Module, normalize: Normalize) -> None:
        super().__init__()
        self.net = net
        self.normalize = normalize

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probabilities = self.net(self.normalize(images)).softmax(dim=1)
        return probabilities, probabilities.argmax(dim=1)


def signature(image_shape: tuple[int, ...]) -> Any:
    """uint8 images of ``image_shape`` in; predicted class, its name, all probabilities out."""
    import numpy as np
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, Schema, TensorSpec
    from mlflow.types.schema import Array

    outputs = [
        ColSpec("long", "predicted"),
        ColSpec("string", "class_name"),
        ColSpec(Array("float"), "probabilities"),
    ]
    return ModelSignature(
        Schema([TensorSpec(np.dtype(np.uint8), (-1, *image_shape))]), Schema(outputs)
    )


def export(model: Any, data: ImageDataModule) -> ModelExport:
    """The network (a CPU float copy) behind the data's normalisation; the input example is the
    first test images, as people have them: ``[N, H, W]`` for one channel."""
    net = copy.deepcopy(model.net).cpu().float().eval()
    images = data.test_set.inputs[:EXAMPLES].cpu()
    example = images[:, 0] if data.image_shape[0] == 1 else images
    return ModelExport(
        module=RawImageClassifier(net, Normalize(data.mean, data.std)),
        example=images,
        code=Path(__file__).with_name("served_model.py"),
        signature=signature(tuple(example.shape[1:])),
        input_example=example.numpy(),
        metadata={"classes": list(data.classes), "image_shape": list(data.image_shape)},
        model_type="image-classifier",
    )
