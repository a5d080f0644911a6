"""An MLP regressor: mean squared error loss, one set of torchmetrics per stage logged as
objects at epoch level, so under DDP every number is synced exactly in ``compute()``."""

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import MeanAbsoluteError, MeanSquaredError, SumMetric

from src.template.data import Batch


def stage_metrics() -> nn.ModuleDict:
    """``<stage>/loss`` (MSE), ``<stage>/mae`` and ``<stage>/samples``."""
    return nn.ModuleDict(
        {"loss": MeanSquaredError(), "mae": MeanAbsoluteError(), "samples": SumMetric()}
    )


class Regressor(L.LightningModule):
    SET_BY_DATA = ("features",)  # from the data, never from config

    def __init__(self, features: int, hidden: int, lr: float = 0.01) -> None:
        super().__init__()
        if lr <= 0:
            raise ValueError(f"model.lr={lr} must be > 0")
        self.save_hyperparameters(logger=False)
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        self.train_metrics, self.val_metrics, self.test_metrics = (
            stage_metrics() for _ in range(3)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)

    def _step(self, batch: Batch, stage: str) -> torch.Tensor:
        predicted = self(batch.inputs)
        metrics = getattr(self, f"{stage}_metrics")
        metrics["loss"].update(predicted.detach(), batch.targets)
        metrics["mae"].update(predicted.detach(), batch.targets)
        metrics["samples"].update(torch.tensor(float(len(batch.targets)), device=self.device))
        for name, metric in metrics.items():
            self.log(f"{stage}/{name}", metric, on_step=False, on_epoch=True)
        return F.mse_loss(predicted, batch.targets)

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        self._step(batch, "val")

    def test_step(self, batch: Batch, batch_idx: int) -> None:
        self._step(batch, "test")

    def predict_step(self, batch: Batch, batch_idx: int) -> dict[str, torch.Tensor]:
        return {"index": batch.indices, "target": batch.targets, "predicted": self(batch.inputs)}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


def build(model: dict[str, Any], data: Any) -> Regressor:
    return Regressor(features=data.hparams.features, **model)


def config_targets(model: Mapping[str, Any]) -> dict[str, tuple[Any, tuple[str, ...]]]:
    return {"model": (Regressor, Regressor.SET_BY_DATA)}
