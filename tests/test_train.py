"""End-to-end: ``python -m src.train`` on a tiny generated dataset, as a subprocess."""

import csv
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from tests.conftest import N_TEST, N_TRAIN, VAL_SIZE, read_metrics, run_entry, tiny_overrides

pytestmark = pytest.mark.slow


def test_train_reports_exact_metrics(trained: dict[str, Path]) -> None:
    metrics = read_metrics(trained["run_dir"])
    # Training drops the last incomplete global batch (src/distributed.py: GlobalBatchSampler).
    assert metrics["train/samples"] == (N_TRAIN - VAL_SIZE) // 32 * 32
    assert metrics["val/samples"] == VAL_SIZE
    assert metrics["test/samples"] == N_TEST
    # The label is drawn into each image, so two epochs learn it well.
    assert metrics["val/acc"] > 0.9 and metrics["test/acc"] > 0.9
    assert metrics["val/acc_best"] >= metrics["val/acc"]
    assert 0 < metrics["test/loss"] < 1
    assert "Seed set to 0" in trained["log"]


def test_train_leaves_checkpoints_config_and_log(trained: dict[str, Path]) -> None:
    run_dir = trained["run_dir"]
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "last.ckpt").is_file()
    assert len(list(ckpts.glob("epoch*-acc*.ckpt"))) == 1
    assert "max_epochs: 2" in (run_dir / "config.yaml").read_text()
    assert (run_dir / "train.log").is_file()
    # Checkpoints hold plain values only: they load with torch.load's safe default.
    saved = torch.load(ckpts / "last.ckpt", weights_only=True)
    assert saved["hyper_parameters"]["net"]["channels"] == [8, 16]
    assert saved["datamodule_hyper_parameters"]["name"] == "mnist"


def test_train_logs_one_finished_mlflow_run(trained: dict[str, Path]) -> None:
    store = trained["workdir"] / "mlflow.db"
    assert store.is_file(), "the default store is mlflow.db in the launch folder"
    client = MlflowClient(f"sqlite:///{store}")
    experiment = client.get_experiment_by_name("mnist")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "train-mnist"
    assert run.data.params["model.lr"] == "0.01"
    assert run.data.params["data.batch_size"] == "32"
    assert run.data.params["world_size"] == "1"
    assert Path(run.info.artifact_uri.removeprefix("file://")).is_relative_to(
        trained["workdir"] / "mlartifacts"
    )
    val_acc = client.get_metric_history(run.info.run_id, "val/acc")
    assert [m.step for m in val_acc] == [1, 3] or len(val_acc) == 2  # one point per epoch
    metrics = read_metrics(trained["run_dir"])
    assert run.data.metrics["test/acc"] == pytest.approx(metrics["test/acc"])
    assert run.data.metrics["test/samples"] == N_TEST


def test_train_resumes_at_the_next_epoch_with_its_best_metric(
    trained: dict[str, Path], tiny_root: Path, tmp_path: Path
) -> None:
    first = read_metrics(trained["run_dir"])
    last = trained["run_dir"] / "checkpoints" / "last.ckpt"
    run_dir = tmp_path / "resumed"
    overrides = [o for o in tiny_overrides(tiny_root) if not o.startswith("trainer.max_epochs")]
    run_entry(
        "train",
        *overrides,
        "trainer.max_epochs=3",
        f"ckpt_path={last}",
        "logger=csv",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    with (run_dir / "csv" / "metrics.csv").open() as file:
        rows = [row for row in csv.DictReader(file) if row.get("val/acc")]
    assert [int(row["epoch"]) for row in rows] == [2], "only the third epoch is trained"
    resumed = read_metrics(run_dir)
    assert resumed["val/acc_best"] == pytest.approx(
        max(first["val/acc_best"], float(rows[0]["val/acc"]))
    )
    saved = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    batches_per_epoch = (N_TRAIN - VAL_SIZE) // 32
    assert (saved["epoch"], saved["global_step"]) == (2, 3 * batches_per_epoch)


def test_failing_run_is_marked_failed(tiny_root: Path, tmp_path: Path) -> None:
    proc = run_entry(
        "train",
        *tiny_overrides(tiny_root),
        f"ckpt_path={tmp_path / 'missing.ckpt'}",
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode != 0
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("mnist").experiment_id])
    assert [run.info.status for run in runs] == ["FAILED"]


def test_missing_data_is_one_short_error(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    proc = run_entry(
        "train",
        f"data.root={empty}",
        "data.download=false",
        "logger=none",
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert f"not found in {empty}/MNIST/raw" in proc.stderr.replace("\n", "")
    assert "data.root=" in proc.stderr and "train-images-idx3-ubyte.gz" in proc.stderr
    assert not empty.exists(), "nothing is written when nothing can be read"
