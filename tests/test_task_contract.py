"""The proof of the task contract (issue #25): in a copy of the project, the image classifier is
deleted and a regression on synthetic vectors (``tests/regression_task/``) takes its place by
edits to ``src/task/`` and ``conf/`` only, the "Make it yours" steps of docs/make-it-yours.md for
another kind of task. The unchanged machinery then trains it on 1 and 2 ranks (the same metrics),
evaluates and predicts with its checkpoint, sweeps it, logs it as an MLflow model and serves it."""

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
from mlflow import MlflowClient

from src.template.task import Task
from src.template.tracking.sweep_run import PARENT_FILE
from tests.conftest import PROJECT, read_metrics, run_entry, served
from tests.machinery_task import TASK as MACHINERY_TASK
from tests.test_sweep_report import rows

REGRESSION = PROJECT / "tests" / "regression_task"  # laid out as the project: src/task/, conf/
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


# The image task's benchmarks and notebooks, deleted with it (docs/make-it-yours.md, step 1).
KEPT_BENCHMARKS = {"__init__.py", "tracking_load.py", "gpu_check.py"}


def image_extras(root: Path) -> list[Path]:
    benchmarks = [p for p in (root / "benchmarks").glob("*.*") if p.name not in KEPT_BENCHMARKS]
    return [*benchmarks, *(root / "notebooks").glob("*.ipynb")]


def make_it_a_regression(copy: Path) -> None:
    """The steps of docs/make-it-yours.md for another kind of task, in ``copy``."""
    replace_the_task(copy, REGRESSION, data="synthetic", model="mlp")


def replace_the_task(copy: Path, task: Path, data: str, model: str) -> None:
    """The steps of docs/make-it-yours.md for another kind of task, in ``copy``: the task laid
    out as the project in ``task`` (src/task/, tests/task/, conf/) with its ``data`` and
    ``model`` configs."""
    # 1. Delete the image task: its package, its tests, the configs of its datasets and networks,
    # its benchmarks and notebooks.
    shutil.rmtree(copy / "src" / "task")
    shutil.rmtree(copy / "tests" / "task", ignore_errors=True)  # absent in a project made so
    for group in ("data", "model", "experiment", "hparams_search"):
        for path in (copy / "conf" / group).glob("*.yaml"):
            path.unlink()
    for path in image_extras(copy):
        path.unlink()
    # 2. Write the new one: src/task/ (TASK and what it names), conf/data/, conf/model/.
    shutil.copytree(task, copy, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__py*"))
    # 3. Point the entry points' defaults at it (the sweep metric follows its TASK.monitor).
    for entry in ("train", "eval", "predict", "prepare"):
        set_line(copy / "conf" / f"{entry}.yaml", "  - data:", f"  - data: {data}")
    set_line(copy / "conf" / "train.yaml", "  - model:", f"  - model: {model}")


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    copy = tmp_path_factory.mktemp("regression") / "project"
    shutil.copytree(PROJECT, copy, ignore=leave_out)
    make_it_a_regression(copy)
    return copy


def test_a_renamed_field_answers_with_its_new_name() -> None:
    """A task written for an older template: one line naming the field's name now."""
    required = ("datamodules", "model_class", "build_model", "config_targets", "monitor", "mode")
    fields = {key: getattr(MACHINERY_TASK, key) for key in required}
    with pytest.raises(TypeError) as refused:
        Task(**fields, predict_files=lambda *args: None)
    assert str(refused.value) == (
        "Task(predict_files=...) is now Task(predict_inputs=...): rename it in src/task/"
    )


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
    in src/template/ and the entry points included); nothing of the image task is left."""
    edited = tuple(f"{path}/" for path in TASK_PATHS)
    deleted = {p.relative_to(PROJECT).as_posix() for p in image_extras(PROJECT)}
    original = {p for p in files(PROJECT) if p.split("/")[0] not in LEFT_OUT} - deleted
    outside = sorted(p for p in files(project) if not p.startswith(edited))
    assert outside == sorted(p for p in original if not p.startswith(edited))
    _, mismatch, errors = filecmp.cmpfiles(PROJECT, project, outside, shallow=False)
    assert not mismatch and not errors, mismatch + errors
    assert any(p.startswith("src/template/") for p in outside)
    assert files(project / "src" / "task") == {
        f"{name}.py" for name in ("__init__", "data", "model", "export", "served_model", "report")
    }
    assert files(project / "conf" / "data") == {"synthetic.yaml"}
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


def assert_same_metrics(metrics: dict[str, float], expected: dict[str, float]) -> None:
    """Sample counts exactly, the rest up to float32 summation order (a few ulps)."""
    assert metrics.keys() == expected.keys()
    for name, value in expected.items():
        if name.endswith("/samples"):
            assert metrics[name] == value, name
        else:
            assert metrics[name] == pytest.approx(value, rel=1e-6, abs=1e-6), name


@pytest.mark.slow
def test_two_ranks_train_as_one(project: Path, regression_run: Path) -> None:
    one = read_metrics(regression_run)
    assert {"train/loss", "train/mae", "val/loss", "test/loss", "test/mae"} <= one.keys()
    assert one["test/samples"] == N_TEST and one["val/samples"] == VAL_SIZE
    assert one["test/loss"] < 2.0, "it learned: the test targets' variance is 8.8"
    assert (regression_run / "figures" / "predicted_vs_target_test.png").stat().st_size > 0
    two = project / "runs" / "two-ranks"
    run(project, "train", *TINY, "strategy=ddp", "devices=2", "logger=none", f"hydra.run.dir={two}")
    assert_same_metrics(read_metrics(two), one)


@pytest.mark.slow
def test_eval_on_one_and_two_ranks(project: Path, regression_run: Path) -> None:
    ckpt = best_checkpoint(regression_run)
    results = {}
    for devices in (1, 2):
        out = project / "runs" / f"eval{devices}"
        run(
            project,
            "eval",
            f"ckpt_path={ckpt}",
            "strategy=ddp",
            f"devices={devices}",
            "logger=none",
            "callbacks.progress_bar=none",
            f"hydra.run.dir={out}",
        )
        results[devices] = read_metrics(out)
    assert results[1]["test/samples"] == N_TEST
    assert_same_metrics(results[2], results[1])
    tested = {k: v for k, v in read_metrics(regression_run).items() if k.startswith("test/")}
    assert_same_metrics(results[1], tested)  # the job tested the same best checkpoint


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
    pick the one of lowest val/loss: the task's mode, as its parent run does."""
    sweep = project / "sweep"
    proc = run(project, "train", "-m", "model.lr=0.01,0.03", *TINY, f"hydra.sweep.dir={sweep}")
    losses = {}
    for job, lr in (("0", 0.01), ("1", 0.03)):
        assert yaml.safe_load((sweep / job / "config.yaml").read_text())["model"]["lr"] == lr
        metrics = read_metrics(sweep / job)
        assert metrics["test/samples"] == N_TEST
        losses[job] = metrics["val/loss"]
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
    )
    done = subprocess.run(
        [sys.executable, "-m", "src.register", str(sweep), "--name", "regression"],
        cwd=project,
        env={**os.environ, "PYTHONPATH": str(project)},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"registered regression version 1: {sweep / best} (val/loss=")
    (version,) = client.search_model_versions("name = 'regression'")
    assert version.run_id == (sweep / best / "mlflow_run_id.txt").read_text().strip()


def failures(proc: subprocess.CompletedProcess) -> str:
    """An inner pytest run's failures and summary (its table of durations, where the tests it
    ran are named, would push them out of the output's tail)."""
    start = proc.stdout.find("= FAILURES =")
    summary = proc.stdout.find("short test summary info")
    if summary < 0:  # it crashed before its summary: the output's tail
        return proc.stdout[-6000:] + proc.stderr[-2000:]
    shown = proc.stdout[start:summary][:6000] if 0 <= start < summary else ""
    return shown + proc.stdout[summary:][-3000:] + proc.stderr[-2000:]


@pytest.mark.slow
def test_the_machinery_tests_pass_without_the_image_task(project: Path, tmp_path: Path) -> None:
    """A forker who replaces the task keeps the machinery's tests: in a fork of the copy (a git
    checkout, tests/task/ replaced by the regression's), every test module imports and the daily
    set passes with nothing skipped but what needs a GPU. The machinery's unit tests build on
    their own task (tests/machinery_task.py), its end-to-end tests on the task's tiny job
    (tests/task/tiny_job.py, the regression's here)."""
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
    assert re.match(r"\d+ passed, \d+ skipped", summary), summary
    assert "error" not in summary and "failed" not in summary, summary
    assert "tests/test_data.py" in proc.stdout and "tests/task/" not in proc.stdout
    for trained in ("tests/test_train.py::", "tests/test_eval.py::", "tests/test_tracking.py::"):
        assert trained in proc.stdout, f"{trained} ran the regression's tiny job"
    skipped = [line for line in proc.stdout.splitlines() if line.startswith("SKIPPED")]
    allowed = ("needs a CUDA GPU", "needs a GPU to build")
    assert all(any(reason in line for reason in allowed) for line in skipped), skipped
