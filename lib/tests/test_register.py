"""``python -m src.register``: the best job of a sweep by its optimized_metric, in the task's
direction. Registering and serving a real sweep's model: tests/task/test_serving.py; a real sweep of
a task that minimises its metric: tests/test_task_contract.py."""

import json
from pathlib import Path

import pytest
import yaml
from lightning_exact.tracking.register import best_job, main

from src.task import TASK


def sweep_of(folder: Path, scores: list[float | None], metric: str | None = "val/acc_best") -> Path:
    """A sweep folder as Hydra and training jobs leave it, whose jobs ``0``, ``1``, ... ended
    with these values of ``metric`` (None: a job that failed before writing metrics.json)."""
    command = ["model.lr=" + ",".join(str(job) for job in range(len(scores)))]
    sweep = {"optimized_metric": metric, "hydra": {"overrides": {"task": command}}}
    folder.mkdir(parents=True)
    (folder / "multirun.yaml").write_text(yaml.safe_dump(sweep))
    for job, score in enumerate(scores):
        (folder / str(job) / ".hydra").mkdir(parents=True)
        (folder / str(job) / ".hydra" / "overrides.yaml").write_text(f"- model.lr={job}\n")
        if score is not None:
            metrics = {metric or "test/loss": score, "test/acc": 0.5}
            (folder / str(job) / "metrics.json").write_text(json.dumps(metrics))
    return folder


def test_the_best_job_is_the_first_of_the_highest_or_lowest(tmp_path: Path) -> None:
    scores = [0.5, 0.9, None, 0.9, 0.1, 0.3, 0.3, 0.3, 0.3, 0.3, 0.95]
    sweep = sweep_of(tmp_path / "sweep", scores)
    assert best_job(sweep, "max") == (sweep / "10", "val/acc_best", 0.95), "10 after 9"
    assert best_job(sweep, "min") == (sweep / "4", "val/acc_best", 0.1)
    assert best_job(sweep_of(tmp_path / "tie", [0.9, 0.9]), "max")[0].name == "0"


def test_a_loss_sweep_registers_its_lowest_job(tmp_path: Path) -> None:
    """A task whose mode is "min" (a loss): its lowest job, as its sweep's parent run says."""
    sweep = sweep_of(tmp_path / "sweep", [0.7, 0.2, 0.4], metric="val/loss")
    assert best_job(sweep, "min") == (sweep / "1", "val/loss", 0.2)


def test_a_sweep_without_a_finished_job_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    sweep = sweep_of(tmp_path / "sweep", [None])
    assert main(TASK, [str(sweep), "--name", "best"]) == 1
    assert capsys.readouterr().err == (
        f"Error: {sweep} holds no finished job (no <job>/metrics.json with val/acc_best)\n"
    )
    not_sweeps = {tmp_path / "nowhere": "is not a folder", tmp_path: "holds no multirun.yaml"}
    for given, problem in not_sweeps.items():
        assert main(TASK, [str(given), "--name", "best"]) == 1
        assert capsys.readouterr().err == (
            f"Error: {given} {problem}: pass a sweep's, outputs/train/multiruns/<time>\n"
        )


def test_a_best_job_without_a_run_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    metric = TASK.config_values()["optimized_metric"]
    sweep = sweep_of(tmp_path / "sweep", [0.4, 0.6], metric)
    assert main(TASK, [str(sweep), "--name", "best"]) == 1
    err = capsys.readouterr().err
    job, score = ("1", 0.6) if TASK.mode == "max" else ("0", 0.4)  # the task's best
    assert err == f"Error: the best job, {sweep / job} ({metric}={score}), has no MLflow run\n"


def test_an_empty_certificate_path_is_refused_before_any_request(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Empty, MLflow would check no certificate at all (as test_store's jobs check)."""
    metric = TASK.config_values()["optimized_metric"]
    sweep = sweep_of(tmp_path / "sweep", [0.4, 0.6], metric)
    for job in ("0", "1"):
        (sweep / job / "mlflow_run_id.txt").write_text("abc\n")
    monkeypatch.setenv("MLFLOW_TRACKING_SERVER_CERT_PATH", "")
    argv = [str(sweep), "--name", "best", "--tracking-uri", "https://127.0.0.1:9"]
    assert main(TASK, argv) == 1
    assert capsys.readouterr().err.startswith(
        "Error: MLFLOW_TRACKING_SERVER_CERT_PATH is set but empty, which would turn certificate "
        "checks off"
    )


def test_a_sweep_of_a_task_without_a_metric_ranks_nothing_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Task.monitor=None and no optimized_metric: a grid sweep ran, but nothing ranks its jobs."""
    sweep = sweep_of(tmp_path / "sweep", [0.5, 0.7], metric=None)
    assert main(TASK, [str(sweep), "--name", "best"]) == 1
    assert capsys.readouterr().err == (
        f"Error: {sweep} ranks no job: its optimized_metric is null (the task names no metric); "
        "sweep again with optimized_metric=<a metric the jobs log>\n"
    )
