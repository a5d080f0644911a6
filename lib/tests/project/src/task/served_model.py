"""MLflow "models from code": float32 vectors in, predictions out; needs torch, numpy, pandas."""

from typing import Any

import mlflow
import numpy as np
import pandas as pd
import torch
from mlflow.pyfunc import PythonModel


class RegressorModel(PythonModel):
    def load_context(self, context: Any) -> None:
        self.program = torch.export.load(context.artifacts["program"]).module()

    def predict(self, context: Any, model_input: np.ndarray, params: Any = None) -> pd.DataFrame:
        with torch.no_grad():
            predicted = self.program(torch.as_tensor(np.asarray(model_input)))
        return pd.DataFrame({"predicted": predicted.numpy()})


mlflow.models.set_model(RegressorModel())
