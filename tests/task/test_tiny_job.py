"""The shipped task's own numbers and files in the session's ``trained`` job (the plugin's
fixture; the library checks its own task's in lib/tests/test_train.py): it learns, every sample
is counted, its checkpoints hold its network's settings, its figures are logged, and lengthened
it keeps its best accuracy and trains on the cosine of its new length."""

import csv
import math
from pathlib import Path

import matplotlib.pyplot as plt
import pytest
import torch
from lightning_exact.testing.plugin import TRAINED_STEPS
from lightning_exact.testing.records import read_metrics

from tests.conftest import HARNESS
from tests.task.tiny_job import BATCH_SIZE

N_TEST = HARNESS.n_test
N_TRAIN = HARNESS.n_train
VAL_SIZE = HARNESS.val_size


def only_run(store, experiment=HARNESS.data_name, task="train"):
    from lightning_exact.testing.records import only_run as only_run_in

    return only_run_in(store, experiment, task)


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


@pytest.mark.slow
def test_lengthened_it_keeps_its_best_accuracy_and_decays_over_its_new_length(
    trained: dict[str, Path], tiny_root: Path, tmp_path: Path
) -> None:
    """The trained job resumed for a third epoch: only that epoch is trained, val/acc_best
    (a persistent metric) is the best of all three, and its lr follows the cosine over the new
    length (a restored CosineAnnealingLR had reached 0 at the old length and stayed there): its
    last step's, 0.05 of the steps warming up (model.warmup)."""
    first = read_metrics(trained["run_dir"])
    last = trained["run_dir"] / "checkpoints" / "last.ckpt"
    run_dir = tmp_path / "resumed"
    overrides = HARNESS.tiny_overrides(tiny_root, logger="csv")
    overrides = [o for o in overrides if not o.startswith("trainer.max_epochs")]
    HARNESS.run_entry(
        "train",
        *overrides,
        *TRAINED_STEPS,
        "trainer.max_epochs=3",
        "seed=0",  # the trained job's (another seed would be another job: refused)
        f"ckpt_path={last}",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    with (run_dir / "csv" / "metrics.csv").open() as file:
        rows = list(csv.DictReader(file))
    validated = [row for row in rows if row.get("val/acc")]
    assert [float(row["epoch"]) for row in validated] == [2, 2], "only the third epoch trained"
    assert read_metrics(run_dir)["val/acc_best"] == pytest.approx(
        max(first["val/acc_best"], *(float(row["val/acc"]) for row in validated))
    )
    steps = (N_TRAIN - VAL_SIZE) // BATCH_SIZE
    total = 3 * steps
    warmup = math.ceil(0.05 * total)
    cosine = 0.5 * (1 + math.cos(math.pi * (total - 1 - warmup) / (total - warmup)))
    lrs = [(int(row["step"]), float(row["train/lr"])) for row in rows if row.get("train/lr")]
    assert lrs[-1] == (total, pytest.approx(0.01 * cosine))
