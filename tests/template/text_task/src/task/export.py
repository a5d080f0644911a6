"""The served model: windows of token ids (int64 ``[N, block_size]``) in, the next token of each
out (see :mod:`src.task.served_model`)."""

import copy
from pathlib import Path
from typing import Any

from lightning_exact import ModelExport
from torch import Tensor, nn


class NextToken(nn.Module):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, tokens: Tensor) -> Tensor:
        return self.net(tokens)[:, -1].argmax(dim=-1)


def export(model: Any, data: Any) -> ModelExport:
    import numpy as np  # here: a job that logs no MLflow model never imports mlflow
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, Schema, TensorSpec

    block_size = data.hparams.block_size
    example = data.test_set.inputs[:2].cpu()
    return ModelExport(
        module=NextToken(copy.deepcopy(model.net).cpu().float().eval()),
        example=example,
        code=Path(__file__).with_name("served_model.py"),
        signature=ModelSignature(
            Schema([TensorSpec(np.dtype(np.int64), (-1, block_size))]),
            Schema([ColSpec("long", "next")]),
        ),
        input_example=example.numpy(),
        metadata={"block_size": block_size},
        model_type="next-token",
    )
