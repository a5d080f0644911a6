"""Training logic around a network: loss, one set of torchmetrics per stage, optimiser.

Every reported number comes from a torchmetrics state, so under DDP it is synced exactly in
``compute()`` (sums of per-sample values and counts) instead of averaging per-rank means.
"""

import math
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import MaxMetric, Metric

from src.task import nets
from src.task.data.images import ImageDataModule
from src.template.data import Batch
from src.template.distributed import shard

# strategy=fsdp: each submodule of these types is sharded as one unit (its weights gathered just
# before it runs, freed after). Every module that holds parameters of its own must be, or be
# inside, one of them (shard() says which is not). A big network: list its blocks instead.
SHARDED_BLOCKS = (nn.Conv2d, nn.BatchNorm2d, nn.Linear)


class StageMetrics(Metric):
    """``<stage>/loss`` (per-sample mean), ``<stage>/acc`` (micro accuracy) and
    ``<stage>/samples`` (count), from three sums updated together: one torchmetrics update a
    step, a few tensor ops, no device-to-host sync. Summed across ranks in ``compute()``, so N
    ranks report what one rank would."""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("loss_sum", torch.zeros(()), dist_reduce_fx="sum")
        self.add_state("correct", torch.zeros((), dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("samples", torch.zeros((), dtype=torch.long), dist_reduce_fx="sum")

    def update(self, losses: Tensor, logits: Tensor, labels: Tensor) -> None:
        # In place: ``+=`` would also set each state again through nn.Module's __setattr__.
        self.loss_sum.add_(losses.sum())
        self.correct.add_((logits.argmax(dim=1) == labels).sum())
        self.samples.add_(labels.numel())  # a Python number: no host-to-device copy

    def compute(self) -> dict[str, Tensor]:
        return {
            "loss": self.loss_sum / self.samples,
            "acc": self.correct / self.samples,
            "samples": self.samples.float(),
        }


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class ImageClassifier(L.LightningModule):
    """Classifies images with the network ``net`` names (``net.name``, see :mod:`src.task.nets`),
    built for the data's ``image_shape`` (C, H, W) and ``num_classes``."""

    # Keys the entry points set from the data, never from config.
    SET_BY_DATA = ("num_classes", "image_shape")

    def __init__(
        self,
        net: dict[str, Any],
        lr: float,
        weight_decay: float = 0.0,
        num_classes: int = 10,
        image_shape: tuple[int, int, int] = (1, 28, 28),
        compile: bool = False,
        channels_last: bool = False,
    ) -> None:
        super().__init__()
        if not is_number(lr) or lr <= 0:
            raise ValueError(f"model.lr={lr} must be a number > 0")
        if not is_number(weight_decay) or weight_decay < 0:
            raise ValueError(f"model.weight_decay={weight_decay} must be a number >= 0")
        # Only plain values go into checkpoints (loadable with weights_only=True); the tracking
        # module logs the whole resolved config, so Lightning's own hparams logging is off.
        self.save_hyperparameters(logger=False)
        channels, height, width = image_shape
        self.net = nets.build(net, channels, (height, width), num_classes)
        self.example_input_array = torch.zeros(1, *image_shape)  # shapes, FLOPs in the summary
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        # The network called through a plain function (not registered as a submodule), so the
        # checkpoint keys stay the plain network's; its __call__ runs FSDP's hooks under
        # strategy=fsdp. torch.compile compiles that call.
        self.net_forward = torch.compile(self.net.__call__) if compile else self.net.__call__
        self.train_metrics = StageMetrics()
        self.val_metrics = StageMetrics()
        self.test_metrics = StageMetrics()
        # Best validation accuracy so far; persistent so a resumed run keeps it.
        self.val_acc_best = MaxMetric(nan_strategy="disable")
        self.val_acc_best.persistent(True)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net_forward(images.contiguous(memory_format=self.memory_format))

    def configure_model(self) -> None:
        """Under strategy=fsdp, shard the network over the ranks (Lightning calls this once the
        ranks are up; with other strategies there is no device mesh and nothing to do)."""
        if self.device_mesh is not None:
            shard(self.net, self.device_mesh, SHARDED_BLOCKS)

    def setup(self, stage: str) -> None:
        self.net.to(memory_format=self.memory_format)  # channels_last: NHWC kernels on GPU

    def _step(self, batch: Batch, stage: str) -> torch.Tensor:
        logits = self(batch.inputs)
        losses = F.cross_entropy(logits, batch.targets, reduction="none")
        getattr(self, f"{stage}_metrics").update(losses.detach(), logits.detach(), batch.targets)
        return losses.mean()

    def _log_epoch(self, stage: str) -> dict[str, Tensor]:
        """Compute the stage's metrics (one sync of its sums across ranks), log them and reset
        them: once, at the epoch's end. Nothing is logged per step (Lightning's result
        collection would process every logged value at every step)."""
        metrics = getattr(self, f"{stage}_metrics")
        values = metrics.compute()
        metrics.reset()
        for name, value in values.items():
            # The same synced value on every rank; "max" of equal values keeps it exact (a mean
            # would also be, but Lightning floors integer batch-size totals).
            self.log(
                f"{stage}/{name}", value, prog_bar=name == "acc", sync_dist=True, reduce_fx="max"
            )
        return values

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        self._step(batch, "val")

    def test_step(self, batch: Batch, batch_idx: int) -> None:
        self._step(batch, "test")

    def on_train_start(self) -> None:
        """This epoch's lr from the schedule: a resumed job's optimizer holds the lr its
        checkpoint's schedule gave, and one lengthened on resume (trainer.max_epochs raised)
        would train its added epochs at the old schedule's end, lr 0. Then the epoch's lr is
        noted, as each epoch start does (a job resumed mid-epoch does not run that again)."""
        scheduler = self.lr_schedulers()
        for group, factor in zip(
            scheduler.optimizer.param_groups, scheduler.lr_lambdas, strict=True
        ):
            group["lr"] = group["initial_lr"] * factor(scheduler.last_epoch)
        self.on_train_epoch_start()

    def on_train_epoch_start(self) -> None:
        # The learning rate of this epoch; the scheduler steps at each epoch end.
        self.epoch_lr = self.optimizers().param_groups[0]["lr"]

    def on_train_epoch_end(self) -> None:
        self._log_epoch("train")
        # Logged at the epoch end like the other epoch metrics (step = epoch), so an epoch cut
        # by a stop is logged once, by the job that completes it.
        self.log("train/lr", self.epoch_lr, on_epoch=True, sync_dist=True, reduce_fx="max")

    def on_validation_epoch_end(self) -> None:
        values = self._log_epoch("val")  # the sanity check's too: Lightning drops them
        if self.trainer.sanity_checking:  # a couple of batches: not a real accuracy
            return
        self.val_acc_best.update(values["acc"])
        self.log(
            "val/acc_best",
            self.val_acc_best.compute(),
            prog_bar=True,
            sync_dist=True,
            reduce_fx="max",
        )

    def on_test_epoch_end(self) -> None:
        self._log_epoch("test")

    def predict_step(self, batch: Batch, batch_idx: int) -> dict[str, torch.Tensor]:
        confidence, predicted = self(batch.inputs).softmax(dim=1).max(dim=1)
        return {
            "index": batch.indices,
            "label": batch.targets,
            "predicted": predicted,
            "confidence": confidence,
        }

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = torch.optim.AdamW(
            self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay
        )
        # Cosine decay over trainer.max_epochs, per epoch: a resumed run restores it exactly. It
        # is computed from the epoch (not stepped from the last lr, as CosineAnnealingLR does),
        # so a job lengthened on resume decays over its new length (see on_train_start).
        epochs = max(1, self.trainer.max_epochs or 1)

        def cosine(epoch: int) -> float:  # the share of model.lr for ``epoch``
            return 0.5 * (1 + math.cos(math.pi * min(epoch, epochs) / epochs))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"},
        }


def build(model: dict[str, Any], data: ImageDataModule) -> ImageClassifier:
    """The ``model`` config section, for the data's image shape and classes."""
    return ImageClassifier(num_classes=data.num_classes, image_shape=data.image_shape, **model)


def config_targets(model: Mapping[str, Any]) -> dict[str, tuple[Any, tuple[str, ...]]]:
    """What each config section is passed to, and the keys set from the data instead: how the
    machinery checks a config or a checkpoint's hyperparameters against this code."""
    net = model.get("net") or {}
    return {
        "model": (ImageClassifier, ImageClassifier.SET_BY_DATA),
        "model.net": (nets.net_class(net.get("name", nets.DEFAULT)), nets.SET_BY_DATA),
    }
