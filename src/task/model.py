"""Training logic around a network: loss, one set of torchmetrics per stage, optimiser.

Every reported number comes from a torchmetrics state, so under DDP it is synced exactly in
``compute()`` (sums of per-sample values and counts) instead of averaging per-rank means.
"""

import math
from collections.abc import Mapping
from functools import partial
from typing import Any

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from lightning_exact import Batch, shard
from torch import Tensor, nn
from torchmetrics import Metric

from src.task import nets
from src.task.data.images import ImageDataModule

# strategy=fsdp: each submodule of these types is sharded as one unit (its weights gathered just
# before it runs, freed after). Every module that holds parameters of its own must be, or be
# inside, one of them (shard() says which is not). A big network: list its blocks instead.
SHARDED_BLOCKS = (nn.Conv2d, nn.BatchNorm2d, nn.Linear)


class SampleMean(Metric):
    """The mean of per-sample values (a loss, 1 for a correct prediction) from two sums: a short
    last batch weighs what its samples weigh, and N ranks report what one process would (the sums
    are added across ranks in ``compute()``). A few tensor ops a step, no device-to-host sync."""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("total", torch.zeros(()), dist_reduce_fx="sum")
        self.add_state("samples", torch.zeros((), dtype=torch.long), dist_reduce_fx="sum")

    def update(self, values: Tensor) -> None:
        # In place: ``+=`` would also set each state again through nn.Module's __setattr__.
        self.total.add_(values.sum())
        self.samples.add_(values.numel())  # a Python number: no host-to-device copy

    def compute(self) -> Tensor:
        return self.total / self.samples


class SampleCount(Metric):
    """How many samples the stage's metrics cover (summed across ranks)."""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("samples", torch.zeros((), dtype=torch.long), dist_reduce_fx="sum")

    def update(self, labels: Tensor) -> None:
        self.samples.add_(labels.numel())

    def compute(self) -> Tensor:
        return self.samples.float()


class LastValue(Metric):
    """The value of the last update (the same on every rank): the learning rate of a point's last
    step."""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("value", torch.zeros(()), dist_reduce_fx="max")

    def update(self, value: float) -> None:
        self.value.fill_(value)  # a kernel with the number as argument: no host-to-device copy

    def compute(self) -> Tensor:
        return self.value


def stage_metrics() -> nn.ModuleDict:
    """``<stage>/loss`` (per-sample mean), ``<stage>/acc`` (micro accuracy) and
    ``<stage>/samples`` (the count they cover)."""
    return nn.ModuleDict({"loss": SampleMean(), "acc": SampleMean(), "samples": SampleCount()})


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
        warmup: float = 0.0,
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
        if not is_number(warmup) or not 0 <= warmup < 1:
            raise ValueError(f"model.warmup={warmup} must be a share of the steps in [0, 1)")
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
        self.train_metrics, self.val_metrics, self.test_metrics = (
            stage_metrics() for _ in range(3)
        )
        self.train_lr = LastValue()

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
        """The batch's loss; the stage's metrics updated and logged as metric objects at epoch
        level: Lightning computes them (one sync of their sums across ranks) and resets them
        at each point, and the template charts the training ones every
        ``trainer.log_every_n_steps`` steps and at each epoch's end (docs/make-it-yours.md)."""
        logits = self(batch.inputs)
        losses = F.cross_entropy(logits, batch.targets, reduction="none")
        metrics = getattr(self, f"{stage}_metrics")
        metrics["loss"].update(losses.detach())
        metrics["acc"].update(logits.detach().argmax(dim=1) == batch.targets)
        metrics["samples"].update(batch.targets)
        for name, metric in metrics.items():
            shown = name == "acc"  # on the progress bar
            self.log(f"{stage}/{name}", metric, on_step=False, on_epoch=True, prog_bar=shown)
        return losses.mean()

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        # The lr of this step: the scheduler sets the next step's after it.
        self.train_lr.update(self.trainer.optimizers[0].param_groups[0]["lr"])
        self.log("train/lr", self.train_lr, on_step=False, on_epoch=True)
        return self._step(batch, "train")

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        self._step(batch, "val")

    def test_step(self, batch: Batch, batch_idx: int) -> None:
        self._step(batch, "test")

    def on_train_start(self) -> None:
        """The lr of this step from the schedule: a resumed job's optimizer holds the lr its
        checkpoint's schedule gave, and one lengthened on resume (trainer.max_steps or
        max_epochs raised) would take its next step at the old schedule's lr."""
        scheduler = self.lr_schedulers()
        for group, factor in zip(
            scheduler.optimizer.param_groups, scheduler.lr_lambdas, strict=True
        ):
            group["lr"] = group["initial_lr"] * factor(scheduler.last_epoch)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """``val/acc_best`` is the machinery's now (the best checkpoint's score, from
        ``monitor``): the state of the metric that computed it before is dropped. (A sharded
        checkpoint, strategy=fsdp, holds no ``state_dict`` here: its shards load later.)"""
        checkpoint.get("state_dict", {}).pop("val_acc_best.max_value", None)

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
        # Per optimizer step: a linear warm-up over the first ``warmup`` share of the job's
        # steps, then a cosine decay to 0 at its last. The share of model.lr is computed from
        # the step (not stepped from the last lr, as CosineAnnealingLR does), so a resumed job
        # restores it exactly and one lengthened on resume decays over its new length.
        total = self.trainer.estimated_stepping_batches
        if math.isinf(total):
            raise ValueError(
                "model: the learning-rate schedule needs the job's length: set trainer.max_steps "
                "or trainer.max_epochs"
            )
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, partial(warmup_cosine, total=int(total), warmup=self.hparams.warmup)
        )
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


def warmup_cosine(step: int, total: int, warmup: float) -> float:
    """The share of model.lr for optimizer step ``step`` (from 0) of ``total``."""
    warmup_steps = math.ceil(warmup * total)
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    done = (step - warmup_steps) / max(1, total - warmup_steps)
    return 0.5 * (1 + math.cos(math.pi * min(done, 1.0)))


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
