"""``trainer.precision`` outside Lightning's loops: the model run as the Trainer runs it, and the
precisions that cannot train as typed refused in one line."""

from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
from lightning_exact.job.config import ConfigError
from lightning_exact.training.precision import check_precision, trainer_precision
from lightning_exact.training.trainer import ModelSummaryFile
from torch.utils.data import DataLoader, TensorDataset


def test_a_model_runs_in_its_trainers_precision() -> None:
    """64-true: inputs converted to float64, float64 the default dtype inside; without a Trainer
    (a model rebuilt from a checkpoint) float32, as typed."""
    model = L.LightningModule()
    with trainer_precision(model) as convert:
        assert convert(torch.zeros(2)).dtype == torch.float32
    model.trainer = L.Trainer(precision="64-true", accelerator="cpu", logger=False)
    with trainer_precision(model) as convert:
        converted = convert({"x": torch.zeros(2), "label": torch.zeros(2, dtype=torch.long)})
        assert converted["x"].dtype == torch.float64
        assert converted["label"].dtype == torch.long, "integers left as they are"
        assert torch.get_default_dtype() == torch.float64
    assert torch.get_default_dtype() == torch.float32


@pytest.mark.parametrize(
    ("precision", "on_cpu", "says"),
    [
        ("transformer-engine", False, "needs NVIDIA Transformer Engine"),
        ("transformer-engine-float16", True, "needs NVIDIA Transformer Engine"),
        ("16-mixed", True, "float16 autocast runs on GPUs only; on the CPU use bf16-mixed"),
        (16, True, "float16 autocast runs on GPUs only"),
    ],
)
def test_a_precision_that_cannot_train_as_typed_is_refused(
    precision: object, on_cpu: bool, says: str
) -> None:
    with pytest.raises(ConfigError, match=f"^trainer.precision={precision}: {says}"):
        check_precision(precision, on_cpu)


@pytest.mark.parametrize("precision", ["64-true", "32-true", "bf16-mixed", "bf16-true", "16-true"])
def test_the_others_are_taken(precision: str) -> None:
    check_precision(precision, on_cpu=True)
    check_precision("16-mixed", on_cpu=False)


class Tiny(L.LightningModule):
    """A convolution and BatchNorm, as the shipped networks run them, with an example input."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten()
        )
        self.example_input_array = torch.zeros(1, 1, 6, 6)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.net(inputs)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch[0]).float().square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("precision", ["64-true", "32-true", "bf16-mixed", "bf16-true", "16-true"])
def test_the_summary_and_a_forward_of_your_own_run_in_every_precision_taken(
    precision: str, tmp_path: Path
) -> None:
    """A step of fitting with the model summary's example forward, then a forward of your own
    (a figure's: a float32 batch, as a split holds it) on the model as the Trainer converted
    it: no dtype error in any precision."""
    summary = ModelSummaryFile(tmp_path / "model_summary.txt", max_depth=1)
    trainer = L.Trainer(
        precision=precision,
        accelerator="cpu",
        logger=False,
        callbacks=[summary],
        max_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    model = Tiny()
    trainer.fit(model, DataLoader(TensorDataset(torch.rand(4, 1, 6, 6)), batch_size=2))
    assert "Total params" in (tmp_path / "model_summary.txt").read_text()
    assert model.example_input_array.dtype == torch.float32, "left as the model had it"
    with torch.no_grad(), trainer_precision(model.eval()) as convert:
        assert model(convert(torch.rand(3, 1, 6, 6))).shape == (3, 64)
