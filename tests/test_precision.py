"""``trainer.precision`` outside Lightning's loops: the model run as the Trainer runs it, and the
precisions that cannot train as typed refused in one line."""

import lightning.pytorch as L
import pytest
import torch

from src.template.config import ConfigError
from src.template.precision import check_precision, trainer_precision


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
