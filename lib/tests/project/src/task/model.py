"""An MLP regressor: mean squared error loss, one set of torchmetrics per stage logged as
objects at epoch level, so under DDP every number is synced exactly in ``compute()``. BatchNorm
and dropout in its hidden layer (exact on any number of ranks: strategy.exact), the best val/loss
so far (a persistent metric: a resumed job keeps it), Adam with an lr decayed every step."""

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from lightning_exact import Batch, shard
from torch import nn
from torchmetrics import MeanAbsoluteError, MeanSquaredError, MinMetric, SumMetric

# strategy=fsdp: each linear layer and BatchNorm is a unit
SHARDED_BLOCKS = (nn.Linear, nn.BatchNorm1d)


def stage_metrics() -> nn.ModuleDict:
    """``<stage>/loss`` (MSE), ``<stage>/mae`` and ``<stage>/samples``."""
    return nn.ModuleDict(
        {"loss": MeanSquaredError(), "mae": MeanAbsoluteError(), "samples": SumMetric()}
    )


class Regressor(L.LightningModule):
    SET_BY_DATA = ("features",)  # from the data, never from config

    def __init__(
        self,
        features: int,
        hidden: int,
        lr: float = 0.01,
        lr_decay: float = 1.0,
        batch_norm: bool = False,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if isinstance(lr, bool) or not isinstance(lr, int | float) or lr <= 0:
            raise ValueError(f"model.lr={lr} must be a number > 0")
        if not 0 < lr_decay <= 1:
            raise ValueError(f"model.lr_decay={lr_decay} must be in (0, 1]")
        self.save_hyperparameters(logger=False)
        norm = [nn.BatchNorm1d(hidden)] if batch_norm else []
        # No bias before BatchNorm: it would cancel it, and Adam would move it by float
        # rounding alone (differently on 1 and 2 ranks), which its running mean then records.
        self.net = nn.Sequential(
            nn.Linear(features, hidden, bias=not batch_norm),
            *norm,
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, 1),
        )
        self.example_input_array = torch.zeros(2, features)  # shapes in the summary
        self.train_metrics, self.val_metrics, self.test_metrics = (
            stage_metrics() for _ in range(3)
        )
        # Best validation loss so far; persistent so a resumed run keeps it.
        self.val_loss_best = MinMetric()
        self.val_loss_best.persistent(True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)

    def configure_model(self) -> None:
        """Under strategy=fsdp, shard the network over the ranks."""
        if self.device_mesh is not None:
            shard(self.net, self.device_mesh, SHARDED_BLOCKS)

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

    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking:  # a couple of batches: not a real loss
            return
        self.val_loss_best.update(self.val_metrics["loss"].compute())  # Lightning reuses it
        self.log("val/loss_best", self.val_loss_best.compute(), sync_dist=True, reduce_fx="min")

    def predict_step(self, batch: Batch, batch_idx: int) -> dict[str, torch.Tensor]:
        return {"index": batch.indices, "target": batch.targets, "predicted": self(batch.inputs)}

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        decay = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=self.hparams.lr_decay)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": decay, "interval": "step"}}


def build(model: dict[str, Any], data: Any) -> Regressor:
    return Regressor(features=data.hparams.features, **model)


def config_targets(model: Mapping[str, Any]) -> dict[str, tuple[Any, tuple[str, ...]]]:
    return {"model": (Regressor, Regressor.SET_BY_DATA)}
