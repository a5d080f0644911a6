"""MLflow "models from code": token windows in, the next token of each out; needs torch, numpy,
pandas."""

from typing import Any

import mlflow
import numpy as np
import pandas as pd
import torch
from mlflow.pyfunc import PythonModel


class NextTokenModel(PythonModel):
    def load_context(self, context: Any) -> None:
        self.program = torch.export.load(context.artifacts["program"]).module()

    def predict(self, context: Any, model_input: np.ndarray, params: Any = None) -> pd.DataFrame:
        with torch.no_grad():
            tokens = self.program(torch.as_tensor(np.asarray(model_input), dtype=torch.long))
        return pd.DataFrame({"next": tokens.numpy()})


mlflow.models.set_model(NextTokenModel())
