"""The shipped task's own numbers and files in the session's ``trained`` job (tests/conftest.py;
the machinery's checks of it are in tests/test_train.py): it learns, every sample is counted,
its checkpoints hold its network's settings, its figures are logged."""

from pathlib import Path

import matplotlib.pyplot as plt
import pytest
import torch

from tests.conftest import N_TEST, N_TRAIN, VAL_SIZE, only_run, read_metrics
from tests.task.tiny_job import BATCH_SIZE


def test_the_tiny_job_learns_and_counts_every_sample(trained: dict[str, Path]) -> None:
    metrics = read_metrics(trained["run_dir"])
    # The training metrics of the last 4 steps (trainer.log_every_n_steps=4).
    assert metrics["train/samples"] == 4 * BATCH_SIZE
    assert metrics["val/samples"] == VAL_SIZE
    assert metrics["test/samples"] == N_TEST
    # The label is drawn into each image, so two epochs learn it well.
    assert metrics["val/acc"] > 0.9 and metrics["test/acc"] > 0.9
    assert metrics["val/acc_best"] >= metrics["val/acc"]
    assert 0 < metrics["test/loss"] < 1


def test_each_epochs_training_points_add_up_to_its_whole_batches(trained: dict[str, Path]):
    """Points every 4 steps and at each epoch's end (10 steps): 4, 4 and 2 steps an epoch, the
    last incomplete global batch dropped."""
    client, run = only_run(trained["workdir"] / "mlflow.db")
    history = sorted(
        client.get_metric_history(run.info.run_id, "train/samples"), key=lambda m: m.step
    )
    assert [m.step for m in history] == [4, 8, 10, 12, 16, 20]
    samples = [m.value for m in history]
    assert samples == [BATCH_SIZE * steps for steps in (4, 4, 2, 2, 4, 4)]
    assert sum(samples[:3]) == (N_TRAIN - VAL_SIZE) // BATCH_SIZE * BATCH_SIZE


def test_its_checkpoints_hold_the_networks_settings(trained: dict[str, Path]) -> None:
    saved = torch.load(trained["run_dir"] / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["hyper_parameters"]["net"]["channels"] == [8, 16]
    assert saved["hyper_parameters"]["lr"] == pytest.approx(0.01)


def test_its_figures_are_logged(trained: dict[str, Path], tmp_path: Path) -> None:
    client, run = only_run(trained["workdir"] / "mlflow.db")
    for name in ("confusion_matrix_test.png", "misclassified_test.png"):
        png = client.download_artifacts(run.info.run_id, f"figures/{name}", str(tmp_path))
        assert plt.imread(png).shape[2] in (3, 4), f"{name} decodes as an image"
