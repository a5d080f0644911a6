"""A sweep's report at its end (lib/lightning_exact/sweeps/report.py): the table of its jobs with
the
task's best marked, the sweep folder, jobs.csv and the parent run's link; also for a sweep whose
jobs failed or whose store is away. A real sweep of a task that minimises its metric:
tests/test_task_contract.py."""

import csv
import json
import os
import sys
from pathlib import Path

import pytest
from lightning_exact.sweeps.report import Sweep, report
from lightning_exact.tracking.sweep_run import PARENT_FILE

from tests.conftest import PROJECT, one_error_line, run_entry, run_job, tiny_overrides
from tests.test_register import sweep_of


def rows(stdout: str) -> dict[str, list[str]]:
    """The report table's rows by job number: their cells."""
    cells = [[cell.strip() for cell in line.split("│")[1:-1]] for line in stdout.splitlines()]
    return {row[0]: row[1:] for row in cells if row and row[0].isdigit()}


def test_the_report_marks_the_tasks_best_and_says_where_everything_is(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    sweep = sweep_of(tmp_path / "sweep", [0.7, 0.2, None], metric="val/loss")
    parent = {"run_id": "abc", "tracking_uri": "http://127.0.0.1:9", "experiment_id": "3"}
    (sweep / PARENT_FILE).write_text(json.dumps(parent))  # a store that is away: not asked
    report(Sweep(sweep, "val/loss"), "min")
    out, err = capsys.readouterr()
    assert rows(out) == {
        "0": ["lr=0", "0.7", ""],
        "1": ["lr=1", "0.2", "best (lowest)"],
        "2": ["lr=2", "unfinished", ""],
    }
    assert err == "Warning: job(s) 2 did not finish: see the log in each one's folder\n"
    assert f"sweep folder: {sweep}\n" in out
    assert f"every job: {sweep / 'jobs.csv'}\n" in out
    assert out.endswith(
        "parent run: http://127.0.0.1:9/#/experiments/3/runs/abc?workflowType=machine_learning\n"
    )
    with (sweep / "jobs.csv").open() as file:
        table = list(csv.DictReader(file))
    assert [(row["job"], row["status"], row["val/loss"]) for row in table] == [
        ("0", "finished", "0.7"),
        ("1", "finished", "0.2"),
        ("2", "unfinished", ""),
    ]


def test_an_offline_sweep_and_one_without_mlflow(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    offline = sweep_of(tmp_path / "offline", [0.5])
    parent = {"run_id": "offline-123", "tracking_uri": "http://127.0.0.1:9"}
    (offline / PARENT_FILE).write_text(json.dumps(parent))
    report(Sweep(offline, "val/acc_best"), "max")
    out = capsys.readouterr().out
    assert rows(out) == {"0": ["(none)", "0.5", "best (highest)"]}, "one job varies nothing"
    assert out.endswith(f"parent run: not sent yet; python -m src.sync {offline} sends it\n")
    without = sweep_of(tmp_path / "csv", [0.5])
    report(Sweep(without, "val/acc_best"), "max")
    assert capsys.readouterr().out.endswith(f"every job: {without / 'jobs.csv'}\n"), "no run"
    report(Sweep(tmp_path / "never-started", "val/acc_best"), "max")
    assert capsys.readouterr() == ("", ""), "a sweep that ran no job reports nothing"


@pytest.mark.slow
def test_a_sweep_whose_jobs_were_refused_reports_after_their_error(
    tiny_root: Path, tmp_path: Path
) -> None:
    proc = run_entry(
        "train", "-m", *tiny_overrides(tiny_root), "model.lr=abc,-1", cwd=tmp_path, check=False
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.rstrip().endswith(
        "Warning: job(s) 0, 1 did not finish: see the log in each one's folder"
    )
    assert rows(proc.stdout) == {
        "0": ["lr=abc", "unfinished", ""],
        "1": ["lr=-1", "unfinished", ""],
    }
    (sweep,) = (tmp_path / "outputs" / "train" / "multiruns").iterdir()
    assert f"sweep folder: {sweep}\n" in proc.stdout
    assert proc.stdout.endswith(f"every job: {sweep / 'jobs.csv'}\n"), "no job reached MLflow"


WITHOUT_A_METRIC = """
import dataclasses, runpy, sys
import src.task
src.task.TASK = dataclasses.replace(src.task.TASK, monitor=None, optimized_metric=None)
sys.argv = ["src.train", *sys.argv[1:]]
runpy.run_module("src.train", run_name="__main__")
"""


def test_an_optuna_search_of_a_task_without_a_metric_is_refused_before_any_job(
    tmp_path: Path,
) -> None:
    """Task.monitor=None, no optimized_metric: the sweeper would have nothing to optimize."""
    command = [sys.executable, "-c", WITHOUT_A_METRIC, "-m", "hydra/sweeper=optuna_search"]
    env = {**os.environ, "PYTHONPATH": str(PROJECT)}
    proc = run_job([*command, f"paths.root_dir={tmp_path}"], cwd=tmp_path, env=env)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert one_error_line(proc.stderr) == (
        "Error: optimized_metric is null: the task names no metric (Task.monitor=None, no "
        "Task.optimized_metric), so this sweeper has nothing to optimize; name one the jobs log: "
        "optimized_metric=<metric>"
    )
    assert not (tmp_path / "outputs").exists() and not (tmp_path / "mlflow.db").exists()
