"""Synthetic vectors: ``x`` float32 ``[N, features]``, ``y = x @ w + noise``, all drawn from
``data_seed``, so every process (and every rank) reads the same splits without any file."""

import torch
from lightning_exact import DataError, TensorDataModule
from torch import Tensor


class SyntheticDataModule(TensorDataModule):
    # What the data is: eval and predict take these from the checkpoint.
    CONTENT_KEYS = (
        "name",
        "val_size",
        "split_seed",
        "folds",
        "fold",
        "features",
        "n_train",
        "n_test",
        "noise",
        "data_seed",
    )

    def __init__(
        self,
        name: str,
        features: int,
        n_train: int,
        n_test: int,
        batch_size: int,
        val_size: int,
        noise: float = 0.1,
        data_seed: int = 0,
        split_seed: int = 12345,
        folds: int | None = None,
        fold: int = 0,
        shuffle_seed: int = 0,
        num_workers: int = 0,
        pin_memory: bool = False,
        device_resident: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(logger=False)
        self.source = f"synthetic://features={features},data_seed={data_seed}"

    def read(self, split: str) -> tuple[Tensor, Tensor]:
        h = self.hparams
        if h.features < 1 or h.n_train < 1 or h.n_test < 1:
            raise DataError("data.features, data.n_train and data.n_test must be 1 or more")
        generator = torch.Generator().manual_seed(h.data_seed)
        weights = torch.randn(h.features, generator=generator)
        splits = {}
        for name, n in (("train", h.n_train), ("test", h.n_test)):  # always both, in this order
            x = torch.randn(n, h.features, generator=generator)
            y = x @ weights + h.noise * torch.randn(n, generator=generator)
            splits[name] = (x, y)
        return splits[split]

    def check(self, split: str, inputs: Tensor, targets: Tensor) -> None:
        if inputs.dtype != torch.float32 or inputs.shape[1:] != (self.hparams.features,):
            raise DataError(f"{split} inputs must be float32 [N, {self.hparams.features}]")
