"""Exact resume: a job stopped anywhere and resumed equals the uninterrupted job. The training
order depends on (seed, epoch) only, the position comes from Lightning's loop state, a
mid-epoch checkpoint carries the epoch's metric sums, every step is seeded anew, and every
checkpoint carries the last value of each metric logged so far (the job's final record)."""

import hashlib
import random
import struct
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import lightning.pytorch as L
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.utils.data import Dataset, DistributedSampler
from torchmetrics import Metric

from lightning_exact.training.steps import without_position


class GlobalBatchSampler(DistributedSampler):
    """Shuffles with ``seed + epoch``, cuts the order into global batches (the incomplete last one
    dropped), rank ``r`` taking the ``r``-th equal part of each: the same for any world size."""

    def __init__(
        self, dataset: Dataset, num_replicas: int, rank: int, global_batch_size: int, seed: int
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)
        self.local_batch_size = global_batch_size // num_replicas
        self.num_batches = len(dataset) // global_batch_size
        if self.num_batches == 0:
            raise ValueError(
                f"data.batch_size={global_batch_size} is larger than the {len(dataset)} "
                "training samples; lower it"
            )
        self.num_samples = self.num_batches * self.local_batch_size
        self.total_size = self.num_batches * global_batch_size
        self.resume_epoch = 0
        self.batches_done = 0

    def resume_at(self, epoch: int, batches_done: int) -> None:
        """Start at ``epoch``, whose first ``batches_done`` global batches were trained (set when
        the loader is built: workers prefetch before Lightning calls ``set_epoch``)."""
        self.set_epoch(epoch)
        self.resume_epoch = epoch
        self.batches_done = batches_done

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.dataset), generator=generator)[: self.total_size]
        shares = order.view(self.num_batches, self.num_replicas, self.local_batch_size)
        skip = self.batches_done if self.epoch == self.resume_epoch else 0
        return iter(shares[skip:, self.rank].reshape(-1).tolist())


def epoch_finished(trainer: L.Trainer) -> bool:
    """Whether every training batch of the current epoch has been trained."""
    done = trainer.fit_loop.epoch_loop.batch_progress.current.processed
    return done >= trainer.num_training_batches


def resume_position(trainer: L.Trainer | None) -> tuple[int, int]:
    """(epoch, its batches already trained) where fitting starts, from Lightning's loop state
    (restored from the checkpoint before the train loader is built)."""
    if trainer is None:
        return 0, 0
    epochs = trainer.fit_loop.epoch_progress.current
    batches = trainer.fit_loop.epoch_loop.batch_progress.current
    return epochs.processed, batches.processed if epochs.started > epochs.processed else 0


class MidEpochState(Callback):
    """The epoch's torchmetrics states so far (reduced over ranks: exact for sum, max, min and cat
    states) in mid-epoch checkpoints, which Lightning leaves out; on resume rank 0 holds them."""

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
                states[name] = apply_to_collection(
                    metric.metric_state, Tensor, lambda t: t.detach().cpu()
                )
        checkpoint["mid_epoch_metric_states"] = states

    def on_load_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self.loaded = checkpoint.get("mid_epoch_metric_states", {})

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        metrics = self._metrics(pl_module)
        for name, states in self.loaded.items():
            if name in metrics:
                metrics[name].reset()
                if trainer.global_rank == 0:  # the reduced sums count once
                    for key, value in states.items():
                        value = apply_to_collection(value, Tensor, Tensor.to, metrics[name].device)
                        setattr(metrics[name], key, value)
        self.loaded = {}


LOGGED_SO_FAR = "logged_so_far"  # a checkpoint's key: the last value of each metric logged


class LoggedSoFar(Callback):
    """The last value of every metric the job has logged, in every checkpoint: a resumed process
    logs only what it trains, so its final record (``metrics.json``, the value returned to
    sweepers) takes those of earlier processes (a validation before the stop, the best so far)
    from ``earlier``, the record it resumed with, under what it logs itself."""

    def __init__(self, earlier: Mapping[str, float] | None = None) -> None:
        self.earlier = dict(earlier or {})

    def record(self, trainer: L.Trainer) -> dict[str, float]:
        """What an uninterrupted job's ``trainer.callback_metrics`` would hold now (less the
        step axis's keys): Lightning keeps the last value logged under each name."""
        logged = {name: float(value) for name, value in trainer.callback_metrics.items()}
        return {**self.earlier, **without_position(logged)}

    def on_save_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        checkpoint[LOGGED_SO_FAR] = self.record(trainer)


def step_seed(seed: int, epoch: int, batch: int, rank: int) -> int:
    """A 32-bit seed of its own for each training step: a hash (BLAKE2b) of where the step is,
    the same on any machine and version (NumPy's SeedSequence took ~30 µs inside a step)."""
    where = struct.pack("<4Q", seed, epoch, batch, rank)
    return int.from_bytes(hashlib.blake2b(where, digest_size=4).digest(), "little")


class SeedEachBatch(Callback):
    """Seeds python, numpy and torch before every training step from (seed, epoch, batch): no
    generator state to gather or store. The seed travels in the checkpoint (``seed=null``). Every
    rank draws the same numbers, so a dropout mask drawn for the global batch is the same on every
    rank (lib/lightning_exact/training/exact.py); ``per_rank`` (``strategy.exact=false``) adds the
    rank, for masks drawn per rank that differ between ranks."""

    def __init__(self, seed: int, per_rank: bool = False) -> None:
        self.seed = seed
        self.per_rank = per_rank

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        rank = trainer.global_rank if self.per_rank else 0  # rank 0's seeds: one process's
        seed = step_seed(self.seed, trainer.current_epoch, batch_idx, rank)
        random.seed(seed)
        np.random.seed(seed)
        # As torch.manual_seed, which also queues a seed for every accelerator not initialised,
        # saving the Python stack with each: about 0.5 ms a step.
        torch.default_generator.manual_seed(seed)
        if torch.cuda.is_initialized():
            torch.cuda.manual_seed_all(seed)
        if torch.xpu.is_initialized():
            torch.xpu.manual_seed_all(seed)
        torch.mps.manual_seed(seed)  # a no-op where there is no MPS

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.seed = state_dict["seed"]


def silence_resume_warning() -> None:
    """Lightning asks for a stateful loader to resume mid-epoch; the sampler resumes from
    Lightning's own loop state instead (:func:`resume_position`), so the warning is wrong."""
    warnings.filterwarnings("ignore", r"You're resuming from a checkpoint that ended before")
