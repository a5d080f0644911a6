"""``python -m src.predict`` on the shipped task writes one CSV row per sample, in dataset order
(in the daily set: predict runs end to end there)."""

import csv
from pathlib import Path

import numpy as np
import pytest
from lightning_exact.testing.records import best_checkpoint, read_metrics

from src.task import TASK
from src.task.data.mnist import DATASETS, load_split
from tests.conftest import HARNESS

N_TEST = HARNESS.n_test
run_entry = HARNESS.run_entry


def test_predict_writes_every_test_sample_in_order(
    trained: dict[str, Path], tiny_root: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "predict"
    proc = run_entry(
        "predict",
        f"ckpt_path={best_checkpoint(trained['run_dir'])}",
        f"data.root={tiny_root}",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    path = run_dir / "predictions_test.csv"
    assert str(path) in proc.stdout.replace("\n", "")
    with path.open() as file:
        rows = list(csv.DictReader(file))
    assert list(rows[0]) == ["index", "label", "predicted", "class_name", "confidence"]
    assert all(r["class_name"] == r["predicted"] for r in rows), "MNIST's classes are 0..9"
    assert [int(r["index"]) for r in rows] == list(range(N_TEST))
    _, labels = load_split(tiny_root, DATASETS["mnist"], train=False)
    assert [int(r["label"]) for r in rows] == labels.tolist()
    confidences = np.array([float(r["confidence"]) for r in rows])
    assert ((confidences > 0.1) & (confidences <= 1)).all()
    # The CSV agrees with the training job's test accuracy on the same checkpoint.
    accuracy = np.mean([r["label"] == r["predicted"] for r in rows])
    assert accuracy == pytest.approx(read_metrics(trained["run_dir"])["test/acc"], abs=1e-6)
    assert read_metrics(run_dir) == {
        "predict/acc": pytest.approx(accuracy),
        "predict/samples": N_TEST,
    }


def test_the_image_task_reads_new_image_files() -> None:
    assert TASK.predict_inputs is not None
