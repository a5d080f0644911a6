"""``python -m src.register``: the best job of a sweep by its optimized_metric. Registering and
serving a real sweep's model: tests/test_serving.py."""

import json
from pathlib import Path

import pytest

from src.register import best_job, main


def sweep_of(folder: Path, scores: list[float | None]) -> Path:
    """A sweep folder whose jobs ``0``, ``1``, ... ended with these ``val/acc_best`` values
    (None: a job that failed before writing metrics.json)."""
    for job, score in enumerate(scores):
        (folder / str(job)).mkdir(parents=True)
        (folder / str(job) / "config.yaml").write_text("optimized_metric: val/acc_best\n")
        if score is not None:
            metrics = {"val/acc_best": score, "test/acc": 0.5}
            (folder / str(job) / "metrics.json").write_text(json.dumps(metrics))
    return folder


def test_the_best_job_is_the_first_of_the_highest_or_lowest(tmp_path: Path) -> None:
    sweep = sweep_of(tmp_path, [0.5, 0.9, None, 0.9, 0.1, 0.3, 0.3, 0.3, 0.3, 0.3, 0.95])
    assert best_job(sweep, lowest=False) == (sweep / "10", "val/acc_best", 0.95), "10 after 9"
    assert best_job(sweep, lowest=True) == (sweep / "4", "val/acc_best", 0.1)
    assert best_job(sweep_of(tmp_path / "tie", [0.9, 0.9]), lowest=False)[0].name == "0"


def test_a_sweep_without_a_finished_job_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    assert main([str(sweep_of(tmp_path, [None])), "--name", "best"]) == 1
    assert capsys.readouterr().err == (
        f"Error: {tmp_path} holds no finished job (no <job>/metrics.json with a value)\n"
    )
    assert main([str(tmp_path / "nowhere"), "--name", "best"]) == 1
    assert capsys.readouterr().err == (
        f"Error: {tmp_path / 'nowhere'} is not a folder: pass a sweep's, "
        "outputs/train/multiruns/<time>\n"
    )


def test_a_best_job_without_a_run_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    sweep = sweep_of(tmp_path, [0.4, 0.6])
    assert main([str(sweep), "--name", "best"]) == 1
    err = capsys.readouterr().err
    assert err == f"Error: the best job, {sweep / '1'} (val/acc_best=0.6), has no MLflow run\n"
