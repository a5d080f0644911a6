"""The served model: float32 vectors ``[N, features]`` in, one ``predicted`` value per row out
(see :mod:`src.task.served_model`)."""

import copy
from pathlib import Path
from typing import Any

from lightning_exact import ModelExport
from torch import nn


class Predict(nn.Module):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x):
        return self.net(x).squeeze(-1)


def export(model: Any, data: Any) -> ModelExport:
    import numpy as np  # here: a job that logs no MLflow model never imports mlflow
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, Schema, TensorSpec

    features = data.hparams.features
    example = data.test_set.inputs[:2].cpu()
    return ModelExport(
        module=Predict(copy.deepcopy(model.net).cpu().float().eval()),
        example=example,
        code=Path(__file__).with_name("served_model.py"),
        signature=ModelSignature(
            Schema([TensorSpec(np.dtype(np.float32), (-1, features))]),
            Schema([ColSpec("float", "predicted")]),
        ),
        input_example=example.numpy(),
        metadata={"features": features},
        model_type="regressor",
    )
