"""The proof of the task contract (issue #25): in a copy of the template, the image classifier is
deleted and a regression on synthetic vectors (the library's test task, ``lib/tests/project/``)
takes its place by edits to ``src/task/``, ``conf/`` and ``tests/task/`` only, the "Make it
yours" steps of docs/make-it-yours.md for another kind of task. The unchanged machinery then
trains it, predicts with its checkpoint on 2 ranks, sweeps it, logs it as an MLflow model and
serves it, and the copy's own tests pass (the conformance check among them: it trains, evaluates
and predicts)."""

import csv
import filecmp
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import mlflow
import numpy as np
import pytest
import yaml
from lightning_exact.testing.records import read_metrics
from lightning_exact.testing.servers import served
from lightning_exact.tracking.sweep_run import PARENT_FILE
from mlflow import MlflowClient

from tests.conftest import HARNESS, PROJECT

run_entry = HARNESS.run_entry


def rows(stdout: str) -> dict[str, list[str]]:
    """The sweep report table's rows by job number: their cells."""
    cells = [[cell.strip() for cell in line.split("│")[1:-1]] for line in stdout.splitlines()]
    return {row[0]: row[1:] for row in cells if row and row[0].isdigit()}


# laid out as a project: src/task/, conf/ (task.yaml, data/, model/, hparams_search/), tests/task/
REGRESSION = PROJECT / "lib" / "tests" / "project"
TASK_PATHS = ("src/task", "conf", "tests/task")  # all a forker edits
LEFT_OUT = {
    ".git",
    ".venv",
    "outputs",
    "data",
    "mlruns",
    "mlartifacts",
    "wheelhouse",
    "mlflow.db",
    "optuna.db",
    ".pytest_cache",
    ".ruff_cache",
}
# conf/data/synthetic.yaml: sizes no world size of 2 or 3 divides
N_TEST, VAL_SIZE, FEATURES = 73, 43, 8
TINY = ["trainer.max_epochs=2", "callbacks.progress_bar=none"]
SHOWN = 5  # test vectors sent to the served model
# In parallel runs (-n), one worker runs this module: its tests share the copy and its job.
pytestmark = pytest.mark.xdist_group("task-contract")


def leave_out(folder: str, names: list[str]) -> list[str]:
    at_top = Path(folder) == PROJECT
    return [n for n in names if (at_top and n in LEFT_OUT) or n == "__pycache__"]


def set_line(path: Path, pattern: str, line: str) -> None:
    """Replace the one line of ``path`` that matches ``pattern`` (a regex) with ``line``."""
    text, count = re.subn(rf"(?m)^{pattern}.*$", line, path.read_text())
    assert count == 1, f"{pattern!r} in {path}"
    path.write_text(text)


IGNORED = shutil.ignore_patterns("__py*")

# The image task's benchmarks and notebooks, deleted with it (docs/make-it-yours.md, step 1).
KEPT_BENCHMARKS = {"__init__.py", "tracking_load.py", "gpu_check.py"}


def image_extras(root: Path) -> list[Path]:
    benchmarks = [p for p in (root / "benchmarks").glob("*.*") if p.name not in KEPT_BENCHMARKS]
    return [*benchmarks, *(root / "notebooks").glob("*.ipynb")]


def make_it_a_regression(copy: Path) -> None:
    """The steps of docs/make-it-yours.md for another kind of task, in ``copy``."""
    replace_the_task(copy, REGRESSION, data="synthetic", model="mlp")


def replace_the_task(
    copy: Path, task: Path, data: str, model: str, keep_image_data: bool = False
) -> None:
    """The steps of docs/make-it-yours.md for another kind of task, in ``copy``: the task laid
    out as the project in ``task`` (src/task/, tests/task/, conf/) with its ``data`` and
    ``model`` configs. ``keep_image_data``: another task on the same images keeps the image
    task's data modules (``src/task/data/``) and their configs (``conf/data/``)."""
    # 1. Delete the image task: its package, its tests, the configs of its datasets and networks,
    # its benchmarks and notebooks.
    for path in (copy / "src" / "task").iterdir():
        if keep_image_data and path.name == "data":
            continue
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    shutil.rmtree(copy / "tests" / "task", ignore_errors=True)  # absent in a project made so
    groups = ("model", "experiment", "hparams_search") + (() if keep_image_data else ("data",))
    for group in groups:
        for path in (copy / "conf" / group).glob("*.yaml"):
            path.unlink()
    for path in image_extras(copy):
        path.unlink()
    # 2. Write the new one: src/task/ (TASK and what it names), conf/data/, conf/model/,
    # conf/task.yaml (its defaults: the entry points read them; the sweep metric follows its
    # TASK.monitor), tests/task/tiny_job.py. Its own folder's copy of the entry points is the
    # template's (the library's test project links them).
    shutil.copytree(
        task / "src" / "task", copy / "src" / "task", dirs_exist_ok=True, ignore=IGNORED
    )
    shutil.copytree(task / "conf", copy / "conf", dirs_exist_ok=True, ignore=IGNORED)
    shutil.copytree(task / "tests", copy / "tests", dirs_exist_ok=True, ignore=IGNORED)
    defaults = (copy / "conf" / "task.yaml").read_text()
    assert f"  - data: {data}" in defaults and f"  - model: {model}" in defaults
    # 3. The image task's conversion to shards (src.prepare) reads its data defaults too.
    set_line(copy / "conf" / "prepare.yaml", "  - data:", f"  - data: {data}")


MADE: dict[Path, set[str]] = {}  # each copy's files, as the fixture made it


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    copy = tmp_path_factory.mktemp("regression") / "project"
    shutil.copytree(PROJECT, copy, ignore=leave_out)
    make_it_a_regression(copy)
    MADE[copy] = files(copy)
    return copy


def files(root: Path) -> set[str]:
    return {
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }


def run(project: Path, entry: str, *overrides: str) -> subprocess.CompletedProcess:
    return run_entry(entry, *overrides, cwd=project, env={"PYTHONPATH": str(project)})


def test_only_the_task_and_its_configs_change(project: Path) -> None:
    """Every file outside src/task/ and conf/ is the original's, byte for byte (the machinery
    in lib/lightning_exact/ and the entry points included); nothing of the image task is left."""
    edited = tuple(f"{path}/" for path in TASK_PATHS)
    deleted = {p.relative_to(PROJECT).as_posix() for p in image_extras(PROJECT)}
    original = {p for p in files(PROJECT) if p.split("/")[0] not in LEFT_OUT} - deleted
    # The copy as made: the module's jobs write into it (with -n, its slow tests run first).
    outside = sorted(p for p in MADE[project] if not p.startswith(edited))
    assert outside == sorted(p for p in original if not p.startswith(edited))
    _, mismatch, errors = filecmp.cmpfiles(PROJECT, project, outside, shallow=False)
    assert not mismatch and not errors, mismatch + errors
    assert any(p.startswith("lib/lightning_exact/") for p in outside)
    assert files(project / "src" / "task") == {
        f"{name}.py" for name in ("__init__", "data", "model", "export", "served_model", "report")
    }
    assert files(project / "conf" / "data") == {"synthetic.yaml", "noisy.yaml"}
    assert files(project / "conf" / "model") == {"mlp.yaml"}


@pytest.fixture(scope="module")
def regression_run(project: Path) -> Path:
    """One training job on 1 rank with the defaults: MLflow in the copy's ./mlflow.db."""
    run_dir = project / "runs" / "one-rank"
    run(project, "train", *TINY, f"hydra.run.dir={run_dir}")
    return run_dir


def best_checkpoint(run_dir: Path) -> Path:
    (best,) = (run_dir / "checkpoints").glob("epoch*-loss*.ckpt")  # named by val/loss
    return best


@pytest.mark.slow
def test_the_regression_trains_and_tests_its_best_checkpoint(regression_run: Path) -> None:
    """(On 2 ranks, and evaluated on 1 and 2: the library's own tests, on this same task,
    lib/tests/test_distributed.py.)"""
    one = read_metrics(regression_run)
    assert {"train/loss", "train/mae", "val/loss", "test/loss", "test/mae"} <= one.keys()
    assert one["test/samples"] == N_TEST and one["val/samples"] == VAL_SIZE
    assert one["test/loss"] < 2.0, "it learned: the test targets' variance is 8.8"
    assert (regression_run / "figures" / "predicted_vs_target_test.png").stat().st_size > 0


def synthetic_test_split(project: Path) -> tuple[np.ndarray, np.ndarray]:
    """The synthetic test split, read by the copy's own data module."""
    spec = importlib.util.spec_from_file_location("regression_data", project / "src/task/data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    settings = yaml.safe_load((project / "conf" / "data" / "synthetic.yaml").read_text())
    settings.pop("shuffle_seed")  # ${seed}: not needed to read
    inputs, targets = module.SyntheticDataModule(**settings).read("test")
    return inputs.numpy(), targets.numpy()


@pytest.mark.slow
def test_predict_and_the_served_model_agree(project: Path, regression_run: Path) -> None:
    """src.predict on 2 ranks writes the regression's own columns for every test sample once,
    in index order; the job's MLflow model (float32 vectors in, a prediction out), served by
    ``mlflow models serve``, predicts the same values."""
    out = project / "runs" / "predict"
    ckpt = best_checkpoint(regression_run)
    run(
        project,
        "predict",
        f"ckpt_path={ckpt}",
        "strategy=ddp",
        "devices=2",
        "callbacks.progress_bar=none",
        f"hydra.run.dir={out}",
    )
    with (out / "predictions_test.csv").open() as file:
        reader = csv.DictReader(file)
        rows = list(reader)
    assert reader.fieldnames == ["index", "target", "predicted"]
    assert [int(row["index"]) for row in rows] == list(range(N_TEST))
    inputs, targets = synthetic_test_split(project)
    assert inputs.dtype == np.float32 and inputs.shape == (N_TEST, FEATURES)
    assert [float(row["target"]) for row in rows] == targets.tolist()
    assert read_metrics(out)["predict/samples"] == N_TEST

    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    run_id = (regression_run / "mlflow_run_id.txt").read_text().strip()
    experiment = client.get_experiment_by_name("synthetic").experiment_id
    (model,) = client.search_logged_models([experiment], f"source_run_id = '{run_id}'")
    assert str(model.status) == "READY"
    assert {m.key for m in model.metrics} == {"test/loss", "test/mae", "test/samples"}
    mlflow.set_tracking_uri(f"sqlite:///{project / 'mlflow.db'}")
    try:
        signature = mlflow.models.get_model_info(f"models:/{model.model_id}").signature
    finally:
        mlflow.set_tracking_uri(None)
    assert signature.inputs.to_dict() == [
        {"type": "tensor", "tensor-spec": {"dtype": "float32", "shape": (-1, FEATURES)}}
    ]
    assert signature.outputs.to_dict() == [{"type": "float", "name": "predicted", "required": True}]

    answers = served(f"models:/{model.model_id}", project, inputs[:SHOWN])
    predicted = [float(row["predicted"]) for row in rows[:SHOWN]]
    assert [answer["predicted"] for answer in answers] == pytest.approx(predicted, abs=1e-6)


@pytest.mark.slow
def test_a_sweep_of_two_learning_rates(project: Path) -> None:
    """Hydra's basic launcher runs both jobs; the sweep's report at its end and src.register
    pick the one of lowest val/loss_best (each job's best checkpoint's val/loss): the task's
    mode, as its parent run does."""
    sweep = project / "sweep"
    proc = run(project, "train", "-m", "model.lr=0.01,0.03", *TINY, f"hydra.sweep.dir={sweep}")
    losses = {}
    for job, lr in (("0", 0.01), ("1", 0.03)):
        assert yaml.safe_load((sweep / job / "config.yaml").read_text())["model"]["lr"] == lr
        metrics = read_metrics(sweep / job)
        assert metrics["test/samples"] == N_TEST
        losses[job] = metrics["val/loss_best"]
    best = min(losses, key=losses.get)
    assert rows(proc.stdout) == {
        job: [f"lr={lr}", f"{losses[job]:.6g}", "best (lowest)" if job == best else ""]
        for job, lr in (("0", 0.01), ("1", 0.03))
    }
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    parent = client.get_run(json.loads((sweep / PARENT_FILE).read_text())["run_id"])
    assert parent.data.tags["best.job"] == best, "the parent run names the same best job"
    experiment = parent.info.experiment_id
    assert proc.stdout.endswith(
        f"sweep folder: {sweep}\nevery job: {sweep / 'jobs.csv'}\nparent run: "
        f"http://127.0.0.1:5000/#/experiments/{experiment}/runs/{parent.info.run_id}"
        "?workflowType=machine_learning (after `mlflow ui` here)\n"
        "its jobs, optimized_metric a column: "
        f"http://127.0.0.1:5000/#/experiments/{experiment}/runs?viewStateShareKey={sweep.name}"
        "&workflowType=machine_learning (after `mlflow ui` here)\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "src.register", str(sweep), "--name", "regression"],
        cwd=project,
        env={**os.environ, "PYTHONPATH": str(project)},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(
        f"registered regression version 1: {sweep / best} (val/loss_best="
    )
    (version,) = client.search_model_versions("name = 'regression'")
    assert version.run_id == (sweep / best / "mlflow_run_id.txt").read_text().strip()


def run_pytest_in_a_fork(
    project: Path, tmp_path: Path, *arguments: str
) -> subprocess.CompletedProcess:
    """``python -m pytest -q -rs ARGUMENTS`` in a git fork of ``project`` (its own: the module's
    copy stays as made; git: what pre-commit's hooks check), as a forker runs it."""
    fork = tmp_path / "fork"
    shutil.copytree(project, fork, ignore=leave_out)
    subprocess.run(["git", "init", "-q"], cwd=fork, check=True)
    subprocess.run(["git", "add", "-A"], cwd=fork, check=True)
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTEST_")}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"]
        + [f"--basetemp={tmp_path / 'inner'}", *arguments],
        cwd=fork,
        env={**env, "PYTHONPATH": str(fork), "COLUMNS": "500"},  # a skip reason on one line
        capture_output=True,
        text=True,
        timeout=1200,
    )


def failures(proc: subprocess.CompletedProcess) -> str:
    """An inner pytest run's failures and summary (its table of durations, where the tests it
    ran are named, would push them out of the output's tail)."""
    start = proc.stdout.find("= FAILURES =")
    summary = proc.stdout.find("short test summary info")
    if summary < 0:  # it crashed before its summary: the output's tail
        return proc.stdout[-6000:] + proc.stderr[-2000:]
    shown = proc.stdout[start:summary][:6000] if 0 <= start < summary else ""
    return shown + proc.stdout[summary:][-3000:] + proc.stderr[-2000:]


# The library's conformance checks, run by a project on its own task's tiny job (once there)
CONFORMANCE = PROJECT / "tests" / "test_conformance.py"


@pytest.mark.slow
def test_the_projects_tests_pass_without_the_image_task(project: Path, tmp_path: Path) -> None:
    """A forker who replaces the task keeps the template's tests: in a fork of the copy (a git
    checkout, tests/task/ replaced by the regression's), every test module imports and the daily
    set passes with nothing skipped but what needs a GPU; the conformance checks run on the
    task's tiny job (tests/task/tiny_job.py, the regression's here). The library's own tests run
    on their own test task (lib/tests/), whatever the project's."""
    fork = tmp_path / "fork"
    shutil.copytree(project, fork, ignore=leave_out)  # its own: the module's copy stays as made
    subprocess.run(["git", "init", "-q"], cwd=fork, check=True)
    subprocess.run(["git", "add", "-A"], cwd=fork, check=True)  # what pre-commit's hooks check
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTEST_")}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"]
        + [f"--basetemp={tmp_path / 'inner'}", "--durations=0"],
        cwd=fork,
        env={**env, "PYTHONPATH": str(fork), "COLUMNS": "500"},  # a skip reason on one line
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, failures(proc)
    summary = proc.stdout.strip().splitlines()[-1]
    assert re.match(r"\d+ passed(, \d+ skipped)?(, \d+ deselected)? in", summary), summary
    assert "error" not in summary and "failed" not in summary, summary
    assert "tests/template/" in proc.stdout and "tests/task/" not in proc.stdout
    if CONFORMANCE.is_file():
        assert "tests/test_conformance.py::" in proc.stdout, "it ran the regression's tiny job"
    skipped = [line for line in proc.stdout.splitlines() if line.startswith("SKIPPED")]
    allowed = ("needs a CUDA GPU", "needs a GPU to build")
    assert all(any(reason in line for reason in allowed) for line in skipped), skipped
