"""Exact resume: a job stopped anywhere and resumed equals the uninterrupted job.

* :class:`GlobalBatchSampler`: the training order is a function of (seed, epoch) only, cut into
  global batches that every world size shares; a resumed job starts at the checkpoint's batch.
* :func:`resume_position`: where that is, read from Lightning's own loop state.
* :class:`MidEpochState`: the epoch's metric sums so far travel in mid-epoch checkpoints.
* :class:`SeedEachBatch`: the randomness of every training step (dropout) is a function of
  (seed, epoch, batch, rank), so no per-rank generator state needs gathering or storing.
"""

import random
import warnings
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as L
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.utils.data import Dataset, DistributedSampler
from torchmetrics import Metric


class GlobalBatchSampler(DistributedSampler):
    """Shuffles with ``seed + epoch`` and cuts the permutation into global batches of
    ``global_batch_size``; rank ``r`` takes the ``r``-th of ``num_replicas`` equal parts of each.

    The last incomplete global batch is dropped, so every rank runs the same number of equal
    steps and the averaged DDP gradient is the gradient of the global batch.

    :meth:`resume_at` makes a job resumed mid-epoch draw only the batches that epoch had left.
    Lightning creates the first iterator (and loader workers prefetch from it) before it calls
    ``set_epoch``, so a resumed job sets the epoch here, when the loader is built.
    """

    def __init__(
        self, dataset: Dataset, num_replicas: int, rank: int, global_batch_size: int, seed: int
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)
        if global_batch_size % num_replicas:
            raise ValueError(f"global batch {global_batch_size} does not split over {num_replicas}")
        self.global_batch_size = global_batch_size
        self.local_batch_size = global_batch_size // num_replicas
        self.num_batches = len(dataset) // global_batch_size
        if self.num_batches == 0:
            raise ValueError(
                f"data.batch_size={global_batch_size} is larger than the {len(dataset)} "
                "training samples; lower it"
            )
        self.num_samples = self.num_batches * self.local_batch_size
        self.total_size = self.num_batches * global_batch_size
        self.resume_epoch, self.batches_done = 0, 0

    def resume_at(self, epoch: int, batches_done: int) -> None:
        """Start at ``epoch``, whose first ``batches_done`` global batches were trained."""
        self.set_epoch(epoch)
        self.resume_epoch, self.batches_done = epoch, batches_done

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.dataset), generator=generator)[: self.total_size]
        shares = order.view(self.num_batches, self.num_replicas, self.local_batch_size)
        skip = self.batches_done if self.epoch == self.resume_epoch else 0
        return iter(shares[skip:, self.rank].reshape(-1).tolist())

    def __len__(self) -> int:
        return self.num_samples


def epoch_finished(trainer: L.Trainer) -> bool:
    """Whether every training batch of the current epoch has been trained."""
    done = trainer.fit_loop.epoch_loop.batch_progress.current.processed
    return done >= trainer.num_training_batches


def resume_position(trainer: L.Trainer | None) -> tuple[int, int]:
    """(epoch, training batches of it already done) where fitting starts, read from Lightning's
    loop state (restored from the checkpoint before the train loader is built)."""
    if trainer is None:
        return 0, 0
    epochs = trainer.fit_loop.epoch_progress.current
    if epochs.started > epochs.processed:  # the checkpoint was written mid-epoch
        return epochs.processed, trainer.fit_loop.epoch_loop.batch_progress.current.processed
    return epochs.processed, 0


class MidEpochState(Callback):
    """The epoch's metric sums so far, in checkpoints written mid-epoch.

    Lightning restores weights and loops but not torchmetrics states, which are per rank and
    not persistent: a job resumed mid-epoch would report that epoch over its remaining batches
    only. At a mid-epoch save the states are reduced over ranks (one collective, at the save);
    on resume rank 0 holds the reduced states and the other ranks start empty, so the epoch-end
    ``compute()`` gives the uninterrupted value (up to float summation order). Exact for states
    reduced by sum, max, min or concatenation (torchmetrics' built-in metrics).
    """

    def __init__(self) -> None:
        self.loaded: dict[str, dict[str, Any]] = {}

    @staticmethod
    def _metrics(pl_module: L.LightningModule) -> dict[str, Metric]:
        return {
            name: module
            for name, module in pl_module.named_modules()
            if isinstance(module, Metric) and set(module.metric_state) - set(module.state_dict())
        }

    def on_save_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        epochs = trainer.fit_loop.epoch_progress.current
        if trainer.state.fn != "fit" or epochs.started <= epochs.processed:
            return  # only a mid-epoch checkpoint needs them
        states = {}
        for name, metric in self._metrics(pl_module).items():
            with metric.sync_context():
                states[name] = apply_to_collection(metric.metric_state, Tensor, to_cpu)
        checkpoint["mid_epoch_metric_states"] = states

    def on_load_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self.loaded = checkpoint.get("mid_epoch_metric_states", {})

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        metrics = self._metrics(pl_module)
        for name, states in self.loaded.items():
            if name not in metrics:
                continue
            metric = metrics[name]
            metric.reset()
            if trainer.global_rank == 0:  # the reduced sums count once
                for key, value in states.items():
                    value = apply_to_collection(value, Tensor, Tensor.to, metric.device)
                    setattr(metric, key, value)
        self.loaded = {}


def seed_torch(seed: int) -> None:
    """``torch.manual_seed(seed)`` for the generators a training step can draw from: the CPU's
    and those of the accelerators this process has initialised. ``torch.manual_seed`` also queues
    a seed for every accelerator not initialised (CUDA and XPU in a CPU job), saving the Python
    stack with each: about 0.5 ms inside a training step, at every step."""
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)  # each GPU's generator, at once
    if torch.xpu.is_initialized():
        torch.xpu.manual_seed_all(seed)
    torch.mps.manual_seed(seed)  # a no-op where there is no MPS


class SeedEachBatch(Callback):
    """Seeds python, numpy and torch before every training step from (seed, epoch, batch, rank).

    The seed travels in the checkpoint, so a resumed run continues the same streams even when
    the first run drew its seed at random (``seed=null``). Ranks draw different dropout masks.
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        entropy = [self.seed, trainer.current_epoch, batch_idx, trainer.global_rank]
        step_seed = int(np.random.SeedSequence(entropy).generate_state(1)[0])
        random.seed(step_seed)
        np.random.seed(step_seed)
        seed_torch(step_seed)

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.seed = state_dict["seed"]


def to_cpu(tensor: Tensor) -> Tensor:
    return tensor.detach().cpu()


def silence_resume_warning() -> None:
    """Lightning asks for a loader with ``state_dict()`` to resume mid-epoch; the sampler resumes
    from Lightning's own loop state instead (:func:`resume_position`), so its warning is wrong."""
    warnings.filterwarnings("ignore", r"You're resuming from a checkpoint that ended before")
