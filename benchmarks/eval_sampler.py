"""Times one DDP test loop with the template's unpadded sampler or Lightning's padded default.

Started by ``benchmarks.run`` as ``python -m benchmarks.eval_sampler ROOT NAME DEVICES SAMPLER``;
Lightning re-runs this module for ranks 1..N-1. Rank 0 prints one JSON line.
"""

import json
import sys
import time

import lightning.pytorch as L
import torch
from lightning_exact.data import keep_batch
from lightning_exact.training.distributed import job_scope
from torch.utils.data import DataLoader

from src.task.data.mnist import MNISTDataModule
from src.task.model import ImageClassifier


class PaddedEval(MNISTDataModule):
    """The same data, but a plain loader: Lightning injects its padded DistributedSampler."""

    def eval_loader(self, dataset):  # type: ignore[override]
        return DataLoader(dataset, batch_size=self.per_device_batch_size, collate_fn=keep_batch)


class TestLoopTimer(L.Callback):
    def on_test_epoch_start(self, trainer, pl_module):
        self.start = time.perf_counter()

    def on_test_epoch_end(self, trainer, pl_module):
        self.seconds = time.perf_counter() - self.start  # includes the synced metric compute


def main(root: str, name: str, devices: int, sampler: str) -> None:
    torch.manual_seed(0)
    data_class = PaddedEval if sampler == "padded" else MNISTDataModule
    datamodule = data_class(name, root, download=False, batch_size=240, val_size=5000)
    model = ImageClassifier(net={"channels": [32, 64], "hidden": 128}, lr=1e-3)
    timer = TestLoopTimer()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="ddp",
        logger=False,
        callbacks=[timer],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    result = trainer.test(model, datamodule=datamodule, verbose=False)[0]
    if trainer.is_global_zero:
        print(json.dumps({"seconds": timer.seconds, "samples": result["test/samples"]}), flush=True)


if __name__ == "__main__":
    # job_scope destroys the process group before exit: left to interpreter shutdown, gloo
    # can abort a rank ("terminate called without an active exception"), failing the run.
    with job_scope():
        main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
