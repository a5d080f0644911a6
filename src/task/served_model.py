"""The served model, as MLflow "models from code": raw uint8 images in, classes out.

MLflow copies this file into every logged model and runs it when the model is loaded, so it
needs only torch, numpy and pandas, never this project, and nothing in the model is unpickled:
the network is a ``torch.export`` program (``program.pt2``) that normalises pixels itself.
Described to the machinery by :func:`src.task.export.export` (``ModelExport.code``).
"""

import json
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
import pandas as pd
import torch
from mlflow.pyfunc import PythonModel


class ImageClassifierModel(PythonModel):
    """``predict`` takes uint8 images ``[N, C, H, W]`` (``[N, H, W]`` for one channel) and returns
    one row per image: the predicted class index, its name and every class's probability."""

    def load_context(self, context: Any) -> None:
        self.program = torch.export.load(context.artifacts["program"]).module()
        labels = json.loads(Path(context.artifacts["metadata"]).read_text())
        self.classes = labels["classes"]
        self.image_shape = tuple(labels["image_shape"])

    # np.ndarray: a type hint MLflow infers no schema from; the signature (src.task.export)
    # says what the model takes, and MLflow checks inputs against it.
    def predict(self, context: Any, model_input: np.ndarray, params: Any = None) -> pd.DataFrame:
        images = torch.as_tensor(np.asarray(model_input))
        if images.ndim == 3 and self.image_shape[0] == 1:
            images = images.unsqueeze(1)  # [N, H, W] -> [N, 1, H, W]
        if images.dtype != torch.uint8 or tuple(images.shape[1:]) != self.image_shape:
            raise ValueError(
                f"images must be uint8 [N, {', '.join(map(str, self.image_shape))}], "
                f"got {images.dtype} {list(images.shape)}"
            )
        with torch.no_grad():
            probabilities, predicted = self.program(images)
        return pd.DataFrame(
            {
                "predicted": predicted.numpy(),
                "class_name": [self.classes[i] for i in predicted.tolist()],
                "probabilities": list(probabilities.numpy()),
            }
        )


mlflow.models.set_model(ImageClassifierModel())
