"""A task that is not images, counted in steps (issue #55): in a copy of the project, the image
classifier is replaced, by edits to ``src/task/`` and ``conf/`` only, with a small next-token GPT
on a generated text (``tests/template/text_task/``: tied embedding and output weights, a one-cycle
schedule sized by ``trainer.estimated_stepping_batches``). The unchanged machinery trains it by
steps with validations in between, resumes it exactly after a SIGTERM mid-epoch, trains the same
on 2 FSDP ranks, predicts from a string, and sweeps it, ``src.register`` picking the lower
val/loss_best (the best checkpoint's val/loss). A project made with copier holds the same task
and runs its daily and conformance checks on it, 2 DDP ranks among them (test_copier.py)."""

import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning_exact.testing.instruments import SIGNAL_AT_STEP
from lightning_exact.testing.processes import run_job
from lightning_exact.testing.records import load_checkpoint, read_metrics
from mlflow import MlflowClient

from tests.conftest import HARNESS, PROJECT
from tests.template.test_task_contract import (
    leave_out,
    replace_the_task,
)

run_entry = HARNESS.run_entry

TEXT = PROJECT / "tests" / "template" / "text_task"  # laid out as a project: src/task/, conf/
# 192 training windows of 16 a batch: 12 steps an epoch; 30 steps end mid-epoch 2. Validation
# every 8 steps of the job (not of the epoch), the training loss logged every 4.
STEPS = [
    "trainer.precision=64-true",  # float64: N ranks and a resume equal one job to 1e-8
    "trainer.max_epochs=-1",
    "trainer.max_steps=30",
    "trainer.check_val_every_n_epoch=null",
    "trainer.val_check_interval=8",
    "trainer.log_every_n_steps=4",
    "callbacks.progress_bar=none",
]
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("text-task")]


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the project made a text task by the steps of docs/make-it-yours.md, to the
    letter: the image task, its configs, benchmarks and notebooks deleted, the text task in its
    place (its conf/task.yaml naming its data and model)."""
    copy = tmp_path_factory.mktemp("text") / "project"
    shutil.copytree(PROJECT, copy, ignore=leave_out)
    replace_the_task(copy, TEXT, data="chars", model="gpt")
    return copy


def run(project: Path, entry: str, *overrides: str, env: dict[str, str] | None = None):
    return run_entry(
        entry, *overrides, cwd=project, env={"PYTHONPATH": str(project), **(env or {})}
    )


def history(store: Path) -> dict[str, list[tuple[int, float]]]:
    """Every metric's points in the store's one training run."""
    client = MlflowClient(f"sqlite:///{store}")
    (found,) = client.search_runs([client.get_experiment_by_name("chars").experiment_id])
    return {
        key: sorted((m.step, m.value) for m in client.get_metric_history(found.info.run_id, key))
        for key in found.data.metrics
        if not key.startswith("system/")
    }


@pytest.fixture(scope="module")
def reference(project: Path) -> Path:
    """The uninterrupted job, on 1 process: MLflow in the copy's ./mlflow.db. Its attention
    dropout, seen on the first real batch (the model has no example_input_array), is made
    exact: nothing is named."""
    proc = run(project, "train", *STEPS, "hydra.run.dir=runs/reference")
    assert "strategy.exact:" not in proc.stderr
    return project / "runs" / "reference"


def assert_same_job(run_dir: Path, expected_dir: Path) -> None:
    """The same weights as the reference, each tensor to 1e-8 of its largest value (float64:
    what remains of float summation order, where a resume or world size that trained otherwise
    is 1e-2 or more away), and the same metrics (torchmetrics sums them in float32)."""
    expected = load_checkpoint(expected_dir / "checkpoints" / "last.ckpt")
    actual = load_checkpoint(run_dir / "checkpoints" / "last.ckpt")
    assert actual["global_step"] == expected["global_step"] == 30
    for name, value in expected["state_dict"].items():
        equal = 1e-8 * value.double().abs().max().clamp_min(1e-3).item()
        torch.testing.assert_close(actual["state_dict"][name], value, rtol=0, atol=equal, msg=name)
    metrics = read_metrics(run_dir)
    assert metrics.keys() == {"train/loss", "val/loss", "val/loss_best", "test/loss"}
    for name, value in read_metrics(expected_dir).items():
        assert metrics[name] == pytest.approx(value, rel=1e-6), name


def test_a_job_counted_in_steps_charts_every_metric_at_its_global_step(reference: Path) -> None:
    points = history(reference.parent.parent / "mlflow.db")
    print("MLflow history of the step-based job:", points)
    assert [step for step, _ in points["val/loss"]] == [8, 16, 24]
    assert [step for step, _ in points["train/loss"]] == [4, 8, 12, 16, 20, 24, 28, 30]
    assert [step for step, _ in points["test/loss"]] == [30]
    assert points["val/loss"][-1][1] < points["val/loss"][0][1], "it learns"
    (best,) = (reference / "checkpoints").glob("*-step*-loss*.ckpt")
    lowest = min(points["val/loss"], key=lambda point: point[1])[0]
    assert f"-step{lowest:06d}-" in best.name, "the best of every validation"


def test_stopped_mid_epoch_and_resumed_on_two_ranks_it_equals_the_uninterrupted_job(
    project: Path, reference: Path, tmp_path: Path
) -> None:
    """SIGTERM in step 13 (epoch 1, between the validations at 8 and 16): last.ckpt at step 14,
    then the printed command, on 2 ranks (an elastic resume of a job counted in steps), resumes
    it into the same run, which ends as the reference's."""
    workdir = tmp_path / "stopped"  # its own MLflow store, ./mlflow.db there
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SIGNAL_AT_STEP), str(project)]),
        "SIGNAL_AT_STEP": "13:SIGTERM",
    }
    workdir.mkdir()
    args = [*STEPS, f"hydra.run.dir={workdir / 'run'}"]
    command = [sys.executable, "-m", "src.train", *args]
    stopped = run_job(command, cwd=workdir, env=env)
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    last = workdir / "run" / "checkpoints" / "last.ckpt"
    assert load_checkpoint(last)["global_step"] == 14
    on_two = ["strategy=ddp", "devices=2", f"ckpt_path={last}"]
    run_entry("train", *args, *on_two, cwd=workdir, env={"PYTHONPATH": str(project)})
    assert_same_job(workdir / "run", reference)
    expected = history(reference.parent.parent / "mlflow.db")
    resumed = history(workdir / "mlflow.db")
    assert resumed.keys() == expected.keys()
    for key, points in expected.items():
        assert [step for step, _ in resumed[key]] == [step for step, _ in points], key
        values = [value for _, value in resumed[key]]
        assert values == pytest.approx([v for _, v in points], rel=1e-6), key


def test_two_fsdp_ranks_train_the_same_model(project: Path, reference: Path) -> None:
    """Under FSDP the tied embedding and output layer are one unit (Task.sharded_blocks). (2 DDP
    ranks: the conformance checks, run on this task in tests/template/test_copier.py.)"""
    out = project / "runs" / "fsdp"
    proc = run(
        project,
        "train",
        *STEPS,
        "strategy=fsdp",
        "devices=2",
        "logger=none",
        f"hydra.run.dir={out}",
    )
    assert "strategy.exact:" not in proc.stderr, "the attention dropout is made exact"
    assert_same_job(out, reference)


def test_predict_continues_a_prompt(project: Path, reference: Path) -> None:
    (best,) = (reference / "checkpoints").glob("*-step*-loss*.ckpt")
    out = project / "runs" / "predict"
    run(project, "predict", f"ckpt_path={best}", "inputs='Return the '", f"hydra.run.dir={out}")
    with (out / "predictions_inputs.csv").open() as file:
        ((prompt, continuation),) = list(csv.reader(file))[1:]
    assert prompt == "Return the "
    assert len(continuation) == 24 and set(continuation) <= set(" .Rabcdefghijklmnopqrstuvwxyz")


def test_a_sweep_registers_its_lower_val_loss(project: Path) -> None:
    sweep = project / "sweep"
    run(project, "train", "-m", "model.lr=0.003,0.0003", *STEPS, f"hydra.sweep.dir={sweep}")
    losses = {job: read_metrics(sweep / job)["val/loss_best"] for job in ("0", "1")}
    best = min(losses, key=losses.get)
    done = subprocess.run(
        [sys.executable, "-m", "src.register", str(sweep), "--name", "text"],
        cwd=project,
        env={**os.environ, "PYTHONPATH": str(project)},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"registered text version 1: {sweep / best} (val/loss_best=")
