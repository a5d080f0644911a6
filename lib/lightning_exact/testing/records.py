"""What a job left, read back for a test: its ``metrics.json``, a checkpoint (a sharded folder
as one file), its MLflow run and every point of it."""

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest


def read_metrics(run_dir: Path) -> dict[str, float]:
    return json.loads((run_dir / "metrics.json").read_text())


def load_checkpoint(path: Path) -> dict:
    """A checkpoint's contents; a sharded folder (strategy=fsdp) as ``src.consolidate`` makes it
    one file (optimizer states keyed as torch's own)."""
    import torch  # here: the daily tests that need no checkpoint start faster

    from lightning_exact.training.sharded import consolidate

    if not path.is_dir():
        return torch.load(path, weights_only=True)
    with tempfile.TemporaryDirectory() as folder:
        consolidate(path, Path(folder) / "whole.ckpt")
        return torch.load(Path(folder) / "whole.ckpt", weights_only=True)


def only_run(store: Path, experiment: str, task: str = "train") -> tuple[Any, Any]:
    """(client, run): the single MLflow run of ``task`` in a SQLite store's ``experiment``
    (fails if there are several)."""
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{store}")
    runs = client.search_runs(
        [client.get_experiment_by_name(experiment).experiment_id], f"tags.task = '{task}'"
    )
    assert len(runs) == 1, [run.info.run_name for run in runs]
    return client, runs[0]


def history(
    store: Path, experiment: str, task: str = "train"
) -> dict[str, list[tuple[int, float]]]:
    """Every metric's (step, value) points in that run, system metrics left out."""
    client, found = only_run(store, experiment, task)
    return {
        key: sorted((m.step, m.value) for m in client.get_metric_history(found.info.run_id, key))
        for key in found.data.metrics
        if not key.startswith("system/")
    }


def files_holding(secret: str, folder: Path, max_size: float = float("inf")) -> list[Path]:
    """The files under ``folder`` (up to ``max_size`` bytes) whose bytes contain ``secret``: a
    password must be in none of them."""
    files = [path for path in folder.rglob("*") if path.is_file()]
    small = [path for path in files if path.stat().st_size <= max_size]
    return [path for path in small if secret.encode() in path.read_bytes()]


def best_checkpoint(run_dir: Path) -> Path:
    """The job's best checkpoint (``epoch*-step*.ckpt``: one, save_top_k=1)."""
    (path,) = (run_dir / "checkpoints").glob("epoch*-step*.ckpt")
    return path


def assert_rank_logs(run_dir: Path, node: int, local: int) -> None:
    """Ranks started by torchrun or srun each log to their own file: rank 1 to train_rank1.log."""
    assert "rank 0/2 (node 0, local 0)" in (run_dir / "train.log").read_text()
    assert "rank 1/2" not in (run_dir / "train.log").read_text()
    assert f"rank 1/2 (node {node}, local {local})" in (run_dir / "train_rank1.log").read_text()


def assert_same_tensors(actual: object, expected: object, where: str) -> None:
    """Nested checkpoint parts (tensors, dicts, lists, plain values) equal to float32's
    summation order."""
    import torch

    if isinstance(expected, torch.Tensor):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=where)
    elif isinstance(expected, dict):
        assert actual.keys() == expected.keys(), where
        for key in expected:
            assert_same_tensors(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, list | tuple):
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same_tensors(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, where


def assert_same_metrics(run_dir: Path, expected: dict[str, float]) -> None:
    metrics = read_metrics(run_dir)
    assert metrics.keys() == expected.keys()
    for name, value in expected.items():
        assert metrics[name] == pytest.approx(value, abs=1e-6), name
