"""A sweep's report at its end (src/template/sweep_report.py): the table of its jobs with the
task's best marked, the sweep folder, jobs.csv and the parent run's link; also for a sweep whose
jobs failed or whose store is away. A real sweep of a task that minimises its metric:
tests/test_task_contract.py."""

import csv
import json
from pathlib import Path

import pytest

from src.template.sweep_report import Sweep, report
from src.template.tracking.sweep_run import PARENT_FILE
from tests.conftest import run_entry, tiny_overrides
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
