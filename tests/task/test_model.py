"""The LightningModule's metrics are exact per-sample values, whatever the batch size."""

from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
import torch.nn.functional as F
from lightning_exact.checkpoints.checkpoint import (
    check_weights_fit,
    load_for_inference,
    migrated,
    model_from_checkpoint,
)
from omegaconf import OmegaConf

from src.task import TASK
from src.task.data.mnist import MNISTDataModule
from src.task.model import ImageClassifier
from tests.conftest import HARNESS

VAL_SIZE = HARNESS.val_size

NET = {"channels": [8, 16], "hidden": 32, "dropout": 0.0, "batch_norm": True}


def validate(model: ImageClassifier, root: Path, batch_size: int) -> dict[str, float]:
    datamodule = MNISTDataModule(
        name="mnist", root=str(root), download=False, batch_size=batch_size, val_size=VAL_SIZE
    )
    trainer = L.Trainer(
        accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False
    )
    return trainer.validate(model, datamodule=datamodule, verbose=False)[0]


def test_loss_mean_does_not_depend_on_batch_size(tiny_root: Path) -> None:
    torch.manual_seed(0)
    model = ImageClassifier(net=NET, lr=0.01)
    results = [validate(model, tiny_root, batch_size) for batch_size in (1, 7, 64)]
    # 67 samples: batches of 7 and 64 leave a short last batch that must not be over-weighted.
    for result in results:
        assert result["val/samples"] == VAL_SIZE
        assert result["val/loss"] == pytest.approx(results[0]["val/loss"], abs=1e-6)
        assert result["val/acc"] == results[0]["val/acc"]

    datamodule = MNISTDataModule(
        name="mnist", root=str(tiny_root), download=False, batch_size=VAL_SIZE, val_size=VAL_SIZE
    )
    datamodule.setup("validate")
    batch = datamodule.val_set.__getitems__(list(range(VAL_SIZE)))
    model.eval()
    with torch.no_grad():
        logits = model(batch.inputs)
    assert results[0]["val/loss"] == pytest.approx(F.cross_entropy(logits, batch.targets).item())
    expected_acc = (logits.argmax(1) == batch.targets).float().mean().item()
    assert results[0]["val/acc"] == pytest.approx(expected_acc)


def test_a_checkpoint_with_the_old_best_accuracy_state_fits(tmp_path: Path) -> None:
    """val/acc_best is the machinery's now (the best checkpoint's score): a checkpoint written
    when the model kept it as a metric state still fits, to resume and to evaluate."""
    model = ImageClassifier(net=NET, lr=0.01)
    saved = {
        "state_dict": {**model.state_dict(), "val_acc_best.max_value": torch.tensor(0.75)},
        "hyper_parameters": dict(model.hparams),
    }
    check_weights_fit(migrated(model, saved), model.state_dict(), "old.ckpt", model.hparams)
    assert "val_acc_best.max_value" in saved["state_dict"], "the checkpoint read is left as is"
    loaded = model_from_checkpoint(saved, "old.ckpt", TASK)
    for name, tensor in model.net.state_dict().items():
        assert torch.equal(loaded.net.state_dict()[name], tensor), name


def test_hyperparameters_are_plain_values() -> None:
    model = ImageClassifier(net=NET, lr=0.01, weight_decay=0.0, num_classes=10)
    expected = {"net": NET, "lr": 0.01, "weight_decay": 0.0, "num_classes": 10}
    defaults = {"compile": False, "channels_last": False, "image_shape": (1, 28, 28), "warmup": 0}
    assert dict(model.hparams) == {**expected, **defaults}


@pytest.mark.parametrize(
    "options", [{"channels_last": True}, pytest.param({"compile": True}, marks=pytest.mark.slow)]
)
def test_speed_options_train_on_cpu(options: dict, tiny_root: Path) -> None:
    """channels_last and torch.compile work on CPU too (compile needs a C++ compiler there)."""
    torch.manual_seed(0)
    model = ImageClassifier(net=NET, lr=0.01, **options)
    datamodule = MNISTDataModule(
        name="mnist", root=str(tiny_root), download=False, batch_size=32, val_size=VAL_SIZE
    )
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=3,
        limit_val_batches=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        precision="bf16-mixed" if options.get("channels_last") else "32-true",
    )
    trainer.fit(model, datamodule=datamodule)
    assert trainer.global_step == 3
    assert set(model.state_dict()) == set(ImageClassifier(net=NET, lr=0.01).state_dict())


def test_an_image_classifier_checkpoint_of_an_older_config_loads(tmp_path: Path) -> None:
    """Keys of the network's own section (model.net) and a metric state dropped since."""
    trained = ImageClassifier(net={**NET, "dropout": 0.25}, lr=0.1)
    saved = {
        "state_dict": trained.state_dict(),
        "hyper_parameters": dict(trained.hparams),
        "datamodule_hyper_parameters": {"name": "mnist"},
    }
    del saved["hyper_parameters"]["channels_last"]  # keys added after it was written
    del saved["hyper_parameters"]["net"]["dropout"]
    saved["state_dict"]["val_acc_best.max_value"] = torch.tensor(0.5)  # a state it dropped
    torch.save(saved, tmp_path / "old.ckpt")
    data = OmegaConf.create({"name": "mnist", "root": str(tmp_path), "download": False})
    data.update(batch_size=8, val_size=2)
    with pytest.warns(UserWarning, match=r"predates config keys channels_last=False, net.dropou"):
        model, _, _ = load_for_inference(str(tmp_path / "old.ckpt"), data, set(), TASK)
    for name, tensor in trained.net.state_dict().items():
        assert torch.equal(model.net.state_dict()[name], tensor)
