"""The notebooks, which show the shipped image task's data, network and runs, run top to bottom
against a store the test creates. A forker who replaces the task adapts or deletes them with this
test."""

from pathlib import Path

import nbformat
import pytest
from mlflow import MlflowClient
from nbclient import NotebookClient

from tests.conftest import HARNESS, PROJECT
from tests.idx_data import make_dataset

N_TEST = HARNESS.n_test
N_TRAIN = HARNESS.n_train
VAL_SIZE = HARNESS.val_size
run_entry = HARNESS.run_entry
tiny_overrides = HARNESS.tiny_overrides

pytestmark = pytest.mark.slow


def execute(name: str) -> nbformat.NotebookNode:
    notebook = nbformat.read(PROJECT / "notebooks" / name, as_version=4)
    assert all(not cell.get("outputs") for cell in notebook.cells), "outputs are stripped in git"
    resources = {"metadata": {"path": str(PROJECT / "notebooks")}}
    NotebookClient(notebook, timeout=300, kernel_name="python3", resources=resources).execute()
    return notebook


def text_of(notebook: nbformat.NotebookNode) -> str:
    return "".join(
        output.get("text", "") + str(output.get("data", {}).get("text/plain", ""))
        for cell in notebook.cells
        for output in cell.get("outputs", [])
    )


def images_in(notebook: nbformat.NotebookNode) -> int:
    outputs = [o for cell in notebook.cells for o in cell.get("outputs", [])]
    return sum("image/png" in output.get("data", {}) for output in outputs)


def test_mlflow_review_notebook(
    tiny_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    overrides = [o for o in tiny_overrides(tiny_root) if not o.startswith("model.lr=")]
    run_entry(
        "train",
        "-m",
        *overrides,
        "model.lr=0.01,0.02",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        cwd=tmp_path,
    )
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs(
        [client.get_experiment_by_name("mnist").experiment_id], "tags.task = 'train'"
    )
    assert len({run.data.tags["sweep.id"] for run in runs}) == 1, "one sweep, one shared tag"
    assert sorted(run.data.tags["sweep.job"] for run in runs) == ["0", "1"]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    notebook = execute("mlflow_review.ipynb")
    text = text_of(notebook)
    assert "2 training runs in 'mnist'" in text
    assert "best run lr=" in text  # a sweep job's run: named for what it varies
    assert images_in(notebook) == 2, "the sweep plot and the confusion matrix"


def test_data_and_model_notebook(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_dataset(tmp_path, n_train=N_TRAIN, n_test=N_TEST, learnable=True)
    monkeypatch.setenv("DATA_ROOT", str(tmp_path))
    monkeypatch.setenv("VAL_SIZE", str(VAL_SIZE))
    notebook = execute("data_and_model.ipynb")
    text = text_of(notebook)
    assert f"{{'train': {N_TRAIN - VAL_SIZE}, 'val': {VAL_SIZE}, 'test': {N_TEST}}}" in text
    assert "images (32, 1, 28, 28) torch.float32" in text
    assert "first global batch identical for every world size: True" in text
    assert images_in(notebook) == 1, "the batch grid"
